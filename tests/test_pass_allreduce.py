"""The allreduce pass alone: it averages each replica's dense gradients across the
replicas with one CollectiveReduceV2 per pack (the plan's packs).

    replica i:  dw ─> Reshape ─┐
                db ─> Reshape ─┴─> ConcatV2 ─> CollectiveReduceV2(Add, Div by R)
                    ─> SplitV ─> Reshape ─> Apply(w_i)
                             └─> Reshape ─> Apply(b_i)

Every replica's collective of a pack has one group (size R) and one instance key; each
pack's collective waits for the previous one, so the replicas issue them in one order.
"""

import pytest
import tensorflow as tf

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import PassManager, run_passes
from graph_rewriter.passes import AllReducePass, MicroBatchesPass, PlanPass, ReplicatePass
from graph_rewriter.traversal import ancestors
from pass_graphs import (collective_keys, context, dense, gradient_of, ops, reads, replica_of, sparse,
                         update_of)









def _collectives(graph, ctx, replica):
    return [n for n in ops(graph, "CollectiveReduceV2") if replica_of(ctx, graph, n) == replica]


def _reduced(graph=None, **options):
    """Plans and replicates ``graph`` (dense()), records each replica's dense gradients
    (what its updates read), then runs allreduce."""
    g = graph or dense()
    ctx = context(**options)
    run_passes(g, ctx, PlanPass(), ReplicatePass())
    variables = [c.variable for c in ctx.plan.cuts if c.kind == "dense"]
    grads = {(v, i): gradient_of(update_of(g, ctx, v, i)) for v in variables for i in ctx.replicas.built}
    run_passes(g, ctx, AllReducePass())
    return g, ctx, grads


def test_every_replica_applies_the_mean_of_the_replicas_gradients():
    """
        dw_0, db_0 ─> concat ─> CollectiveReduceV2 (CPU:0) ─> split ─> Apply(w), Apply(b)
        dw_1, db_1 ─> concat ─> CollectiveReduceV2 (CPU:1) ─> split ─> Apply(w'), Apply(b')
        one group of 2, one instance key; merge Add, final Div (the mean)
    """
    g, ctx, grads = _reduced(devices_per_worker=2)
    assert ctx.passes_run == ["plan", "replicate", "allreduce"]
    reduces = {i: _collectives(g, ctx, i) for i in (0, 1)}
    assert [len(reduces[0]), len(reduces[1])] == [1, 1]   # one pack
    for i in (0, 1):
        (reduce,) = reduces[i]
        assert reduce.device == f"/device:CPU:{i}"
        assert reduce.attr["merge_op"].s == b"Add" and reduce.attr["final_op"].s == b"Div"
        assert 2 in collective_keys(reduce)   # group size: the replica count it divides by
        into = ancestors([reduce], data_only=True)
        for v in ("w", "b"):
            assert grads[(v, i)] in into and grads[(v, 1 - i)] not in into
            update = update_of(g, ctx, v, i)
            assert gradient_of(update) is not grads[(v, i)]
            assert reduce in ancestors([update], data_only=True)
    assert collective_keys(reduces[0][0]) == collective_keys(reduces[1][0])


def test_small_packs_give_one_collective_per_pack_issued_in_order():
    """
        bytes_per_pack=4:  db ─> Reduce (pack 0) ─> Apply(b)
                           dw ─> Reduce (pack 1) ─> Apply(w);  Reduce 1 ─^─ Reduce 0
    """
    g, ctx, _ = _reduced(devices_per_worker=2, bytes_per_pack=4)
    assert [p.cuts for p in ctx.plan.packs] == [["b"], ["w"]]
    keys = []
    for i in (0, 1):
        reduces = _collectives(g, ctx, i)
        assert len(reduces) == 2
        feeding = {v: [r for r in reduces if r in ancestors([update_of(g, ctx, v, i)], data_only=True)]
                   for v in ("b", "w")}
        assert len(feeding["b"]) == 1 and len(feeding["w"]) == 1 and feeding["b"] != feeding["w"]
        first, second = feeding["b"][0], feeding["w"][0]
        assert first in ancestors(second.control_inputs) | set(second.control_inputs)
        keys.append((collective_keys(first), collective_keys(second)))
    assert keys[0] == keys[1] and keys[0][0] != keys[0][1]


def test_compression_sends_half_precision_and_casts_back():
    """
        concat ─> Cast(float16) ─> CollectiveReduceV2 ─> Cast(float32) ─> split
    """
    g, ctx, _ = _reduced(devices_per_worker=2, compression="fp16")
    for i in (0, 1):
        (reduce,) = _collectives(g, ctx, i)
        (payload,) = [p for p in reads(reduce) if p.op != "Const"]
        assert payload.op == "Cast" and payload.attr["DstT"].type == tf.float16.as_datatype_enum
        readers = [c for c, _ in reduce.consumers()]
        assert [c.op for c in readers] == ["Cast"] and readers[0].attr["DstT"].type == tf.float32.as_datatype_enum


def test_sparse_as_dense_scatters_the_rows_then_reduces():
    """
        (rows, ids) ─> UnsortedSegmentSum ─> CollectiveReduceV2 ─> ScatterAdd(table, every row)
                                                          Range(0, 10) ─┘
    """
    g, ctx, _ = _reduced(sparse(), devices_per_worker=2, sparse_as_dense=True)
    for i in (0, 1):
        (reduce,) = _collectives(g, ctx, i)
        assert any(a.op == "UnsortedSegmentSum" for a in ancestors([reduce], data_only=True))
        update = update_of(g, ctx, "table", i)
        parents = reads(update)
        assert any(p.op == "Range" for p in parents)
        assert reduce in ancestors([update], data_only=True)


def test_allreduce_applies_with_several_replicas_and_packs_only():
    """One replica: nothing to average. sparse(): the only gradient is gathered, no pack."""
    for build, options, expected in ((dense, {}, False), (sparse, {"devices_per_worker": 2}, False),
                                     (dense, {"devices_per_worker": 2}, True)):
        ctx = context(**options)
        run_passes(build(), ctx, PlanPass())
        assert AllReducePass().applies(ctx) is expected, (build.__name__, options)
    g, ctx, _ = _reduced(sparse(), devices_per_worker=2)
    assert ctx.passes_run == ["plan", "replicate"] and ops(g, "CollectiveReduceV2") == []


def test_allreduce_runs_after_micro_batches_and_requires_the_replicas():
    """allreduce reduces the micro-batch mean, so micro_batches must come first."""
    assert AllReducePass.requires == {"plan", "replicas"} and "micro_batches" in AllReducePass.after
    with pytest.raises(GraphRewriteError, match="'allreduce' must run after micro_batches"):
        PassManager([PlanPass(), ReplicatePass(), AllReducePass(), MicroBatchesPass()]).check_order()
    with pytest.raises(GraphRewriteError, match="'allreduce' requires replicas"):
        run_passes(dense(), context(devices_per_worker=2), PlanPass(), AllReducePass())
