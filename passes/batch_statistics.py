"""batch_statistics: synchronised batch statistics, one device's BatchNorm on R replicas.

A BatchNorm in training mode normalises with the mean and variance of its batch. Each
replica computes them over its own shard, so without this pass R replicas normalise
with R different statistics (the plan's notes say so). With the option
sync_batch_statistics the statistics the plan lists (plan.sync_batch_statistics, found
by the analysis) are all-reduced over every replica's rows, forward and backward.

A statistic that is a Mean over the rows (tf.nn.moments, a BatchNorm written by hand): one
device's is Σ_r C_r m_r / Σ_r C_r for the replicas' counts C_r and means m_r. With
f_r = C_r / C̄ (C̄ their mean, one all-reduce of C_r), that is the replicas' mean of
f_r m_r:

    forward:   Mean ─> MulNoNan(·, f_r) ─> CollectiveReduceV2(Add, Div) ─> what read it
    backward:  dL/dMean ─> CollectiveReduceV2(Add, Div) ─> × f_r ─> Mean_grad

Replica r's backward pass must hold R times one device's gradient for its rows (the
replicas' gradients are averaged), and the gradient of the all-reduced mean is the
replicas' mean of theirs, so its entry is all-reduced too. The all-reduce takes the
statistic's name; the Mean is renamed ``<name>/replica_rows``. With tf.nn.moments the
variance, a Mean of the squared distances to the synced mean, is then one device's too.

A sum over the rows (a Sum, a MatMul contracting them: Barlow Twins' C = z_a^T z_b / n):
one device's is the replicas' sum, whatever their counts:

    forward:   Sum ─> CollectiveReduceV2(Add, Id) ─> what read it
    backward:  dL/dSum ─> CollectiveReduceV2(Add, Id) ─> Sum_grad

One device divides it by the whole batch's count of rows, a replica's tf.shape(h)[0]
counts its own: where a value of the sum alone meets such a count (plan.synced_row_counts,
found by the analysis), that op and its backward pass read a copy of the count's ops
whose Shape's first element (or Size) is summed over the replicas, as float64.

A FusedBatchNorm in training mode computes its statistics inside one kernel, and its
backward, FusedBatchNormGrad, reads them from the forward's reserve spaces: both are
replaced by their ops, the statistics and the two means of the backward all-reduced
(x̂ = (x - m) / √(v + ε), with m, v all-reduced as above; dx = γ / √(v + ε) · (dy -
mean(dy) - x̂ · mean(dy · x̂)), the two means all-reduced; dγ = Σ dy · x̂ and dβ = Σ dy
over the replica's rows, averaged with the other gradients). An IdentityN takes each
fused op's name, so every reader of an output (the moving averages' updates read the
batch mean and Bessel-corrected variance, the optimizer reads dγ and dβ) reads the same
output index of the same name.

Order: every replica issues its collectives in one order (NCCL needs it): the forward
ones in a chain, the backward ones in a chain per gradients scope (a train op runs its
own backward pass only), each in the topological order of replica 0.
"""

import re

from graph_rewriter import dtypes
from graph_rewriter.analysis import (BATCH_NORM_AXES, FUSED_BATCH_NORM_GRADS, dead_zeros_like, gradient_entries,
                                     gradient_scopes)
from graph_rewriter.collectives import all_reduce, counted_down_start, group_key, normalizer_instance_key
from graph_rewriter.ir import Tensor
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import topological_order, unread_ancestors

_SHAPE_READERS = frozenset(("Shape", "ShapeN", "Size", "Rank"))
_GRADIENTS = re.compile(r"^(?:.*/)?gradients(?:_\d+)?/")
# statistics synced by summing the replicas' (a segment sum's and a bincount's of a
# fixed size, which the analysis checks)
SUMMED = ("Sum", "MatMul", "UnsortedSegmentSum", "DenseBincount", "Bincount")
EXTREMES = ("Max", "Min")   # synced by the replicas' maximum or minimum: no gradient goes through them
FORWARD = ""   # the forward chain's name; a backward chain is named by its gradients scope


class BatchStatisticsPass(Pass):
    name = "batch_statistics"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"normalizers"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.sync_batch_statistics)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        names = plan.sync_batch_statistics or []
        if rm.group_size == 1 or not names:
            return False
        statistics = {name: rm.node(graph, 0, name) for name in names
                      if rm.node(graph, 0, name).op in ("Mean",) + SUMMED}
        mine = [n for n in graph.nodes if "_grad/" in n.name and rm.replica_of(graph, n.name) == 0]
        entries = gradient_entries(mine, statistics) if statistics else {}
        counts = [(op, pos, reads, _gradient_readers(mine, rm.node(graph, 0, op), pos))
                  for op, pos, reads in plan.synced_row_counts or []]
        first_key = counted_down_start(plan, "sync_batch_statistics")
        syncs = [_Sync(graph, rm, i, plan, group_key(rm.group_devices), first_key) for i in rm.built]
        for sync in syncs:
            with graph.adding_to_replica(sync.i):
                for name in names:
                    node = rm.node(graph, sync.i, name)
                    at = [(rm.node(graph, sync.i, reader.name), pos) for _, (reader, pos) in entries.get(name, [])]
                    if node.op == "Mean":
                        sync.mean(node, at)
                    elif node.op in SUMMED:
                        sync.summed(node, at)
                    elif node.op in EXTREMES:
                        sync.extreme(node)
                    else:
                        sync.fused_batch_norm(node)
                sync.whole_counts(counts)
        _chain(graph, syncs)
        replaced = [n for sync in syncs for n in sync.replaced]
        unread = _unread_reads(replaced) + _unread_counts([n for sync in syncs for n in sync.counted])
        graph.remove_nodes(replaced + unread)
        for phase in (0, 1):   # the statistics leave their names, then their replacements take them
            graph.rename_nodes({n: new for sync in syncs for n, new in sync.renames[phase]})
        graph.touch()
        return True


def _unread_reads(replaced):
    """The reads (ReadVariableOp, Identity) that only the ``replaced`` ops read, now read by
    nobody: a FusedBatchNorm in training mode takes the moving averages as inputs and
    ignores them. Left, such a read is a root of the graph, and a control input on it (a
    script ordering its second application of a BatchNorm after the first's updates)
    would make it run one replica's synced update alone."""
    return unread_ancestors([t.node for n in replaced for t in n.inputs], set(replaced),
                   lambda n: n.op in ("ReadVariableOp", "Identity"))


def _gradient_readers(nodes, op, pos):
    """[(name, position)]: the inputs of ``op``'s backward pass (among ``nodes``) that
    read its input ``pos``, as RealDiv's gradient reads the divisor."""
    tensor = op.inputs[pos]
    return [(n.name, k) for members in gradient_scopes(nodes, {op.name: op}).values()
            for n in members for k, t in enumerate(n.inputs) if t == tensor]


def _unread_counts(counts):
    """The replica's counts of rows (and the ops they alone read, up to the batch's
    shape) that nobody reads once a synced sum and its backward read the whole count:
    left, such a count is a root of the graph, and one computed after a synced statistic
    (the rows of a normalised embedding) would run one replica's collectives alone."""
    return unread_ancestors(counts, (), lambda n: n.op not in _SHAPE_READERS)


def _chain(graph, syncs):
    """Every replica's collectives, chain by chain, in replica 0's topological order."""
    position = {n: k for k, n in enumerate(topological_order(graph))}
    order = sorted(range(len(syncs[0].collectives)), key=lambda k: position[syncs[0].collectives[k][1]])
    for sync in syncs:
        last = {}
        for k in order:
            chain, node = sync.collectives[k]
            if chain in last:
                node.add_control_input(last[chain])
            last[chain] = node


def _chain_of(name):
    """The backward chain of a gradient op: its gradients scope ("gradients_1/")."""
    m = _GRADIENTS.match(name)
    return m.group(0) if m else FORWARD


class _Sync:
    """Builds one replica's synchronised statistics; remembers its collectives (chain,
    node) in the order it made them (the same in every replica), the nodes replaced and
    the renames."""

    def __init__(self, graph, rm, i, plan, gkey, first_key):
        self.g, self.rm, self.i, self.plan, self.gkey = graph, rm, i, plan, gkey
        self.device = rm.devices[i]
        self.next_key = first_key
        self.collectives = []
        self.replaced = []
        self.counted = []   # the replica's own counts of rows that synced sums read before
        self.renames = ([], [])

    def op(self, op_type, name, inputs, **kw):
        return make_op(self.g, op_type, name, inputs, device=self.device, **kw).output(0)

    def const(self, name, value, dtype):
        return const(self.g, name, value, dtype, self.device)

    def all_reduce(self, scope, tensor, chain, final_op="Div", merge_op="Add"):
        """The replicas' mean of ``tensor`` (``final_op="Id"``: their sum; ``merge_op``
        "Max" or "Min" with "Id": their maximum or minimum), a collective of the chain
        ``chain``."""
        node = all_reduce(self.g, scope, tensor, self.rm.group_size, self.gkey,
                          normalizer_instance_key(self.plan, self.next_key), self.device, merge_op, final_op)
        self.next_key += 1
        self.collectives.append((chain, node))
        return node.output(0)

    def factor(self, scope, value, dtype):
        """(f_r = C_r / C̄, C̄): this replica's count of ``value``'s elements over the
        replicas' mean count, in ``dtype``."""
        size = self.op("Size", f"{scope}/rows", [value], type_attrs={"out_type": dtypes.as_dtype("int32").as_datatype_enum})
        count = self.op("Cast", f"{scope}/count", [size], type_attrs={"DstT": dtype})
        mean_count = self.all_reduce(f"{scope}/mean_count", count, FORWARD)
        return self.op("RealDiv", f"{scope}/factor", [count, mean_count]), mean_count

    def synced_mean(self, scope, local, factor, chain):
        """The replicas' mean of ``factor`` × ``local`` (a replica with no rows adds 0)."""
        return self.all_reduce(scope, self.op("MulNoNan", f"{scope}/weighted", [local, factor]), chain)

    # ---- a Mean over the rows ------------------------------------------------------------
    def mean(self, node, entries):
        """``node``'s readers read the synced mean, and its backward entries ``entries``
        ([(reader, position)]) the replicas' mean of the gradient, times f_r."""
        factor, _ = self.factor(f"{node.name}/sync", node.inputs[0], node.attr["T"].type)
        self._synced(node, entries, lambda: self.synced_mean(f"{node.name}/sync", node.output(0), factor, FORWARD),
                     lambda scope, gradient, chain: self.op("Mul", f"{scope}/scaled", [
                         self.all_reduce(scope, gradient, chain), factor]))

    def _synced(self, node, entries, forward, backward):
        """``node``'s readers (but its shape's) read ``forward()``, which takes its name
        (the statistic is renamed ``<name>/replica_rows``), and its backward entries
        ``entries`` ([(reader, position)]) ``backward(scope, gradient, chain)``, once per
        gradient tensor."""
        readers = [(c, pos) for c, pos in node.consumers(0) if c.op not in _SHAPE_READERS]
        synced = forward()
        for c, pos in readers:
            c.set_input(pos, synced)
        by_tensor = {}
        for reader, pos in entries:
            by_tensor.setdefault(reader.inputs[pos], []).append((reader, pos))
        for gradient, readers in by_tensor.items():
            entry = backward(f"{readers[0][0].name}/sync", gradient, _chain_of(readers[0][0].name))
            for reader, pos in readers:
                reader.set_input(pos, entry)
        self.renames[0].append((node, self.g.unique_name(f"{node.name}/replica_rows")))
        self.renames[1].append((synced.node, node.name))

    # ---- a sum over the rows ---------------------------------------------------------------
    def summed(self, node, entries):
        """``node``'s readers read the replicas' sum of it, and its backward entries
        ``entries`` ([(reader, position)]) the replicas' sum of the gradient."""
        self._synced(node, entries, lambda: self.all_reduce(f"{node.name}/sync", node.output(0), FORWARD, final_op="Id"),
                     lambda scope, gradient, chain: self.all_reduce(scope, gradient, chain, final_op="Id"))

    # ---- a maximum or minimum over the rows, with no gradient --------------------------------
    def extreme(self, node):
        """``node``'s readers read the replicas' maximum (minimum) of it: one device's. No
        gradient goes through it (the analysis checks): tf.reduce_logsumexp's shift, under
        tf.stop_gradient, cancels in its value but must be one on every replica for the
        synced sum of exp(x - max) to be one device's."""
        self._synced(node, [], lambda: self.all_reduce(f"{node.name}/sync", node.output(0), FORWARD, final_op="Id",
                                                       merge_op=node.op), None)

    def whole_counts(self, counts):
        """Where a synced sum's value meets a count of the batch's rows (``counts``:
        [(op, input position, [shape reads], [(gradient reader, position)])], original
        names), the op and its backward pass read the count of every replica's rows: a
        copy of the ops from the shape reads to the count, each read's rows summed."""
        memo = {self.rm.node(self.g, self.i, read).name: None for _, _, reads, _ in counts for read in reads}
        for op, pos, _, gradient_readers in counts:
            node = self.rm.node(self.g, self.i, op)
            self.counted.append(node.inputs[pos].node)
            whole = self._whole(node.inputs[pos], memo, f"{node.name}/sync/whole_count")
            node.set_input(pos, whole)
            for reader, k in gradient_readers:
                self.rm.node(self.g, self.i, reader).set_input(k, whole)

    def _whole(self, tensor, memo, scope):
        """``tensor`` computed from every replica's rows: ``memo`` maps the names of the
        shape reads of the batch to their whole versions (None until made) and of the
        ops copied to their copies."""
        node = tensor.node
        if node.name in memo:
            if memo[node.name] is None:
                memo[node.name] = self._summed_rows(node, scope)
            return Tensor(memo[node.name], tensor.index)
        if node.op in _SHAPE_READERS or node.op == "Const":   # (the shape of a tensor without rows)
            return tensor
        inputs = [self._whole(t, memo, scope) for t in node.inputs]
        if inputs == list(node.inputs):
            return tensor
        copy = self.g.clone_node(node, self.g.unique_name(f"{scope}/{node.name.rsplit('/', 1)[-1]}"))
        copy.set_inputs(inputs)
        copy.set_control_inputs(node.control_inputs)
        copy.replica = self.i
        memo[node.name] = copy
        return Tensor(copy, tensor.index)

    def _summed_rows(self, read, scope):
        """A Size, or a Shape with its first element, summed over the replicas (counts
        travel as float64: exact to 2**53)."""
        out_type = read.attr["out_type"].type
        f64 = dtypes.as_dtype("float64").as_datatype_enum
        name = f"{scope}/{read.name.rsplit('/', 1)[-1]}"
        if read.op == "Size":
            total = self.all_reduce(name, self.op("Cast", f"{name}/as_float", [read.output(0)],
                                                  type_attrs={"DstT": f64}), FORWARD, final_op="Id")
            return self.op("Cast", f"{name}/whole", [total], type_attrs={"DstT": out_type}).node
        int_name = dtypes.as_dtype(out_type).name
        zero, one, rest = (self.const(f"{name}/{what}", [v], int_name) for what, v in
                           (("begin", 0), ("one", 1), ("rest", -1)))
        rows = self.op("Slice", f"{name}/rows", [read.output(0), zero, one])
        total = self.all_reduce(name, self.op("Cast", f"{name}/as_float", [rows], type_attrs={"DstT": f64}),
                                FORWARD, final_op="Id")
        others = self.op("Slice", f"{name}/other_axes", [read.output(0), one, rest])
        axis = self.const(f"{name}/axis", 0, "int32")
        return make_op(self.g, "ConcatV2", f"{name}/whole",
                       [[self.op("Cast", f"{name}/whole_rows", [total], type_attrs={"DstT": out_type}), others],
                        axis], device=self.device)

    # ---- a FusedBatchNorm in training mode -------------------------------------------------
    def fused_batch_norm(self, node):
        """``node`` and its backward FusedBatchNormGrads replaced by their ops, the
        statistics and the backward's two means all-reduced."""
        scope = node.name + "/sync"
        x, scale, offset, mean_in, var_in = node.inputs[:5]
        t = node.attr["T"].type
        u = node.attr["U"].type if "U" in node.attr else t
        fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NHWC"
        axes = BATCH_NORM_AXES[fmt]
        kept = [1] * (len(axes) + 1)
        kept[1 if fmt.startswith("NC") else len(axes)] = -1
        avg = node.attr["exponential_avg_factor"].f if "exponential_avg_factor" in node.attr else 1.0
        eps = self.const(f"{scope}/epsilon", node.attr["epsilon"].f, dtypes.as_dtype(u).name)
        axes_t = self.const(f"{scope}/axes", axes, "int32")
        kept_t = self.const(f"{scope}/kept_shape", kept, "int32")
        cast = (lambda name, v, to: self.op("Cast", name, [v], type_attrs={"DstT": to})) if t != u \
            else (lambda name, v, to: v)

        def mean_over_rows(name, value, **kw):
            return self.op("Mean", name, [value, axes_t], attrs={"keep_dims": True}, **kw)

        xu = cast(f"{scope}/x", x, u)
        factor, mean_count = self.factor(scope, xu, u)
        m = self.synced_mean(f"{scope}/mean", mean_over_rows(f"{scope}/replica_mean", xu,
                                                             control_inputs=node.control_inputs), factor, FORWARD)
        centred = self.op("Sub", f"{scope}/centred", [xu, m])
        squares = self.op("Square", f"{scope}/squares", [centred])
        v = self.synced_mean(f"{scope}/variance", mean_over_rows(f"{scope}/replica_variance", squares),
                             factor, FORWARD)
        inv = self.op("Rsqrt", f"{scope}/inverse_std", [self.op("AddV2", f"{scope}/variance_eps", [v, eps])])
        xhat = self.op("Mul", f"{scope}/normalised", [centred, inv])
        gamma = self.op("Reshape", f"{scope}/scale", [scale, kept_t])
        beta = self.op("Reshape", f"{scope}/offset", [offset, kept_t])
        y = cast(f"{scope}/y", self.op("AddV2", f"{scope}/shifted",
                                       [self.op("Mul", f"{scope}/scaled", [xhat, gamma]), beta]), t)
        # the batch's mean and its Bessel-corrected variance (rows N: every replica's count
        # over the channels; N / (N - 1) as 1 for one row, as the kernel does)
        flat = self.const(f"{scope}/flat_shape", [-1], "int32")
        batch_mean = self.op("Reshape", f"{scope}/batch_mean", [m, flat])
        channels = self.op("Cast", f"{scope}/channels", [self.op("Size", f"{scope}/channel_count", [scale],
                                                                    type_attrs={"out_type": dtypes.as_dtype("int32").as_datatype_enum})],
                           type_attrs={"DstT": u})
        replicas = self.const(f"{scope}/replicas", float(self.rm.group_size), dtypes.as_dtype(u).name)
        rows = self.op("RealDiv", f"{scope}/rows_per_channel",
                       [self.op("Mul", f"{scope}/all_rows", [mean_count, replicas]), channels])
        one = self.const(f"{scope}/one", 1.0, dtypes.as_dtype(u).name)
        bessel = self.op("RealDiv", f"{scope}/bessel", [rows, self.op("Maximum", f"{scope}/rows_less_one", [
            self.op("Sub", f"{scope}/rows_minus_one", [rows, one]), one])])
        batch_var = self.op("Mul", f"{scope}/batch_variance", [self.op("Reshape", f"{scope}/variance_flat", [v, flat]),
                                                                bessel])
        if avg != 1.0:   # the kernel's own moving average: (1 - a) · old + a · batch
            keep = self.const(f"{scope}/keep", 1.0 - avg, dtypes.as_dtype(u).name)
            take = self.const(f"{scope}/take", avg, dtypes.as_dtype(u).name)
            batch_mean, batch_var = (
                self.op("AddV2", f"{scope}/{what}_average", [self.op("Mul", f"{scope}/{what}_kept", [old, keep]),
                                                            self.op("Mul", f"{scope}/{what}_taken", [new, take])])
                for what, old, new in (("mean", mean_in, batch_mean), ("variance", var_in, batch_var)))
        grads = [c for c, pos in node.consumers() if c.op in FUSED_BATCH_NORM_GRADS]
        for grad in dict.fromkeys(grads):
            self._backward(grad, xhat, inv, factor, axes_t, kept_t, cast, u, t)
        self._replace(node, [y, batch_mean, batch_var])

    def _backward(self, grad, xhat, inv, factor, axes_t, kept_t, cast, u, t):
        scope, chain = grad.name + "/sync", _chain_of(grad.name)
        dy = cast(f"{scope}/dy", grad.inputs[0], u)
        products = self.op("Mul", f"{scope}/dy_normalised", [dy, xhat])
        means = [self.synced_mean(f"{scope}/{what}", self.op("Mean", f"{scope}/replica_{what}", [value, axes_t],
                                                             attrs={"keep_dims": True},
                                                             control_inputs=grad.control_inputs if not k else ()),
                                  factor, chain)
                 for k, (what, value) in enumerate((("mean_dy", dy), ("mean_dy_normalised", products)))]
        gamma = self.op("Reshape", f"{scope}/scale", [grad.inputs[2], kept_t])
        centred = self.op("Sub", f"{scope}/centred_dy", [self.op("Sub", f"{scope}/dy_less_mean", [dy, means[0]]),
                                                         self.op("Mul", f"{scope}/projection", [xhat, means[1]])])
        dx = cast(f"{scope}/dx", self.op("Mul", f"{scope}/x_backprop", [
            self.op("Mul", f"{scope}/scale_inverse_std", [gamma, inv]), centred]), t)
        dscale = self.op("Sum", f"{scope}/scale_backprop", [products, axes_t])
        doffset = self.op("Sum", f"{scope}/offset_backprop", [dy, axes_t])
        self._replace(grad, [dx, dscale, doffset])

    def _replace(self, node, outputs):
        """An IdentityN of ``outputs`` takes ``node``'s name and readers (of its first
        outputs; the analysis checked nobody else reads the rest) and control readers."""
        ident = make_op(self.g, "IdentityN", f"{node.name}/synced", [outputs], device=self.device,
                        control_inputs=node.control_inputs)
        for c, pos in node.consumers():
            index = c.inputs[pos].index
            if index < len(outputs):
                c.set_input(pos, ident.output(index))
            elif dead_zeros_like(c):
                for waiting in c.control_consumers:
                    waiting.remove_control_input(c)
                self.replaced.append(c)
        self.g.replace_control_uses(node, ident)
        self.replaced.append(node)
        self.renames[1].append((ident, node.name))
