"""shard_variables: split large parameter-server variables by rows across the ps tasks.

A variable the plan gives ``shards`` (rows per ps task) becomes one variable per shard,
``<name>/part_<k>``, on ps task k; its optimizer slots are split the same way. Every use
of the original handle is rewritten so the rest of the graph still sees one variable:

    ReadVariableOp(v)             -> ConcatV2(ReadVariableOp(part_k)...)       (the Saver too)
    ResourceGather(v, ids)        -> ids partitioned by row range, one gather per part,
                                     DynamicStitch back into lookup order
    Assign*VariableOp(v, value)   -> value split by rows, one assign per part  (init, restore)
    ResourceScatter*(v, ids, up)  -> ids and rows partitioned, one scatter per part
    ResourceApply*(v, slots, g)   -> g split by rows, one update per part
    ResourceSparseApply*(v, slots, g, ids) -> (g, ids) partitioned, one update per part

so embedding lookups and checkpoints still use the original name and shapes. Row k
goes to the part whose range holds it ("div" partitioning, like tf.nn.embedding_lookup's).
"""

from graph_rewriter import dtypes
from graph_rewriter import opdefs
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.op_builder import const, dtype_of, make_op, shape_attr
from graph_rewriter.pass_manager import Pass

class ShardVariablesPass(Pass):
    name = "shard_variables"
    requires = frozenset({"plan", "replicas"})
    # it rewrites every reader of a variable it splits, so the passes that add readers
    # (accumulate's applies) or look variables up by name (sync_queues) come first
    after = frozenset({"accumulate", "sync_queues"})

    def applies(self, ctx):
        return any(v.placement == "ps" and v.shards for v in ctx.plan.variables)

    def run(self, graph, ctx):
        sharded = [v for v in ctx.plan.variables if v.placement == "ps" and v.shards]
        if not sharded:
            return False
        parts = {}
        for vp in sharded:
            var = graph.node(vp.name)
            rows = [s["rows"] for s in vp.shards]
            parts[var] = [self._part(graph, ctx, var, vp, k, s) for k, s in enumerate(vp.shards)]
            parts[var].append(rows)
        for var, info in parts.items():
            handles, rows = info[:-1], info[-1]
            starts = [sum(rows[:k]) for k in range(len(rows))]
            for user, pos in list(var.consumers(0)):
                # what replaces a replica's reader belongs to that replica (its inputs are
                # global: the batch split and the ps parts)
                with graph.adding_to_replica(user.replica if user.replica >= 0 else None):
                    self._rewrite(graph, ctx, var, user, pos, handles, rows, starts, parts)
        for var in parts:
            if not var.consumers() and not var.control_consumers:
                graph.remove_node(var)
        return True

    def _part(self, graph, ctx, var, vp, k, shard):
        shape = list(vp.shape)
        shape[0] = shard["rows"]
        shared = var.attr["shared_name"].s.decode() or var.name
        return make_op(graph, "VarHandleOp", f"{var.name}/part_{k}", [], device=ctx.cluster.ps_device(shard["ps_task"]),
                       attrs={"dtype": var.attr["dtype"], "shape": shape_attr(shape),
                              "shared_name": f"{shared}/part_{k}", "container": var.attr["container"]})

    def _rewrite(self, graph, ctx, var, user, pos, handles, rows, starts, parts):
        op = user.op
        scope = f"{user.name}/sharded"
        dev = user.device
        if op == "ReadVariableOp":
            reads = [make_op(graph, "ReadVariableOp", f"{scope}/read_{k}", [h.output(0)],
                             attrs={"dtype": user.attr["dtype"]}, control_inputs=user.control_inputs).output(0)
                     for k, h in enumerate(handles)]
            whole = make_op(graph, "ConcatV2", f"{scope}/concat", [reads, const(graph, f"{scope}/axis", 0, "int32", dev)],
                            device=dev).output(0)
            _replace(graph, user, whole)
        elif op == "ResourceGather":
            ids = user.inputs[1]
            local, shard, positions, k = self._partition(graph, scope, ids, starts, dev)
            gathered = []
            for j, h in enumerate(handles):
                g = make_op(graph, "ResourceGather", f"{scope}/gather_{j}", [h.output(0), local.output(j)],
                            attrs={"dtype": user.attr["dtype"], "batch_dims": user.attr["batch_dims"],
                                   "validate_indices": user.attr["validate_indices"]})
                gathered.append(g.output(0))
            stitched = make_op(graph, "DynamicStitch", f"{scope}/stitch",
                               [[positions.output(j) for j in range(k)], gathered], device=dev).output(0)
            out_shape = make_op(graph, "ConcatV2", f"{scope}/out_shape",
                                [[make_op(graph, "Shape", f"{scope}/ids_shape", [ids], device=dev).output(0),
                                  const(graph, f"{scope}/row_shape", _row_shape(var), "int32", dev)],
                                 const(graph, f"{scope}/axis", 0, "int32", dev)], device=dev).output(0)
            _replace(graph, user, make_op(graph, "Reshape", f"{scope}/lookup", [stitched, out_shape], device=dev).output(0))
        elif op in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
            value = user.inputs[1]
            pieces = _split_rows(graph, scope, value, rows, dev)
            ops = [make_op(graph, op, f"{scope}/part_{j}", [h.output(0), p], attrs={"dtype": user.attr["dtype"]},
                           control_inputs=user.control_inputs) for j, (h, p) in enumerate(zip(handles, pieces))]
            _replace_with_group(graph, user, ops)
        elif op.startswith("ResourceScatter"):
            sl = opdefs.input_arg_slices(user)
            ids, updates = user.inputs[sl["indices"][0]], user.inputs[sl["updates"][0]]
            local, shard, positions, k = self._partition(graph, scope, ids, starts, dev)
            rows_of = make_op(graph, "DynamicPartition", f"{scope}/updates", [updates, shard.output(0)],
                              attrs={"num_partitions": k}, device=dev)
            ops = [make_op(graph, op, f"{scope}/part_{j}", [h.output(0), local.output(j), rows_of.output(j)],
                           control_inputs=user.control_inputs) for j, h in enumerate(handles)]
            _replace_with_group(graph, user, ops)
        elif op.startswith(("ResourceApply", "ResourceSparseApply")):
            self._rewrite_apply(graph, user, scope, rows, starts, parts, dev)
        elif op == "VarIsInitializedOp":
            each = [make_op(graph, "VarIsInitializedOp", f"{scope}/part_{j}", [h.output(0)]).output(0)
                    for j, h in enumerate(handles)]
            stacked = make_op(graph, "Pack", f"{scope}/stack", [each], device=dev).output(0)
            _replace(graph, user, make_op(graph, "All", f"{scope}/all",
                                          [stacked, const(graph, f"{scope}/axis", [0], "int32", dev)], device=dev).output(0))
        elif op == "VariableShape":
            full = [sum(rows)] + _row_shape(var)
            _replace(graph, user, const(graph, f"{scope}/shape", full, dtypes.as_dtype(user.attr["out_type"].type).name, dev))
        else:
            raise GraphRewriteError(
                f"cannot shard variable '{var.name}': it is used by '{user.name}' ({op})",
                hint="raise ps_shard_bytes above its size (or set it to 0) to keep it whole")

    def _rewrite_apply(self, graph, user, scope, rows, starts, parts, dev):
        """An optimizer update of a sharded variable and its slots: one update per part."""
        sparse = user.op.startswith("ResourceSparseApply")
        sl = opdefs.input_arg_slices(user)
        names = opdefs.input_arg_names(user)
        dts = opdefs.input_dtypes(user)
        if any(n.op != "VarHandleOp" for n in [user.inputs[i].node for i, dt in enumerate(dts) if dt == opdefs.DT_RESOURCE]):
            raise GraphRewriteError(f"cannot shard the variables of '{user.name}': a handle passes through other ops")
        grad_pos = sl["grad"][0] if "grad" in sl else sl["delta"][0]
        k = len(rows)
        if sparse:
            ids = user.inputs[sl["indices"][0]]
            local, shard, _, _ = self._partition(graph, scope, ids, starts, dev)
            grads = make_op(graph, "DynamicPartition", f"{scope}/grad", [user.inputs[grad_pos], shard.output(0)],
                            attrs={"num_partitions": k}, device=dev)
            grad_parts = [grads.output(j) for j in range(k)]
        else:
            grad_parts = _split_rows(graph, scope, user.inputs[grad_pos], rows, dev)
        ops = []
        for j in range(k):
            inputs = []
            for i, t in enumerate(user.inputs):
                if dts[i] == opdefs.DT_RESOURCE:
                    if t.node not in parts:
                        raise GraphRewriteError(
                            f"cannot shard '{t.node.name}' with '{user.name}': the plan shards only some of "
                            "its variables", hint="shard a variable together with its optimizer slots")
                    inputs.append(parts[t.node][j].output(0))
                elif i == grad_pos:
                    inputs.append(grad_parts[j])
                elif sparse and names[i] == "indices":
                    inputs.append(local.output(j))
                else:
                    inputs.append(t)
            node = graph.add_node(graph.unique_name(f"{scope}/part_{j}"), user.op, inputs=inputs,
                                  control_inputs=user.control_inputs, device="")
            for key, value in user.attr.items():
                node.set_attr(key, value)
            ops.append(node)
        _replace_with_group(graph, user, ops)

    def _partition(self, graph, scope, ids, starts, dev):
        """(local ids per part, part of each id, positions per part, part count)."""
        k = len(starts)
        idt = dtypes.as_dtype(dtype_of(ids)).name
        flat = make_op(graph, "Reshape", f"{scope}/ids", [ids, const(graph, f"{scope}/flat", [-1], "int32", dev)],
                       device=dev).output(0)
        column = make_op(graph, "ExpandDims", f"{scope}/ids_column",
                         [flat, const(graph, f"{scope}/last", -1, "int32", dev)], device=dev).output(0)
        above = make_op(graph, "GreaterEqual", f"{scope}/above",
                        [column, const(graph, f"{scope}/bounds", starts[1:], idt, dev)], device=dev).output(0)
        above = make_op(graph, "Cast", f"{scope}/above_int", [above], attrs={"DstT": dtypes.int32}, device=dev).output(0)
        shard = make_op(graph, "Sum", f"{scope}/part", [above, const(graph, f"{scope}/axis1", [1], "int32", dev)],
                        device=dev)
        offset = make_op(graph, "GatherV2", f"{scope}/offset",
                         [const(graph, f"{scope}/starts", starts, idt, dev), shard.output(0),
                          const(graph, f"{scope}/axis0", 0, "int32", dev)], device=dev).output(0)
        local_ids = make_op(graph, "Sub", f"{scope}/local_ids", [flat, offset], device=dev).output(0)
        local = make_op(graph, "DynamicPartition", f"{scope}/local", [local_ids, shard.output(0)],
                        attrs={"num_partitions": k}, device=dev)
        count = make_op(graph, "Size", f"{scope}/count", [flat], attrs={"out_type": dtypes.int32}, device=dev).output(0)
        order = make_op(graph, "Range", f"{scope}/order",
                        [const(graph, f"{scope}/zero", 0, "int32", dev), count,
                         const(graph, f"{scope}/one", 1, "int32", dev)], device=dev).output(0)
        positions = make_op(graph, "DynamicPartition", f"{scope}/positions", [order, shard.output(0)],
                            attrs={"num_partitions": k}, device=dev)
        return local, shard, positions, k


def _row_shape(var):
    return [d.size for d in var.attr["shape"].shape.dim][1:]


def _split_rows(graph, scope, value, rows, dev):
    split = make_op(graph, "SplitV", f"{scope}/rows",
                    [value, const(graph, f"{scope}/sizes", rows, "int64", dev),
                     const(graph, f"{scope}/split_axis", 0, "int32", dev)],
                    attrs={"num_split": len(rows)}, device=dev)
    return [split.output(j) for j in range(len(rows))]


def _replace(graph, old, new_tensor):
    """``old`` (one output) is replaced by ``new_tensor`` everywhere and removed; the new
    node takes its name, so fetching the original tensor name still works."""
    name = old.name
    graph.replace_all_uses(old.output(0), new_tensor)
    if old.control_consumers:
        graph.replace_control_uses(old, new_tensor.node)
    graph.remove_node(old)
    if new_tensor.index == 0:
        graph.rename_node(new_tensor.node, name)


def _replace_with_group(graph, old, ops):
    """An op without outputs becomes a NoOp of the same name running ``ops``."""
    name = old.name
    group = graph.add_node(graph.unique_name(f"{name}/group"), "NoOp", control_inputs=ops)
    graph.replace_control_uses(old, group)
    if old.consumers():
        raise GraphRewriteError(f"cannot shard: '{name}' ({old.op}) has outputs read by other ops")
    graph.remove_node(old)
    graph.rename_node(group, name)
