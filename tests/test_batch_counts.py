"""Counts a training step keeps of its batch: a TF1 script's ``examples_seen``
(assign_add of ``tf.shape(x)[0]``), a count of correct predictions, and
``tf.compat.v1.metrics.accuracy``'s running total and count.

A non-trainable variable that a step updates from batch data is a statistic whose
update the replicas share (docs/semantics.md, "BatchNorm and other batch statistics").
A mean of the batch (BatchNorm's moments, a mean loss) is averaged. A sum or a count of
the batch's rows is summed, so R replicas count what one device counts on their R
batches. Before, every statistic was averaged: the counts came out R times too small
under allreduce (an integer count rounded, too), the graph with tf.metrics.accuracy
failed when it ran (its count is a float of an int32 Size, which the all-reduce pack
and the accumulator were given as a float), and under ps an integer count did too
(TensorFlow's accumulators hold floating point only: it travels as float64).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.testing.tf1_scripts import counts_script
from pass_graphs import PS2_WORKERS2

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
COUNTS = ["examples_seen", "correct_seen", "loss_sum", "global_step"]


def _batches():
    rng = np.random.RandomState(0)
    return [{"x:0": rng.randn(BATCH, 3).astype(np.float32), "y:0": rng.randint(0, 4, BATCH).astype(np.int64)}
            for _ in range(STEPS)]


def _train(session):
    with session as sess:
        sess.run(["init", "init_1"])
        for feed in _batches():
            sess.run("train_op", feed)
        return sess.run({name: f"{name}/Read/ReadVariableOp:0" for name in COUNTS} | {"accuracy": "accuracy_value:0"})


def _one_device():
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(counts_script(), name="")
    return _train(tf1.Session(graph=graph))


def test_the_reference_counts_every_row():
    want = _one_device()
    assert want["examples_seen"] == STEPS * BATCH and want["global_step"] == STEPS
    assert 0 < want["correct_seen"] < STEPS * BATCH
    assert want["accuracy"] == pytest.approx(want["correct_seen"] / (STEPS * BATCH))


@pytest.mark.parametrize("strategy, options", [
    ("allreduce", {}), ("allreduce", {"allreduce_algorithm": "reduce_to_one"}), ("ps", {}), ("hybrid", {})],
    ids=["allreduce", "allreduce-reduce_to_one", "ps", "hybrid"])
def test_two_replicas_count_what_one_device_counts(strategy, options):
    want = _one_device()
    result = gr.rewrite(counts_script(), devices_per_worker=2, device_type="CPU", strategy=strategy, **options)
    got = _train(gr.Session(result))
    assert got["examples_seen"] == want["examples_seen"] and got["correct_seen"] == want["correct_seen"], got
    assert got["global_step"] == STEPS
    np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-5)   # a mean: averaged
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)   # total / count


def test_the_plan_says_which_statistics_are_sums():
    plan = gr.rewrite(counts_script(), devices_per_worker=2, device_type="CPU").metadata["plan"]
    combine = {c["variable"]: c.get("combine") for c in plan["cuts"]}
    assert combine == {"examples_seen": "sum", "correct_seen": "sum", "accuracy/total": "sum",
                       "accuracy/count": "sum", "loss_sum": None, "w": None}
    dtypes = {c["variable"]: c["dtype"] for c in plan["cuts"]}
    assert dtypes["accuracy/count"] == "int32"   # the Size its update casts to float


def test_sums_are_summed_at_both_levels_of_a_hierarchical_all_reduce():
    result = gr.rewrite(counts_script(), PS2_WORKERS2, strategy="allreduce", devices_per_worker=2,
                        allreduce_algorithm="hierarchical", device_type="CPU")
    plan = result.metadata["plan"]
    combine = {c["variable"]: c.get("combine") for c in plan["cuts"]}
    summed = {p for p, pack in enumerate(plan["packs"]) if combine[pack["cuts"][0]] == "sum"}
    assert summed and all(len({combine[c] for c in pack["cuts"]}) == 1 for pack in plan["packs"])
    collectives = [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"]
    assert {n.name.split("/")[-2] for n in collectives} == {"within", "across"}
    for n in collectives:
        p = int(n.name.split("pack_")[1].split("/")[0])
        assert n.attr["final_op"].s == (b"Id" if p in summed else b"Div"), n.name
