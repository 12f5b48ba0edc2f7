"""The Session wrapper and running a rewritten graph with the original names: fetch
merging, op fetches, plain tf sessions, save/load, and checkpoints both ways."""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.session import merge_values, session_config
from graph_rewriter.testing import harness, models

tf1 = tf.compat.v1


@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp", "adam", seed=3)


@pytest.fixture(scope="module")
def mlp2(mlp):
    return gr.rewrite(mlp.graph_def, devices_per_worker=2, device_type="CPU")


def _prediction(graph_def):
    """The per-example prediction: the other input of the op comparing it with y."""
    for n in graph_def.node:
        if "y" in n.input and len(n.input) == 2:
            inputs = list(n.input)
            other = inputs[1 - inputs.index("y")]
            return other if ":" in other else other + ":0"
    raise AssertionError("no op reads y")


def _copy_reads(graph, names, prefix="replica_1/"):
    """Tensors reading replica copies of variables (built here: the original read op may
    exist once, when only the Saver reads the variable)."""
    out = []
    with graph.as_default():
        for n in names:
            op = graph.get_operation_by_name(prefix + n)
            if op.type == "VarHandleOp":
                out.append(tf1.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=op.get_attr("dtype")))
            else:
                out.append(tf.identity(op.outputs[0]))
    return out


def _import(graph_def):
    g = tf.Graph()
    with g.as_default():
        tf1.import_graph_def(graph_def, name="")
    return g


def test_scalar_fetch_is_the_mean_and_per_example_fetch_is_concatenated(mlp, mlp2):
    feed = mlp.batch(0, size=8)
    pred = _prediction(mlp.graph_def)
    with tf1.Session(graph=_import(mlp.graph_def)) as s:
        s.run("init")
        loss1, pred1 = s.run([mlp.loss, pred], feed)
    with gr.Session(mlp2) as s:
        s.run("init")
        loss2, pred2 = s.run([mlp.loss, pred], feed)
        # Nested structures come back in the same shape.
        out = s.run({"l": mlp.loss, "both": (mlp.loss, [pred])}, feed)
    assert pred2.shape == pred1.shape == (8, 1)
    np.testing.assert_allclose(pred2, pred1, rtol=1e-5)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    assert isinstance(out, dict) and isinstance(out["both"], tuple)
    np.testing.assert_allclose(out["both"][1][0], pred1, rtol=1e-5)


def test_merge_override_and_rules():
    parts = [np.float32(1.0), np.float32(3.0)]
    assert merge_values(parts, "auto") == 2.0
    assert merge_values(parts, "sum") == 4.0
    assert merge_values(parts, "master") == 1.0
    rows = [np.ones((2, 3)), np.zeros((2, 3))]
    assert merge_values(rows, "auto-concat").shape == (4, 3)
    assert merge_values(rows, "auto").shape == (2, 3)  # not batch-shaped: the master's
    np.testing.assert_allclose(merge_values(rows, "mean"), np.full((2, 3), 0.5))


def test_merge_option_is_applied_by_the_session(mlp):
    result = gr.rewrite(mlp.graph_def, devices_per_worker=2, device_type="CPU",
                        merge={"loss:0": "sum"})
    feed = mlp.batch(0, size=8)
    with gr.Session(result) as s:
        s.run("init")
        total = s.run(mlp.loss, feed)
    with gr.Session(gr.rewrite(mlp.graph_def, devices_per_worker=2, device_type="CPU")) as s:
        s.run("init")
        mean = s.run(mlp.loss, feed)
    np.testing.assert_allclose(total, 2 * mean, rtol=1e-5)


def test_plain_tf_session_trains_every_replica_by_running_train_op(mlp, mlp2):
    """Without the wrapper: feed the original placeholders, run 'train_op' by name."""
    config = session_config(mlp2.metadata["session_config"])
    g = _import(mlp2.graph_def)
    names = list(mlp.variables)
    reads = _copy_reads(g, names)
    with tf1.Session(graph=g, config=config) as s:
        s.run("init")
        for step in range(3):
            s.run("train_op", mlp.batch(step, size=8))
        master = s.run([mlp.variables[n] for n in names])
        copies = s.run(reads)
    _, single = harness.run_single(mlp, steps=3, feeds=lambda step: mlp.batch(step, size=8))
    for n, a, b in zip(names, master, copies):
        np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=n)
        np.testing.assert_allclose(a, single[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_save_and_load_round_trip(tmp_path, mlp, mlp2):
    for name in ("out.pb", "out.pbtxt", "out.meta"):
        path = str(tmp_path / name)
        mlp2.save(path)
        loaded = gr.load(path)
        assert loaded.num_replicas == 2
        assert loaded.plan.to_json() == mlp2.plan.to_json()
        losses, _ = harness.run_rewritten(path, mlp, steps=2)
        assert len(losses) == 2 and np.isfinite(losses).all()


def test_meta_graph_keeps_saver_def_and_collections(tmp_path):
    g = _import(models.build("mlp", "sgd").graph_def)
    with g.as_default():
        saver = tf1.train.Saver(var_list=[v for v in tf1.global_variables()] or None) if tf1.global_variables() else None
        meta = tf1.train.export_meta_graph(graph=g, saver_def=saver.as_saver_def() if saver else None)
    result = gr.rewrite(meta, devices_per_worker=2, device_type="CPU")
    path = str(tmp_path / "out.meta")
    result.save(path)
    from tensorflow.core.protobuf import meta_graph_pb2
    mg = meta_graph_pb2.MetaGraphDef()
    with open(path, "rb") as f:
        mg.ParseFromString(f.read())
    if meta.saver_def.restore_op_name:
        assert mg.saver_def == meta.saver_def
    else:   # read off the graph's Saver nodes (export_meta_graph left it empty)
        assert mg.saver_def.restore_op_name == "save/restore_all"
        assert mg.saver_def.filename_tensor_name == "save/Const:0"
    assert set(meta.collection_def) <= set(mg.collection_def)
    assert any(n.name == "replica_1/loss" for n in mg.graph_def.node)


def _live_training_graph(saver=True, sharded=False):
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", [4, 1], use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w) - y)), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=tf1.train.get_or_create_global_step(), name="train_op")
        tf1.global_variables_initializer()
        made = tf1.train.Saver(sharded=sharded) if saver else None
    return graph, made


def test_a_live_graph_keeps_its_collections_and_its_saver(tmp_path):
    from graph_rewriter import graph_io
    graph, saver = _live_training_graph()
    item = graph_io.load_graph(graph)
    assert {"variables", "trainable_variables", "train_op"} <= set(item.meta_graph.collection_def)
    assert item.meta_graph.saver_def == saver.as_saver_def()   # found by its nodes
    with graph.as_default():   # the default graph, as a script passes it
        result = gr.rewrite(tf1.get_default_graph(), devices_per_worker=2, device_type="CPU")
    path = str(tmp_path / "out.meta")
    result.save(path)
    mg = graph_io.load_graph(path).meta_graph
    assert mg.saver_def == saver.as_saver_def()
    assert set(item.meta_graph.collection_def) <= set(mg.collection_def)   # and meta_graph adds its own


def test_a_live_graph_s_saver_comes_from_its_savers_collection_first():
    from graph_rewriter import graph_io
    graph, saver = _live_training_graph(sharded=True)
    with graph.as_default():
        other = tf1.train.Saver(name="kept")
        tf1.add_to_collection(tf1.GraphKeys.SAVERS, other)
    assert graph_io.load_graph(graph).meta_graph.saver_def == other.as_saver_def()
    graph, saver = _live_training_graph(sharded=True)
    assert graph_io.load_graph(graph).meta_graph.saver_def == saver.as_saver_def()
    graph, _ = _live_training_graph(saver=False)
    assert not graph_io.load_graph(graph).meta_graph.HasField("saver_def")


def _saver_names(graph_def):
    for n in graph_def.node:
        if n.op == "SaveV2":
            return n
    raise AssertionError("no SaveV2 in graph")


def _save(sess, graph, path):
    """Runs the graph's own Saver (its save/Const filename and save/control_dependency)."""
    prefix = _saver_names(graph.as_graph_def()).input[0].split(":")[0]
    scope = prefix.rsplit("/", 1)[0]
    sess.run(f"{scope}/control_dependency:0", {f"{scope}/Const:0": path})


def _restore(sess, graph, path):
    scope = _saver_names(graph.as_graph_def()).input[0].split(":")[0].rsplit("/", 1)[0]
    sess.run(f"{scope}/restore_all", {f"{scope}/Const:0": path})


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_checkpoints_restore_across_the_rewrite_both_ways(tmp_path, resource):
    example = models.build("mlp", "momentum", resource=resource, seed=5)
    result = gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU")
    names = list(example.variables)
    ckpt = str(tmp_path / "dist.ckpt")
    # Train the rewritten graph, save with its Saver (original names) ...
    with gr.Session(result) as s:
        s.run("init")
        for step in range(3):
            s.run(example.train_op, example.batch(step))
        _save(s, s.graph, ckpt)
        trained = s.run([example.variables[n] for n in names])
    # ... restore into the original single-device graph.
    g = _import(example.graph_def)
    with tf1.Session(graph=g) as s:
        s.run("init")
        _restore(s, g, ckpt)
        for n, want, got in zip(names, trained, s.run([example.variables[n] for n in names])):
            np.testing.assert_allclose(got, want, err_msg=n)
        # Train one more step there and save: a single-device checkpoint.
        s.run(example.train_op, example.batch(7))
        ckpt1 = str(tmp_path / "single.ckpt")
        _save(s, g, ckpt1)
        single = s.run([example.variables[n] for n in names])
    # Restoring it into the rewritten graph reaches every replica's copy.
    with gr.Session(result) as s:
        reads = _copy_reads(s.graph, names)
        s.run("init")
        _restore(s, s.graph, ckpt1)
        master = s.run([example.variables[n] for n in names])
        copy = s.run(reads)
    for n, want, a, b in zip(names, single, master, copy):
        np.testing.assert_allclose(a, want, err_msg=n)
        np.testing.assert_allclose(b, want, err_msg=f"replica_1 copy of {n}")


def test_replica_copies_start_from_the_master_values(mlp2, mlp):
    with gr.Session(mlp2) as s:
        names = list(mlp.variables)
        reads = _copy_reads(s.graph, names)
        s.run("init")
        for n, master, copy in zip(names, s.run([mlp.variables[n] for n in names]), s.run(reads)):
            np.testing.assert_array_equal(master, copy, err_msg=n)


def test_a_graph_without_init_op_initializes_every_copy_through_each_variables_assign():
    # The script exported the graph before creating an init op: the variables' own
    # initializer ops are what the user runs.
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 2], use_resource=True)
        loss = tf.identity(tf.reduce_sum(tf.matmul(x, w)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as s:
        copy = _copy_reads(s.graph, ["w"])[0]
        s.run("w/Assign")
        master, replica = s.run(["w/Read/ReadVariableOp:0", copy])
        np.testing.assert_array_equal(master, replica)
        assert np.abs(master).sum() > 0       # a random draw, not zeros


def test_step_counter_advances_once_per_step(mlp):
    result = gr.rewrite(mlp.graph_def, devices_per_worker=4, device_type="CPU")
    with gr.Session(result) as s:
        copy = _copy_reads(s.graph, ["global_step"], prefix="replica_3/")[0]
        s.run("init")
        for step in range(3):
            s.run(mlp.train_op, mlp.batch(step))
        assert s.run(mlp.step_counter) == 3
        assert s.run(copy) == 3


def test_non_batch_placeholder_is_fed_to_every_replica():
    example = models.build("cond", "sgd", seed=2)
    result = gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU")
    assert "use_branch:0" not in result.plan.batch_inputs
    assert "use_branch:0" in result.plan.broadcast_inputs
    losses1, v1 = harness.run_single(example, steps=4)
    losses2, v2 = harness.run_rewritten(result, example, steps=4)
    np.testing.assert_allclose(losses2, losses1, rtol=1e-4)


def test_scalar_summaries_report_the_mean_over_replicas():
    """A tf.summary.scalar of the loss reports the replicas' mean loss (the global batch's
    loss), not replica 0's loss on its own half of the batch."""
    from tensorflow.core.framework import summary_pb2
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", [2, 1], initializer=tf1.constant_initializer(0.5), use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w))), name="loss")
        tf1.summary.scalar("loss_summary", loss)
        merged = tf1.summary.merge_all()
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer().name  # noqa: B018
    feed = {"x:0": np.array([[1, 0], [0, 1], [3, 3], [4, 4]], np.float32)}
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as s:
        s.run("init")
        serialized, loss_value = s.run([merged.name, "loss:0"], feed)
    summary = summary_pb2.Summary.FromString(serialized)
    reported = summary.value[0].simple_value
    first_half = np.mean(np.square(feed["x:0"][:2] @ np.full((2, 1), 0.5)))
    np.testing.assert_allclose(reported, loss_value, rtol=1e-6)
    np.testing.assert_allclose(reported, np.mean(np.square(feed["x:0"] @ np.full((2, 1), 0.5))), rtol=1e-6)
    assert abs(reported - first_half) > 1.0   # replica 0's own value would be far off
