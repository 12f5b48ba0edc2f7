"""Tests of the batch_statistics pass alone (after plan and replicate), with the option
sync_batch_statistics: every replica's batch statistics are all-reduced, forward and
where their gradients enter their backward pass.

    a Mean over the rows:   Mean --> MulNoNan(count factor) --> CollectiveReduceV2 --> its readers
                            (the collective takes the Mean's name); its gradient entry
                            --> CollectiveReduceV2 --> Mul(factor) --> the Mean's backward
    a FusedBatchNorm:       replaced by its ops; an IdentityN takes its name, another its
                            FusedBatchNormGrad's; five collectives per replica
"""

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import collective_keys, context, normalized, ops, reaches, reads, replica_of


def sync(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.BatchStatisticsPass())


def _by_replica(ctx, graph, nodes):
    out = {}
    for n in nodes:
        out.setdefault(replica_of(ctx, graph, n), []).append(n)
    return out


def test_a_fused_batch_norm_and_its_gradient_become_their_ops_with_synced_statistics():
    g = normalized("fused")
    ctx = context(devices_per_worker=2, sync_batch_statistics=True)
    sync(g, ctx)
    assert not ops(g, "FusedBatchNormV3", "FusedBatchNormGradV3")
    idents = _by_replica(ctx, g, ops(g, "IdentityN"))
    reduces = _by_replica(ctx, g, ops(g, "CollectiveReduceV2"))
    assert sorted(idents) == sorted(reduces) == [0, 1]
    for i in (0, 1):
        assert len(reduces[i]) == 5       # the count, the mean, the variance, the backward's two means
        forward, backward = sorted(idents[i], key=lambda n: "_grad/" in n.name)
        assert forward.name.endswith("bn") and "FusedBatchNormGradV3" in backward.name
        assert len(forward.inputs) == len(backward.inputs) == 3
        # the normalised output comes from synced statistics; dx from the synced backward means
        assert any(reaches(r, reads(forward)[0]) for r in reduces[i])
        assert sum(reaches(r, reads(backward)[0]) for r in reduces[i]) == 5
        # dgamma and dbeta are the replica's own sums (averaged later with the other gradients)
        assert [p.op for p in reads(backward)[1:]] == ["Sum", "Sum"]
    assert sorted(map(collective_keys, reduces[0])) == sorted(map(collective_keys, reduces[1]))


def test_a_mean_over_the_rows_is_synced_forward_and_at_its_gradient():
    g = normalized("moments")
    ctx = context(devices_per_worker=2, sync_batch_statistics=True)
    sync(g, ctx)
    for name in ("bn/mean", "bn/variance"):
        for i in (0, 1):
            synced = ctx.replicas.node(g, i, name)     # the collective takes the statistic's name
            assert synced.op == "CollectiveReduceV2" and replica_of(ctx, g, synced) == i
            (weighted,) = [p for p in reads(synced) if p.op == "MulNoNan"]
            assert {p.op for p in reads(weighted)} == {"Mean", "RealDiv"}
    for i, reduces in _by_replica(ctx, g, ops(g, "CollectiveReduceV2")).items():
        backward = [r for r in reduces if "_grad/" in r.name]
        assert len(reduces) == 6 and len(backward) == 2   # per statistic: count, value, gradient
        for r in backward:
            assert {c.op for c, _ in r.consumers()} == {"Mul"}


def test_the_forward_collectives_wait_for_each_other_in_one_order():
    g = normalized("moments")
    ctx = context(devices_per_worker=2, sync_batch_statistics=True)
    sync(g, ctx)
    by_replica = _by_replica(ctx, g, ops(g, "CollectiveReduceV2"))
    assert sorted(by_replica) == [0, 1]
    for reduces in by_replica.values():
        forward = [r for r in reduces if "_grad/" not in r.name]
        assert len(forward) == 4          # per statistic: its count and its value
        for a in forward:
            for b in forward:
                assert a is b or reaches(a, b) or reaches(b, a)


def test_nothing_to_do_without_the_option_or_for_one_replica():
    for ctx in (context(devices_per_worker=2), context(devices_per_worker=1, sync_batch_statistics=True)):
        g = normalized("fused")
        sync(g, ctx)
        assert not ops(g, "CollectiveReduceV2") and ops(g, "FusedBatchNormV3")
