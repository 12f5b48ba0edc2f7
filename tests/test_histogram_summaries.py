"""Histogram summaries of the rewritten graph show the global batch, as one device's do.

``tf.compat.v1.summary.histogram`` of a value whose first dimension is the batch (a
layer's activations, the per-example losses) reads every replica's rows: each replica's
value flattened, concatenated in replica order (passes/merge_outputs.py), so TensorBoard
shows one device's count, range, buckets and sum for the global batch, not replica 0's
half. A value that has been through an exchange between the replicas (an all-gathered
embedding gradient, which every replica holds whole) and a value whose first dimension
is not the batch (a dense gradient, already the average) stay replica 0's: concatenating
those would count them R times.

Each case runs the same seeded model on one device and rewritten for R replicas on the
same batches, fetching the merged summary with the train op, and compares every
histogram field (count and bucket counts exactly; min, max, sum and sum of squares to
float rounding: an averaged gradient rounds differently) and the scalar summaries.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

import graph_rewriter as gr
from graph_rewriter.testing import harness

tf1 = tf.compat.v1

BATCH = 8
STEPS = 2
VOCAB = 10


def _model():
    """(GraphDef, merged summary tensor name): a small click model with an embedding, the
    histograms a TF1 script writes (activations, per-example losses, every gradient, the
    embedding gradient's values) and a loss scalar."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [VOCAB, 3], use_resource=True)
        w1 = tf1.get_variable("w1", [7, 5], use_resource=True)
        w2 = tf1.get_variable("w2", [5, 1], use_resource=True)
        hidden = tf.nn.relu(tf.matmul(tf.concat([x, tf.gather(emb, ids)], 1), w1), name="hidden")
        per_example = tf.square(tf.matmul(hidden, w2) - y)[:, 0]
        loss = tf.reduce_mean(per_example, name="loss")
        opt = tf1.train.AdamOptimizer(0.05)
        grads = opt.compute_gradients(loss)
        tf1.summary.histogram("activations", hidden)
        tf1.summary.histogram("example_losses", per_example)
        for grad, var in grads:
            values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            tf1.summary.histogram(var.op.name + "/gradient", values)
        tf1.summary.scalar("loss_summary", loss)
        merged = tf1.summary.merge_all()
        opt.apply_gradients(grads, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def(), merged.name


def _feeds():
    rng = np.random.RandomState(3)
    return [{"x:0": rng.randn(BATCH, 4).astype(np.float32),
             "ids:0": rng.randint(VOCAB, size=BATCH).astype(np.int32),
             "y:0": rng.randn(BATCH, 1).astype(np.float32)} for _ in range(STEPS)]


def _parse(serialized):
    out = {}
    for v in summary_pb2.Summary.FromString(serialized).value:
        if v.HasField("histo"):
            h = v.histo
            out[v.tag] = {"num": h.num, "min": h.min, "max": h.max, "sum": h.sum,
                          "sum_squares": h.sum_squares, "buckets": dict(zip(h.bucket_limit, h.bucket))}
        else:
            out[v.tag] = v.simple_value
    return out


def _one_device(graph_def, merged):
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        return [_parse(sess.run([merged, "train_op"], feed)[0]) for feed in _feeds()]


def _rewritten(result, merged):
    with gr.Session(result) as sess:
        sess.run("init")
        return [_parse(sess.run([merged, "train_op"], feed)[0]) for feed in _feeds()]


def _assert_same(what, got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{what}, step {step}: tags {sorted(g)} != {sorted(w)}"
        for tag, value in w.items():
            where = f"{what}, step {step}, '{tag}'"
            if not isinstance(value, dict):
                np.testing.assert_allclose(g[tag], value, rtol=1e-5, atol=1e-6, err_msg=where)
                continue
            assert g[tag]["num"] == value["num"], f"{where}: {g[tag]['num']} values, one device {value['num']}"
            assert g[tag]["buckets"] == value["buckets"], f"{where}: bucket counts differ"
            for key in ("min", "max", "sum", "sum_squares"):   # (an average rounds differently)
                np.testing.assert_allclose(g[tag][key], value[key], rtol=1e-5, atol=1e-6, err_msg=f"{where}: {key}")


@pytest.fixture(scope="module")
def reference():
    graph_def, merged = _model()
    return graph_def, merged, _one_device(graph_def, merged)


def test_the_reference_has_the_histograms_the_cases_need(reference):
    """The one-device histograms count the global batch: hidden 8 x 5 values, 8
    per-example losses, one embedding-gradient row per id of the batch."""
    _, _, want = reference
    assert want[0]["activations"]["num"] == BATCH * 5
    assert want[0]["example_losses"]["num"] == BATCH
    assert want[0]["emb/gradient"]["num"] == BATCH * 3
    assert want[0]["w1/gradient"]["num"] == 7 * 5


@pytest.mark.parametrize("strategy,replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 4)])
def test_histograms_show_what_one_device_shows(reference, strategy, replicas):
    """Activations and per-example losses: every replica's rows; gradients (dense: the
    average; the embedding's values: all-gathered under allreduce and hybrid) as one
    device's; the loss scalar the mean."""
    graph_def, merged, want = reference
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    got = _rewritten(result, merged)
    # the embedding gradient's values are the replica's own (below)
    forward = ("activations", "example_losses", "loss_summary", "w1/gradient", "w2/gradient")
    _assert_same(f"{strategy}, {replicas} replicas", [{t: s[t] for t in forward} for s in got],
                 [{t: s[t] for t in forward} for s in want])


def test_a_histogram_of_an_embedding_gradients_values_shows_replica_0s(reference):
    """The values of an IndexedSlices gradient, read before the optimizer deduplicates
    them (where the rewrite averages them), are each replica's gradient of its own rows'
    mean: concatenated, they would be R times one device's values. They stay replica
    0's, which is what one device computes on replica 0's rows alone (documented in
    docs/semantics.md)."""
    graph_def, merged, _ = reference
    feed = _feeds()[0]
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as sess:
        sess.run("init")
        got = _parse(sess.run(merged, feed))["emb/gradient"]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = _parse(sess.run(merged, {k: v[: BATCH // 2] for k, v in feed.items()}))["emb/gradient"]
    assert got["num"] == want["num"] == BATCH // 2 * 3
    np.testing.assert_allclose([got["min"], got["max"], got["sum"]], [want["min"], want["max"], want["sum"]],
                               rtol=1e-5, atol=1e-7)


def test_without_the_concatenation_replica_0_would_show_half_the_rows(reference):
    """The control: replica 0's own histogram (its own summary op, which keeps its own
    value) counts a replica's rows only, so the comparison above can fail."""
    graph_def, merged, want = reference
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    own = [n.name for n in result.graph_def.node if n.op == "HistogramSummary" and n.name.startswith("replica_1/")
           and n.input[1].startswith("replica_1/hidden")]
    assert len(own) == 1
    with gr.Session(result) as sess:
        sess.run("init")
        value = sess.run(own[0] + ":0", _feeds()[0])
    (histo,) = [v.histo for v in summary_pb2.Summary.FromString(value).value]
    assert histo.num == want[0]["activations"]["num"] / 2


def test_what_a_histogram_reads(reference):
    """Structure: the master's histograms of activations and losses read a ConcatV2 on
    the host over one flattening Reshape per replica, on the replica's device; the
    gradients' histograms read no such concatenation."""
    graph_def, _, _ = reference
    result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    for tag in ("activations", "example_losses"):
        concat = nodes[nodes[tag].input[1]]
        assert concat.op == "ConcatV2" and concat.attr["N"].i == 4, tag
        assert concat.device.endswith("CPU:0")
        for i, name in enumerate(concat.input[:4]):
            reshape = nodes[name]
            assert reshape.op == "Reshape" and reshape.device.endswith(f"CPU:{i}"), name
            assert nodes[reshape.input[1]].attr["value"].tensor.int_val == [-1]
    for tag in ("emb/gradient", "w1/gradient", "w2/gradient"):
        assert nodes[nodes[tag].input[1]].op != "ConcatV2", tag


def test_with_template_replicas_every_replica_is_concatenated(reference):
    """Template replicas (replica 1 written once per replica by the export): the exported
    concatenation reads each of the 4 replicas' own flattened rows."""
    graph_def, _, _ = reference
    result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    concat = nodes[nodes["activations"].input[1]]
    sources = [nodes[nodes[name].input[0]].name for name in concat.input[:4]]
    assert sources == ["hidden"] + [f"replica_{i}/hidden" for i in (1, 2, 3)]


def test_between_graph_a_worker_shows_its_own_replicas_rows(reference):
    """Between-graph, worker 0 of 2 with 2 replicas each: its histogram concatenates its
    two replicas (a worker's graph holds only its own), as its scalar summaries average them."""
    graph_def, _, _ = reference
    spec = {"worker": ["localhost:2222", "localhost:2223"]}
    result = gr.rewrite(graph_def, spec, devices_per_worker=2, device_type="CPU", task="worker:0")
    nodes = {n.name: n for n in result.graph_def.node}
    concat = nodes[nodes["activations"].input[1]]
    assert concat.op == "ConcatV2" and concat.attr["N"].i == 2
    assert "/task:0/" in concat.device
