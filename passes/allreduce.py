"""allreduce: average dense gradients across replicas with one collective per pack.

Per replica, for each pack of same-dtype gradients (the plan's packs, in the order
backprop produces them):

    g1 ─> Reshape[-1] ─┐
    g2 ─> Reshape[-1] ─┴─> ConcatV2 ─> [Cast fp16] ─> CollectiveReduceV2(Add, Div)
        ─> [Cast back] ─> SplitV ─> Reshape(shape of g1) ─> g1's readers
                                 └> Reshape(shape of g2) ─> g2's readers

Each pack's collective waits for the previous pack's, so every replica issues them in
the same order (NCCL requires it), while later packs' gradients are still computed.
Packs of different train ops (a GAN's, run at different steps) form chains of their own:
running one train op must not wait for the other's gradients.

A pack the plan makes "hierarchical" is averaged in two levels instead of one ring:

    packed ─> CollectiveReduceV2 within the worker (mean of its d replicas)
      worker's first replica: ─> CollectiveReduceV2 across the workers' first replicas
                                 (mean of the means) ─> CollectiveBcastSendV2 within the worker
      the others:              ─> CollectiveBcastRecvV2 within the worker

so only one replica per machine talks across machines. Every worker has the same number
of replicas, so the mean of the workers' means is the mean over every replica.

A pack the plan makes "reduce_to_one" (every replica in one worker) has no collective:

    every replica's packed ─> AddN (one node, on replica p mod R's device) ─> Div(R)
        ─> each replica's [Cast back] ─> SplitV ─> Reshape ─> its readers

TensorFlow copies a pack between devices where it must; CPU devices of one process share
memory, so there the sum is one pass over the packs and the mean is computed once, not
once per replica (tf.distribute's ReductionToOneDevice, and tf_cnn_benchmarks'
replicated mode on CPU, do the same).
Sparse gradients planned as "allreduce" (sparse_as_dense) are first scattered into a
dense tensor of the variable's shape and handed back as (every row, row ids).
BatchNorm moving statistics and other batch-dependent state updates are packed and
averaged the same way, except sums and counts over the batch (plan: ``combine="sum"``,
such as a count of examples, or tf.metrics' running totals), which are summed: the
replicas' sums add up to one device's.
"""

from graph_rewriter import dtypes
from graph_rewriter.analysis import statistic_update_readers
from graph_rewriter.collectives import (all_reduce_mean, broadcast_recv, broadcast_send, dense_instance_key,
                                        group_key, hierarchical_instance_keys, worker_groups)
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import readers_of_indices

_COMPRESS = {"fp16": "float16", "bf16": "bfloat16"}


class AllReducePass(Pass):
    name = "allreduce"
    requires = frozenset({"plan", "replicas"})
    # it reduces the micro-batch mean micro_batches reroutes to, and a statistic of a
    # loss sum as loss_sums scales it
    after = frozenset({"micro_batches", "loss_sums"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.packs)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        if rm.group_size == 1 or not plan.packs:
            return False
        gkey = group_key(rm.group_devices)
        cuts = {c.key: c for c in plan.cuts}
        memo = _Memo()   # this run's shared nodes (the pass itself keeps nothing)
        for p, pack in enumerate(plan.packs):   # one node sums every replica's pack
            if pack.algorithm == "reduce_to_one":
                members = [cuts[v] for v in pack.cuts]
                packed = {i: self._pack(graph, ctx, memo, i, p, members) for i in rm.built}
                mean = _mean_on_one_device(graph, ctx, p, [packed[i][0] for i in rm.built], _summed(pack, cuts))
                for i in rm.built:
                    with graph.adding_to_replica(i):   # it reads the global mean only
                        self._unpack(graph, ctx, memo, i, p, members, mean, *packed[i][1:])
        for i in rm.built:
            previous = {}   # per train op: a GAN's two train ops each run their own packs
            for p, pack in enumerate(plan.packs):
                if pack.algorithm == "reduce_to_one":
                    continue
                members = [cuts[v] for v in pack.cuts]
                train_ops = tuple(members[0].train_ops or ())
                packed, sizes, readers, compressed = self._pack(graph, ctx, memo, i, p, members)
                final_op = "Id" if _summed(pack, cuts) else "Div"
                reduced = previous[train_ops] = self._reduce(graph, ctx, i, p, packed, sum(sizes), compressed,
                                                             gkey, previous.get(train_ops), final_op)
                self._unpack(graph, ctx, memo, i, p, members, reduced.output(0), sizes, readers, compressed)
        return True

    def _pack(self, graph, ctx, memo, i, p, cuts):
        """Replica ``i``'s gradients of pack ``p`` as one flat tensor (cast down if the
        rewrite compresses), with what ``_unpack`` needs: their sizes, their readers, and
        whether the pack was cast."""
        rm = ctx.replicas
        device = rm.devices[i]
        scope = f"{rm.prefixes[i]}allreduce/pack_{p}"
        flats, sizes, readers = [], [], []
        for cut in cuts:
            values = rm.tensor(graph, i, cut.values)
            if cut.kind == "sparse":
                indices = rm.tensor(graph, i, cut.indices)
                readers.append((values.node.consumers(values.index), readers_of_indices(indices, values)))
                values = self._densify(graph, f"{scope}/{cut.variable}", cut, values, indices, device)
            elif cut.role == "state":
                # found on replica 0, mapped to replica i's clones (the same structure)
                master = memo.state_readers.get(cut.key)
                if master is None:
                    master_values = rm.tensor(graph, 0, cut.values)
                    master = memo.state_readers[cut.key] = [
                        (c.name, p) for c, p in statistic_update_readers(master_values, cut.variables)]
                readers.append(([(rm.node(graph, i, name), p) for name, p in master], None))
            else:
                readers.append((values.node.consumers(values.index), None))
            n = _num_elements(cut.shape)
            if n is None:
                raise GraphRewriteError(
                    f"variable '{cut.variable}' has no static shape, which allreduce packing needs",
                    hint="give the variable a fully defined shape")
            sizes.append(n)
            flat = make_op(graph, "Reshape", f"{scope}/flat", [values, memo.const(graph, rm, i, [-1], "int32", device)],
                           device=device)
            flats.append(flat.output(0))
        packed = flats[0] if len(flats) == 1 else make_op(
            graph, "ConcatV2", f"{scope}/concat", [flats, memo.const(graph, rm, i, 0, "int32", device)],
            device=device).output(0)
        wire = dtypes.as_dtype(cuts[0].dtype)
        compressed = bool(ctx.options.compression and wire.is_floating and wire.size > 2)
        if compressed:
            packed = make_op(graph, "Cast", f"{scope}/compress", [packed],
                             attrs={"DstT": dtypes.as_dtype(_COMPRESS[ctx.options.compression])},
                             device=device).output(0)
        return packed, sizes, readers, compressed

    def _reduce(self, graph, ctx, i, p, packed, size, compressed, gkey, previous, final_op):
        """Replica ``i``'s collective mean of its pack (``final_op`` "Id": sum): the node
        whose output 0 is the result."""
        rm = ctx.replicas
        device = rm.devices[i]
        scope = f"{rm.prefixes[i]}allreduce/pack_{p}"
        controls = [previous] if previous is not None else []
        if ctx.plan.packs[p].algorithm == "hierarchical":
            wire = dtypes.as_dtype(ctx.plan.packs[p].dtype)
            wire_dtype = dtypes.as_dtype(_COMPRESS[ctx.options.compression]) if compressed else wire
            return _two_level_mean(graph, ctx, i, p, scope, packed, size, wire_dtype, device, controls, final_op)
        return all_reduce_mean(graph, scope, packed, rm.group_size, gkey, dense_instance_key(ctx.plan, p), device,
                               control_inputs=controls, final_op=final_op)

    def _unpack(self, graph, ctx, memo, i, p, cuts, out, sizes, readers, compressed):
        """Hands replica ``i``'s readers of the pack's gradients their slices of the mean ``out``."""
        rm = ctx.replicas
        device = rm.devices[i]
        scope = f"{rm.prefixes[i]}allreduce/pack_{p}"
        if compressed:
            out = make_op(graph, "Cast", f"{scope}/decompress", [out], attrs={"DstT": dtypes.as_dtype(cuts[0].dtype)},
                          device=device).output(0)
        if len(cuts) > 1:
            split = make_op(graph, "SplitV", f"{scope}/split",
                            [out, const(graph, f"{scope}/sizes", sizes, "int64", device),
                             memo.const(graph, rm, i, 0, "int32", device)],
                            attrs={"num_split": len(cuts)}, device=device)
            parts = [split.output(k) for k in range(len(cuts))]
        else:
            parts = [out]
        for cut, part, (value_readers, index_readers) in zip(cuts, parts, readers):
            shaped = make_op(graph, "Reshape", f"{scope}/{cut.key}/mean",
                             [part, memo.const(graph, rm, i, cut.shape, "int64", device)],
                             device=device).output(0)
            for c, pos in value_readers:
                c.set_input(pos, shaped)
            if index_readers is not None:
                rows = make_op(graph, "Range", f"{scope}/{cut.variable}/rows",
                               [memo.const(graph, rm, i, 0, _index_dtype(graph, rm, i, cut), device),
                                memo.const(graph, rm, i, cut.shape[0], _index_dtype(graph, rm, i, cut), device),
                                memo.const(graph, rm, i, 1, _index_dtype(graph, rm, i, cut), device)],
                               device=device).output(0)
                for c, pos in index_readers:
                    c.set_input(pos, rows)

    def _densify(self, graph, scope, cut, values, indices, device):
        """The dense gradient of the rows: duplicates summed, untouched rows zero."""
        if not cut.shape or cut.shape[0] < 0:
            raise GraphRewriteError(
                f"sparse_as_dense needs the row count of variable '{cut.variable}', which is not static")
        return make_op(graph, "UnsortedSegmentSum", f"{scope}/densify",
                       [values, indices, const(graph, f"{scope}/num_rows", cut.shape[0], "int64", device)],
                       device=device).output(0)


def _summed(pack, cuts):
    """A pack of sums or counts over the batch (the planner packs them apart) is summed,
    not averaged."""
    return cuts[pack.cuts[0]].combine == "sum"


def _mean_on_one_device(graph, ctx, p, packed, summed=False):
    """Pack ``p``'s mean over every replica, computed once on one replica's device: an
    AddN of every replica's pack, divided by the replica count. Each replica reads it
    from there (TensorFlow's own copy between devices; none between CPU devices of one
    process, which share memory). The packs take turns among the replicas' devices, so
    GPUs share the summing. With template replicas the AddN lists replicas 0 and 1; the
    export lists every replica (replica_export)."""
    rm = ctx.replicas
    device = rm.devices[p % rm.num_local]
    scope = f"allreduce/pack_{p}"
    total = make_op(graph, "AddN", f"{scope}/sum", [packed], device=device, replica=GLOBAL)
    if summed:
        return total.output(0)
    dtype = dtypes.as_dtype(dtype_of(packed[0])).name
    count = const(graph, f"{scope}/replicas", rm.group_size, dtype, device, replica=GLOBAL)
    return make_op(graph, "Div", f"{scope}/mean",   # the collectives' final_op, for the same rounding
                   [total.output(0), count], device=device, replica=GLOBAL).output(0)


def _two_level_mean(graph, ctx, i, p, scope, packed, size, dtype, device, controls, final_op="Div"):
    """The hierarchical pack's mean (``final_op="Id"``: sum) on local replica ``i``
    (module doc): the node whose output 0 is the mean over every replica."""
    rm, plan = ctx.replicas, ctx.plan
    d = plan.devices_per_worker
    within, leaders = worker_groups(rm.group_devices, d)
    rank = rm.first_replica + i
    local = within[rank // d]
    reduce_key, broadcast_key = hierarchical_instance_keys(plan, p)
    local_mean = all_reduce_mean(graph, f"{scope}/within", packed, d, group_key(local), reduce_key, device,
                                 control_inputs=controls, final_op=final_op)
    if rank % d:
        return broadcast_recv(graph, f"{scope}/back", [size], dtype, d, group_key(local), broadcast_key, device,
                              control_inputs=[local_mean])
    mean = all_reduce_mean(graph, f"{scope}/across", local_mean.output(0), len(leaders), group_key(leaders),
                           dense_instance_key(plan, p), device, final_op=final_op)
    return broadcast_send(graph, f"{scope}/back", mean.output(0), d, group_key(local), broadcast_key, device)


class _Memo:
    """What one run of the pass shares between replicas and packs."""

    def __init__(self):
        self.state_readers = {}   # variable -> [(reader name, position)] of replica 0
        self.consts = {}

    def const(self, graph, rm, i, value, dtype, device):
        """One Const per replica and value: every gradient's flattening reads the same
        [-1], and gradients of one shape the same shape (fewer nodes to place and export)."""
        key = (i, dtype, repr(value))
        t = self.consts.get(key)
        if t is None:
            t = self.consts[key] = const(graph, f"{rm.prefixes[i]}allreduce/const", value, dtype, device)
        return t


def _index_dtype(graph, rm, i, cut):
    return dtypes.as_dtype(dtype_of(rm.tensor(graph, i, cut.indices))).name


def _num_elements(shape):
    if shape is None or any(d < 0 for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n
