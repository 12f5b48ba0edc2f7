"""The meta_graph pass alone: the MetaGraphDef's collections describe the emitted graph.

    variables:          the original variables by their original names (a sharded one as
                        its parts, each with its slice of the whole)
    init_op:            in-graph the graph's init op; between-graph its work without any
                        collective (no broadcast send, no receive)
    local_init_op:      between-graph: graph_rewriter/broadcast_variables
    ready_op:           names of uninitialized variables: GatherV2(names, Where(!stack(VarIsInitializedOp)))
    ready_for_local_init_op: a non-chief's leaves out the mirrored variables
"""

from tensorflow.core.framework import variable_pb2

from graph_rewriter.collectives import BROADCAST_VARIABLES
from graph_rewriter.op_vocabulary import COLLECTIVES
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import (MetaGraphPass, MirrorVariablesPass, PlanPass, ReplicatePass, SaverPass,
                                   ShardVariablesPass)
from graph_rewriter.traversal import ancestors
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, sparse


def _variable_defs(graph, key):
    return [variable_pb2.VariableDef.FromString(raw)
            for raw in graph.meta_graph.collection_def[key].bytes_list.value]


def _node(graph, key):
    (name,) = graph.meta_graph.collection_def[key].node_list.value
    return graph.node(name.split(":")[0])


def _collections(graph, cluster=None, **options):
    ctx = context(cluster, **options)
    run_passes(graph, ctx, SaverPass(), PlanPass(), ReplicatePass(), MirrorVariablesPass(), MetaGraphPass())
    return ctx


def _reported(graph, report):
    """The variables a ready report checks (the ones whose is-initialized flag it stacks,
    by data edges: a master's own flag also runs its replicas' copies, by control edges)."""
    seen, stack = set(), [report]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(t.node for t in n.inputs)
    return {n.inputs[0].node.name for n in seen if n.op in ("VarIsInitializedOp", "IsVariableInitialized")}


def test_in_graph_collections_name_the_original_variables_and_the_init_op():
    g = dense(optimizer="adam", global_step=True)
    _collections(g, devices_per_worker=2)
    names = {vd.variable_name for vd in _variable_defs(g, "variables")}
    assert names == {"w:0", "b:0", "global_step:0", "beta1_power:0", "beta2_power:0",
                     "w/Adam:0", "w/Adam_1:0", "b/Adam:0", "b/Adam_1:0"}
    assert {vd.variable_name for vd in _variable_defs(g, "trainable_variables")} == {"w:0", "b:0"}
    assert [vd.variable_name for vd in _variable_defs(g, "global_step")] == ["global_step:0"]
    for vd in _variable_defs(g, "variables"):
        assert g.node(vd.initializer_name).op == "AssignVariableOp"
        assert g.node(vd.snapshot_name.split(":")[0]).op == "ReadVariableOp"
    assert _node(g, "init_op").name == "init"     # it initializes every replica in-graph
    report = _node(g, "ready_op")
    assert report.op == "GatherV2"
    assert _reported(g, report) == {vd.variable_name[:-2] for vd in _variable_defs(g, "variables")}
    assert "savers" in g.meta_graph.collection_def


def test_between_graph_chief_initializes_without_collectives_and_broadcasts_in_local_init():
    g = dense()
    _collections(g, WORKERS2, task="worker:0")
    init = _node(g, "init_op")
    assert init.name != "init"
    work = ancestors([init])
    assert not any(n.op in COLLECTIVES for n in work)
    assert g.node("w/Assign") in init.control_inputs and g.node("b/Assign") in init.control_inputs
    local = _node(g, "local_init_op")
    assert g.node(BROADCAST_VARIABLES) in local.control_inputs
    assert _reported(g, _node(g, "ready_for_local_init_op")) == {"w", "b"}


def test_between_graph_worker_waits_for_nothing_before_its_local_init():
    """A non-chief's variables are mirrored: its local init op (the broadcast) gives
    them their values, so nothing needs to be ready before it."""
    g = dense()
    _collections(g, WORKERS2, task="worker:1")
    ready_local = _node(g, "ready_for_local_init_op")
    assert ready_local.op == "Const" and not ready_local.attr["value"].tensor.string_val
    assert g.node(BROADCAST_VARIABLES) in _node(g, "local_init_op").control_inputs
    assert not any(n.op == "CollectiveBcastRecvV2" for n in ancestors([_node(g, "init_op")]))
    assert _reported(g, _node(g, "ready_op")) == {"w", "b"}


def test_a_sharded_variable_is_listed_as_its_parts_with_their_slices():
    g = sparse(rows=10)
    ctx = context(PS2_WORKERS2, strategy="ps", ps_shard_bytes=16)
    run_passes(g, ctx, SaverPass(), PlanPass(), ReplicatePass(), ShardVariablesPass(), MetaGraphPass())
    shards = ctx.plan.variable("table").shards
    assert shards and len(shards) == 2
    parts = [vd for vd in _variable_defs(g, "variables") if vd.save_slice_info_def.full_name == "table"]
    assert [vd.variable_name for vd in parts] == ["table/part_0:0", "table/part_1:0"]
    offsets = [list(vd.save_slice_info_def.var_offset) for vd in parts]
    sizes = [list(vd.save_slice_info_def.var_shape) for vd in parts]
    assert offsets == [[0, 0], [shards[0]["rows"], 0]]
    assert [s[0] for s in sizes] == [s["rows"] for s in shards] and sum(s[0] for s in sizes) == 10
    assert all(list(vd.save_slice_info_def.full_shape) == [10, 2] for vd in parts)
    assert "table:0" not in {vd.variable_name for vd in _variable_defs(g, "variables")}
    assert ops(g, "VarHandleOp") and "table" not in g
