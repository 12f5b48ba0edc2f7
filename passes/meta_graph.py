"""meta_graph: the emitted MetaGraphDef's collections describe the emitted graph.

TF1's session machinery reads a graph through its collections: MonitoredTrainingSession's
default Scaffold takes its init op, local init op, ready ops and Saver from them (only
building defaults from the variable collections when they are absent), and Savers and
``global_variables_initializer`` read the variable collections. The input's collections
describe one device; this pass rewrites the ones that must change and adds the ones
the Scaffold would otherwise build wrongly:

- ``variables`` / ``trainable_variables`` / ``local_variables``: the original
  variables by their original names (replica 0's copy; a parameter-server variable
  split into parts is listed as its parts, with the slice of the whole each holds),
  so a default Saver saves what the single-device graph saves. A GraphDef input gets
  them from the analysis.
- ``init_op``: what initializes this graph's variables without any collective: the
  graph's init op in-graph; between-graph, the chief's init op without its broadcast of
  initial values (a worker's would wait for it).
- ``local_init_op``: the local variables' and tables' initializers of every replica,
  and between-graph ``graph_rewriter/broadcast_variables`` (every replica takes the
  chief's variables once they are initialized or restored: MonitoredTrainingSession
  runs the local init op on every worker, the init op only on the chief, and only when
  it did not restore).
- ``ready_op`` / ``ready_for_local_init_op``: the names of the variables still
  uninitialized (what the Scaffold's default reports, over the variables above; a
  non-chief's ready-for-local-init leaves out the mirrored variables its local init
  op initializes).
- ``savers`` (and the MetaGraphDef's ``saver_def``, which ``result.saver()`` and
  SavedModel loaders use): the Saver's SaverDef (the saver pass made sure there is
  one), whose restore op the chief runs alone (a between-graph restore that ends with
  a workers' barrier gets a twin without it).
- ``queue_runners``, for a GraphDef input whose batches come from TF1 queues: one
  QueueRunnerDef per input queue, rebuilt from the graph (a MetaGraphDef input keeps its
  own).
Collections that name nodes which no longer exist are dropped; the others (train_op,
summaries, losses, global_step, update_ops, cond and while contexts) name replica 0's
or the merged nodes and stay.
"""

from graph_rewriter.analysis import enqueues_fed_values, is_input_queue
from graph_rewriter.collectives import BROADCAST_VARIABLES
from graph_rewriter.ir import GLOBAL, split_tensor_name
from graph_rewriter.op_builder import const, make_op, own_op
from graph_rewriter.op_vocabulary import COLLECTIVES
from graph_rewriter.pass_manager import Pass
from graph_rewriter.protos import meta_graph_pb2, queue_runner_pb2, saver_pb2
from graph_rewriter.protos import variable_pb2
from graph_rewriter.ps_state import INIT_BARRIER

RESTORES = ("RestoreV2", "Restore", "RestoreSlice")
OUT_OF_RANGE = 11   # tensorflow.error.Code: what a closed queue's dequeue raises
RECEIVES = ("CollectiveBcastRecvV2", "CollectiveBcastRecv")
RELEASE = f"{INIT_BARRIER}/release"   # sync_queues: the chief's init tells the workers' it is done

SCOPE = "graph_rewriter/collections"
VARIABLE_COLLECTIONS = ("variables", "trainable_variables", "local_variables", "model_variables", "global_step")


class MetaGraphPass(Pass):
    name = "meta_graph"
    requires = frozenset({"plan", "replicas"})
    # it names the finished graph's nodes: the passes that add, split or rename them first
    after = frozenset({"replicate", "mirror_variables", "accumulate", "sync_queues", "shard_variables",
                       "merge_outputs", "saver"})

    def applies(self, ctx):
        # one replica: the graph is the input's, and so are its collections
        return ctx.num_replicas > 1

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        meta = graph.meta_graph
        if meta is None:
            meta = graph.meta_graph = meta_graph_pb2.MetaGraphDef()
        if not meta.collection_def:   # a GraphDef input (the saver pass may have added a saver_def)
            with graph.adding_to_replica(GLOBAL):
                _rebuild_queue_runners(graph, meta)
        between = ctx.cluster.task is not None
        with graph.adding_to_replica(GLOBAL):
            collections = _variable_collections(graph, plan, meta)
            init_op = _init_op(graph, rm, plan)
            local_vars = [graph.node(split_tensor_name(vd.variable_name)[0])
                          for vd in collections["local_variables"]]
            local_init = _local_init_op(graph, rm, meta, local_vars)
            global_nodes = [graph.node(split_tensor_name(vd.variable_name)[0])
                            for vd in collections["variables"]]
            flags = {}   # variable -> its is-initialized flag, shared by the two reports
            ready = _report_uninitialized(graph, f"{SCOPE}/ready_op", global_nodes + local_vars, flags)
            if between and not rm.chief:
                mirrored = {vp.name for vp in plan.variables if vp.placement == "mirrored"}
                waited = [n for n in global_nodes if n.name not in mirrored]
            else:
                waited = global_nodes
            ready_local = _report_uninitialized(graph, f"{SCOPE}/ready_for_local_init_op", waited, flags)
        for key in VARIABLE_COLLECTIONS:
            if key in collections:
                col = meta.collection_def[key]
                col.Clear()
                col.bytes_list.value.extend(vd.SerializeToString() for vd in collections[key])
                if not collections[key]:
                    del meta.collection_def[key]
        _set_nodes(meta, "init_op", [init_op.name])
        _set_nodes(meta, "local_init_op", [local_init.name])
        _set_nodes(meta, "ready_op", [f"{ready.name}:0"])
        _set_nodes(meta, "ready_for_local_init_op", [f"{ready_local.name}:0"])
        if meta.HasField("saver_def"):
            saver_def = _saver_for_one_client(graph, meta.saver_def)
            meta.saver_def.CopyFrom(saver_def)   # result.saver() and SavedModel loaders too
            meta.collection_def["savers"].Clear()
            meta.collection_def["savers"].bytes_list.value.append(saver_def.SerializeToString())
        _drop_stale(graph, meta)
        return True


def _saver_for_one_client(graph, saver_def):
    """The SaverDef a client uses: the chief alone restores. A
    between-graph restore op that ends with a workers' barrier (hybrid: it is a run's
    start, like the init op) gets a twin without it; the workers take the restored
    values in the local init op (broadcast_variables) or from the parameter servers."""
    restore = graph.get(saver_def.restore_op_name)
    work = _without_collectives(restore, _received(graph)) if restore is not None else None
    if work is None:
        return saver_def
    with graph.adding_to_replica(GLOBAL):
        alone = graph.add_node(graph.unique_name(f"{SCOPE}/restore"), "NoOp",
                               control_inputs=[w for w in work if w.name != RELEASE])
    out = saver_pb2.SaverDef()
    out.CopyFrom(saver_def)
    out.restore_op_name = alone.name
    return out


def _rebuild_queue_runners(graph, meta):
    """A GraphDef keeps the queues of tf.train.batch and its kin but not the QueueRunners
    that fill them (they are a MetaGraphDef collection): one per input queue, running its
    enqueues, with its close and cancel ops (made when the graph has none), as
    tf.compat.v1.train.QueueRunner describes them. An enqueue of fed values is the
    script's own thread's to run; the rewrite's queues are not inputs."""
    runners = []
    for queue in [n for n in graph if is_input_queue(n)]:
        readers = queue.readers()
        enqueues = [r for r in readers if r.op.startswith("QueueEnqueue") and not enqueues_fed_values(r)]
        if not enqueues:
            continue
        close, cancel = (_close_op(graph, queue, readers, cancel) for cancel in (False, True))
        runners.append(queue_runner_pb2.QueueRunnerDef(
            queue_name=queue.name, enqueue_op_name=[e.name for e in enqueues], close_op_name=close.name,
            cancel_op_name=cancel.name, queue_closed_exception_types=[OUT_OF_RANGE]))
    if runners:
        meta.collection_def["queue_runners"].bytes_list.value.extend(r.SerializeToString() for r in runners)


def _close_op(graph, queue, readers, cancel):
    """The queue's close op (``cancel``: the one that also cancels pending enqueues)."""
    for r in readers:
        if r.op in ("QueueCloseV2", "QueueClose") and bool(r.attr["cancel_pending_enqueues"].b) == cancel:
            return r
    op = "QueueCloseV2" if queue.op.endswith("V2") else "QueueClose"
    return make_op(graph, op, f"{queue.name}/{'cancel' if cancel else 'close'}", [queue.output(0)],
                   attrs={"cancel_pending_enqueues": cancel})


def _set_nodes(meta, key, names):
    col = meta.collection_def[key]
    col.Clear()
    col.node_list.value.extend(names)


def _drop_stale(graph, meta):
    """Entries of node-list collections whose nodes are gone (a sharded variable's
    snapshot); a collection left empty goes."""
    for key in list(meta.collection_def):
        col = meta.collection_def[key]
        if col.HasField("node_list"):
            kept = [v for v in col.node_list.value if split_tensor_name(v.lstrip("^"))[0] in graph]
            if len(kept) != len(col.node_list.value):
                col.node_list.Clear()
                col.node_list.value.extend(kept)
            if not kept:
                del meta.collection_def[key]


# ----- the variable collections ---------------------------------------------------------

def _declared(meta, key):
    if key not in meta.collection_def:
        return None
    return [variable_pb2.VariableDef.FromString(raw) for raw in meta.collection_def[key].bytes_list.value]


def _variable_collections(graph, plan, meta):
    """{collection key: [VariableDef]} for the original variables as this graph holds them."""
    out = {}
    declared = {key: _declared(meta, key) for key in VARIABLE_COLLECTIONS}
    if declared["variables"] is None:
        # a GraphDef: every variable the plan knows is global; trainable as analysed
        defs = [_variable_def(graph, vp.name, vp.initializer, vp.role == "trainable")
                for vp in plan.variables if vp.name in graph]
        defs += [d for vp in plan.variables if vp.shards and vp.name not in graph
                 for d in _part_defs(graph, vp, vp.role == "trainable", None)]
        out["variables"] = defs
        out["trainable_variables"] = [d for d in defs if d.trainable]
        out["local_variables"] = []
        # MonitoredTrainingSession's hooks find the step by this collection, else by the
        # tensor "global_step:0", which for a resource variable is its handle (a TypeError)
        steps = [d for d in defs if split_tensor_name(d.variable_name)[0] in plan.step_counters]
        named = [d for d in steps if d.variable_name == "global_step:0"]
        if named or len(steps) == 1:
            out["global_step"] = (named or steps)[:1]
        return out
    by_name = {vp.name: vp for vp in plan.variables}
    for key, defs in declared.items():
        if defs is None:
            if key == "local_variables":
                out[key] = []
            continue
        fixed = []
        for vd in defs:
            name = split_tensor_name(vd.variable_name)[0]
            vp = by_name.get(name)
            if name in graph:
                fixed.append(vd)
            elif vp is not None and vp.shards:
                fixed.extend(_part_defs(graph, vp, vd.trainable, vd))
        out[key] = fixed
    return out


def _variable_def(graph, name, initializer, trainable):
    var = graph.node(name)
    initializer = initializer or _initializer_of(graph, var)
    vd = variable_pb2.VariableDef(
        variable_name=f"{name}:0", initializer_name=initializer,
        snapshot_name=_snapshot(graph, var), trainable=trainable, is_resource=var.op == "VarHandleOp")
    assign = graph.get(initializer) if initializer else None
    if assign is not None and len(assign.inputs) > 1:
        # hooks read it (the step's value before it is initialized)
        vd.initial_value_name = assign.inputs[1].name
    return vd


def _initializer_of(graph, var):
    """An assign of ``var`` outside the Saver (its initializer), or "" if none."""
    for c, pos in var.consumers(0):
        if pos == 0 and c.op in ("Assign", "AssignVariableOp") and not _in_saver(c):
            return c.name
    return ""


def _in_saver(node):
    """Whether an assign writes a restored value (the Saver's, not an initializer)."""
    for t in node.inputs:
        n = t.node
        if n.op == "Identity" and n.inputs:
            n = n.inputs[0].node
        if n.op in RESTORES:
            return True
    return False


def _snapshot(graph, var):
    """The tensor a VariableDef reads the variable through: an existing read of replica
    0 (``<name>/Read/ReadVariableOp`` or ``<name>/read``), else a new one."""
    want = "ReadVariableOp" if var.op == "VarHandleOp" else "Identity"
    for c, pos in var.consumers(0):
        if c.op == want and pos == 0 and c.name.startswith(var.name + "/"):
            return f"{c.name}:0"
    if var.op == "VarHandleOp":
        read = make_op(graph, "ReadVariableOp", f"{var.name}/Read/ReadVariableOp", [var.output(0)],
                       attrs={"dtype": var.attr["dtype"]}, colocate_with=[var])
    else:
        read = make_op(graph, "Identity", f"{var.name}/read", [var.output(0)], colocate_with=[var])
    return f"{read.name}:0"


def _part_defs(graph, vp, trainable, original):
    """VariableDefs of a sharded variable's parts, each with its slice of the whole (how
    TF1 lists a partitioned variable)."""
    defs = []
    start = 0
    for k, shard in enumerate(vp.shards):
        part = graph.node(f"{vp.name}/part_{k}")
        vd = _variable_def(graph, part.name, None, trainable)
        info = vd.save_slice_info_def
        info.full_name = vp.name
        info.full_shape.extend(vp.shape)
        info.var_offset.extend([start] + [0] * (len(vp.shape) - 1))
        info.var_shape.extend([shard["rows"]] + list(vp.shape[1:]))
        start += shard["rows"]
        defs.append(vd)
    return defs


# ----- init, local init, ready ----------------------------------------------------------

def _init_op(graph, rm, plan):
    """The op that initializes this graph's variables and waits for no collective."""
    received = _received(graph)
    initializers = {graph.get(vp.initializer) for vp in plan.variables if vp.initializer}
    initializers.discard(None)
    best, covered = None, 0
    for node in graph.nodes:
        if node.op == "NoOp" and rm.replica_of(graph, node.name) in (0, None):
            n = sum(1 for c in _flatten(node) if c in initializers)
            if n > covered:
                best, covered = node, n
    if best is not None:
        members = _without_collectives(best, received)
        if members is None and graph.get(RELEASE) not in _flatten(best):
            return best
        # (the release of the workers' plain init ops: no MonitoredTrainingSession
        # client waits for it, and a token left in its queue would let a later worker's
        # plain init run before the chief's)
        members = [m for m in (members if members is not None else _flatten(best))
                   if m.name != RELEASE and m.op != "NoOp"]
    else:
        members = [rm.node(graph, i, vp.initializer) for vp in plan.variables if vp.initializer
                   for i in rm.built]
        members = [m for m in members if m is not None and m not in received]
    return graph.add_node(graph.unique_name(f"{SCOPE}/init_op"), "NoOp", control_inputs=members)


def _flatten(noop):
    """The ops a NoOp runs, through the NoOps and barriers (collectives) it waits for."""
    seen, out, stack = set(), [], list(noop.control_inputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "NoOp" or n.op in COLLECTIVES:
            stack.extend(n.control_inputs)
        out.append(n)
    return out


def _without_collectives(init, received):
    """``init``'s work without collectives, or None when it has none: NoOps, barriers
    and broadcast sends are replaced by what they wait for, and what reads a received
    value goes (a worker's copies take the chief's values in the local init op)."""
    work, changed = [], False
    seen, stack = set(), list(init.control_inputs)
    while stack:
        n = stack.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n.op in COLLECTIVES or n.op == "NoOp":
            changed = changed or n.op in COLLECTIVES
            stack.extend(n.control_inputs)
        elif n in received:
            changed = True
        else:
            work.append(n)
    return work if changed else None


def _received(graph):
    """Every node that reads, by data edges, a value a collective received (a worker's
    initial values from the chief): computed once, forward from the receives (few)."""
    out, stack = set(), [n for n in graph.nodes if n.op in RECEIVES]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(c for c, _ in n.consumers())
    return out


def _local_init_op(graph, rm, meta, local_vars):
    """Every replica's local-variable and table initializers, and between-graph the
    broadcast of the chief's variables."""
    members = []
    if "local_init_op" in meta.collection_def:   # the script's own
        members += [graph.get(split_tensor_name(v.lstrip("^"))[0])
                    for v in meta.collection_def["local_init_op"].node_list.value]
    for var in local_vars:
        init = _initializer_of(graph, var)
        if init:
            members += [rm.node(graph, i, init) for i in rm.built]
    if "table_initializer" in meta.collection_def:
        members += [graph.get(split_tensor_name(v)[0])
                    for v in meta.collection_def["table_initializer"].node_list.value]
    broadcast = graph.get(BROADCAST_VARIABLES)
    if broadcast is not None:
        members.append(broadcast)
    members = list(dict.fromkeys(m for m in members if m is not None))
    return graph.add_node(graph.unique_name(f"{SCOPE}/local_init_op"), "NoOp", control_inputs=members)


def _report_uninitialized(graph, name, variables, made):
    """A 1-D string tensor of the names of ``variables`` not yet initialized (what
    tf.compat.v1.report_uninitialized_variables builds); ``made``: the flags built so
    far, by variable."""
    if not variables:
        return const(graph, name, [], "string").node
    flags = []
    for v in variables:
        if v not in made:
            own = own_op(v, "IsInitialized/VarIsInitializedOp", "VarIsInitializedOp")
            made[v] = own.output(0) if own is not None else None
        if made[v] is None:
            scope = f"{SCOPE}/is_initialized/{v.name}"
            if v.op == "VarHandleOp":
                made[v] = make_op(graph, "VarIsInitializedOp", scope, [v.output(0)], colocate_with=[v]).output(0)
            else:
                made[v] = make_op(graph, "IsVariableInitialized", scope, [v.output(0)],
                                  attrs={"dtype": _base(v.attr["dtype"].type)}, colocate_with=[v]).output(0)
        flags.append(made[v])
    names = const(graph, f"{name}/names", [v.name for v in variables], "string")
    stacked = make_op(graph, "Pack", f"{name}/stack", [flags], attrs={"axis": 0})
    missing = make_op(graph, "LogicalNot", f"{name}/not", [stacked.output(0)])
    where = make_op(graph, "Where", f"{name}/where", [missing.output(0)])
    flat = make_op(graph, "Reshape", f"{name}/flat",
                   [where.output(0), const(graph, f"{name}/minus_one", [-1], "int32")])
    return make_op(graph, "GatherV2", name,
                   [names, flat.output(0), const(graph, f"{name}/axis", 0, "int32")], attrs={"batch_dims": 0})


def _base(enum):
    from graph_rewriter import dtypes
    return dtypes.as_dtype(enum if enum < 100 else enum - 100)
