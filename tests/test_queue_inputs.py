"""TF1 queue-based input: tf.train.batch, shuffle_batch and the input producers.

A TF1 script that reads its data through queues dequeues each batch from a queue that
QueueRunner threads fill (MonitoredTrainingSession starts them; a plain session's script
calls ``tf.compat.v1.train.start_queue_runners``). The rewrite keeps the queues, their
enqueues and the producers once, on the host, and draws a batch per replica:

    batch/fifo_queue ─> batch (DequeueMany 8) ───────────────┐
                    └─> batch/draw_1 (DequeueMany 8, ^batch) ─┴─> batch/per_replica_i ─:k─> replica k

so replica k takes the k-th batch of the step: R replicas of batch B compute what one
device computes on a batch of R x B (the queue is first in, first out). A DequeueUpTo
(``allow_smaller_final_batch``) has no static batch: its batch is split. Between-graph,
each worker's producer enqueues its own part of the list (elements k, k+W, ...).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import PlanPass, ReplicatePass, SplitInputsPass
from graph_rewriter.testing.tf1_scripts import (
    FEATURES, ROWS, cifar10_tutorial, queue_regression, tfrecord_regression, write_cifar_files, write_records)
from pass_graphs import WORKERS2, context

tf1 = tf.compat.v1
STEPS = 4
RTOL, ATOL = 1e-5, 1e-6


def monitored(meta, steps, config=None):
    """(losses, w) after ``steps`` steps under MonitoredTrainingSession, which starts the
    graph's QueueRunners. The losses are the graph's "loss:0" (replica 0's, rewritten)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta)
        with tf1.train.MonitoredTrainingSession(config=config) as sess:
            losses = [sess.run(["loss:0", "train_op"])[0] for _ in range(steps)]
            w = sess.run(graph.get_tensor_by_name("w/Read/ReadVariableOp:0"))
    return losses, w


def with_runners(result, steps):
    """(losses, w) through gr.Session, its QueueRunners started as a TF1 script does."""
    with gr.Session(result) as sess:
        sess.run("init")
        coord = tf1.train.Coordinator()
        threads = tf1.train.start_queue_runners(sess, coord=coord)
        try:
            losses = [sess.run(["loss:0", "train_op"])[0] for _ in range(steps)]
            w = sess.run("w/Read/ReadVariableOp:0")
        finally:
            coord.request_stop()
            coord.join(threads, stop_grace_period_secs=10)
    return losses, w


def rewrite(meta, replicas=2, **options):
    return gr.rewrite(meta, devices_per_worker=replicas, device_type="CPU", **options)


def test_each_replica_draws_its_own_batch_from_the_one_queue():
    result = rewrite(queue_regression(8))
    nodes = {n.name: n for n in result.graph_def.node}
    assert nodes["batch"].op == nodes["batch/draw_1"].op == "QueueDequeueManyV2"
    assert list(nodes["batch/draw_1"].input) == ["batch/fifo_queue", "batch/n", "^batch"]
    assert list(nodes["batch/per_replica_0"].input) == ["batch", "batch/draw_1"]
    assert nodes["MatMul"].input[0] == "batch/per_replica_0"
    assert nodes["replica_1/MatMul"].input[0] == "batch/per_replica_0:1"
    queue_ops = [n for n in nodes.values() if n.op.startswith("Queue") or n.op.endswith("QueueV2")]
    assert not [n.name for n in queue_ops if n.name.startswith("replica_1/")], "the pipeline exists once"
    # and so does the queue-size summary tf.train.batch adds
    assert "batch/fraction_of_32_full" in nodes and not [n for n in nodes if "fraction_of" in n and "replica_" in n]
    assert {n.device for n in queue_ops} == {"/device:CPU:0"}
    assert result.metadata["inputs"] == [
        {"name": f"batch:{i}", "kind": "queue", "mode": "per_replica", "static_batch": 8, "global_batch": 16}
        for i in range(2)]
    assert not result.metadata["plan"].get("notes")   # the MetaGraphDef has its QueueRunners


@pytest.mark.parametrize("replicas, strategy", [(2, "allreduce"), (3, "allreduce"), (2, "ps")])
def test_monitored_training_session_trains_as_one_device_on_the_replicas_batches(replicas, strategy, tmp_path):
    """MonitoredTrainingSession starts the rewritten MetaGraphDef's QueueRunners; the
    replicas' batches are one device's batch of R x 8 rows, in order."""
    want_losses, want_w = monitored(queue_regression(8 * replicas), STEPS)
    result = rewrite(queue_regression(8), replicas, strategy=strategy)
    path = result.save(str(tmp_path / "rewritten.meta"))
    _, w = monitored(path, STEPS, result.session_config())
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)
    losses, w = with_runners(result, STEPS)   # gr.Session: the loss merged over the replicas
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)


def test_a_tfrecord_reader_pipeline_trains_as_one_device(tmp_path):
    """string_input_producer -> TFRecordReader -> parse_single_example -> tf.train.batch."""
    files = write_records(tmp_path)
    want_losses, want_w = monitored(tfrecord_regression(files, 16), STEPS)
    result = rewrite(tfrecord_regression(files, 8))
    losses, w = with_runners(result, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)


def _variables(meta, steps, config=None):
    """Every global variable (weights, both moving averages, global_step) after ``steps``
    steps under MonitoredTrainingSession, by name."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta)
        with tf1.train.MonitoredTrainingSession(config=config) as sess:
            for _ in range(steps):
                sess.run("train_op")
            return sess.run({v.op.name: v for v in tf1.global_variables()})


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_the_cifar10_tutorial_trains_as_one_device(strategy, tmp_path):
    """Its reader pipeline, weight decay in a collection, the loss moving average before
    the gradients, the decayed learning rate and the variables' moving average after
    the update: 2 replicas of batch 8 end where one device with batch 16 ends."""
    files = write_cifar_files(tmp_path)
    want = _variables(cifar10_tutorial(files, 16), STEPS)
    result = rewrite(cifar10_tutorial(files, 8), strategy=strategy)
    got = _variables(result.save(str(tmp_path / "rewritten.meta")), STEPS, result.session_config())
    assert sorted(got) == sorted(want)
    assert want["global_step"] == STEPS
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("strategy", ["allreduce", "hybrid", "ps"])
def test_the_cifar10_tutorial_rewrites_between_graph(strategy):
    """Each worker's graph of a two-worker cluster (with a ps task for ps and hybrid).
    Under ps the tutorial's gradients wait for its loss averages, which only the chief
    updates, after its take mid-step: another worker's gradients do not wait for them
    (tests/test_cluster.py trains it on loopback servers)."""
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    if strategy != "allreduce":
        cluster["ps"] = ["p0:2222"]
    meta = cifar10_tutorial(["data_batch_1.bin", "data_batch_2.bin"], 8)
    for task in ("worker:0", "worker:1"):
        result = gr.rewrite(meta, cluster, task=task, strategy=strategy, device_type="CPU")
        assert result.metadata["plan"]["strategy"] == strategy


def test_the_distorted_cifar10_tutorial_trains_under_monitored_training_session(tmp_path):
    """Random crops and flips, shuffle_batch with two threads: no run repeats another;
    the rewritten graph trains with MonitoredTrainingSession and its hooks."""
    files = write_cifar_files(tmp_path)
    result = rewrite(cifar10_tutorial(files, 8, distort=True))
    path = result.save(str(tmp_path / "rewritten.meta"))
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(path)
        loss = graph.get_tensor_by_name("loss:0")
        hooks = [tf1.train.StopAtStepHook(last_step=6), tf1.train.NanTensorHook(loss)]
        with tf1.train.MonitoredTrainingSession(config=result.session_config(), hooks=hooks,
                                                checkpoint_dir=str(tmp_path / "ckpt")) as sess:
            while not sess.should_stop():
                sess.run("train_op")
    assert tf.train.latest_checkpoint(str(tmp_path / "ckpt")).endswith("model.ckpt-6")


def _steps_until_the_data_ends(meta, config=None):
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta)
        steps = 0
        with tf1.train.MonitoredTrainingSession(config=config) as sess:
            while not sess.should_stop():   # an OutOfRangeError from the dequeue stops it
                sess.run("train_op")
                steps += 1
    return steps


def test_num_epochs_ends_training_at_one_devices_step(tmp_path):
    """slice_input_producer(num_epochs=2): 2 x ROWS rows, then the queues close;
    MonitoredTrainingSession stops at the step one device with batch 16 stops at."""
    want = _steps_until_the_data_ends(queue_regression(16, num_epochs=2))
    assert want == 2 * ROWS // 16
    result = rewrite(queue_regression(8, num_epochs=2))
    assert _steps_until_the_data_ends(result.save(str(tmp_path / "rewritten.meta")), result.session_config()) == want


def test_a_dequeue_up_to_is_split_across_the_replicas():
    """allow_smaller_final_batch: DequeueUpTo, no static batch; the batch of 8 is split
    into 2 x 4, as one device computes on those 8 rows."""
    meta = queue_regression(8, smaller_final=True)
    result = rewrite(meta)
    nodes = {n.name: n for n in result.graph_def.node}
    assert nodes["batch"].op == "QueueDequeueUpToV2" and "batch/draw_1" not in nodes
    assert nodes["batch/split_for_replicas"].op == "Split"
    assert result.metadata["batch_inputs"] == ["batch:0", "batch:1"] and "inputs" not in result.metadata
    want_losses, want_w = monitored(meta, STEPS)
    losses, w = with_runners(result, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)


def test_shuffle_batch_is_drawn_per_replica_and_trains():
    """A RandomShuffleQueue's order depends on its threads: no one-device twin to compare
    with, but each replica draws a batch of 8 and the model learns."""
    result = rewrite(queue_regression(8, batcher="shuffle_batch", shuffle_producer=True))
    nodes = {n.name: n for n in result.graph_def.node}
    assert nodes["shuffle_batch"].op == "QueueDequeueManyV2" and "shuffle_batch/draw_1" in nodes
    assert nodes["shuffle_batch/random_shuffle_queue"].op == "RandomShuffleQueueV2"
    losses, _ = with_runners(result, 30)
    assert losses[-1] < 0.2 * losses[0], losses


def _runners(meta):
    from tensorflow.core.protobuf import queue_runner_pb2
    return [queue_runner_pb2.QueueRunnerDef.FromString(raw)
            for raw in meta.collection_def["queue_runners"].bytes_list.value]


def test_a_graph_defs_queue_runners_are_rebuilt_from_its_queues(tmp_path):
    """A GraphDef has no collections: the output's MetaGraphDef gets the QueueRunners the
    script had (the queues' enqueues, close and cancel ops), so gr.Session and a .meta
    output train as the MetaGraphDef input does; the plan notes that a .pb loses them."""
    meta = queue_regression(8)
    result = rewrite(meta.graph_def)
    assert sorted(map(str, _runners(result.meta_graph))) == sorted(map(str, _runners(meta)))
    (note,) = result.metadata["plan"]["notes"]
    assert "QueueRunners" in note and ".meta" in note
    assert "note: " + note in result.summary()
    want_losses, want_w = monitored(queue_regression(16), STEPS)
    losses, w = with_runners(result, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)
    _, w = monitored(result.save(str(tmp_path / "rewritten.meta")), STEPS, result.session_config())
    np.testing.assert_allclose(w, want_w, rtol=RTOL, atol=ATOL)


# ----- between-graph: each worker's producer enqueues its own part -------------------------

def _worker_graph(meta, task):
    g = graph_io.load_graph(meta)
    run_passes(g, context(WORKERS2, task=task), PlanPass(), ReplicatePass(), SplitInputsPass())
    return g


@pytest.mark.parametrize("shuffle", [False, True])
def test_between_graph_each_producer_enqueues_its_workers_part_of_the_list(shuffle):
    """
        range(ROWS) ─> [RandomShuffle] ─> EnqueueMany(input_producer)
        worker k:  range(ROWS) ─> StridedSlice[k::2] ─> [RandomShuffle] ─> EnqueueMany
    (before the shuffle: the parts stay disjoint whatever each worker's shuffle does)
    """
    for k in range(2):
        g = _worker_graph(queue_regression(8, shuffle_producer=shuffle), f"worker:{k}")
        (enqueue,) = [n for n in g if n.op == "QueueEnqueueManyV2"]
        head = enqueue.inputs[1].node
        if shuffle:
            assert head.op == "RandomShuffle"
            head = head.inputs[0].node
        assert head.op == "StridedSlice" and head.name.endswith("/shard_for_worker")
        assert head.inputs[0].node.op == "Range"
        begin, end, strides = (tf.make_ndarray(t.node.attr["value"].tensor) for t in head.inputs[1:])
        assert (list(begin), list(end), list(strides), head.attr["end_mask"].i) == ([k], [0], [2], 1)
        # the batch queue is filled from the producer's queue: not sliced again
        assert len([n for n in g if n.op == "StridedSlice" and n.name.endswith("/shard_for_worker")]) == 1


def test_between_graph_each_worker_reads_its_own_files(tmp_path):
    """The file names are the producer's list: worker k reads files k, k+2, ...; the
    reader's records reach the batch queue unsliced."""
    files = [str(tmp_path / f"part{f}.tfrecord") for f in range(4)]
    g = _worker_graph(tfrecord_regression(files, 8), "worker:1")
    (part,) = [n for n in g if n.op == "StridedSlice" and n.name.endswith("/shard_for_worker")]
    assert part.inputs[0].node.op == "Const"   # the file names
    enqueued = g.node("input_producer/input_producer_EnqueueMany").inputs[1].node
    assert enqueued.op == "Identity" and enqueued.inputs[0].node is part   # in front of the producer's Identity
    values = tf.make_ndarray(part.inputs[0].node.attr["value"].tensor)
    assert [v.decode() for v in values[1::2]] == files[1::2]


def test_between_graph_a_queue_fed_from_a_placeholder_is_left_to_its_client():
    """An enqueue of fed values: each worker's client feeds its own rows."""
    g = tf.Graph()
    with g.as_default():
        rows = tf1.placeholder(tf.float32, [None, FEATURES], name="rows")
        queue = tf1.FIFOQueue(64, [tf.float32], shapes=[[FEATURES]])
        queue.enqueue_many([rows], name="feed_rows")
        x = queue.dequeue_many(4, name="batch")
        w = tf1.get_variable("w", [FEATURES, 1], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    worker = _worker_graph(g.as_graph_def(), "worker:1")
    assert not [n for n in worker if n.op == "StridedSlice"]
    assert worker.node("feed_rows").inputs[1].node.name == "rows"
    # nor is its enqueue a QueueRunner's, when the runners are rebuilt for a GraphDef
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")
    assert "queue_runners" not in result.meta_graph.collection_def
