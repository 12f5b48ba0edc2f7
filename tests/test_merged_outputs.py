"""Merged outputs by their original names, from any session (docs/semantics.md,
"Fetching merged outputs by name from any session"): a plain tf.compat.v1.Session on the
rewritten graph fetching the loss gets the mean over the replicas, as gr.Session does,
and as one device computes it on the same global batch.

The model: a MetaGraphDef whose losses collection holds the mean squared error (put
there by tf.compat.v1.losses), with a scalar summary of it and a per-example prediction.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import graph_rewriter as gr
from graph_rewriter.session import session_config

tf1 = tf.compat.v1
ROWS = 8
CPU = dict(device_type="CPU")


class Model:
    """x [None, 3], y [None, 1] -> pred = x w + b -> loss (mse, in the losses collection)."""

    def __init__(self):
        g = tf.Graph()
        with g.as_default():
            tf1.set_random_seed(1)
            x = tf1.placeholder(tf.float32, [None, 3], name="x")
            y = tf1.placeholder(tf.float32, [None, 1], name="y")
            w = tf1.get_variable("w", [3, 1], use_resource=True)
            b = tf1.get_variable("b", [1], initializer=tf1.constant_initializer(0.5), use_resource=True)
            pred = tf.add(tf.matmul(x, w), b, name="pred")
            loss = tf1.losses.mean_squared_error(y, pred)   # adds it to the losses collection
            self.summary = tf1.summary.scalar("loss", loss).name
            self.summaries = tf1.summary.merge_all().name
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
            tf1.global_variables_initializer()
            self.meta = tf1.train.export_meta_graph()
        self.graph = g
        self.loss = loss.name
        assert tf1.GraphKeys.LOSSES in self.meta.collection_def
        assert list(self.meta.collection_def[tf1.GraphKeys.LOSSES].node_list.value) == [self.loss]
        self.variables = ["w", "b"]

    def batch(self, seed=0):
        rng = np.random.RandomState(seed)
        return {"x:0": rng.randn(ROWS, 3).astype(np.float32), "y:0": rng.randn(ROWS, 1).astype(np.float32)}

    def one_device(self, fetches, feed, train=False):
        with tf1.Session(graph=self.graph) as s:
            s.run("init")
            if train:
                s.run("train_op", feed)
            return s.run(fetches, feed)


@pytest.fixture(scope="module")
def model():
    return Model()


def _plain(result):
    """A plain tf.compat.v1.Session on the rewritten graph, initialised."""
    g = tf.Graph()
    with g.as_default():
        tf1.import_graph_def(result.graph_def, name="")
    s = tf1.Session(graph=g, config=session_config(result.metadata["session_config"]))
    s.run("init")
    return s


def _replica_names(result, tensor):
    """Every local replica's own copy of an output the graph merged."""
    op, _, index = tensor.partition(":")
    renamed = result.metadata["merged"][op]
    return [f"{renamed}:{index}"] + [f"{p}{op}:{index}" for p in result.metadata["replica_prefixes"][1:]]


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_plain_session_fetches_the_mean_loss_by_its_name(model, replicas):
    result = gr.rewrite(model.meta, devices_per_worker=replicas, **CPU)
    assert result.metadata["merged"] == {model.loss.split(":")[0]: "replica_0/" + model.loss.split(":")[0]}
    feed = model.batch()
    with _plain(result) as s:
        loss, parts = s.run([model.loss, _replica_names(result, model.loss)], feed)
    assert len(parts) == replicas and len(set(np.round(parts, 5))) == replicas   # they differ
    np.testing.assert_allclose(loss, np.mean(parts), rtol=1e-6)
    assert not np.isclose(loss, parts[0])   # not replica 0's, as it was before
    with gr.Session(result) as s:
        s.run("init")
        wrapped = s.run(model.loss, feed)
    np.testing.assert_allclose(wrapped, loss, rtol=1e-6)
    # a mean over equal splits: the one-device loss on the same global batch
    np.testing.assert_allclose(loss, model.one_device(model.loss, feed), rtol=1e-5)


def test_a_hook_of_a_monitored_training_session_sees_the_mean_loss(model, tmp_path):
    """The rewritten MetaGraphDef imported as a user's script would (its losses collection
    now names the merged loss); a hook fetching the loss, as LoggingTensorHook does,
    gets the one-device loss of the global batch."""
    result = gr.rewrite(model.meta, devices_per_worker=2, **CPU)
    path = result.save(str(tmp_path / "out.meta"))
    seen = []

    class Capture(tf1.train.SessionRunHook):
        def before_run(self, run_context):
            return tf1.train.SessionRunArgs(model.loss)

        def after_run(self, run_context, run_values):
            seen.append(run_values.results)

    feed = model.batch(5)
    with tf.Graph().as_default() as g:
        tf1.train.import_meta_graph(path)
        (collected,) = tf1.get_collection(tf1.GraphKeys.LOSSES)
        assert collected.name == model.loss and collected.op.type == "RealDiv"
        scaffold = tf1.train.Scaffold(init_op=g.get_operation_by_name("init"))
        config = session_config(result.metadata["session_config"])
        with tf1.train.MonitoredTrainingSession(scaffold=scaffold, config=config,
                                                hooks=[Capture()]) as s:
            s.run("train_op", feed)
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], model.one_device(model.loss, feed), rtol=1e-5)


def test_a_named_per_example_output_comes_back_concatenated(model):
    result = gr.rewrite(model.meta, devices_per_worker=4, outputs=["pred:0"], **CPU)
    feed = model.batch(1)
    with _plain(result) as s:
        pred = s.run("pred:0", feed)
    assert pred.shape == (ROWS, 1)
    np.testing.assert_allclose(pred, model.one_device("pred:0", feed), rtol=1e-5)
    with gr.Session(result) as s:
        s.run("init")
        np.testing.assert_allclose(s.run("pred:0", feed), pred, rtol=1e-6)


def test_the_merge_option_sums_in_the_graph(model):
    result = gr.rewrite(model.meta, devices_per_worker=2, merge={model.loss: "sum"}, **CPU)
    feed = model.batch(2)
    with _plain(result) as s:
        total, parts = s.run([model.loss, _replica_names(result, model.loss)], feed)
    np.testing.assert_allclose(total, np.sum(parts), rtol=1e-6)
    np.testing.assert_allclose(total, 2 * model.one_device(model.loss, feed), rtol=1e-5)
    with gr.Session(result) as s:
        s.run("init")
        np.testing.assert_allclose(s.run(model.loss, feed), total, rtol=1e-6)


@pytest.mark.parametrize("merge", [{}, {"sum": True}])
def test_the_summary_reports_the_mean(model, merge):
    """The merged summary's loss is the mean over the replicas, whether the loss itself is
    merged as the mean (the summary reads it) or as the sum (the summary has its own mean)."""
    options = {"merge": {model.loss: "sum"}} if merge else {}
    result = gr.rewrite(model.meta, devices_per_worker=4, **CPU, **options)
    feed = model.batch(3)
    with _plain(result) as s:
        proto, parts = s.run([model.summaries, _replica_names(result, model.loss)], feed)
    (value,) = tf1.Summary.FromString(proto).value
    assert value.tag == "loss"
    np.testing.assert_allclose(value.simple_value, np.mean(parts), rtol=1e-6)
    np.testing.assert_allclose(value.simple_value, model.one_device(model.loss, feed), rtol=1e-5)


def test_training_in_a_plain_session_equals_one_device(model):
    result = gr.rewrite(model.meta, devices_per_worker=4, outputs=["pred:0"], **CPU)
    feed = model.batch(4)
    with _plain(result) as s:
        s.run("train_op", feed)
        values = s.run([f"{v}/Read/ReadVariableOp:0" for v in model.variables])
        loss_after = s.run(model.loss, feed)
    single = model.one_device([f"{v}/Read/ReadVariableOp:0" for v in model.variables], feed, train=True)
    single_loss = model.one_device(model.loss, feed, train=True)
    for name, a, b in zip(model.variables, values, single):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(loss_after, single_loss, rtol=1e-5)


def _canonical_nodes(result):
    """name -> NodeDef with control inputs sorted (TensorFlow treats them as a set)."""
    out = {}
    for node in graph_pb2.GraphDef.FromString(bytes(result.serialized())).node:
        controls = sorted(i for i in node.input if i.startswith("^"))
        data = [i for i in node.input if not i.startswith("^")]
        del node.input[:]
        node.input.extend(data + controls)
        out[node.name] = node
    return out


def test_template_replicas_give_the_graph_every_replica_built_gives(model):
    options = dict(devices_per_worker=4, outputs=["pred:0"], **CPU)
    lines = []
    template = gr.rewrite(model.meta, log=lines.append, **options)
    built = gr.rewrite(model.meta, materialize_replicas=True, **options)
    assert any("the template of the others" in line for line in lines)
    assert _canonical_nodes(template) == _canonical_nodes(built)
    assert template.metadata["merged"] == built.metadata["merged"]


def test_between_graph_the_merge_is_over_this_workers_replicas(model):
    cluster = {"worker": ["localhost:2222", "localhost:2223"]}
    result = gr.rewrite(model.meta, cluster, task="worker:0", devices_per_worker=2, **CPU)
    assert result.num_replicas == 4 and result.metadata["local_replicas"] == 2
    nodes = {n.name: n for n in result.graph_def.node}
    op = model.loss.split(":")[0]
    merged = nodes[op]
    assert merged.op == "RealDiv" and "/job:worker/replica:0/task:0/device:CPU:0" == merged.device
    total = nodes[merged.input[0]]
    assert total.op == "AddN" and list(total.input) == [f"replica_0/{op}", f"replica_1/{op}"]
    divisor = tf.make_ndarray(nodes[merged.input[1]].attr["value"].tensor)
    assert divisor == 2.0


def test_a_graph_def_input_without_collections_keeps_its_names(model):
    """No losses collection, no option, no summary: nothing is merged in the graph (and
    the metadata has no 'merged'), so gr.Session merges in Python as before."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, **CPU)
    assert "merged" not in result.metadata
    nodes = {n.name: n for n in result.graph_def.node}
    assert nodes["loss"].op == "Mean" and "replica_0/loss" not in nodes
