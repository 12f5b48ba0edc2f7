"""mirror_variables: every replica's copy of a variable starts from the master's value.

In-graph (one client, every replica in this graph):

    replica_1/w/Assign(replica_1/w, <its own initial value>)
      becomes
    replica_1/w/Assign(replica_1/w, <the tensor w/Assign assigns>)

so random initializers are drawn once (a tensor has one value per run). Between-graph (each worker runs its own graph),
the group's replica 0, on the chief, initializes and broadcasts: its initial values are
packed per dtype and sent with CollectiveBcastSendV2; every other replica of every
worker receives them (CollectiveBcastRecvV2) as its initial value. Every worker runs
its init op; the broadcast pairs them up (bounded by the session's deadline).

A checkpoint restore writes the graph's master copy (the Saver keeps the original
names); the restore op then also copies the restored values into the graph's other
replicas, so restoring never leaves the replicas apart. Only variables the plan
mirrors are touched (parameter-server variables exist once).

Between-graph, a restore writes the chief's copies only (each worker's Saver writes its
own graph's). Every worker's graph therefore also has ``graph_rewriter/broadcast_variables``:
the chief's replica 0 sends the current value of every mirrored variable and every other
replica assigns it. Run on every worker at once (after the chief restored, or in
MonitoredTrainingSession's local init op, which the emitted collections name), it
makes every replica equal to the chief's restored or initialized variables.
"""

from graph_rewriter import dtypes
from graph_rewriter import opdefs
from graph_rewriter.collectives import BROADCAST_VARIABLES, broadcast_recv, broadcast_send, group_key, init_instance_key
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.op_vocabulary import DENSE_ASSIGNS, PASS_THROUGH
from graph_rewriter.pass_manager import Pass


class MirrorVariablesPass(Pass):
    name = "mirror_variables"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and any(v.placement == "mirrored" for v in ctx.plan.variables)

    def run(self, graph, ctx):
        rm = ctx.replicas
        if rm.group_size == 1:
            return False
        mirrored = [vp for vp in ctx.plan.variables if vp.placement == "mirrored"]
        between = ctx.cluster.task is not None
        changed = False
        if between:
            changed = self._broadcast_initial_values(graph, ctx, mirrored)
            self._broadcast_current_values(graph, ctx, mirrored)
            changed = True
        for vp in mirrored:
            if not rm.is_cloned(graph, vp.name):
                continue
            master = graph.node(vp.name)
            if vp.initializer is not None and not between:
                # Every copy assigns the tensor the master assigns: within one run it has
                # one value (one random draw). Reading the master after its assign would
                # loop when the assign itself is what the user runs (a graph without an
                # init op), since running it runs the copies' assigns first.
                master_init = graph.node(vp.initializer)
                value = master_init.inputs[opdefs.input_position(master_init, "value")]
                for i in rm.built[1:]:
                    init = rm.node(graph, i, vp.initializer)
                    init.set_input(opdefs.input_position(init, "value"), value)
                    changed = True
            for restore in _restore_assigns(graph, rm, master):
                waiting = restore.control_consumers  # e.g. save/restore_all, before we add readers
                for i in rm.built[1:]:
                    copy = rm.node(graph, i, vp.name)
                    value = _read(graph, master, f"{rm.prefixes[i]}{vp.name}/restored_value",
                                  control_inputs=[restore])
                    sync = _assign(graph, copy, value, f"{rm.prefixes[i]}{vp.name}/sync_after_restore")
                    for c in waiting:
                        c.add_control_input(sync)
                    changed = True
        return changed

    def _broadcast_initial_values(self, graph, ctx, mirrored):
        rm = ctx.replicas
        gkey = group_key(rm.group_devices)
        packs = {}
        for vp in mirrored:
            if vp.initializer is not None:
                packs.setdefault(vp.dtype, []).append(vp)
        for k, (dtype, members) in enumerate(packs.items()):
            ikey = init_instance_key(ctx.plan, k)
            for i in rm.built:
                rank = rm.first_replica + i
                device = rm.devices[i]
                scope = f"{rm.prefixes[i]}initial_values/{dtype}"
                inits = [rm.node(graph, i, vp.initializer) for vp in members]
                if rank == 0:
                    send = _send_packed(graph, scope, members, device, rm, gkey, ikey,
                                        lambda vp, init: _read(graph, graph.node(vp.name), f"{scope}/{vp.name}/value",
                                                               control_inputs=[init]), inits)
                    for init_op in _init_ops_of(inits):
                        init_op.add_control_input(send)
                    continue
                shaped = _receive_unpacked(graph, scope, members, dtype, device, rm, gkey, ikey)
                for init, value in zip(inits, shaped):
                    init.set_input(opdefs.input_position(init, "value"), value)
        return bool(packs)

    def _broadcast_current_values(self, graph, ctx, mirrored):
        """``graph_rewriter/broadcast_variables``: replica 0 of the group sends what its
        mirrored variables hold now; every other replica assigns it (module doc)."""
        rm = ctx.replicas
        gkey = group_key(rm.group_devices)
        packs = {}
        for vp in mirrored:
            packs.setdefault(vp.dtype, []).append(vp)
        first_key = len({vp.dtype for vp in mirrored if vp.initializer is not None})
        done = []
        for k, (dtype, members) in enumerate(packs.items()):
            ikey = init_instance_key(ctx.plan, first_key + k)
            for i in rm.built:
                device = rm.devices[i]
                scope = f"{rm.prefixes[i]}graph_rewriter/broadcast_variables/{dtype}"
                with graph.adding_to_replica(i):
                    if rm.first_replica + i == 0:
                        done.append(_send_packed(
                            graph, scope, members, device, rm, gkey, ikey,
                            lambda vp, _: _read(graph, graph.node(vp.name), f"{scope}/{vp.name}/value")))
                        continue
                    shaped = _receive_unpacked(graph, scope, members, dtype, device, rm, gkey, ikey)
                    for vp, value in zip(members, shaped):
                        done.append(_assign(graph, rm.node(graph, i, vp.name), value, f"{scope}/{vp.name}/assign"))
        with graph.adding_to_replica(GLOBAL):
            graph.add_node(graph.unique_name(BROADCAST_VARIABLES), "NoOp", control_inputs=done)


def _send_packed(graph, scope, members, device, rm, gkey, ikey, value_of, inits=None):
    """Broadcasts the members' values (``value_of(vp, its initializer)``), flattened and
    concatenated into one tensor, from replica 0 of the group."""
    flats = []
    for vp, init in zip(members, inits or [None] * len(members)):
        flats.append(make_op(graph, "Reshape", f"{scope}/flat",
                             [value_of(vp, init), const(graph, f"{scope}/minus_one", [-1], "int32", device)],
                             device=device).output(0))
    packed = flats[0] if len(flats) == 1 else make_op(
        graph, "ConcatV2", f"{scope}/concat",
        [flats, const(graph, f"{scope}/axis", 0, "int32", device)], device=device).output(0)
    return broadcast_send(graph, scope, packed, rm.group_size, gkey, ikey, device)


def _receive_unpacked(graph, scope, members, dtype, device, rm, gkey, ikey):
    """What _send_packed sent, split back into one tensor per member, in its shape."""
    sizes = [_num_elements(vp) for vp in members]
    received = broadcast_recv(graph, scope, [sum(sizes)], dtypes.as_dtype(dtype), rm.group_size,
                              gkey, ikey, device).output(0)
    parts = [received]
    if len(members) > 1:
        split = make_op(graph, "SplitV", f"{scope}/split",
                        [received, const(graph, f"{scope}/sizes", sizes, "int64", device),
                         const(graph, f"{scope}/split_axis", 0, "int32", device)],
                        attrs={"num_split": len(members)}, device=device)
        parts = [split.output(j) for j in range(len(members))]
    return [make_op(graph, "Reshape", f"{scope}/{vp.name}/shaped",
                    [part, const(graph, f"{scope}/{vp.name}/shape", vp.shape, "int64", device)],
                    device=device).output(0) for vp, part in zip(members, parts)]


def _num_elements(vp):
    n = 1
    for d in vp.shape or []:
        n *= d
    return n


def _init_ops_of(initializers):
    """The NoOps that run these initializers (the graph's init op)."""
    out = {}
    for init in initializers:
        for c in init.control_consumers:
            if c.op == "NoOp":
                out[c] = None
    return list(out)


def _read(graph, var, name, control_inputs=()):
    if var.op == "VarHandleOp":
        return make_op(graph, "ReadVariableOp", name, [var.output(0)],
                       attrs={"dtype": var.attr["dtype"]}, control_inputs=control_inputs).output(0)
    # A ref is read where the variable lives: reading it from another device would send
    # the value when the step starts, before the control dependency lets it be written.
    return make_op(graph, "Identity", name, [var.output(0)], control_inputs=control_inputs,
                   colocate_with=[var]).output(0)


def _assign(graph, var, value, name):
    if var.op == "VarHandleOp":
        return make_op(graph, "AssignVariableOp", name, [var.output(0), value],
                       attrs={"dtype": var.attr["dtype"]})
    return make_op(graph, "Assign", name, [var.output(0), value],
                   type_attrs={"T": opdefs.base_dtype(var.attr["dtype"].type)})


def _restore_assigns(graph, rm, var):
    """Global (uncloned) assigns of the master variable: the Saver's restore ops."""
    out = []
    stack = [var]
    while stack:
        n = stack.pop()
        for c, pos in n.consumers(0):
            if c.op in PASS_THROUGH:
                stack.append(c)
            elif c.op in DENSE_ASSIGNS and pos == 0 and rm.replica_of(graph, c.name) is None:
                out.append(c)
    return out
