"""Updates that write the batch's rows into a variable read every replica's rows
(passes/gather_rows.py): MoCo's queue of keys trains as on one device.

MoCo (graph_rewriter.testing.tf1_scripts.moco) keeps the last keys in a variable and
reads it as the negatives of the next steps. One device enqueues the batch's keys; a
replica has its own shard's. Before, the analysis took the queue's new value for a
batch statistic and averaged the replicas' queues (0.37 in the loss by the second step,
1.29 in the queue, silently, under ps; a cycle the verifier refused under allreduce),
and refused the pointer form ("cannot find the gradient of variable 'queue'"). Now each
replica's update reads every replica's keys, gathered in replica order, so every
replica's mirrored queue (and pointer) is one device's.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import GraphRewriteError, graph_io, inspect_report
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (MOCO_QUEUE, center_loss_batches, center_loss_classifier, moco,
                                                moco_batches)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 5, 8   # the pointer wraps around the queue of 32 after 4 steps
RTOL, ATOL = 1e-5, 1e-6




_REFERENCES = {}


def _reference(queue):
    if queue not in _REFERENCES:
        graph_def = moco(queue)
        with harness.one_device_session(graph_def) as sess:
            _REFERENCES[queue] = graph_def, harness.train_and_read(sess, graph_def, moco_batches(STEPS, BATCH))
    return _REFERENCES[queue]


@pytest.mark.parametrize("queue", ["concat", "pointer"])
def test_the_reference_enqueues_the_batchs_keys(queue):
    """What the tests below lean on: one device's queue holds the last batch's keys in
    its rows (newest first, or at the pointer), the pointer wrapped around, and the
    queue changes the loss (its negatives)."""
    graph_def, (losses, values) = _reference(queue)
    feeds = moco_batches(STEPS, BATCH)
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        for feed in feeds[:-1]:
            sess.run("train_op", feed)
        keys = sess.run("keys:0", feeds[-1])
        sess.run("train_op", feeds[-1])
        bank = sess.run("queue/Read/ReadVariableOp:0")
    last = (STEPS - 1) * BATCH % MOCO_QUEUE if queue == "pointer" else 0
    np.testing.assert_allclose(bank[last:last + BATCH], keys, rtol=1e-6)
    if queue == "pointer":
        assert values["queue_ptr"] == STEPS * BATCH % MOCO_QUEUE
    assert len(set(np.round(losses, 4))) == STEPS


@pytest.mark.parametrize("queue,strategy,replicas", [
    ("concat", "allreduce", 2),
    ("pointer", "allreduce", 2),
    ("concat", "allreduce", 4),
    ("pointer", "ps", 2),
    ("concat", "ps", 4),
    ("pointer", "hybrid", 2),
])
def test_trains_as_one_device(queue, strategy, replicas):
    """Losses at every step and every variable (the queue, its pointer, the key
    encoder, the momentum slots) after STEPS steps."""
    graph_def, want = _reference(queue)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, moco_batches(STEPS, BATCH))
    harness.assert_trained_alike(f"{queue}, {strategy}, {replicas} replicas", got, want, RTOL, ATOL)


@pytest.mark.parametrize("queue", ["concat", "pointer"])
def test_each_replicas_own_keys_would_be_caught(queue):
    """The control: a given plan with ``"gathered_rows": []`` leaves each replica writing
    its own shard's keys; the first loss is still one device's, the later ones are not,
    so the test above can fail."""
    graph_def, want = _reference(queue)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.gathered_rows = []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    with gr.Session(result) as sess:
        losses, values = harness.train_and_read(sess, graph_def, moco_batches(STEPS, BATCH))
    assert abs(losses[0] - want[0][0]) < 1e-5
    assert max(abs(a - b) for a, b in zip(losses, want[0])) > 1e-2, (losses, want[0])
    assert np.abs(values["queue"] - want[1]["queue"]).max() > 1e-1


@pytest.mark.parametrize("queue", ["concat", "pointer"])
def test_the_plan_gathers_the_keys_for_the_update_alone(queue):
    """The plan lists the keys with the update ops that read them (the forward pass's
    positive logits read the replica's own); no gradient is cut for the queue; under
    strategy ps the queue (and pointer) are mirrored; the graph gathers per replica,
    and `graph-rewrite inspect` says so."""
    graph_def = moco(queue)
    a = analyze(graph_io.load_graph(graph_def))
    assert [t for t, _ in a.gathered_rows] == ["keys:0"]
    assert a.row_state_variables == (["queue"] if queue == "concat" else ["queue", "queue_ptr"])
    assert all(c.variable not in a.row_state_variables for c in a.cuts)
    readers = {r for r, _ in a.gathered_rows[0][1]}
    assert "mul" not in readers and readers, readers   # q * k, the positive logits
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy="ps")
    plan = result.metadata["plan"]
    placements = {v["name"]: v["placement"] for v in plan["variables"]}
    assert all(placements[v] == "mirrored" for v in a.row_state_variables), placements
    assert placements["query/w1"] == "ps"
    gathers = [n for n in result.graph_def.node if n.op == "CollectiveGatherV2"]
    assert sorted(n.name for n in gathers) == ["keys/every_replica/all_gather", "replica_1/keys/every_replica/all_gather"]
    assert [list(e) for e in plan["gathered_rows"]][0][0] == "keys:0"
    text = inspect_report.format_report(inspect_report.report(result))
    assert "rows gathered from every replica for the updates that write them into variables: keys:0" in text


def test_between_graph_ps_without_collectives_is_refused():
    """Between-graph under strategy ps each worker's gradients go to the parameter
    servers: no collective spans the workers, so the keys cannot be gathered. The
    rewrite stops, naming the variable and the tensor."""
    graph_def, _ = _reference("concat")
    spec = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224"]}
    with pytest.raises(GraphRewriteError, match="variable 'queue' is assigned rows of the batch \\('keys:0'\\)"):
        gr.rewrite(graph_def, spec, devices_per_worker=1, device_type="CPU", strategy="ps", task="worker:0")


def test_rows_written_with_a_statistic_of_the_forward_pass_are_refused():
    """An update that writes the keys scaled by a statistic the loss also uses (a value
    that is not rows, which no gather makes one device's) is refused, naming the
    variable, where it used to be averaged silently."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 3])
        h = tf.matmul(x, w)
        scale = tf.reduce_mean(h)
        loss = tf.identity(tf.reduce_mean(tf.square(h)) * scale, name="loss")
        cache = tf1.get_variable("cache", [4, 3], trainable=False)
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([step]):
            update = tf1.assign(cache, tf.concat([tf.stop_gradient(h) * tf.stop_gradient(scale), cache], 0)[:4])
        tf.group(update, name="train_op")
    with pytest.raises(GraphRewriteError, match="variable 'cache' is assigned rows of the batch"):
        gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")


def _cache_of_the_last_batch():
    """A variable holding the last batch's raw inputs (``assign(cache, x)`` after the
    step), read by the next step's loss."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 1], initializer=tf1.glorot_uniform_initializer(seed=2))
        cache = tf1.get_variable("cache", [BATCH, 4], initializer=tf1.zeros_initializer(), trainable=False)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w)))
                           + 0.1 * tf.reduce_mean(tf.square(tf.matmul(cache, w))), name="loss")
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([step]):
            tf.group(tf1.assign(cache, x), name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_batch_input_written_as_it_is_is_gathered(replicas):
    """A batch input itself written into a variable (a cache of the last batch): the
    analysis found no tensor to gather (the input is no forward op) and each replica
    wrote its shard into the whole cache, a shape error at run time ("Expected [8,4] got
    [4,4]"). Now every replica writes the batch, gathered from the replicas' parts of the
    split (at 4 replicas through the template replicas' per-replica part)."""
    graph_def = _cache_of_the_last_batch()
    assert analyze(graph_io.load_graph(graph_def)).gathered_rows == [("x:0", [("AssignVariableOp", 1)])]
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(BATCH, 4).astype(np.float32)} for _ in range(3)]
    with harness.one_device_session(graph_def) as sess:
        want = harness.train_and_read(sess, graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU")
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, feeds)
    harness.assert_trained_alike(f"{replicas} replicas", got, want, RTOL, ATOL)


def test_a_center_loss_scatter_is_no_gradient():
    """FaceNet's center loss moves the centers by a scatter_sub of the batch's features,
    each row's step divided by its label's count in the batch. A scatter's values not
    computed from the backward pass are no sparse gradient: the analysis had taken them
    for one and refused ("cannot find the gradient of variable 'centers'"); now the
    update is rows written into state, gathered, the counts taken over every replica's
    labels."""
    found = analyze(graph_io.load_graph(center_loss_classifier()))
    # (the labels, the batch's centers and the features)
    assert [t for t, _ in found.gathered_rows] == ["labels:0", "Relu:0", "Gather:0"]
    assert found.variables["centers"].role != "trainable" and "centers" not in {c.variable for c in found.cuts}


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_a_center_loss_trains_as_one_device(strategy, replicas):
    """The losses, the weights and the centers."""
    graph_def, feeds = center_loss_classifier(), center_loss_batches(4, BATCH)
    with harness.one_device_session(graph_def) as sess:
        want = harness.train_and_read(sess, graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, feeds)
    harness.assert_trained_alike(f"{strategy}, {replicas} replicas", got, want, RTOL, ATOL)
    assert np.abs(want[1]["centers"]).max() > 0.01   # (the centers moved)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("queue", ["concat", "pointer"])
def test_between_graph_on_servers(queue, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch: the keys are gathered across the workers' processes, and the
    variables equal one device's after STEPS steps."""
    graph_def, (_, want) = _reference(queue)
    reads = harness.resource_reads(graph_def)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(),
                              moco_batches(STEPS, BATCH), dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
