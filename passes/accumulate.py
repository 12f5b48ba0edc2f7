"""accumulate: average parameter-server gradients in accumulators on the variable's ps.

    replica i: grad_i ─> AccumulatorApplyGradient(acc, local_step, grad_i)   (every replica)
    ps:        AccumulatorTakeGradient(acc, num_required=R) ─> the optimizer's update
               (once; the original apply op now reads the average)

Dense gradients use a ConditionalAccumulator (reduction MEAN). Sparse gradients use a
SparseConditionalAccumulator with reduction SUM, fed rows each replica has already
deduplicated and sorted by row id; the take is divided by R. (With MEAN, TensorFlow
divides each row by the number of replicas that touched it, which is not the mean
gradient; and it merges the rows of different replicas by a sorted merge, so unsorted
ids would leave one row twice in the result.)

Accumulators drop gradients whose local step is older than their own: every replica
tags its gradient with ``graph_rewriter/sync_step``, a counter on the first ps task that
this pass increments once per applied step, after the updates. Accumulators and the
counter have shared_names derived from the graph's fingerprint, so every worker's graph
of a between-graph run uses the same ones.

Asynchronous training (sync=False) uses no accumulator: each replica applies its own
gradient to the shared variables.
"""

from tensorflow.python.framework import dtypes

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.op_builder import const, dedup_rows, dtype_of, make_op, run_after, shape_attr
from graph_rewriter.pass_manager import Pass
from graph_rewriter.ps_state import ACCUMULATORS, COUNTER, INCREMENT, shared_name
from graph_rewriter.traversal import descendants, reaches


class AccumulatePass(Pass):
    name = "accumulate"
    requires = frozenset({"replicated", "plan"})
    ensures = frozenset({"ps_synced"})

    def run(self, graph, ctx):
        plan = ctx.plan
        cuts = [c for c in plan.cuts if c.sync == "accumulate"]
        if not cuts or not plan.sync:
            return False
        rm = graph.replicas
        ps0 = ctx.cluster.ps_device(0)
        counter = make_op(graph, "VarHandleOp", COUNTER, [],
                          attrs={"dtype": dtypes.int64, "shape": shape_attr([]),
                                 "shared_name": shared_name(plan.fingerprint, "sync_step")}, device=ps0)
        counter_init = make_op(graph, "AssignVariableOp", f"{COUNTER}/initial_value",
                               [counter.output(0), const(graph, f"{COUNTER}/zero", 0, "int64", ps0)],
                               device=ps0)
        for init_op in init_ops(graph, plan):
            init_op.add_control_input(counter_init)
        local_step = make_op(graph, "ReadVariableOp", f"{COUNTER}/read", [counter.output(0)],
                             attrs={"dtype": dtypes.int64}, device=ps0).output(0)
        takes = [self._accumulate(graph, ctx, cut, local_step) for cut in cuts]
        # The step is applied when every global op downstream of the takes has run: the
        # optimizer's update ops and the optimizer math between (Adam's scatter path
        # reads the take through a Mul before it writes anything).
        after = descendants(takes)
        updates = [n for n in graph if n in after and rm.replica_of(graph, n.name) is None]
        roots = [n for n in graph if n in after and not n._consumers and not n._control_consumers]
        increment = make_op(graph, "AssignAddVariableOp", INCREMENT,
                            [counter.output(0), const(graph, f"{COUNTER}/one", 1, "int64", ps0)],
                            control_inputs=takes + updates, device=ps0)
        # The train op (a root after the updates) keeps its name and now also bumps the
        # counter once everything it ran is done.
        for root in roots:
            run_after(graph, root, [increment])
        return True

    def _accumulate(self, graph, ctx, cut, local_step):
        rm, plan = graph.replicas, ctx.plan
        var = plan.variable(cut.variable)
        task = var.ps_task if var.ps_task is not None else (var.shards[0]["ps_task"] if var.shards else 0)
        dev = ctx.cluster.ps_device(task)
        scope = f"{ACCUMULATORS}/{cut.variable}"
        dtype = dtypes.as_dtype(cut.dtype)
        sparse = cut.kind == "sparse"
        acc = make_op(graph, "SparseConditionalAccumulator" if sparse else "ConditionalAccumulator",
                      scope, [], device=dev,
                      attrs={"dtype": dtype, "shape": shape_attr(cut.shape),
                             "shared_name": shared_name(plan.fingerprint, f"{cut.variable}/gradients"),
                             "reduction_type": "SUM" if sparse else "MEAN"})
        applies = []
        for i in range(rm.num_local):
            values = rm.tensor(graph, i, cut.values)
            s = f"{rm.prefixes[i]}{scope}/apply"
            if not sparse:
                applies.append(make_op(graph, "AccumulatorApplyGradient", s,
                                       [acc.output(0), local_step, values], device=dev))
                continue
            indices = rm.tensor(graph, i, cut.indices)
            if not cut.deduplicated:
                values, indices = dedup_rows(graph, f"{s}/dedup", values, indices, rm.devices[i])
            idx64 = make_op(graph, "Cast", f"{s}/indices", [indices], attrs={"DstT": dtypes.int64},
                            device=rm.devices[i]).output(0)
            idx64, values = _sorted_rows(graph, f"{s}/sorted", idx64, values, rm.devices[i])
            if cut.shape is None or any(d < 0 for d in cut.shape):
                raise GraphRewriteError(f"variable '{cut.variable}' needs a static shape for a sparse accumulator")
            applies.append(make_op(graph, "SparseAccumulatorApplyGradient", s,
                                   [acc.output(0), local_step, idx64, values,
                                    const(graph, f"{s}/shape", cut.shape, "int64", dev)],
                                   attrs={"has_known_shape": True}, device=dev))
        r = const(graph, f"{scope}/num_required", rm.group_size, "int32", dev)
        master_values = rm.tensor(graph, 0, cut.values)
        if not sparse:
            take = make_op(graph, "AccumulatorTakeGradient", f"{scope}/take", [acc.output(0), r],
                           type_attrs={"dtype": dtype}, control_inputs=applies, device=dev)
            _rewire(graph, master_values, take.output(0))
            return take
        take = make_op(graph, "SparseAccumulatorTakeGradient", f"{scope}/take", [acc.output(0), r],
                       type_attrs={"dtype": dtype}, control_inputs=applies, device=dev)
        mean = make_op(graph, "RealDiv", f"{scope}/mean",
                       [take.output(1), const(graph, f"{scope}/replicas", rm.group_size, dtype.name, dev)],
                       device=dev).output(0)
        master_indices = rm.tensor(graph, 0, cut.indices)
        # the deduplication's Shape(unique ids) reads the ids to compute the values: not a reader to move
        keep = {c for c, _ in master_indices.node.consumers(master_indices.index) if reaches(c, master_values.node)}
        index_dtype = dtypes.as_dtype(dtype_of(master_indices))
        indices = take.output(0)
        if index_dtype != dtypes.int64:
            indices = make_op(graph, "Cast", f"{scope}/indices", [indices], attrs={"DstT": index_dtype},
                              device=dev).output(0)
        _rewire(graph, master_values, mean)
        _rewire(graph, master_indices, indices, keep)
        return take


def _sorted_rows(graph, scope, indices, values, dev):
    """(indices, values) ordered by ascending row id (TopK of the negated ids)."""
    count = make_op(graph, "Size", f"{scope}/count", [indices], attrs={"out_type": dtypes.int32}, device=dev)
    negated = make_op(graph, "Neg", f"{scope}/negated", [indices], device=dev)
    order = make_op(graph, "TopKV2", f"{scope}/order", [negated.output(0), count.output(0)],
                    attrs={"sorted": True}, device=dev).output(1)
    axis = const(graph, f"{scope}/axis", 0, "int32", dev)
    return (make_op(graph, "GatherV2", f"{scope}/indices", [indices, order, axis], device=dev).output(0),
            make_op(graph, "GatherV2", f"{scope}/values", [values, order, axis], device=dev).output(0))


def _rewire(graph, tensor, replacement, keep=()):
    """The global readers of a replica-0 gradient (the optimizer's update) read the
    accumulated one instead; readers inside the replicas keep their own."""
    rm = graph.replicas
    changed = []
    for c, pos in tensor.node.consumers(tensor.index):
        if rm.replica_of(graph, c.name) is None and c is not replacement.node and c not in keep:
            c.set_input(pos, replacement)
            changed.append(c)
    return changed


def init_ops(graph, plan):
    """The graph's init NoOps: those running a variable initializer."""
    out = {}
    for vp in plan.variables:
        if vp.initializer and vp.initializer in graph:
            for c in graph.node(vp.initializer).control_consumers:
                if c.op == "NoOp" and graph.replicas.replica_of(graph, c.name) in (0, None):
                    out[c] = None
    return list(out)
