"""The plan pass alone: it analyses the single-device graph and puts a Plan in the
context (how each variable is synchronised, which gradients are packed together, which
inputs are batch inputs), leaving the graph itself unchanged:

    x, y ─> MatMul(w) + b ─> loss ─> dw, db ─> ApplyGradientDescent(w, b)
        unchanged; ctx.plan = {w, b mirrored; dw, db allreduce in packs; batch x, y}

It refuses graphs that do not train (no variables, no batch input to split, no update
that depends on the batch) and options that name what the graph does not have.
"""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import PlanPass
from pass_graphs import PS2_WORKERS2, context, dense, reads, sparse


def _structure(graph):
    """Every node with its op, device and what it reads: what a pass could change."""
    return {n.name: (n.op, n.device, [t.name for t in n.inputs], sorted(c.name for c in n.control_inputs))
            for n in graph}


def _no_variables():
    """x ─> Square ─> Sum ("out"): an inference graph, nothing to train."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        tf.reduce_sum(tf.square(x), name="out")
    return graph_io.load_graph(g.as_graph_def())


def _no_batch_input():
    """Const ─> MatMul(w) ─> loss ─> ApplyGradientDescent(w): trains, but on constants."""
    g = tf.Graph()
    with g.as_default():
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        loss = tf.reduce_sum(tf.matmul(tf.ones([2, 3]), w), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    return graph_io.load_graph(g.as_graph_def())


def test_the_plan_pass_provides_a_plan_and_leaves_the_graph_unchanged():
    """
        dense():  x, y ─> ... ─> loss;  dw ─> Apply(w), db ─> Apply(b)
        after:    the same graph;  ctx.plan: w, b mirrored, their gradients all-reduced
    """
    g = dense()
    before = _structure(g)
    ctx = context(devices_per_worker=2)
    assert PlanPass.provides == {"plan"} and not PlanPass.requires
    result = run_passes(g, ctx, PlanPass())
    assert result.modified is False and _structure(g) == before
    plan = ctx.plan
    assert {v.name: v.placement for v in plan.variables} == {"w": "mirrored", "b": "mirrored"}
    assert {c.variable: (c.kind, c.sync) for c in plan.cuts} == {"w": ("dense", "allreduce"),
                                                                  "b": ("dense", "allreduce")}
    assert sorted(plan.batch_inputs) == ["x:0", "y:0"]
    assert plan.num_replicas == 2 and plan.fingerprint
    # each variable's initializer is the assign that reads its initial value
    for v in plan.variables:
        assert any(t.node.name == v.name for t in g.node(v.initializer).inputs)
    # the planned gradient of w is what w's update reads
    update_w = next(n for n in g if n.op == "ResourceApplyGradientDescent" and g.node("w") in reads(n))
    assert g.tensor(plan.cut("w").values).node in reads(update_w)


def test_the_plan_pass_applies_with_one_replica():
    """The plan is needed by every rewrite, even one replica: dense() planned for 1."""
    ctx = context()
    assert PlanPass().applies(ctx)
    run_passes(dense(), ctx, PlanPass())
    assert ctx.plan.num_replicas == 1 and ctx.passes_run == ["plan"]


@pytest.mark.parametrize("bytes_per_pack, expected", [(None, [["b", "w"]]), (0, [["b", "w"]]),
                                                      (4, [["b"], ["w"]])])
def test_dense_gradients_are_packed_by_bytes_per_pack(bytes_per_pack, expected):
    """
        db (4 bytes), dw (12 bytes), in backprop order
        default / 0: one pack [db, dw];   bytes_per_pack=4: [db], [dw]
    """
    ctx = context(devices_per_worker=2, bytes_per_pack=bytes_per_pack)
    run_passes(dense(), ctx, PlanPass())
    assert [p.cuts for p in ctx.plan.packs] == expected
    for p, pack in enumerate(ctx.plan.packs):
        assert pack.dtype == "float32"
        assert all(ctx.plan.cut(v).pack == p for v in pack.cuts)
    assert {c.bytes for c in ctx.plan.cuts} == {4, 12}


@pytest.mark.parametrize("sparse_as_dense, sync, packs", [(False, "allgather", 0), (True, "allreduce", 1)])
def test_a_sparse_gradient_is_gathered_or_densified(sparse_as_dense, sync, packs):
    """
        sparse():  ids ─> Gather(table) ─> loss;  d table = IndexedSlices(rows, ids)
        plan: table's gradient is gathered (no pack), or with sparse_as_dense all-reduced
    """
    ctx = context(devices_per_worker=2, sparse_as_dense=sparse_as_dense)
    run_passes(sparse(), ctx, PlanPass())
    cut = ctx.plan.cut("table")
    assert cut.kind == "sparse" and cut.indices is not None and cut.sync == sync
    assert len(ctx.plan.packs) == packs
    assert ctx.plan.batch_inputs == ["ids:0"]


def test_strategy_ps_puts_every_variable_on_a_parameter_server():
    """dense() under strategy ps with two ps tasks: w and b placed "ps", nothing packed."""
    ctx = context(PS2_WORKERS2, strategy="ps")
    run_passes(dense(), ctx, PlanPass())
    assert {v.placement for v in ctx.plan.variables} == {"ps"}
    assert {v.ps_task for v in ctx.plan.variables} <= {0, 1}
    assert {c.sync for c in ctx.plan.cuts} == {"accumulate"} and ctx.plan.packs == []


@pytest.mark.parametrize("build, options, message", [
    (_no_variables, {}, "has no variables"),
    (_no_batch_input, {"devices_per_worker": 2}, "no batch input"),
    (dense, {"merge": {"nope:0": "mean"}}, "merge names 'nope:0'"),
    (dense, {"strategy": "ps", "cluster": {"worker": ["w0:2222", "w1:2222"]}}, "needs parameter servers"),
])
def test_graphs_and_options_that_cannot_be_planned_are_refused(build, options, message):
    """
        x ─> Square ─> out                      no variables
        Const ─> MatMul(w) ─> loss ─> Apply(w)  two replicas but no batch to split
        dense() with merge of a missing tensor, or strategy ps without ps tasks
    """
    cluster = options.pop("cluster", None)
    ctx = context(cluster, **options)
    with pytest.raises(GraphRewriteError, match=message) as err:
        run_passes(build(), ctx, PlanPass())
    assert "pass 'plan'" in str(err.value)
    assert ctx.plan is None or ctx.passes_run == []
