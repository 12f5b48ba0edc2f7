"""The replicate pass alone: it clones the compute once per extra replica and records in
a ReplicaMap (ctx.replicas) which node belongs to which replica.

    before                      after (2 replicas)
    x ─> MatMul(w) ─> loss      x ─┬─> MatMul(w) ─> loss                (replica 0)
                                   └─> MatMul(w') ─> loss'              (replica 1)
    train_op                    train_op ─^─ train_op'   (running train_op runs both)

Replica 0 keeps the original names; the batch inputs exist once (global); with three or
more replicas only replica 1 is built and stands for the others (the template).
"""

import pytest

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import PlanPass, ReplicatePass
from pass_graphs import WORKERS2, context, dense, ops, reaches, reads, replica_of


def _replicated(**options):
    g = dense()
    ctx = context(**options)
    run_passes(g, ctx, PlanPass(), ReplicatePass())
    return g, ctx


def test_two_replicas_each_compute_from_their_own_variables():
    """
        x ─┬─> MatMul ─> ... ─> Apply(w)          replica 0: reads w
           └─> MatMul' ─> ... ─> Apply(w')        replica 1: reads w', never w
    """
    g, ctx = _replicated(devices_per_worker=2)
    rm = ctx.replicas
    assert rm.num_local == 2 and rm.devices == ["/device:CPU:0", "/device:CPU:1"]
    handles = ops(g, "VarHandleOp")
    assert sorted(replica_of(ctx, g, h) for h in handles) == [0, 0, 1, 1]
    # two handles of one variable would be one variable: their shared_names differ
    assert len({h.attr["shared_name"].s for h in handles}) == 4
    for i in (0, 1):
        mine = {h for h in handles if replica_of(ctx, g, h) == i}
        for mm in ops(g, "MatMul"):
            if replica_of(ctx, g, mm) != i:
                continue
            # every node of replica i reads nodes of replica i or global ones
            assert all(replica_of(ctx, g, p) in (i, None) for p in reads(mm))
        for update in ops(g, "ResourceApplyGradientDescent"):
            handle = next(p for p in reads(update) if p.op == "VarHandleOp")
            assert (handle in mine) == (replica_of(ctx, g, update) == i)
    assert {replica_of(ctx, g, n) for n in ops(g, "ResourceApplyGradientDescent")} == {0, 1}
    # the replica's forward and backward read only its own or global nodes
    for name in rm.variant:
        copy = rm.node(g, 1, name)
        assert copy is not g.node(name) and replica_of(ctx, g, copy) == 1
        assert all(replica_of(ctx, g, p) in (1, None) for p in reads(copy)), name


def test_batch_inputs_exist_once_and_are_read_by_every_replica():
    """
        x (global) ─┬─> MatMul  (replica 0)
                    └─> MatMul' (replica 1)
    """
    g, ctx = _replicated(devices_per_worker=2)
    placeholders = ops(g, "Placeholder")
    assert sorted(p.name for p in placeholders) == ["x", "y"]
    for p in placeholders:
        assert replica_of(ctx, g, p) is None
        assert {replica_of(ctx, g, c) for c, _ in p.consumers()} == {0, 1}


def test_running_the_train_op_or_the_init_op_runs_every_replica():
    """
        train_op ─^─ train_op'      init ─^─ init'      (control edges on the clones)
    """
    g, ctx = _replicated(devices_per_worker=2)
    for root in ("train_op", "init"):
        master = g.node(root)
        clone = ctx.replicas.node(g, 1, root)
        assert clone is not master and clone in master.control_inputs
    for update in ops(g, "ResourceApplyGradientDescent"):
        assert reaches(update, g.node("train_op"))


def test_one_replica_clones_nothing():
    """dense() for one replica: the same nodes, each marked replica 0 or global."""
    g = dense()
    names = sorted(g.names())
    ctx = context()
    assert ReplicatePass().applies(ctx)
    run_passes(g, ctx, PlanPass(), ReplicatePass())
    assert sorted(g.names()) == names
    assert ctx.replicas.num_local == 1 and ctx.replicas.group_size == 1
    assert {replica_of(ctx, g, n) for n in g} <= {0, None}
    assert replica_of(ctx, g, g.node("x")) is None and replica_of(ctx, g, g.node("w")) == 0


@pytest.mark.parametrize("materialize, built", [(False, 2), (True, 3)])
def test_three_replicas_build_replica_1_as_the_template_unless_materialized(materialize, built):
    """
        3 replicas:  w (replica 0), w' (replica 1, standing for replicas 1 and 2)
        materialize_replicas: w, w', w'' all built
    """
    g, ctx = _replicated(devices_per_worker=3, materialize_replicas=materialize)
    rm = ctx.replicas
    assert rm.num_local == 3 and rm.template is (not materialize)
    assert list(rm.built) == list(range(built))
    copies_of_w = [h for h in ops(g, "VarHandleOp") if h.attr["shape"].shape.dim[0].size == 3]
    assert sorted(replica_of(ctx, g, h) for h in copies_of_w) == list(range(built))


def test_between_graph_a_worker_holds_its_own_replica_of_the_group():
    """
        cluster w0, w1; task worker:1:  one local replica (group rank 1 of 2), no clones
    """
    g = dense()
    names = sorted(g.names())
    ctx = context(WORKERS2, task="worker:1")
    run_passes(g, ctx, PlanPass(), ReplicatePass())
    rm = ctx.replicas
    assert rm.num_local == 1 and rm.group_size == 2 and rm.first_replica == 1 and not rm.chief
    assert rm.devices == ["/job:worker/replica:0/task:1/device:CPU:0"]
    assert sorted(g.names()) == names


def test_replicate_requires_the_plan():
    """ReplicatePass alone, with no plan in the context: refused before anything runs."""
    g = dense()
    ctx = context(devices_per_worker=2)
    assert ReplicatePass.requires == {"plan"} and ReplicatePass.provides == {"replicas"}
    with pytest.raises(GraphRewriteError, match="'replicate' requires plan"):
        run_passes(g, ctx, ReplicatePass())
    assert ctx.replicas is None and ctx.passes_run == []
