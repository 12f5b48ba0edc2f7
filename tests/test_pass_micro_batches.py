"""The micro_batches pass alone: with accumulation_steps = k, each run of the train op
adds the replicas' gradients to sums; every k-th run hands the mean of the k sums to
the update and resets them.

    global:     counter += 1 ─> apply = (counter mod k == 0) ─> Switch
    replica i:  sum_i + dw_i ─> Switch(apply) ─false─> sum_i := it
                                             └─true──> * 1/k ─> Apply(w_i)   (and sum_i := 0)
    every update ─^─ the applying branch;  train_op ─^─ Merge(stored, reset) per replica
"""

import numpy as np
import pytest
import tensorflow as tf

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import AllReducePass, MicroBatchesPass, PlanPass, ReplicatePass
from graph_rewriter.traversal import ancestors
from pass_graphs import (context, dense, gradient_of, ops, reads, replica_of, sparse,
                         update_of)



def _value(node):
    return tf.make_ndarray(node.attr["value"].tensor)






def _accumulated(graph, *after, **options):
    ctx = context(**options)
    run_passes(graph, ctx, PlanPass(), ReplicatePass())
    grads = {(c.variable, i): gradient_of(update_of(graph, ctx, c.variable, i))
             for c in ctx.plan.cuts if c.kind == "dense" for i in ctx.replicas.built}
    run_passes(graph, ctx, MicroBatchesPass(), *after)
    return ctx, grads


def _is_mean_of_steps(node, k):
    """A Mul by the Const 1/k."""
    return node.op == "Mul" and any(p.op == "Const" and np.isclose(_value(p), 1.0 / k) for p in reads(node))


def test_each_replica_applies_the_mean_of_its_summed_micro_batches():
    """
        dw_i ─> AddV2(sum_i) ─> Switch(apply) ─true─> Identity ─> Mul(1/3) ─> Apply(w_i)
        apply = Equal(FloorMod(count, 3), 0)   (global)
    """
    g = dense()
    ctx, grads = _accumulated(g, devices_per_worker=2, accumulation_steps=3)
    (phase,) = [n for n in ops(g, "FloorMod") if replica_of(ctx, g, n) is None]
    assert any(p.op == "Const" and _value(p) == 3 for p in reads(phase))
    for i in (0, 1):
        for v in ("w", "b"):
            mean = gradient_of(update_of(g, ctx, v, i))
            assert _is_mean_of_steps(mean, 3) and replica_of(ctx, g, mean) == i
            before = ancestors([mean], data_only=True)
            assert grads[(v, i)] in before and grads[(v, 1 - i)] not in before
            switches = [a for a in before if a.op == "Switch"]
            assert switches and all(replica_of(ctx, g, s) == i for s in switches)
            assert phase in ancestors(switches, data_only=True)


def test_updates_wait_for_the_applying_branch_and_the_train_op_for_every_replica():
    """
        Switch(apply) ─true─> Identity ─^─ Apply(w), Apply(b), Apply(w'), Apply(b')
        train_op ─^─ Merge(stored, reset) of replica 0 and of replica 1
    """
    g = dense()
    ctx, _ = _accumulated(g, devices_per_worker=2, accumulation_steps=3)
    (branch,) = [n for n in ops(g, "Switch") if replica_of(ctx, g, n) is None]
    for update in ops(g, "ResourceApplyGradientDescent"):
        gates = [c for c in update.control_inputs if branch in reads(c)]
        assert len(gates) == 1 and replica_of(ctx, g, gates[0]) is None
    merges = [c for c in g.node("train_op").control_inputs if c.op == "Merge"]
    assert sorted(replica_of(ctx, g, m) for m in merges) == [0, 1]


def test_the_micro_batch_counter_is_global_and_reset_by_the_init_op():
    """
        count (int64, global) ─> AssignAdd(1) ─^─ read ─> FloorMod(3)
        init ─^─ count := 0, and every replica's sum := 0
    """
    g = dense()
    ctx, _ = _accumulated(g, devices_per_worker=2, accumulation_steps=3)
    counters = [h for h in ops(g, "VarHandleOp") if h.attr["dtype"].type == tf.int64.as_datatype_enum]
    assert len(counters) == 1 and replica_of(ctx, g, counters[0]) is None
    (counter,) = counters
    assert any(c.op == "AssignAddVariableOp" for c, _ in counter.consumers())
    init_writes = [c for c in g.node("init").control_inputs if c.op == "AssignVariableOp"]
    assert any(counter in reads(c) for c in init_writes)
    model = {ctx.replicas.node(g, i, v) for v in ("w", "b") for i in (0, 1)}
    sums = [h for h in ops(g, "VarHandleOp") if h not in counters and h not in model]
    assert sorted(replica_of(ctx, g, h) for h in sums) == [0, 0, 1, 1]   # w's and b's, per replica
    assert all(any(h in reads(c) for c in init_writes) for h in sums)


def test_sparse_rows_and_ids_are_kept_by_concatenation():
    """
        rows_i ─> ConcatV2(kept rows) ─> Switch ─> Mul(1/2) ─> ScatterAdd(table_i)
        ids_i  ─> ConcatV2(kept ids)  ─> Switch ─────────────┘
    """
    g = sparse()
    ctx, _ = _accumulated(g, devices_per_worker=2, accumulation_steps=2)
    for i in (0, 1):
        update = update_of(g, ctx, "table", i)
        before = ancestors([update], data_only=True)
        assert any(_is_mean_of_steps(a, 2) for a in before)
        table = ctx.replicas.node(g, i, "table")
        kept = [a for a in before if a.op == "ConcatV2"   # what was kept, then the new rows/ids
                and any(p.op == "ReadVariableOp" and reads(p)[0] is not table for p in reads(a))]
        assert len(kept) == 2 and all(replica_of(ctx, g, a) == i for a in kept)   # rows and ids


def test_allreduce_after_micro_batches_reduces_the_micro_batch_mean():
    """
        dw_i ─> sum ─> Switch ─> Mul(1/3) ─> CollectiveReduceV2 ─> Apply(w_i)
    """
    g = dense()
    ctx, _ = _accumulated(g, AllReducePass(), devices_per_worker=2, accumulation_steps=3)
    assert ctx.passes_run == ["plan", "replicate", "micro_batches", "allreduce"]
    for i in (0, 1):
        (reduce,) = [n for n in ops(g, "CollectiveReduceV2") if replica_of(ctx, g, n) == i]
        means = [a for a in ancestors([reduce], data_only=True) if _is_mean_of_steps(a, 3)]
        assert len(means) == 2 and all(replica_of(ctx, g, m) == i for m in means)   # w's and b's


def test_micro_batches_applies_only_with_several_steps():
    """accumulation_steps=1: skipped, the graph unchanged; with 3, one replica too."""
    for options, expected in (({"devices_per_worker": 2}, False), ({"accumulation_steps": 3}, True)):
        ctx = context(**options)
        run_passes(dense(), ctx, PlanPass())
        assert MicroBatchesPass().applies(ctx) is expected, options
    g = dense()
    ctx, _ = _accumulated(g, devices_per_worker=2)
    assert ctx.passes_run == ["plan", "replicate"] and ops(g, "Switch") == []


def test_micro_batches_requires_the_replicas():
    assert MicroBatchesPass.requires == {"plan", "replicas"}
    with pytest.raises(GraphRewriteError, match="'micro_batches' requires replicas"):
        run_passes(dense(), context(accumulation_steps=2), PlanPass(), MicroBatchesPass())
