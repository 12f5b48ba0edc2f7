"""Tests of the accumulate pass alone (after plan and replicate): under synchronous
parameter servers, every replica's gradient goes into an accumulator on its variable's
ps task, and the variable's update reads the accumulator's take (the mean over the
replicas) instead of replica 0's own gradient:

    replica i: grad_i --> AccumulatorApplyGradient(acc_w)     (acc_w on w's ps task)
    ps:        AccumulatorTakeGradient(acc_w) --> ResourceApply*(w)
    ps0:       takes --> sync_step += 1 --> (the updates and the train op wait for it)
"""

import pytest

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, reaches, reads, replica_of, sparse

TAKES = ("AccumulatorTakeGradient", "SparseAccumulatorTakeGradient")
APPLIES = ("AccumulatorApplyGradient", "SparseAccumulatorApplyGradient")


def accumulate(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.AccumulatePass())


def update_of(graph, variable):
    """The optimizer's (global) update of an original variable: the op that writes it."""
    var = graph.node(variable)
    found = [n for n in ops(graph, "ResourceApplyGradientDescent", "ResourceScatterAdd")
             if var in reads(n)]
    assert len(found) == 1, [n.name for n in found]
    return found[0]


def ps_task_of(ctx, variable):
    return ctx.plan.variable(variable).ps_task


def test_each_update_reads_a_take_of_an_accumulator_on_its_variables_ps():
    """
        before:  grad_w --> ResourceApplyGradientDescent(w)
        after:   grad_w (replica 0) ---> apply --> acc_w (ps task of w) <-- apply <-- grad_w (replica 1)
                                                   acc_w --> take --> ResourceApplyGradientDescent(w)
    """
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    accumulate(g, ctx)
    assert {ps_task_of(ctx, "w"), ps_task_of(ctx, "b")} == {0, 1}   # one variable per ps task
    for variable in ("w", "b"):
        device = ctx.cluster.ps_device(ps_task_of(ctx, variable))
        update = update_of(g, variable)
        takes = [n for n in reads(update) if n.op in TAKES]
        assert len(takes) == 1, variable
        take = takes[0]
        (acc,) = [n for n in reads(take) if n.op == "ConditionalAccumulator"]
        assert take.device == acc.device == device
        assert acc.attr["reduction_type"].s == b"MEAN"
        applies = [c for c, _ in acc.consumers() if c.op in APPLIES]
        # one apply per replica, each reading that replica's own gradient, before the take
        assert sorted(replica_of(ctx, g, a) for a in applies) == [0, 1]
        for a in applies:
            assert a.device == device
            assert reaches(a, take)
            grads = [n for n in reads(a) if n is not acc and n.op != "ReadVariableOp"]
            assert [replica_of(ctx, g, n) for n in grads] == [replica_of(ctx, g, a)]
        # the update no longer reads replica 0's gradient directly
        assert all(replica_of(ctx, g, n) is None for n in reads(update)), variable


def test_the_step_counter_is_bumped_after_the_takes_and_the_updates_wait_for_it():
    """
        take_w, take_b --> AssignAddVariableOp(sync_step on ps 0) --> update_w, update_b, train_op
        apply (every replica) reads sync_step (the tag of its step)
    """
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    accumulate(g, ctx)
    (bump,) = ops(g, "AssignAddVariableOp")
    assert bump.device == ctx.cluster.ps_device(0)
    for take in [t for t in ops(g, *TAKES) if not t.name.endswith("/drain")]:
        assert take in bump.control_inputs
    for variable in ("w", "b"):
        assert bump in update_of(g, variable).control_inputs
    assert reaches(bump, g.node("train_op"))
    counter = reads(bump)[0]
    assert counter.op == "VarHandleOp" and counter.device == ctx.cluster.ps_device(0)
    for a in ops(g, *APPLIES):   # the step tag each apply carries is the counter's value
        assert any(n.op == "ReadVariableOp" and counter in reads(n) for n in reads(a))


def test_the_init_op_resets_every_accumulators_step():
    """ConditionalAccumulator --> AccumulatorSetGlobalStep(0) --> init"""
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    accumulate(g, ctx)
    init = g.node("init")
    accumulators = ops(g, "ConditionalAccumulator")
    assert len(accumulators) == 2
    for acc in accumulators:
        resets = [c for c, _ in acc.consumers() if c.op == "AccumulatorSetGlobalStep"]
        assert len(resets) == 1 and resets[0] in init.control_inputs


def test_each_replica_marks_its_applies_done_between_graph():
    """
        replica i's applies (w, b) --> NoOp (replica i): what sync_queues waits for

    In-graph nothing waits for a marker: there is none (a sink nobody runs would be
    taken for a root by check_collectives_run).
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 1), strategy="ps", devices_per_worker=2)
    accumulate(g, ctx)
    markers = [n for n in ops(g, "NoOp")
               if n.control_inputs and all(c.op in APPLIES for c in n.control_inputs)]
    assert sorted(replica_of(ctx, g, m) for m in markers) == [0, 1]
    for m in markers:
        assert len(m.control_inputs) == 2
        assert {replica_of(ctx, g, c) for c in m.control_inputs} == {replica_of(ctx, g, m)}
    g = dense()
    accumulate(g, context(PS2_WORKERS2, strategy="ps"))
    assert not [n for n in ops(g, "NoOp") if n.control_inputs and all(c.op in APPLIES for c in n.control_inputs)]


def test_batchnorm_statistics_all_reduced_with_gradients_on_the_ps_in_graph():
    """strategy="auto" on two workers of two devices puts BatchNorm's weights on the ps
    and all-reduces its statistics. With control_dependencies(update_ops) around minimize
    each replica's gradients, and so its applies, wait for its copy of the statistics'
    all-reduce. A marker joining one replica's applies would be a root that runs one copy
    only: the rewrite used to fail check_collectives_run on it."""
    import graph_rewriter as gr
    from graph_rewriter.testing import models
    ex = models.build("batchnorm", "sgd", update_ops="control")
    result = gr.rewrite(ex.graph_def, PS2_WORKERS2, strategy="auto", devices_per_worker=2, device_type="CPU")
    syncs = {c.variable: c.sync for c in result.plan.cuts}
    assert syncs["bn/moving_mean"] == "allreduce" and syncs["hidden/kernel"] == "accumulate", syncs


def test_a_sparse_gradient_is_summed_sorted_and_divided_by_the_replicas():
    """
        replica i: (rows_i, ids_i) --> dedup --> sort by id --> SparseAccumulatorApplyGradient
        ps:        SparseConditionalAccumulator(SUM) --> take --> values / 2 --> ResourceScatterAdd(table)
    """
    g = sparse()
    ctx = context(PS2_WORKERS2, strategy="ps")
    accumulate(g, ctx)
    (acc,) = ops(g, "SparseConditionalAccumulator")
    assert acc.attr["reduction_type"].s == b"SUM"
    assert acc.device == ctx.cluster.ps_device(ps_task_of(ctx, "table"))
    applies = [c for c, _ in acc.consumers() if c.op == "SparseAccumulatorApplyGradient"]
    assert sorted(replica_of(ctx, g, a) for a in applies) == [0, 1]
    for a in applies:   # the ids each replica sends were sorted (TopK of the negated ids)
        assert any(reaches(n, a) and replica_of(ctx, g, n) == replica_of(ctx, g, a) for n in ops(g, "TopKV2"))
    (take,) = [t for t in ops(g, "SparseAccumulatorTakeGradient") if not t.name.endswith("/drain")]
    (mean,) = [c for c, _ in take.consumers() if c.op == "RealDiv"]
    divisor = [n for n in reads(mean) if n.op == "Const"][0]
    assert divisor.attr["value"].tensor.float_val == [2.0]
    assert reaches(mean, update_of(g, "table"))


def test_staleness_keeps_one_accumulator_per_step_in_flight():
    """
        staleness 1 (between-graph): two accumulators per variable; the worker's step mod 2
        picks the apply (Switch), the applied step mod 2 picks the take (Merge of two takes)
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps", staleness=1)
    accumulate(g, ctx)
    for variable in ("w", "b"):
        device = ctx.cluster.ps_device(ps_task_of(ctx, variable))
        accs = [n for n in ops(g, "ConditionalAccumulator") if n.device == device]
        assert len(accs) == 2, variable
        merges = [n for n in reads(update_of(g, variable)) if n.op == "Merge"]
        assert len(merges) == 1
        assert sorted(n.op for n in reads(merges[0])) == ["AccumulatorTakeGradient"] * 2
        assert {reads(t)[0] for t in reads(merges[0])} == set(accs)


@pytest.mark.parametrize("cluster, options", [
    (WORKERS2, {"strategy": "allreduce"}),              # gradients are all-reduced
    (PS2_WORKERS2, {"strategy": "ps", "sync": False}),  # each replica applies its own
])
def test_applies_only_to_synchronous_parameter_servers(cluster, options):
    """All-reduced gradients, or asynchronous ps training: no accumulator, the pass is skipped."""
    g = dense()
    ctx = context(cluster, **options)
    accumulate(g, ctx)
    assert not passes.AccumulatePass().applies(ctx)
    assert "accumulate" not in ctx.passes_run
    assert not ops(g, "ConditionalAccumulator", *APPLIES, *TAKES)
    ps = context(PS2_WORKERS2, strategy="ps")
    passes.PlanPass().run(dense(), ps)
    assert passes.AccumulatePass().applies(ps)


def test_the_init_op_empties_every_accumulator_before_resetting_its_step():
    """A step cancelled after some replicas applied their gradients leaves them in the
    accumulator, tagged with a later step than the reset's 0: the init op takes whatever
    an accumulator holds (if anything: a Switch on its count) before it resets the step,
    so a rerun's first take averages only the rerun's gradients."""
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    accumulate(g, ctx)
    for reset in ops(g, "AccumulatorSetGlobalStep"):
        acc = reset.inputs[0].node
        (empty,) = reset.control_inputs
        assert empty.op == "Merge"
        drain = g.node(f"{acc.name}/drain")
        assert drain.op in TAKES and drain.inputs[0].node is acc
        switch = drain.inputs[1].node
        assert switch.op == "Switch" and drain.inputs[1].index == 1
        assert switch.inputs[0].node.op == "AccumulatorNumAccumulated" and switch.inputs[0].node.inputs[0].node is acc
        assert reaches(drain, empty)

