"""The two-level (hierarchical) all-reduce of a pack: what the cost model predicts, when
the plan picks it, the collectives the allreduce pass builds for it, and that the
template export writes it as building every replica does.

The numbers: tests/test_cluster.py trains hierarchical packs on loopback servers (2
workers x 2 devices, in-graph and between-graph) and compares them with one device.
"""

import pytest

import graph_rewriter as gr
from graph_rewriter import cost_model as cm
from graph_rewriter import inspect_report
from graph_rewriter.collectives import dense_instance_key, group_key, hierarchical_instance_keys
from graph_rewriter.testing import models

MB = 1000 * 1000


def workers(n):
    return {"worker": [f"w{i}:2222" for i in range(n)]}


# ----- the cost model -------------------------------------------------------------------

def test_two_levels_cut_the_cross_machine_messages_by_the_devices_per_worker():
    model = cm.CostModel()
    topo = cm.Topology(workers=128, devices_per_worker=8)
    flat = cm.allreduce_cost(1 * MB, topo, model)
    two = cm.hierarchical_cost(1 * MB, topo, model)
    assert flat.messages == 2 * (1024 - 1)
    # within: 2 (8 - 1); across: 2 (128 - 1); back: 8 - 1
    assert two.messages == 2 * 7 + 2 * 127 + 7
    # hand computed: 14 x 10 us + 1.75 MB / 12e9 + 254 x 50 us + 1.984 MB / 1.25e9 + 7 x 10 us + 1 MB / 12e9
    expected = (14 * 10e-6 + 2 * 7 / 8 * MB / 12e9 + 254 * 50e-6 + 2 * 127 / 128 * MB / 1.25e9
                + 7 * 10e-6 + MB / 12e9)
    assert two.seconds == pytest.approx(expected)
    assert two.seconds < flat.seconds / 3
    assert two.bytes_per_link == int(2 * 127 / 128 * MB)


def test_one_level_clusters_have_only_the_flat_ring():
    model = cm.CostModel()
    for topo in (cm.Topology(1, 8), cm.Topology(16, 1)):
        assert cm.hierarchical_cost(4 * MB, topo, model) == cm.allreduce_cost(4 * MB, topo, model)


def test_two_levels_also_cut_the_bytes_each_nic_carries():
    """A flat ring over 2 x 4 replicas sends 2 (8 - 1) / 8 of the pack through each NIC;
    the ring across 2 workers, 2 (2 - 1) / 2."""
    model, topo = cm.CostModel(), cm.Topology(workers=2, devices_per_worker=4)
    assert cm.allreduce_cost(256 * MB, topo, model).bytes_per_link == int(1.75 * 256 * MB)
    assert cm.hierarchical_cost(256 * MB, topo, model).bytes_per_link == 256 * MB
    assert cm.hierarchical_cost(256 * MB, topo, model).seconds < cm.allreduce_cost(256 * MB, topo, model).seconds


def test_without_a_fast_bus_a_large_pack_stays_flat():
    """When the machine's bus is no faster than the network, the two passes over it cost
    more than the cross-machine bytes saved: large packs keep the flat ring, small
    (latency-bound) ones still go two-level."""
    model = cm.CostModel(intra_bandwidth=1.25e9, intra_latency=50e-6)
    topo = cm.Topology(workers=2, devices_per_worker=4)
    assert cm.hierarchical_cost(256 * MB, topo, model).seconds > cm.allreduce_cost(256 * MB, topo, model).seconds
    assert cm.hierarchical_cost(1000, topo, model).seconds < cm.allreduce_cost(1000, topo, model).seconds


# ----- the plan ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp", "adam").graph_def


def test_the_option_makes_every_pack_hierarchical_and_the_plan_records_it(mlp):
    result = gr.rewrite(mlp, workers(2), devices_per_worker=2, allreduce_algorithm="hierarchical")
    assert [p.algorithm for p in result.plan.packs] == ["hierarchical"]
    assert result.plan.to_dict()["packs"][0]["algorithm"] == "hierarchical"
    flat = gr.rewrite(mlp, workers(2), devices_per_worker=2)
    assert "algorithm" not in flat.plan.to_dict()["packs"][0]   # flat plans stay as they were
    text = inspect_report.format_report(inspect_report.report(result))
    assert "pack 0: float32" in text and "hierarchical (within each worker" in text


def test_strategy_auto_picks_two_levels_where_the_model_predicts_them_cheaper(mlp):
    many = gr.rewrite(mlp, workers(16), devices_per_worker=8, strategy="auto")
    assert [p.algorithm for p in many.plan.packs] == ["hierarchical"]
    one_machine = gr.rewrite(mlp, None, devices_per_worker=8, strategy="auto")
    assert not any(p.algorithm for p in one_machine.plan.packs)
    forced = gr.rewrite(mlp, workers(16), devices_per_worker=8, strategy="auto", allreduce_algorithm="flat")
    assert [p.algorithm for p in forced.plan.packs] == [None]
    assert forced.plan.cost["predicted"]["seconds"] > many.plan.cost["predicted"]["seconds"]


def test_an_edited_plan_chooses_per_pack(mlp, tmp_path):
    plan = gr.rewrite(mlp, workers(2), devices_per_worker=2).plan
    plan.packs[0].algorithm = "hierarchical"
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    result = gr.rewrite(mlp, workers(2), devices_per_worker=2, strategy=str(path))
    assert [p.algorithm for p in result.plan.packs] == ["hierarchical"]
    assert any("/within/" in n.name for n in result.graph_def.node)


@pytest.mark.parametrize("cluster, dpw", [(None, 4), (workers(4), 1)])
def test_hierarchical_on_a_one_level_cluster_is_refused_naming_the_shape(mlp, cluster, dpw):
    with pytest.raises(gr.GraphRewriteError, match=r"needs several workers with several devices each"):
        gr.rewrite(mlp, cluster, devices_per_worker=dpw, allreduce_algorithm="hierarchical")


def test_an_unknown_algorithm_is_refused(mlp):
    with pytest.raises(gr.GraphRewriteError, match="unknown allreduce_algorithm 'tree'"):
        gr.rewrite(mlp, workers(2), devices_per_worker=2, allreduce_algorithm="tree")


# ----- the graph ----------------------------------------------------------------------------

def _collectives(graph_def):
    nodes = {n.name: n for n in graph_def.node}
    out = []
    for n in graph_def.node:
        if n.op.startswith("Collective"):
            consts = [nodes[i.split(":")[0]] for i in n.input if not i.startswith("^")]
            values = {c.name.rsplit("/", 1)[-1]: (list(c.attr["value"].tensor.int_val) or [None])[0]
                      for c in consts if c.op == "Const"}
            out.append((n.name, n.op, n.device, values.get("group_size"), values.get("group_key"),
                        values.get("instance_key")))
    return out


def test_only_each_workers_first_replica_talks_across_machines(mlp):
    """2 workers x 3 devices, in-graph: a reduce within each worker (group size 3, its
    own devices), a reduce across replicas 0 and 3 (group size 2), and a broadcast back
    from them to their worker's other replicas."""
    result = gr.rewrite(mlp, workers(2), devices_per_worker=3, device_type="CPU",
                        allreduce_algorithm="hierarchical")
    plan = result.plan
    within_key, back_key = hierarchical_instance_keys(plan, 0)
    grads = [c for c in _collectives(result.graph_def) if "/allreduce/" in "/" + c[0]]
    devices = result.devices
    by_role = {}
    for name, op, device, size, gkey, ikey in grads:
        role = name.split("/pack_0/")[1].split("/")[0]
        by_role.setdefault(role, []).append((op, device, size, gkey, ikey))
    assert sorted(d for _, d, *_ in by_role["within"]) == sorted(devices)
    for op, device, size, gkey, ikey in by_role["within"]:
        worker = devices[:3] if device in devices[:3] else devices[3:]
        assert (op, size, gkey, ikey) == ("CollectiveReduceV2", 3, group_key(worker), within_key)
    leaders = [devices[0], devices[3]]
    assert sorted(d for _, d, *_ in by_role["across"]) == sorted(leaders)
    for op, device, size, gkey, ikey in by_role["across"]:
        assert (op, size, gkey, ikey) == ("CollectiveReduceV2", 2, group_key(leaders), dense_instance_key(plan, 0))
    sends = [(op, d) for op, d, *_ in by_role["back"] if op == "CollectiveBcastSendV2"]
    receives = [(op, d) for op, d, *_ in by_role["back"] if op == "CollectiveBcastRecvV2"]
    assert sorted(d for _, d in sends) == sorted(leaders)
    assert sorted(d for _, d in receives) == sorted(set(devices) - set(leaders))
    assert all(ikey == back_key and size == 3 for _, _, size, _, ikey in by_role["back"])


def test_a_between_graph_worker_holds_its_own_two_levels(mlp):
    result = gr.rewrite(mlp, workers(2), devices_per_worker=4, device_type="CPU", task=("worker", 1),
                        allreduce_algorithm="hierarchical")
    grads = [c for c in _collectives(result.graph_def) if "/pack_0/" in c[0]]
    across = [c for c in grads if "/across/" in c[0]]
    assert [c[2] for c in across] == [result.devices[0]]   # this worker's first replica only
    assert len([c for c in grads if "/within/" in c[0]]) == 4
    assert len([c for c in grads if c[1] == "CollectiveBcastRecvV2"]) == 3


@pytest.mark.parametrize("task, template", [
    (("worker", 1), True),   # between-graph: replica 0 leads, 1..3 come from the template
    (None, False),           # in-graph: replica 4 leads worker 1, so every replica is built
])
def test_the_template_stands_only_for_replicas_that_lead_nothing(mlp, task, template):
    """The template export of hierarchical packs is compared with building every
    replica in tests/test_template_replicas.py (its *_hierarchical configurations)."""
    lines = []
    gr.rewrite(mlp, workers(2), devices_per_worker=4, device_type="CPU", allreduce_algorithm="hierarchical",
               task=task, log=lines.append)
    assert any("the template of the others" in line for line in lines) is template


def test_the_communication_option_reaches_both_reduces(mlp):
    result = gr.rewrite(mlp, workers(2), devices_per_worker=2, device_type="CPU",
                        allreduce_algorithm="hierarchical", communication="ring")
    hints = {n.name: n.attr["communication_hint"].s.decode() for n in result.graph_def.node
             if n.op == "CollectiveReduceV2" and "/pack_0/" in n.name}
    assert hints and set(hints.values()) == {"ring"}


def test_compressed_packs_travel_compressed_through_both_levels(mlp):
    result = gr.rewrite(mlp, workers(2), devices_per_worker=2, device_type="CPU", task=("worker", 1),
                        allreduce_algorithm="hierarchical", compression="fp16")
    half = 19   # DT_HALF
    collectives = [n for n in result.graph_def.node if "/pack_0/" in n.name and n.op.startswith("Collective")]
    assert len(collectives) == 5   # within x 2, across, broadcast, receive
    assert all(n.attr["T"].type == half for n in collectives), [(n.name, n.attr["T"].type) for n in collectives]
