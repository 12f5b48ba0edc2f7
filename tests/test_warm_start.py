"""Fine-tuning from a pre-trained checkpoint: ``tf.compat.v1.train.init_from_checkpoint``.

BERT's fine-tuning scripts build the model, then call ``init_from_checkpoint`` so that the
init op loads the encoder from the pre-trained checkpoint (each variable's initializer
reads it) while the new head starts from its initializer. The rewritten graph must start
every replica, and every worker, from the checkpoint's values, and then train as one
device (docs/semantics.md, "Variables, initial values, checkpoints").
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.testing.tf1_scripts import dropout_batches, warm_started_mlp

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6


def _reads(resource):
    if resource:
        return {"w1": "bert/w1/Read/ReadVariableOp:0", "w2": "head/w2/Read/ReadVariableOp:0"}
    return {"w1": "bert/w1/read:0", "w2": "head/w2/read:0"}


def _train(session, feeds, reads):
    with session as sess:
        sess.run("init")
        start = sess.run(reads)
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return start, losses, sess.run(reads)


def _one_device(graph_def, feeds, reads):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds, reads)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_replicas_start_from_the_checkpoint_and_train_as_one_device(strategy, resource, tmp_path):
    graph_def, _ = warm_started_mlp(str(tmp_path), resource=resource)
    feeds, reads = dropout_batches(STEPS, 2 * BATCH), _reads(resource)
    want = _one_device(graph_def, feeds, reads)
    np.testing.assert_array_equal(want[0]["w1"], np.full([4, 16], 0.3, np.float32))
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    got = _train(gr.Session(result), feeds, reads)
    np.testing.assert_array_equal(got[0]["w1"], want[0]["w1"])
    np.testing.assert_array_equal(got[0]["w2"], want[0]["w2"])
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=ATOL)
    for name in reads:
        np.testing.assert_allclose(got[2][name], want[2][name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_every_replicas_copy_starts_from_the_checkpoint(tmp_path):
    """Under allreduce every replica holds a copy: replica 1's encoder after the init op
    is the checkpoint's, its head the master's initial value."""
    graph_def, _ = warm_started_mlp(str(tmp_path))
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(result.graph_def, name="")
        reads = [tf1.raw_ops.ReadVariableOp(resource=graph.get_tensor_by_name(f"{name}:0"), dtype=tf.float32)
                 for name in ("bert/w1", "replica_1/bert/w1", "head/w2", "replica_1/head/w2")]
    with tf1.Session(graph=graph, config=result.session_config()) as sess:
        sess.run("init")
        w1, copy1, w2, copy2 = sess.run(reads)
    np.testing.assert_array_equal(copy1, np.full([4, 16], 0.3, np.float32))
    np.testing.assert_array_equal(copy1, w1)
    np.testing.assert_array_equal(copy2, w2)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_two_workers_start_from_the_checkpoint_on_loopback_servers(strategy, pool, procs, tmp_path):
    """Between-graph, 2 workers, each its own client: the chief's init op (and under
    allreduce every worker's, for its own copies) reads the checkpoint; after three steps
    worker 0's variables are one device's."""
    graph_def, _ = warm_started_mlp(str(tmp_path))
    feeds, reads = dropout_batches(STEPS, 2 * BATCH), _reads(True)
    want = _one_device(graph_def, feeds, reads)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, reads.values(), feeds)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[2][name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


def test_between_graph_ps_takes_the_orphaned_initializer_for_no_train_op_of_its_own(tmp_path):
    """init_from_checkpoint leaves the variable's first initializer ('bert/w1/Assign')
    unread, so it is listed beside train_op as a train op of that variable's gradient: the
    train ops overlap and run together, not in turns, and between-graph ps rewrites the
    graph (the refusal for train ops taking turns once caught it)."""
    graph_def, _ = warm_started_mlp(str(tmp_path))
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    result = gr.rewrite(graph_def, cluster, devices_per_worker=1, device_type="CPU", strategy="ps", task="worker:1")
    assert sorted(result.plan.cut("bert/w1").train_ops) == ["bert/w1/Assign", "train_op"]
