"""A loss normalised by a sum over the batch: a sequence model's masked mean over its
tokens (graph_rewriter.testing.tf1_scripts.masked_sequence_model).

One device divides the batch's summed token losses by the batch's token count. Each
replica holds a shard with its own count; dividing by it and averaging the replicas'
gradients would weight the shards alike, not by their tokens: 0.05 in the weights after
three SGD steps of the batches below, whose halves count 25 and 6 tokens. The rewrite
divides every replica's sum by the replicas' mean count instead (passes/normalizers.py),
and R replicas train exactly as one device.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing.tf1_scripts import masked_sequence_batches, masked_sequence_model, transformer_block
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
READS = {"embedding": "embedding/Read/ReadVariableOp:0", "softmax/kernel": "softmax/kernel/Read/ReadVariableOp:0"}


def _one_device(loss, feeds=None):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(masked_sequence_model(loss), name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds or masked_sequence_batches(STEPS, BATCH)]
        return losses, sess.run(READS)


def _loss_of(loss, feed):
    """The loss of the untrained graph on ``feed``."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(masked_sequence_model(loss), name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        return sess.run("loss:0", feed)


@pytest.mark.parametrize("loss, found", [
    ("masked", ["Sum_1:0"]), ("losses", ["sparse_softmax_cross_entropy_loss/num_present:0"]),
    ("clamped", ["Maximum:0"]), ("per_sequence", []), ("time_major", []),
    ("example_weights", ["sparse_softmax_cross_entropy_loss/num_present:0"])])
def test_the_analysis_finds_the_sums_a_loss_divides_by(loss, found):
    """Not a divisor that keeps the batch's rows (each sequence's own length, also as a
    time-major sum over axis 0), nor one that depends on the batch's shape only (the
    gradient of a mean divides by the row count, the same on every replica). A [batch]
    weight vector's sum has axes [0] too: the graph tells its rank (1) from a
    time-major mask's (2)."""
    assert [t.name for t in analyze(graph_io.load_graph(masked_sequence_model(loss))).normalizers] == found


def test_the_shards_count_different_tokens_so_their_weighting_matters():
    """The control: the mean of the two halves' losses, each normalised by its own
    count, is not the batch's loss (what an unsynchronised rewrite would report)."""
    feed = masked_sequence_batches(1, BATCH)[0]
    halves = [{k: v[h * BATCH // 2:(h + 1) * BATCH // 2] for k, v in feed.items()} for h in range(2)]
    whole = _loss_of("masked", feed)
    assert abs(np.mean([_loss_of("masked", half) for half in halves]) - whole) > 1e-2


@pytest.mark.parametrize("loss", ["masked", "losses", "clamped", "per_sequence", "time_major", "example_weights"])
@pytest.mark.parametrize("strategy, options", [
    ("allreduce", {}), ("allreduce", {"allreduce_algorithm": "reduce_to_one"}), ("ps", {}), ("hybrid", {})],
    ids=["allreduce", "allreduce-reduce_to_one", "ps", "hybrid"])
def test_two_replicas_train_as_one_device(loss, strategy, options):
    want_losses, want = _one_device(loss)
    result = gr.rewrite(masked_sequence_model(loss), devices_per_worker=2, device_type="CPU", strategy=strategy,
                        **options)
    with gr.Session(result) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in masked_sequence_batches(STEPS, BATCH)]
        got = sess.run(READS)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in READS:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{loss}, {strategy}: {name}")


def _padded_batches(steps, batch):
    """A fixed-shape pipeline's last batches: the second half is padding, sequences of
    no tokens, so a replica holding it counts 0 tokens."""
    feeds = masked_sequence_batches(steps, batch)
    for feed in feeds:
        feed["lengths:0"] = np.array([3] * (batch // 4) + [1] * (batch // 4) + [0] * (batch // 2), np.int32)
    return feeds


@pytest.mark.parametrize("loss", ["clamped", "shifted"])
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_a_clamped_count_is_clamped_as_one_device_clamps_it(loss, strategy, replicas):
    """``tf.maximum(count, 1.0)`` (a detector's count of positive anchors) and ``count +
    1e-5`` (BERT's masked LM): one device clamps the batch's count. The mean of the
    replicas' clamped counts is not that where a replica counts no tokens (its 0 clamped
    to 1): every replica divides by one device's clamped count over R instead."""
    feeds = _padded_batches(STEPS, BATCH)
    want_losses, want = _one_device(loss, feeds)
    result = gr.rewrite(masked_sequence_model(loss), devices_per_worker=replicas, device_type="CPU",
                        strategy=strategy)
    with gr.Session(result) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        got = sess.run(READS)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in READS:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{loss}: {name}")


def test_a_clamped_count_is_summed_then_clamped():
    """The control of the test above, in the graph: the count below the clamp is summed
    over the replicas (final_op Id) and the clamp is copied onto the sum; the loss of a
    half that counts no tokens, clamped by itself, is not one device's share."""
    result = gr.rewrite(masked_sequence_model("clamped"), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    reduce = nodes["normalizers/0/all_reduce"]
    assert reduce.attr["final_op"].s == b"Id" and reduce.input[0] == "Sum_1"
    clamp = nodes["Maximum/every_replica"]
    assert clamp.input[0] == "normalizers/0/all_reduce" and nodes["Maximum/every_replica/mean"].input[0] == clamp.name
    assert not [n for n in nodes.values() if "Maximum" in n.input and n.name != "Maximum/every_replica"
                and not n.name.startswith("replica_")]
    # the data: the first half's n tokens are all the batch's, and the mean of the halves'
    # clamped counts, (n + 1) / 2, would divide its sum by n + 1 where one device divides by n
    feed = _padded_batches(1, BATCH)[0]
    first = {k: v[:BATCH // 2] for k, v in feed.items()}
    assert _loss_of("clamped", first) == _loss_of("clamped", feed)
    n = float(np.sum(feed["lengths:0"]))
    assert abs(_loss_of("clamped", feed) * (n / (n + 1) - 1)) > 1e-2


def test_the_plan_lists_the_normalizers_and_each_replica_reduces_them_in_one_group():
    result = gr.rewrite(masked_sequence_model("masked"), PS2_WORKERS2, devices_per_worker=2, device_type="GPU",
                        allreduce_algorithm="hierarchical")
    assert result.metadata["plan"]["normalizers"] == ["Sum_1:0"]
    nodes = {n.name: n for n in result.graph_def.node}
    copies = [n for n in nodes.values() if n.name.endswith("normalizers/0/all_reduce")]
    assert len(copies) == 4 and {n.attr["final_op"].s for n in copies} == {b"Div"}
    # every reader of replica 0's count reads the mean, forward (the loss) and backward
    assert not [c for c in nodes.values() if "Sum_1" in c.input and not c.name.startswith("normalizers/")]
    assert "truediv" in {c.name for c in nodes.values() if "normalizers/0/all_reduce" in c.input}
    # no two collectives of replica 0 share an instance key within one group
    keys = [(n.input[2], n.input[3]) for n in nodes.values()
            if n.op == "CollectiveReduceV2" and not n.name.startswith("replica_")]
    values = [(nodes[g.split(":")[0]].attr["value"].tensor.int_val[0],
               nodes[k.split(":")[0]].attr["value"].tensor.int_val[0]) for g, k in keys]
    assert len(set(values)) == len(values), values


def test_a_parameter_server_plan_across_machines_says_the_normalizer_stays_per_replica():
    result = gr.rewrite(masked_sequence_model("masked"), PS2_WORKERS2, task="worker:1", strategy="ps",
                        device_type="CPU")
    plan = result.metadata["plan"]
    assert "normalizers" not in plan
    assert any("Sum_1:0" in note and "allreduce or hybrid" in note for note in plan["notes"])
    assert not [n for n in result.graph_def.node if "normalizers/" in n.name]


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_two_workers_train_as_one_device_on_loopback_servers(strategy, pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half: the long
    sequences to worker 0, the short ones to worker 1."""
    _, want = _one_device("masked")
    feeds = masked_sequence_batches(STEPS, BATCH)
    got = tc.two_workers_read(pool, procs, tmp_path, masked_sequence_model("masked"), strategy, STEPS,
                              READS.values(), feeds)
    for name, tensor in READS.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


def test_inspect_lists_the_normalizers():
    from graph_rewriter.inspect_report import format_report, report
    result = gr.rewrite(masked_sequence_model("losses"), devices_per_worker=2, device_type="CPU")
    text = format_report(report(result))
    assert "loss normalizers (sums over the batch a loss divides by, averaged across replicas): " \
           "sparse_softmax_cross_entropy_loss/num_present:0" in text


@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_between_graph_the_normalizers_keys_are_apart_from_the_initial_values_broadcasts(strategy):
    """Between-graph, mirrored variables' initial values are broadcast under keys of the
    same block (the verifier refuses two collectives sharing a group and an instance)."""
    for task in ("worker:0", "worker:1"):
        result = gr.rewrite(masked_sequence_model("masked"), PS2_WORKERS2, task=task, strategy=strategy,
                            device_type="CPU")
        assert result.metadata["plan"]["normalizers"] == ["Sum_1:0"]
        assert [n.name for n in result.graph_def.node if n.name.endswith("normalizers/0/all_reduce")]


def assert_transformer_trains_as_one_device(graph_def, names, strategy):
    """2 replicas of tf1_scripts.transformer_block's graph equal one device, loss and every
    variable, on 4 steps whose halves count 23 and 7 tokens; returns the rewrite."""
    rng = np.random.RandomState(0)
    lengths = np.array([6, 6, 5, 6, 1, 2, 1, 3], np.int32)
    feeds = [{"x:0": rng.randint(0, 11, (8, 6)).astype(np.int32), "y:0": rng.randint(0, 11, (8, 6)).astype(np.int32),
              "lengths:0": lengths} for _ in range(4)]
    reads = {name: f"{name}/Read/ReadVariableOp:0" for name in names}

    def train(session):
        with session as sess:
            sess.run("init")
            return [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds], sess.run(reads)

    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    want_losses, want = train(tf1.Session(graph=graph))
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    losses, got = train(gr.Session(result))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=ATOL, err_msg=f"{strategy}: {name}")
    return result


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_a_transformer_block_trains_as_one_device(strategy):
    """Masked self-attention, layer norm, a tied output embedding, label smoothing with
    the padding mask as weights, a warm-up learning rate, global-norm clipping and Adam
    (tf1_scripts.transformer_block)."""
    result = assert_transformer_trains_as_one_device(*transformer_block(), strategy)
    assert result.metadata["plan"]["normalizers"] == ["softmax_cross_entropy_loss/num_present:0"]
