"""Tests of the normalizers pass alone (after plan and replicate): a loss divided by a
sum over the batch (a count of tokens) divides, on every replica, by the replicas' mean
of that sum:

    replica i:  sum(m1_i) --> CollectiveReduceV2(Add, Div) --> every reader of sum(m1_i)
                sum(m2_i) --> CollectiveReduceV2 (after the first) --> every reader of sum(m2_i)
"""

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import collective_keys, context, masked, ops, reaches, reads, replica_of


def normalize(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.NormalizersPass())


def test_every_reader_of_a_replicas_sum_reads_the_mean_over_the_replicas():
    g = masked()
    ctx = context(devices_per_worker=2)
    normalize(g, ctx)
    reduces = ops(g, "CollectiveReduceV2")
    assert len(reduces) == 4                      # 2 normalizers x 2 replicas
    for r in reduces:
        (total,) = [p for p in reads(r) if p.op == "Sum"]
        assert replica_of(ctx, g, total) == replica_of(ctx, g, r)
        assert r.attr["final_op"].s == b"Div"
        # nothing else reads the replica's own sum: the loss and its gradient read the mean
        assert [c.name for c, _ in total.consumers()] == [r.name]
        assert {c.op for c, _ in r.consumers()} >= {"RealDiv"}


def test_the_replicas_reduce_in_one_group_and_in_the_same_order():
    g = masked()
    ctx = context(devices_per_worker=2)
    normalize(g, ctx)
    by_replica = {}
    for r in ops(g, "CollectiveReduceV2"):
        by_replica.setdefault(replica_of(ctx, g, r), []).append(r)
    keys = {i: sorted(collective_keys(r) for r in rs) for i, rs in by_replica.items()}
    assert keys[0] == keys[1], "the same group and instance keys on both replicas"
    for rs in by_replica.values():
        a, b = rs
        assert reaches(a, b) or reaches(b, a), "one normalizer waits for the other"


def test_nothing_to_do_for_one_replica_or_a_loss_without_a_sum_to_divide_by():
    from pass_graphs import dense
    for g, ctx in ((masked(), context(devices_per_worker=1)), (dense(), context(devices_per_worker=2))):
        normalize(g, ctx)
        assert not ops(g, "CollectiveReduceV2")
