"""Checkpoints of a rewritten graph, both ways against the single-device graph.

- rewritten -> one device: train the rewritten graph, save with ``result.saver()`` (the
  ``checkpoint`` index file is written, so tf.train.latest_checkpoint finds it), restore
  into the single-device graph with its own Saver: every variable equals what the
  rewritten graph holds.
- one device -> rewritten: train and save the single-device graph, restore into the
  rewritten graph with ``result.saver()`` and train one more step in both: the
  variables agree, so the restore reached every replica's copy (mirrored variables),
  the parameter servers (ps) and every part of a sharded variable.

For allreduce, ps (one ps on this machine, and two ps servers in this process with the
embedding split between them) and hybrid; a graph without a Saver (a .pb of the bare
training graph) gets one.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.server import start_server
from graph_rewriter.local_cluster import free_port
from graph_rewriter.testing import models

tf1 = tf.compat.v1
CPU2 = dict(devices_per_worker=2, device_type="CPU")
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6


def _single_graph(example):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(example.graph_def, name="")
    return graph


def _train(sess, example, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        loss, _ = sess.run([example.loss, example.train_op], feed_dict=example.batch(step, size=8))
        losses.append(float(loss))
    return losses


def _values(sess, example):
    return {k: np.asarray(v) for k, v in sess.run(dict(example.variables)).items()}


def _assert_close(got, want, what):
    assert set(got) == set(want), what
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def two_ps():
    """A worker and two ps servers in this process (in-graph: one client)."""
    spec = {"worker": [f"localhost:{free_port()}"], "ps": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    servers = [start_server(spec, f"{job}:{i}", device_type="CPU", devices_per_worker=2)
               for job in ("ps", "worker") for i in range(len(spec[job]))]
    yield spec, servers[-1].target


CASES = [
    ("mlp", "adam", "allreduce", {}),
    ("mlp", "momentum", "ps", {}),
    ("embedding", "adagrad", "hybrid", {}),
    ("embedding", "adam", "ps-sharded", {"ps_shard_bytes": 64}),
]


def _rewrite(example, strategy, options, two_ps):
    if strategy == "ps-sharded":
        spec, target = two_ps
        result = gr.rewrite(example.graph_def, spec, strategy="ps", **CPU2, **options)
        assert result.plan.variable("embedding").shards, "the embedding was not split"
        return result, target
    return gr.rewrite(example.graph_def, strategy=strategy, **CPU2, **options), ""


@pytest.mark.parametrize("model,optimizer,strategy,options", CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_rewritten_checkpoint_restores_into_the_single_device_graph(model, optimizer, strategy, options,
                                                                   two_ps, tmp_path):
    example = models.build(model, optimizer)
    result, target = _rewrite(example, strategy, options, two_ps)
    with gr.Session(result, target=target) as sess:
        sess.run(example.init)
        _train(sess, example, STEPS)
        trained = _values(sess, example)
        saved = result.saver().save(sess, str(tmp_path / "model.ckpt"), global_step=STEPS)
    assert tf.train.latest_checkpoint(str(tmp_path)) == saved
    reader = tf.train.load_checkpoint(saved)
    names = set(reader.get_variable_to_shape_map())
    assert not any(n.startswith("replica_") or "/part_" in n for n in names), sorted(names)
    with tf1.Session(graph=_single_graph(example)) as sess:
        sess.run("save/restore_all", {"save/Const:0": saved})
        _assert_close(_values(sess, example), trained, f"{strategy}: restored into one device")


@pytest.mark.parametrize("model,optimizer,strategy,options", CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_single_device_checkpoint_restores_into_the_rewritten_graph(model, optimizer, strategy, options,
                                                                   two_ps, tmp_path):
    example = models.build(model, optimizer)
    prefix = str(tmp_path / "single.ckpt")
    with tf1.Session(graph=_single_graph(example)) as sess:
        sess.run(example.init)
        _train(sess, example, STEPS)
        sess.run("save/control_dependency:0", {"save/Const:0": prefix})
        want_losses = _train(sess, example, 1, start=STEPS)
        want = _values(sess, example)
    result, target = _rewrite(example, strategy, options, two_ps)
    with gr.Session(result, target=target) as sess:
        sess.run(example.init)          # fresh values everywhere, then the checkpoint's
        result.saver().restore(sess, prefix)
        losses = _train(sess, example, 1, start=STEPS)
        got = _values(sess, example)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    _assert_close(got, want, f"{strategy}: one step after the restore")


def test_a_graph_without_a_saver_gets_one(tmp_path):
    """A bare training graph (no Saver): the rewrite adds tf.compat.v1.train.Saver()'s
    nodes over its variables; the checkpoint holds them by their original names."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        v = tf1.get_variable("v", [1], use_resource=False)   # a ref variable too
        loss = tf.reduce_mean(tf.matmul(x, w) + v, name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    result = gr.rewrite(graph.as_graph_def(), **CPU2)
    assert result.metadata["saver"]["restore_op_name"] == "save/restore_all"
    assert "saver" in result.metadata["passes"]
    with gr.Session(result) as sess:
        sess.run("init")
        sess.run("train_op", {"x:0": np.ones((4, 3), np.float32)})
        want = sess.run({"w": "w/Read/ReadVariableOp:0", "v": "v:0", "global_step": "global_step:0"}) \
            if "w/Read/ReadVariableOp" in {n.name for n in result.graph_def.node} else None
        path = result.saver().save(sess, str(tmp_path / "m"))
    reader = tf.train.load_checkpoint(path)
    assert sorted(reader.get_variable_to_shape_map()) == ["global_step", "v", "w"]
    if want is not None:
        for name in ("w", "v"):
            np.testing.assert_allclose(reader.get_tensor(name), want[name])
    assert reader.get_tensor("global_step") == 1


def test_saver_keeps_the_inputs_saver_def(tmp_path):
    """A MetaGraphDef with a SaverDef: that Saver is the one used (not a new one)."""
    example = models.build("mlp", "sgd")
    graph = _single_graph(example)
    meta = tf1.train.export_meta_graph(graph=graph)
    meta.saver_def.filename_tensor_name = "save/Const:0"
    meta.saver_def.save_tensor_name = "save/control_dependency:0"
    meta.saver_def.restore_op_name = "save/restore_all"
    result = gr.rewrite(meta, **CPU2)
    assert result.meta_graph.saver_def == meta.saver_def
    assert not any(n.name.startswith("save_1/") for n in result.graph_def.node)
