"""The communication pass: each gradient collective asks TensorFlow for the implementation
the plan names (CollectiveReduceV2/CollectiveGatherV2's communication_hint): per pack from
the plan, the rewrite's ``communication`` option otherwise. Collectives are told apart by
their instance key, not their names."""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.collectives import dense_instance_key, key_of
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import PassManager, run_passes
from graph_rewriter.passes import (AllGatherPass, AllReducePass, CommunicationPass, PlanPass,
                                   ReplicatePass)
from graph_rewriter.testing import harness, models

import pass_graphs as pg


def hints(graph, op):
    return [n.attr["communication_hint"].s.decode() for n in pg.ops(graph, op)]


def test_the_option_sets_every_reduce_and_gather():
    """
        ids --> gather(table) --> loss      x --> MatMul(w) --> loss
        replica i: CollectiveGatherV2 (rows, ids, counts)   CollectiveReduceV2 (w, b)
        all of them: communication_hint "ring"
    """
    for graph in (pg.dense(), pg.sparse()):
        ctx = pg.context(devices_per_worker=2, communication="ring")
        run_passes(graph, ctx, PlanPass(), ReplicatePass(), AllReducePass(), AllGatherPass(),
                   CommunicationPass())
        found = hints(graph, "CollectiveReduceV2") + hints(graph, "CollectiveGatherV2")
        assert found and set(found) == {"ring"}, found
        assert "communication" in ctx.passes_run


def test_a_plan_chooses_per_pack():
    """
        bytes_per_pack=4: w's gradient in pack 0, b's in pack 1 (each replica: two reduces)
        the plan says pack 1 "ring": pack 1's reduces ring, pack 0's stay "auto"
    """
    probe = pg.dense()
    ctx = pg.context(devices_per_worker=2, bytes_per_pack=4)
    run_passes(probe, ctx, PlanPass())
    plan = ctx.plan
    assert len(plan.packs) == 2
    plan.packs[1].communication = "ring"
    graph = pg.dense()
    ctx = pg.context(devices_per_worker=2, bytes_per_pack=4)
    ctx.plan = plan
    run_passes(graph, ctx, PlanPass(), ReplicatePass(), AllReducePass(), CommunicationPass())
    by_pack = {}
    for n in pg.ops(graph, "CollectiveReduceV2"):
        key = key_of(n, "instance_key")
        pack = [dense_instance_key(plan, i) for i in range(2)].index(key)
        by_pack.setdefault(pack, set()).add(n.attr["communication_hint"].s.decode())
    assert by_pack == {0: {"auto"}, 1: {"ring"}}


def test_not_needed_by_default_and_the_output_keeps_auto():
    result = gr.rewrite(models.build("embedding", "adam").graph_def, devices_per_worker=2,
                        device_type="CPU")
    assert "communication" not in result.metadata["passes"]
    graph = graph_io.load_graph(result.graph_def)
    found = hints(graph, "CollectiveReduceV2") + hints(graph, "CollectiveGatherV2")
    assert found and set(found) == {"auto"}
    assert all("communication" not in p for p in result.metadata["plan"]["packs"])
    one_replica = pg.context(devices_per_worker=1, communication="ring")
    run_passes(pg.dense(), one_replica, PlanPass())
    assert not CommunicationPass().applies(one_replica)


def test_it_runs_after_the_passes_that_build_the_collectives():
    with pytest.raises(GraphRewriteError, match="'communication' must run after allreduce"):
        PassManager([PlanPass(), ReplicatePass(), CommunicationPass(), AllReducePass()]).check_order()


def test_nccl_is_refused_for_cpu_replicas():
    with pytest.raises(GraphRewriteError, match="'nccl' runs on GPUs"):
        pg.context(devices_per_worker=2, communication="nccl")
    probe = pg.dense()
    ctx = pg.context(devices_per_worker=2)
    run_passes(probe, ctx, PlanPass())
    ctx.plan.packs[0].communication = "nccl"
    again = pg.context(devices_per_worker=2)
    again.plan = ctx.plan
    with pytest.raises(GraphRewriteError, match="pack 0 asks for communication 'nccl'"):
        run_passes(pg.dense(), again, PlanPass())
    gpu = pg.context(devices_per_worker=2, device_type="GPU", communication="nccl")
    graph = pg.dense()
    run_passes(graph, gpu, PlanPass(), ReplicatePass(), AllReducePass(), CommunicationPass())
    assert set(hints(graph, "CollectiveReduceV2")) == {"nccl"}


def test_the_plan_json_round_trip_keeps_a_packs_choice():
    probe = pg.dense()
    ctx = pg.context(devices_per_worker=2, communication="ring")
    run_passes(probe, ctx, PlanPass())
    doc = ctx.plan.to_dict()
    assert [p["communication"] for p in doc["packs"]] == ["ring"]
    assert type(ctx.plan).from_json(ctx.plan.to_json()).packs[0].communication == "ring"


def test_ring_trains_as_one_device():
    """Two CPU replicas on TensorFlow's ring implementation compute what one device does."""
    example = models.build("embedding", "adam")
    single_losses, single = harness.run_single(example, steps=3)
    result = gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU",
                        communication="ring")
    losses, values = harness.run_rewritten(result, example, steps=3)
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5, atol=1e-6)
    for name, value in single.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
