"""Tests of the merge_summaries pass alone (after plan and replicate): the master's
scalar summaries of a value that depends on the batch report the mean over the local
replicas, not replica 0's value:

    loss ─────────> ScalarSummary            loss, replica_1/loss ─> AddN ─> / R ─> ScalarSummary
    replica_1/loss ─> replica_1/ScalarSummary   =>   replica_1/loss ─> replica_1/ScalarSummary
"""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io, passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, reads, replica_of


def merge(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.MergeSummariesPass())


def with_rate_summary():
    """dense()'s model plus a summary of a constant learning rate (not batch dependent):
        x --> MatMul(w) --> loss --> ScalarSummary("loss");  rate (Const) --> ScalarSummary("rate")
    """
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        rate = tf.constant(0.1, name="rate")
        tf.compat.v1.summary.scalar("loss", loss)
        tf.compat.v1.summary.scalar("rate", rate)
        tf.compat.v1.train.GradientDescentOptimizer(rate).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def summaries_of(graph, ctx, replica):
    return [n for n in ops(graph, "ScalarSummary") if replica_of(ctx, graph, n) == replica]


def test_the_masters_loss_summary_reads_the_mean_over_replicas():
    """
        loss, replica_1/loss --> AddN --> RealDiv(2) --> ScalarSummary (replica 0)
    """
    g = dense(summary=True)
    ctx = context(WORKERS2)
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 0)
    mean = [n for n in reads(summary) if n.op == "RealDiv"]
    assert len(mean) == 1
    total, divisor = reads(mean[0])
    assert total.op == "AddN" and divisor.op == "Const"
    assert divisor.attr["value"].tensor.float_val == [2.0]
    losses = [ctx.replicas.node(g, i, "loss") for i in (0, 1)]
    assert sorted(reads(total), key=lambda n: replica_of(ctx, g, n)) == losses
    assert total.device == mean[0].device == ctx.replicas.global_device   # computed once, on the host


def test_a_replicas_own_summary_keeps_its_own_value():
    """
        replica_1/loss --> replica_1/ScalarSummary   (unchanged)
    """
    g = dense(summary=True)
    ctx = context(WORKERS2)
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 1)
    assert reads(summary)[1] is ctx.replicas.node(g, 1, "loss")


def test_a_summary_of_a_value_the_batch_does_not_change_is_left_alone():
    """
        rate (Const) --> ScalarSummary("rate")   (unchanged: every replica has the same value)
    """
    g = with_rate_summary()
    ctx = context(WORKERS2)
    merge(g, ctx)
    masters = summaries_of(g, ctx, 0)
    assert len(masters) == 2
    values = sorted((reads(n)[1] for n in masters), key=lambda n: n.op)
    assert [n.op for n in values] == ["Const", "RealDiv"]
    assert values[0] is g.node("rate")


def test_with_template_replicas_the_mean_divides_by_every_local_replica():
    """
        4 local replicas (replica 1 the template for 1..3): the export's AddN sums 4 losses,
        the divisor is 4
    """
    g = dense(summary=True)
    ctx = context(WORKERS2, devices_per_worker=2)
    merge(g, ctx)
    assert ctx.replicas.template and ctx.replicas.num_local == 4
    (summary,) = summaries_of(g, ctx, 0)
    (mean,) = [n for n in reads(summary) if n.op == "RealDiv"]
    divisor = [n for n in reads(mean) if n.op == "Const"][0]
    assert divisor.attr["value"].tensor.float_val == [4.0]
    exported = {n.name: n for n in graph_io.to_graph_def(g, ctx.replicas).node}
    (total,) = [t for t in exported[mean.name].input if exported[t.split(":")[0]].op == "AddN"]
    losses = {ctx.replicas.name(i, "loss") for i in range(4)}
    assert {t.split(":")[0] for t in exported[total].input} == losses


@pytest.mark.parametrize("cluster, task", [
    (None, None),                     # one device
    (PS2_WORKERS2, ("worker", 1)),    # between-graph: this graph holds one replica
])
def test_applies_only_with_several_local_replicas(cluster, task):
    """One local replica: its summary already is the local mean; the pass is skipped."""
    g = dense(summary=True)
    ctx = context(cluster, task=task, strategy="ps" if cluster else "allreduce")
    merge(g, ctx)
    assert not passes.MergeSummariesPass().applies(ctx)
    assert "merge_summaries" not in ctx.passes_run
    (summary,) = ops(g, "ScalarSummary")
    assert reads(summary)[1] is g.node("loss")
    assert passes.MergeSummariesPass().applies(context(WORKERS2))
