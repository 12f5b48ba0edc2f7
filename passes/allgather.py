"""allgather: average sparse gradients (IndexedSlices) by gathering rows, not densifying.

Per replica and sparse gradient (values [n_i, ...], indices [n_i]):

    (local dedup: Unique + UnsortedSegmentSum, when the update is a linear scatter)
    n_i ─> CollectiveGatherV2 ─> sizes[R] ─> max
    values, indices ─> Pad to max rows ─> CollectiveGatherV2 ─> keep the real rows
        ─> values / R ─> (global dedup: Unique + UnsortedSegmentSum) ─> the update

Replicas may hold different numbers of rows: CollectiveGatherV2 needs equal shapes, so
rows are padded to the largest count rounded up to a power of two, gathered under the
instance key of that power (TensorFlow pins each key to the first shape it sees; see
graph_rewriter.collectives), and the padding is dropped after. Duplicate ids across
replicas are summed again after the gather when the optimizer had deduplicated (its
update is not linear: Adagrad, Ftrl, Adam), giving exactly the one-device update.
An optimizer that did not deduplicate keeps every row, in replica order.
"""

from graph_rewriter import dtypes
from graph_rewriter.collectives import SPARSE_BUCKETS, all_gather, group_key, sparse_instance_keys
from graph_rewriter.op_builder import const, dedup_rows, dtype_of, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import readers_of_indices


class AllGatherPass(Pass):
    name = "allgather"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"micro_batches"})   # it gathers the micro-batch rows micro_batches reroutes to

    def applies(self, ctx):
        return ctx.num_replicas > 1 and any(c.sync == "allgather" for c in ctx.plan.cuts)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        gathered = [c for c in plan.cuts if c.sync == "allgather"]
        if rm.group_size == 1 or not gathered:
            return False
        gkey = group_key(rm.group_devices)
        for k, cut in enumerate(gathered):
            keys = sparse_instance_keys(plan, k)
            for i in rm.built:
                self._gather(graph, ctx, i, cut, gkey, keys)
        return True

    def _gather(self, graph, ctx, i, cut, gkey, keys):
        rm = ctx.replicas
        dev = rm.devices[i]
        r = rm.group_size
        s = f"{rm.prefixes[i]}allgather/{cut.variable}"
        values = rm.tensor(graph, i, cut.values)
        indices = rm.tensor(graph, i, cut.indices)
        # Readers that help compute the values themselves (the optimizer's deduplication
        # reads Shape(unique indices) for its segment count) keep the local tensor.
        value_readers = values.node.consumers(values.index)
        index_readers = readers_of_indices(indices, values)
        vdt = dtypes.as_dtype(dtype_of(values))
        dedup_after = cut.deduplicated or cut.linear
        if cut.linear and not cut.deduplicated:
            values, indices = dedup_rows(graph, f"{s}/local_dedup", values, indices, dev)

        def c(name, value, dtype):
            return const(graph, f"{s}/{name}", value, dtype, dev)

        count = make_op(graph, "Size", f"{s}/rows", [indices], attrs={"out_type": dtypes.int64}, device=dev)
        count = make_op(graph, "Reshape", f"{s}/rows_vector", [count.output(0), c("one_shape", [1], "int32")], device=dev)
        sizes = all_gather(graph, f"{s}/sizes", count.output(0), r, gkey, keys[0], dev)
        most = make_op(graph, "Max", f"{s}/max_rows", [sizes.output(0), c("axis0", [0], "int32")], device=dev)
        # bucket = how many powers of two lie below the largest count; pad to 2**bucket.
        powers = [1 << b for b in range(SPARSE_BUCKETS)]
        above = make_op(graph, "Greater", f"{s}/above_powers", [most.output(0), c("powers", powers, "int64")], device=dev)
        above = make_op(graph, "Cast", f"{s}/above_powers_int", [above.output(0)], attrs={"DstT": dtypes.int32}, device=dev)
        bucket = make_op(graph, "Sum", f"{s}/bucket", [above.output(0), c("axis0b", [0], "int32")], device=dev).output(0)
        capacity = make_op(graph, "GatherV2", f"{s}/padded_rows",
                           [c("powers_b", powers, "int64"), bucket, c("gaxis0", 0, "int32")], device=dev)
        value_key = make_op(graph, "AddV2", f"{s}/values_key", [c("values_key0", keys[1], "int32"), bucket], device=dev).output(0)
        index_key = make_op(graph, "AddV2", f"{s}/indices_key", [c("indices_key0", keys[2], "int32"), bucket], device=dev).output(0)
        missing = make_op(graph, "Sub", f"{s}/pad_rows", [capacity.output(0), count.output(0)], device=dev)
        pad_row = make_op(graph, "ConcatV2", f"{s}/pad_row",
                          [[c("zero_vec", [0], "int64"), missing.output(0)], c("axis", 0, "int32")], device=dev)
        pad_row = make_op(graph, "Reshape", f"{s}/pad_row_2d", [pad_row.output(0), c("row_shape", [1, 2], "int32")], device=dev)
        rank = len(cut.shape) if cut.shape is not None else 2
        value_pads = pad_row if rank == 1 else make_op(
            graph, "ConcatV2", f"{s}/value_paddings",
            [[pad_row.output(0), c("no_pad", [[0, 0]] * (rank - 1), "int64")], c("axis_b", 0, "int32")], device=dev)
        padded_values = make_op(graph, "Pad", f"{s}/pad_values", [values, value_pads.output(0)], device=dev)
        padded_indices = make_op(graph, "Pad", f"{s}/pad_indices", [indices, pad_row.output(0)], device=dev)
        all_values = all_gather(graph, f"{s}/values", padded_values.output(0), r, gkey, value_key, dev)
        all_indices = all_gather(graph, f"{s}/indices", padded_indices.output(0), r, gkey, index_key, dev)
        # Rows to keep: row j of replica q is real if j < sizes[q].
        positions = make_op(graph, "Range", f"{s}/positions",
                            [c("zero", 0, "int64"), capacity.output(0), c("step", 1, "int64")], device=dev)
        pos_row = make_op(graph, "ExpandDims", f"{s}/positions_row", [positions.output(0), c("dim0", 0, "int32")], device=dev)
        size_col = make_op(graph, "ExpandDims", f"{s}/sizes_col", [sizes.output(0), c("dim1", 1, "int32")], device=dev)
        real = make_op(graph, "Less", f"{s}/real_rows", [pos_row.output(0), size_col.output(0)], device=dev)
        real = make_op(graph, "Reshape", f"{s}/real_rows_flat", [real.output(0), c("flat", [-1], "int32")], device=dev)
        where = make_op(graph, "Where", f"{s}/real_positions", [real.output(0)], device=dev)
        keep = make_op(graph, "Reshape", f"{s}/keep", [where.output(0), c("flat_b", [-1], "int32")], device=dev)
        kept_values = make_op(graph, "GatherV2", f"{s}/kept_values",
                              [all_values.output(0), keep.output(0), c("gaxis", 0, "int32")], device=dev)
        kept_indices = make_op(graph, "GatherV2", f"{s}/kept_indices",
                               [all_indices.output(0), keep.output(0), c("gaxis_b", 0, "int32")], device=dev)
        mean = make_op(graph, "RealDiv", f"{s}/mean",
                       [kept_values.output(0), c("replicas", r, vdt.name)], device=dev).output(0)
        out_indices = kept_indices.output(0)
        if dedup_after:
            mean, out_indices = dedup_rows(graph, f"{s}/global_dedup", mean, out_indices, dev)
        for node, pos in value_readers:
            node.set_input(pos, mean)
        for node, pos in index_readers:
            node.set_input(pos, out_indices)
