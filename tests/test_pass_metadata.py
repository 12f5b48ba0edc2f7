"""Tests of the metadata pass alone (after plan, replicate and place): it adds one Const
node, graph_rewriter/metadata, whose JSON records what the Session wrapper and `inspect`
need: the replicas and their devices, the plan, the session configuration and the passes
that ran.

    (graph) ...          =>   (graph) ...   +   graph_rewriter/metadata (Const string, read by nothing)
"""

from graph_rewriter import passes
from graph_rewriter.metadata import METADATA_FORMAT, METADATA_NODE, read_metadata_of
from graph_rewriter.pass_manager import run_passes
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops


def with_metadata(graph, ctx, *middle):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), *middle,
                      passes.PlacePass(), passes.MetadataPass())


def metadata_nodes(graph):
    return [n for n in ops(graph, "Const") if n.attr["dtype"].type == 7   # DT_STRING
            and n.attr["value"].tensor.string_val
            and n.attr["value"].tensor.string_val[0].startswith(b'{"')]


def test_one_metadata_node_names_the_replicas_and_the_plan():
    """graph_rewriter/metadata: Const string JSON {replicas, devices, plan, cluster}, read by nothing"""
    g = dense()
    ctx = context(WORKERS2)
    with_metadata(g, ctx)
    (node,) = metadata_nodes(g)
    assert node.name == METADATA_NODE
    assert not node.consumers() and not node.control_consumers   # nothing runs it
    assert node.device == ctx.replicas.global_device
    doc = read_metadata_of(g)
    assert doc["format"] == METADATA_FORMAT
    assert doc["num_replicas"] == doc["local_replicas"] == 2
    assert doc["replica_devices"] == ctx.replicas.devices and len(set(doc["replica_devices"])) == 2
    assert doc["replica_prefixes"] == ctx.replicas.prefixes
    assert doc["plan"]["strategy"] == "allreduce"
    assert sorted(v["name"] for v in doc["plan"]["variables"]) == ["b", "w"]
    assert doc["batch_inputs"] == ctx.plan.batch_inputs and "x:0" in str(doc["batch_inputs"])
    assert doc["cluster"] == WORKERS2 and doc["task"] is None
    assert doc["num_nodes"] == len(g)


def test_the_passes_listed_are_those_that_ran():
    """under strategy ps in-graph, accumulate runs and sync_queues (between-graph only) does not"""
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    with_metadata(g, ctx, passes.AccumulatePass(), passes.SyncQueuesPass())
    doc = read_metadata_of(g)
    assert doc["passes"] == ["plan", "replicate", "accumulate", "place", "metadata"]
    assert {v["name"]: v["placement"] for v in doc["plan"]["variables"]} == {"w": "ps", "b": "ps"}


def test_between_graph_metadata_names_the_task_and_the_whole_group():
    """worker 1's graph: one local replica, rank 1 of a group of 2, not the chief"""
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 1), strategy="ps")
    with_metadata(g, ctx, passes.AccumulatePass(), passes.SyncQueuesPass())
    doc = read_metadata_of(g)
    assert doc["task"] == ["worker", 1] and doc["chief"] is False
    assert doc["local_replicas"] == 1 and doc["num_replicas"] == 2
    assert doc["first_replica"] == 1
    assert doc["group_devices"][1] == doc["replica_devices"][0]


def test_the_session_config_allows_the_cpu_replicas():
    """3 CPU replicas per worker: the session needs 3 CPU devices and enough inter-op threads"""
    g = dense()
    ctx = context(WORKERS2, devices_per_worker=3, timeout_seconds=5)
    with_metadata(g, ctx)
    cfg = read_metadata_of(g)["session_config"]
    assert cfg["device_count"] == {"CPU": 3}
    assert cfg["inter_op_parallelism_threads"] >= 4
    assert cfg["operation_timeout_in_ms"] == 5000


def test_running_it_again_replaces_the_node():
    """a second run replaces the node (one metadata node, listing both runs)"""
    g = dense()
    ctx = context(WORKERS2)
    with_metadata(g, ctx)
    run_passes(g, ctx, passes.MetadataPass())
    (node,) = metadata_nodes(g)
    assert node.name == METADATA_NODE
    assert read_metadata_of(g)["passes"][-2:] == ["metadata", "metadata"]


def test_metadata_applies_to_every_rewrite_even_one_device():
    """one device: the metadata still records the (single) replica and the passes"""
    g = dense()
    ctx = context()
    with_metadata(g, ctx)
    assert passes.MetadataPass().applies(ctx)
    doc = read_metadata_of(g)
    assert doc["num_replicas"] == 1 and doc["replica_prefixes"] == [""]
    assert doc["passes"] == ["plan", "replicate", "place", "metadata"]
