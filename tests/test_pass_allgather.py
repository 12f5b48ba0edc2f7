"""The allgather pass alone: it averages each replica's sparse gradient (rows, ids) by
gathering every replica's rows, not by densifying.

    replica i:  ids_i ─> Size ─> CollectiveGatherV2 (row counts) ─> max ─> bucket
                rows_i, ids_i ─> Pad to 2**bucket ─> CollectiveGatherV2 (values, indices)
                    ─> keep the real rows ─> rows / R ─> (dedup: Unique + SegmentSum)
                    ─> ScatterAdd(table_i)
"""

import pytest
import tensorflow as tf

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import PassManager, run_passes
from graph_rewriter.passes import AllGatherPass, MicroBatchesPass, PlanPass, ReplicatePass
from graph_rewriter.traversal import ancestors
from pass_graphs import (collective_keys, context, dense, ops, reads, replica_of, sparse,
                         update_of)





def _gathered(optimizer="sgd", **options):
    """sparse() planned and replicated; each replica's update inputs recorded; then allgather."""
    g = sparse(optimizer)
    ctx = context(**options)
    run_passes(g, ctx, PlanPass(), ReplicatePass())
    grads = {i: set(ancestors([update_of(g, ctx, "table", i)], data_only=True)) for i in ctx.replicas.built}
    run_passes(g, ctx, AllGatherPass())
    return g, ctx, grads


def _gathers(graph, ctx, replica):
    return [n for n in ops(graph, "CollectiveGatherV2") if replica_of(ctx, graph, n) == replica]




def test_every_replica_applies_the_gathered_rows_divided_by_the_replica_count():
    """
        rows_i, ids_i ─> Gather(counts), Gather(values), Gather(indices)  (CPU:i)
            ─> kept rows ─> RealDiv(2) ─> ... ─> ScatterAdd(table_i)
    """
    g, ctx, grads = _gathered(devices_per_worker=2)
    for i in (0, 1):
        gathers = _gathers(g, ctx, i)
        assert len(gathers) == 3 and {n.device for n in gathers} == {f"/device:CPU:{i}"}
        assert all(2 in collective_keys(n) for n in gathers)   # group size 2
        update = update_of(g, ctx, "table", i)
        into = ancestors([update], data_only=True)
        assert set(gathers) <= into and not set(_gathers(g, ctx, 1 - i)) & into
        # the replica's own backprop feeds its gathers, not the other's
        fed = ancestors(gathers, data_only=True)
        mine = {a for a in grads[i] if a.op in ("Mul", "Reshape") and replica_of(ctx, g, a) == i}
        assert mine and mine <= fed
        assert not {a for a in fed if replica_of(ctx, g, a) == 1 - i}
        (mean,) = [a for a in into if a.op == "RealDiv" and replica_of(ctx, g, a) == i
                   and any(p.op == "Const" and tf.make_ndarray(p.attr["value"].tensor) == 2 for p in reads(a))]
        assert len(set(gathers) & ancestors([mean], data_only=True)) == 2   # counts, values


def test_rows_are_padded_and_gathered_under_a_bucket_key():
    """
        rows_i ─> Pad ─> Gather(values, key = base + bucket)   (key computed at run time)
        ids_i ─> Size ─> Gather(counts, constant key: the same in both replicas)
    """
    g, ctx, _ = _gathered(devices_per_worker=2)
    constant_keys = []
    for i in (0, 1):
        padded = [n for n in _gathers(g, ctx, i) if any(p.op == "Pad" for p in reads(n))]
        assert len(padded) == 2   # values and indices
        assert all(any(p.op == "AddV2" for p in reads(n)) for n in padded)
        (counts,) = [n for n in _gathers(g, ctx, i) if n not in padded]
        assert len(collective_keys(counts)) == 3
        constant_keys.append(collective_keys(counts))
    assert constant_keys[0] == constant_keys[1]


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_duplicate_ids_across_replicas_are_summed_after_the_gather(optimizer):
    """
        sgd (a linear scatter) and momentum (which deduplicated on one device):
            Gather(indices) ─> ... ─> Unique ─> UnsortedSegmentSum ─> the update
    """
    g, ctx, _ = _gathered(optimizer, devices_per_worker=2)
    for i in (0, 1):
        update = update_of(g, ctx, "table", i)
        gathers = set(_gathers(g, ctx, i))
        after = [a for a in ancestors([update], data_only=True)
                 if a.op == "Unique" and gathers & ancestors([a], data_only=True)]
        assert len(after) == 1 and replica_of(ctx, g, after[0]) == i


def test_allgather_applies_to_gathered_gradients_of_several_replicas():
    """One replica, a dense model or sparse_as_dense: nothing to gather."""
    for build, options, expected in ((sparse, {}, False), (dense, {"devices_per_worker": 2}, False),
                                     (sparse, {"devices_per_worker": 2, "sparse_as_dense": True}, False),
                                     (sparse, {"devices_per_worker": 2}, True)):
        ctx = context(**options)
        run_passes(build(), ctx, PlanPass())
        assert AllGatherPass().applies(ctx) is expected, (build.__name__, options)
    g = sparse()
    ctx = context()
    run_passes(g, ctx, PlanPass(), ReplicatePass(), AllGatherPass())
    assert ctx.passes_run == ["plan", "replicate"] and ops(g, "CollectiveGatherV2") == []


def test_allgather_runs_after_micro_batches_and_requires_the_replicas():
    """allgather gathers the micro-batch rows, so micro_batches must come first."""
    assert AllGatherPass.requires == {"plan", "replicas"} and "micro_batches" in AllGatherPass.after
    with pytest.raises(GraphRewriteError, match="'allgather' must run after micro_batches"):
        PassManager([PlanPass(), ReplicatePass(), AllGatherPass(), MicroBatchesPass()]).check_order()
    with pytest.raises(GraphRewriteError, match="'allgather' requires replicas"):
        run_passes(sparse(), context(devices_per_worker=2), PlanPass(), AllGatherPass())
