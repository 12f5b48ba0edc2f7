"""SparseTensor batch inputs: a Wide & Deep click model over a variable-length sparse
feature (graph_rewriter.testing.tf1_scripts.sparse_features_model), fed through
tf.compat.v1.sparse_placeholder or read from tf.data with tf.io.VarLenFeature.

A SparseTensor's indices and values have one row per entry, not per example: split by
rows like a dense input, replica k would get the k-th slice of the entries, numbered by
the whole batch's rows, with the whole batch's dense shape (a shape error at best). The
rewrite gives each replica the entries of its own rows, renumbered, with its own dense
shape (a SparseSplit on the host, passes/split_inputs.py), and R replicas train as one
device.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.testing.tf1_scripts import (ctc_batches, ctc_model, feature_column_model, feature_column_records,
                                                sparse_feature_batches, sparse_feature_records, sparse_features_model)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
VARIABLES = ["wide/weights", "deep/embedding", "deep/hidden/kernel", "deep/out/kernel"]
READS = {v: f"{v}/Read/ReadVariableOp:0" for v in VARIABLES}
RECORDS = sparse_feature_records(STEPS * BATCH)
SPARSE = ["ids/indices:0", "ids/values:0", "ids/shape:0"]


def _model(source, batch=BATCH, drop_remainder=False):
    return sparse_features_model(source, batch=batch, drop_remainder=drop_remainder, records=RECORDS)


def _feeds(source):
    return sparse_feature_batches(STEPS, BATCH) if source == "placeholder" else [None] * STEPS


def _one_device(graph_def, feeds, reads=READS):
    """(losses, {name: value} of ``reads``) after a step per feed on one device."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return losses, sess.run(reads)


def _rewritten(result, feeds, reads=READS):
    with gr.Session(result) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return losses, sess.run(reads)


def _assert_equal(what, got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL, err_msg=f"{what}: losses")
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


def _variable_reads(graph_def):
    """{name: tensor} of every resource variable's read (its optimizer slots' too)."""
    return {n.name: n.name + ":0" for n in graph_def.node
            if n.op == "ReadVariableOp" and n.name.endswith("/Read/ReadVariableOp")}


def test_the_batches_have_empty_rows_and_rows_of_several_ids():
    """The data exercise what a split must keep: rows without entries (the lookup's
    SparseFillEmptyRows gives them a zero embedding) and entries per row that differ,
    so the entries do not split where the rows do."""
    for feed in sparse_feature_batches(STEPS, BATCH):
        per_row = np.bincount(feed["ids/indices:0"][:, 0], minlength=BATCH)
        assert per_row.min() == 0 and per_row.max() >= 2
        assert per_row[:BATCH // 2].sum() * 2 != len(feed["ids/values:0"])


@pytest.mark.parametrize("source", ["placeholder", "dataset"])
def test_the_analysis_finds_the_sparse_tensor_and_the_plan_splits_it(source):
    a = analyze(graph_io.load_graph(_model(source)))
    assert len(a.sparse_inputs) == 1
    triple = [t.name for t in a.sparse_inputs[0]]
    if source == "placeholder":
        assert triple == SPARSE
    else:
        assert {t.node.op for t in a.sparse_inputs[0]} == {"DeserializeSparse"}
        assert a.sparse_inputs[0][0].node in a.input_pipeline   # deserialized once, on the host
    assert set(triple) <= {t.name for t in a.batch_inputs}
    assert not set(triple) & {t.name for t in a.broadcast_inputs}
    plan = gr.rewrite(_model(source), devices_per_worker=2, device_type="CPU").metadata["plan"]
    assert plan["sparse_inputs"] == [triple]


@pytest.mark.parametrize("source, strategy, replicas", [
    ("placeholder", "allreduce", 2), ("placeholder", "ps", 2), ("placeholder", "hybrid", 2),
    ("placeholder", "allreduce", 4), ("dataset", "allreduce", 2), ("dataset", "ps", 4), ("dataset", "hybrid", 2)])
def test_replicas_train_as_one_device(source, strategy, replicas):
    feeds = _feeds(source)
    want = _one_device(_model(source), feeds)
    result = gr.rewrite(_model(source), devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    _assert_equal(f"{source}, {strategy}, {replicas} replicas", _rewritten(result, feeds), want)


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("hybrid", 4), ("ps", 2)])
def test_a_feature_column_model_trains_as_one_device(strategy, replicas):
    """tf.compat.v1.feature_column as a TF1 Wide & Deep estimator builds it: a hashed and a
    vocabulary column (a lookup table) over a VarLenFeature of strings, a crossed column,
    an embedding column in input_layer, linear_model; every variable as one device's."""
    graph_def = feature_column_model(feature_column_records(STEPS * BATCH), batch=BATCH)
    reads = _variable_reads(graph_def)
    assert len(reads) >= 8
    want = _one_device(graph_def, [None] * STEPS, reads)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert len(result.metadata["plan"]["sparse_inputs"]) == 2   # tags, city: VarLenFeatures
    _assert_equal(strategy, _rewritten(result, [None] * STEPS, reads), want)


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("ps", 4)])
def test_a_ctc_loss_over_sparse_transcripts_trains_as_one_device(strategy, replicas):
    """The transcripts are the SparseTensor: each replica's utterances with their own
    labels (renumbered), the dense shape's label axis the batch's longest."""
    feeds = ctc_batches(STEPS, BATCH)
    reads = {"w": "w/Read/ReadVariableOp:0", "b": "b/Read/ReadVariableOp:0"}
    want = _one_device(ctc_model(), feeds, reads)
    result = gr.rewrite(ctc_model(), devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert result.metadata["plan"]["sparse_inputs"] == [["labels/indices:0", "labels/values:0", "labels/shape:0"]]
    _assert_equal(strategy, _rewritten(result, feeds, reads), want)


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("ps", 4), ("hybrid", 2)])
def test_a_partitioned_embedding_trains_as_one_device(strategy, replicas):
    """The deep embedding a PartitionedVariable of 3 parts (fixed_size_partitioner, the
    lookup's "mod" strategy: ids split by DynamicPartition, rows put back by
    DynamicStitch), each part a variable with its own sparse gradient."""
    graph_def = sparse_features_model("placeholder", partitions=3)
    reads = _variable_reads(graph_def)
    assert {f"deep/embedding/part_{k}/Read/ReadVariableOp" for k in range(3)} <= set(reads)
    assert "deep/embedding/Read/ReadVariableOp" not in reads
    feeds = sparse_feature_batches(STEPS, BATCH)
    want = _one_device(graph_def, feeds, reads)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    _assert_equal(strategy, _rewritten(result, feeds, reads), want)


def test_each_replica_gets_the_entries_of_its_rows_renumbered():
    """Replica k's indices, values and dense shape are what tf.sparse.slice of its rows
    gives (4 replicas: 2 rows each; row 0 and row 5 have no entries)."""
    result = gr.rewrite(_model("placeholder"), devices_per_worker=4, device_type="CPU")
    feed = sparse_feature_batches(1, BATCH)[0]
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(result.graph_def, name="")
    parts = [f"ids/split_for_replicas/{c}:{k}" for k in range(4) for c in ("indices", "values", "shape")]
    config = tf1.ConfigProto(device_count={"CPU": 4})
    with tf1.Session(graph=graph, config=config) as sess:
        got = sess.run(parts, {**feed})
    indices, values = feed["ids/indices:0"], feed["ids/values:0"]
    for k in range(4):
        mine = (indices[:, 0] >= 2 * k) & (indices[:, 0] < 2 * k + 2)
        np.testing.assert_array_equal(got[3 * k], indices[mine] - [2 * k, 0])
        np.testing.assert_array_equal(got[3 * k + 1], values[mine])
        np.testing.assert_array_equal(got[3 * k + 2], [2, feed["ids/shape:0"][1]])


def test_the_split_runs_on_the_host_of_gpu_replicas():
    result = gr.rewrite(_model("placeholder"), devices_per_worker=2, device_type="GPU")
    nodes = {n.name: n for n in result.graph_def.node}
    split = nodes["ids/split_for_replicas"]
    assert split.op == "SparseSplit" and "CPU" in split.device
    for c in ("indices", "values", "shape"):
        assert "CPU" in nodes[f"ids/split_for_replicas/{c}"].device
    # every replica's lookup reads its own part, none the whole batch
    readers = [n for n in nodes.values() if "ids/indices" in n.input or "ids/values" in n.input]
    assert {n.name for n in readers} == {"ids/split_for_replicas"}


def test_a_dataset_batched_with_drop_remainder_is_drawn_per_replica():
    """A static batch: each replica draws its own batch of 4 (its serialized SparseTensor
    with it, deserialized on the replica), as one device reading batches of 8."""
    want = _one_device(_model("dataset", batch=BATCH, drop_remainder=True), [None] * STEPS)
    result = gr.rewrite(_model("dataset", batch=BATCH // 2, drop_remainder=True), devices_per_worker=2,
                        device_type="CPU")
    assert "sparse_inputs" not in result.metadata["plan"]
    assert {i["mode"] for i in result.metadata["inputs"]} == {"per_replica"}
    _assert_equal("drop_remainder", _rewritten(result, [None] * STEPS), want)


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("ps", 4)])
def test_a_tf1_batch_of_sparse_tensors_is_taken_per_replica(strategy, replicas):
    """tf.train.batch of a parsed VarLenFeature: the queue holds handles into a
    SparseTensorsMap its AddSparseToTensorsMap (on the host, once) fills; each replica
    dequeues its own batch (a static batch) and takes its handles from that one map
    (the clones keep the map's shared_name), as one device taking R batches at once."""
    records = sparse_feature_records(STEPS * BATCH)

    def run(session):
        with session as sess:
            sess.run("init")
            coord = tf1.train.Coordinator()
            threads = tf1.train.start_queue_runners(sess, coord)
            losses = [sess.run(["loss:0", "train_op"])[0] for _ in range(STEPS)]
            values = sess.run(READS)
            coord.request_stop()
            coord.join(threads, stop_grace_period_secs=10)
        return losses, values

    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(sparse_features_model("queue", batch=BATCH, records=records))
    want = run(tf1.Session(graph=graph))
    result = gr.rewrite(sparse_features_model("queue", batch=BATCH // replicas, records=records),
                        devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    takes = [n for n in result.graph_def.node if n.op == "TakeManySparseFromTensorsMap"]
    assert len(takes) == replicas and {n.attr["shared_name"].s for n in takes} == {b"batch/AddSparseToTensorsMap"}
    _assert_equal(f"queue, {strategy}, {replicas} replicas", run(gr.Session(result)), want)


def test_the_session_takes_the_sparse_tensor_as_a_feed_key():
    """As tf.compat.v1.Session does: a SparseTensor key, its value a SparseTensorValue or
    an (indices, values, dense_shape) tuple."""
    feeds = sparse_feature_batches(STEPS, BATCH)
    want = _one_device(_model("placeholder"), feeds)
    result = gr.rewrite(_model("placeholder"), devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as sess:
        ids = tf.SparseTensor(*(sess.graph.get_tensor_by_name(name) for name in SPARSE))
        sess.run("init")
        losses = []
        for step, feed in enumerate(feeds):
            parts = tuple(feed[name] for name in SPARSE)
            value = tf1.SparseTensorValue(*parts) if step % 2 else parts
            losses.append(sess.run(["loss:0", "train_op"], {ids: value, "x:0": feed["x:0"], "y:0": feed["y:0"]})[0])
        got = sess.run(READS)
    _assert_equal("SparseTensor feed key", (losses, got), want)


def test_a_sparse_batch_that_does_not_split_evenly_is_refused_naming_it():
    result = gr.rewrite(_model("placeholder"), devices_per_worker=4, device_type="CPU")
    feed = sparse_feature_batches(1, BATCH)[0]
    with gr.Session(result) as sess:
        sess.run("init")
        uneven = {**feed, "ids/shape:0": np.array([6, 3], np.int64)}
        with pytest.raises(GraphRewriteError, match=r"'ids/shape:0' gets 6 row\(s\).*4 replicas"):
            sess.run("train_op", uneven)
        without_shape = {k: v for k, v in feed.items() if k != "ids/shape:0"}
        with pytest.raises(GraphRewriteError, match=r"'ids/indices:0' comes without its dense shape 'ids/shape:0'"):
            sess.run("train_op", without_shape)


def test_the_graph_itself_refuses_rows_that_do_not_split_evenly():
    """Run by a plain tf.compat.v1.Session, which checks nothing: the Assert before the
    split fails the step, saying so, where SparseSplit would hand the first replicas
    one row more."""
    result = gr.rewrite(_model("placeholder"), devices_per_worker=4, device_type="CPU")
    feed = sparse_feature_batches(1, 6)[0]
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(result.graph_def, name="")
    with tf1.Session(graph=graph, config=tf1.ConfigProto(device_count={"CPU": 4})) as sess:
        sess.run("init")
        with pytest.raises(tf.errors.InvalidArgumentError, match="graph_rewriter: SparseTensor ids of the batch: the first dimension of its dense shape"):
            sess.run("ids/split_for_replicas/values:1", feed)


def test_per_replica_draws_of_a_dataset_sparse_tensor_are_refused():
    with pytest.raises(GraphRewriteError, match="batch_split='per_replica'.*SparseTensor 'DeserializeSparse'"):
        gr.rewrite(_model("dataset"), devices_per_worker=2, device_type="CPU", batch_split="per_replica")


def test_one_replica_leaves_the_graph_without_a_split():
    result = gr.rewrite(_model("placeholder"), devices_per_worker=1, device_type="CPU")
    assert not [n for n in result.graph_def.node if n.op == "SparseSplit"]


def test_an_unnamed_sparse_placeholder_is_refused_when_its_batch_is_split():
    """Its three placeholders cannot be told apart from dense inputs by name: the indices
    CTCLoss reads are refused (tests/test_bad_input.py checks the message), unless
    nothing is split (one replica per client)."""
    with pytest.raises(GraphRewriteError, match="'Placeholder_2' is a SparseTensor's indices"):
        gr.rewrite(ctc_model(named=False), devices_per_worker=2, device_type="CPU")
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    gr.rewrite(ctc_model(named=False), cluster, task="worker:0", devices_per_worker=1, device_type="CPU")
    gr.rewrite(ctc_model(named=False), devices_per_worker=1, device_type="CPU")


def test_an_unnamed_sparse_placeholder_read_by_an_embedding_lookup_is_refused():
    """tf.nn.embedding_lookup_sparse reads the indices' first column as the segments of
    a SparseSegmentMean, and never the dense shape: split like dense inputs, the entries
    would be sliced whatever their rows (a run-time "do not split evenly", or a silently
    wrong shard). The rewrite refuses it, naming the indices and the lookup."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        ids = tf1.sparse_placeholder(tf.int64, shape=[None, 3])
        y = tf1.placeholder(tf.float32, [None], name="y")
        table = tf1.get_variable("table", [20, 4])
        h = tf.nn.embedding_lookup_sparse(table, ids, None, combiner="mean")
        w = tf1.get_variable("w", [4, 1])
        loss = tf.reduce_mean(tf.square(tf.squeeze(tf.matmul(h, w), 1) - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    with pytest.raises(GraphRewriteError, match=f"'{ids.indices.op.name}' is a SparseTensor's indices "
                                                "\('embedding_lookup_sparse' reads it as segment_ids"):
        gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")
    gr.rewrite(g.as_graph_def(), devices_per_worker=1, device_type="CPU")


def _half(feed, k):
    """Worker k's half of a global batch of sparse_feature_batches: its rows of x and y,
    and the entries of its rows of the SparseTensor, renumbered, with its dense shape."""
    rows = len(feed["x:0"]) // 2
    mine = (feed["ids/indices:0"][:, 0] >= k * rows) & (feed["ids/indices:0"][:, 0] < (k + 1) * rows)
    return {"ids/indices:0": feed["ids/indices:0"][mine] - [k * rows, 0], "ids/values:0": feed["ids/values:0"][mine],
            "ids/shape:0": np.array([rows, feed["ids/shape:0"][1]], np.int64),
            "x:0": feed["x:0"][k * rows:(k + 1) * rows], "y:0": feed["y:0"][k * rows:(k + 1) * rows]}


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_two_workers_of_two_replicas_train_as_one_device_on_loopback_servers(strategy, pool, procs, tmp_path):
    """Between-graph, 2 workers x 2 replicas, each worker its own client fed its half of
    the rows (its entries renumbered), which its graph splits again between its replicas."""
    feeds = sparse_feature_batches(STEPS, BATCH)
    _, want = _one_device(_model("placeholder"), feeds)
    got = tc.two_workers_read(pool, procs, tmp_path, _model("placeholder"), strategy, STEPS, READS.values(), feeds,
                              dpw=2, halve=_half)
    for name, tensor in READS.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


def test_between_graph_each_worker_shards_its_pipeline_and_splits_its_own_sparse_batch():
    """Worker 1 of 2 (2 replicas each): the dataset is sharded for the worker before it is
    batched, and the worker's SparseTensor is split between its own replicas."""
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    result = gr.rewrite(_model("dataset"), cluster, task="worker:1", devices_per_worker=2, device_type="CPU")
    ops = [n.op for n in result.graph_def.node]
    assert ops.count("ShardDataset") == 1 and ops.count("SparseSplit") == 1
    split = next(n for n in result.graph_def.node if n.op == "SparseSplit")
    assert split.input[1:] == ["DeserializeSparse", "DeserializeSparse:1", "DeserializeSparse:2"]
    assert split.device.endswith("/job:worker/replica:0/task:1/device:CPU:0")
