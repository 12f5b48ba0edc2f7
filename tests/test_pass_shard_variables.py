"""Tests of the shard_variables pass alone (after plan, replicate and accumulate): a
parameter-server variable larger than ps_shard_bytes is split by rows, one part per ps
task, and every use of the original handle is rewritten so the graph still sees one
variable:

    table [10, 2] (ps)  =>  table/part_0 [5, 2] (ps 0), table/part_1 [5, 2] (ps 1)
    ReadVariableOp(table)        => ConcatV2(ReadVariableOp(part_k)...)
    ResourceGather(table, ids)   => one gather per part --> DynamicStitch
    AssignVariableOp(table, v)   => SplitV(v) --> one assign per part
    ResourceScatterAdd / ResourceApply* (the update) => one per part
"""

import pytest

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import PS2_WORKERS2, context, dense, ops, reaches, reads, replica_of, sparse


def shard(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.AccumulatePass(),
                      passes.ShardVariablesPass())


def table_parts(graph):
    """The VarHandleOps of rows of 2 floats: the table's parts (or the table)."""
    return [n for n in ops(graph, "VarHandleOp") if len(shape_of(n)) == 2 and shape_of(n)[1] == 2]


def w_parts(graph):
    """The VarHandleOps of rows of 1 float: w's parts (or w)."""
    return [n for n in ops(graph, "VarHandleOp") if len(shape_of(n)) == 2 and shape_of(n)[1] == 1]


def shape_of(handle):
    return [d.size for d in handle.attr["shape"].shape.dim]


def sharded_sparse():
    g = sparse()                    # table [10, 2] float32: 80 bytes
    ctx = context(PS2_WORKERS2, strategy="ps", ps_shard_bytes=40)
    shard(g, ctx)
    return g, ctx


def test_a_large_variable_becomes_one_part_per_ps_task():
    """
        table [10, 2]  =>  part [5, 2] on ps 0  +  part [5, 2] on ps 1;  'table' is gone
    """
    g, ctx = sharded_sparse()
    assert "table" not in g
    handles = table_parts(g)
    assert sorted(n.device for n in handles) == [ctx.cluster.ps_device(0), ctx.cluster.ps_device(1)]
    assert sum(shape_of(n)[0] for n in handles) == 10
    assert len({n.attr["shared_name"].s for n in handles}) == 2
    # nothing reads the original handle any more: every resource user reads a part
    for user in ops(g, "ReadVariableOp", "ResourceGather", "AssignVariableOp", "ResourceScatterAdd"):
        (handle,) = [n for n in reads(user) if n.op == "VarHandleOp"]
        if shape_of(handle)[1:] == [2]:
            assert handle in handles


def data_ancestors(node):
    """The nodes ``node`` computes from, by data edges."""
    seen, todo = set(), [node]
    while todo:
        for m in reads(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def lookups(graph):
    """The DynamicStitch ops that join gathers from the parts."""
    return [s for s in ops(graph, "DynamicStitch") if any(n.op == "ResourceGather" for n in reads(s))]


def test_each_replicas_lookup_gathers_from_every_part_and_stitches_them():
    """
        ids --> partition by row range --> ResourceGather(part_0), ResourceGather(part_1)
            --> DynamicStitch --> Reshape --> loss, once per replica
    """
    g, ctx = sharded_sparse()
    handles = set(table_parts(g))
    stitches = lookups(g)
    assert len(stitches) == 2
    for s in stitches:
        gathers = [n for n in reads(s) if n.op == "ResourceGather"]
        assert len(gathers) == 2
        assert {reads(gather)[0] for gather in gathers} == handles
    # each replica's loss computes from one lookup of its own (by data edges)
    feeding = [[s for s in stitches if s in data_ancestors(ctx.replicas.node(g, i, "loss"))] for i in (0, 1)]
    assert [len(f) for f in feeding] == [1, 1] and feeding[0] != feeding[1]


def test_each_replicas_sharded_lookup_belongs_to_that_replica():
    """
        replica 1:  ids --> ... --> DynamicStitch (replica 1) --> Reshape (replica 1) --> replica_1/loss

    (The lookup's inputs are all global, the batch split and the ps parts: it once became
    a global node, placed on worker 0's host for every replica.)
    """
    g, ctx = sharded_sparse()
    for i in (0, 1):
        (s,) = [s for s in lookups(g) if s in data_ancestors(ctx.replicas.node(g, i, "loss"))]
        assert replica_of(ctx, g, s) == i


def test_the_update_and_the_initializer_are_split_by_rows():
    """
        update:  averaged gradient --> one ResourceScatterAdd per part --> train_op
        init:    initial value --> SplitV --> AssignVariableOp(part_0), AssignVariableOp(part_1) --> init
    """
    g, ctx = sharded_sparse()
    handles = set(table_parts(g))
    scatters = ops(g, "ResourceScatterAdd")
    assert {reads(n)[0] for n in scatters} == handles and len(scatters) == 2
    (take,) = [t for t in ops(g, "SparseAccumulatorTakeGradient") if not t.name.endswith("/drain")]
    for n in scatters:
        assert reaches(take, n) and reaches(n, g.node("train_op"))
    assigns = [n for n in ops(g, "AssignVariableOp") if reads(n)[0] in handles]
    assert len(assigns) == 2
    (split,) = {reads(n)[1] for n in assigns}
    assert split.op == "SplitV"
    assert all(n in g.node("init").control_inputs or reaches(n, g.node("init")) for n in assigns)


def test_a_dense_variable_and_its_update_are_split_unevenly_by_rows():
    """
        w [3, 1] (12 bytes, ps_shard_bytes 8)  =>  parts of 2 and 1 rows on ps 0 and ps 1
        take_w --> SplitV --> ResourceApplyGradientDescent(part_k) for each part
        ReadVariableOp(w) in each replica --> ConcatV2(ReadVariableOp(part_0), ReadVariableOp(part_1))
    """
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps", ps_shard_bytes=8)
    shard(g, ctx)
    assert "w" not in g and "b" in g            # b [1] is 4 bytes: kept whole
    parts = w_parts(g)
    assert sorted(shape_of(n)[0] for n in parts) == [1, 2]
    assert {n.device for n in parts} == {ctx.cluster.ps_device(0), ctx.cluster.ps_device(1)}
    updates = [n for n in ops(g, "ResourceApplyGradientDescent") if reads(n)[0] in parts]
    assert len(updates) == 2
    (split,) = {n for u in updates for n in reads(u) if n.op == "SplitV"}
    assert any(n.op == "AccumulatorTakeGradient" for n in reads(split))
    concats = [n for n in ops(g, "ConcatV2")
               if sorted(m.op for m in reads(n)) == ["Const", "ReadVariableOp", "ReadVariableOp"]
               and {reads(m)[0] for m in reads(n) if m.op == "ReadVariableOp"} == set(parts)]
    assert {replica_of(ctx, g, n) for n in concats} == {0, 1}   # every replica reads the whole w


@pytest.mark.parametrize("shard_bytes", [0, 64 * 1024 * 1024])   # never shard; larger than any variable
def test_applies_only_when_the_plan_shards_a_variable(shard_bytes):
    """ps_shard_bytes 0 (never) or above the table's 80 bytes: 'table' stays whole, the pass is skipped"""
    g = sparse()
    ctx = context(PS2_WORKERS2, strategy="ps", ps_shard_bytes=shard_bytes)
    shard(g, ctx)
    assert not passes.ShardVariablesPass().applies(ctx)
    assert "shard_variables" not in ctx.passes_run and "table" in g
    small = context(PS2_WORKERS2, strategy="ps", ps_shard_bytes=40)
    passes.PlanPass().run(sparse(), small)
    assert passes.ShardVariablesPass().applies(small)
