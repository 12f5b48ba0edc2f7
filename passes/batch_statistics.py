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
from graph_rewriter.analysis import BATCH_NORM_AXES, FUSED_BATCH_NORM_GRADS, dead_zeros_like, gradient_entries
from graph_rewriter.collectives import all_reduce_mean, group_key, normalizer_instance_key
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import topological_order

_SHAPE_READERS = frozenset(("Shape", "ShapeN", "Size", "Rank"))
_GRADIENTS = re.compile(r"^(?:.*/)?gradients(?:_\d+)?/")
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
        means = {name: rm.node(graph, 0, name) for name in names if rm.node(graph, 0, name).op == "Mean"}
        mine = [n for n in graph.nodes if "_grad/" in n.name and rm.replica_of(graph, n.name) == 0]
        entries = gradient_entries(mine, means) if means else {}
        first_key = len(plan.normalizers or []) + len(plan.selected_means or [])
        syncs = [_Sync(graph, rm, i, plan, group_key(rm.group_devices), first_key) for i in rm.built]
        for sync in syncs:
            with graph.adding_to_replica(sync.i):
                for name in names:
                    node = rm.node(graph, sync.i, name)
                    if node.op == "Mean":
                        sync.mean(node, [(rm.node(graph, sync.i, reader.name), pos)
                                         for _, (reader, pos) in entries.get(name, [])])
                    else:
                        sync.fused_batch_norm(node)
        _chain(graph, syncs)
        replaced = [n for sync in syncs for n in sync.replaced]
        unread = _unread_reads(replaced)
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
    gone = set(replaced)
    found, stack = [], [t.node for n in replaced for t in n.inputs]
    while stack:
        n = stack.pop()
        if (n in gone or n.op not in ("ReadVariableOp", "Identity")
                or any(c not in gone for c, _ in n.consumers()) or n.control_consumers):
            continue
        gone.add(n)
        found.append(n)
        stack.extend(t.node for t in n.inputs)
    return found


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
        self.renames = ([], [])

    def op(self, op_type, name, inputs, **kw):
        return make_op(self.g, op_type, name, inputs, device=self.device, **kw).output(0)

    def const(self, name, value, dtype):
        return const(self.g, name, value, dtype, self.device)

    def all_reduce(self, scope, tensor, chain):
        """The replicas' mean of ``tensor`` (a collective of the chain ``chain``)."""
        node = all_reduce_mean(self.g, scope, tensor, self.rm.group_size,
                               self.gkey, normalizer_instance_key(self.plan, self.next_key), self.device)
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
        name = node.name
        readers = [(c, pos) for c, pos in node.consumers(0) if c.op not in _SHAPE_READERS]
        factor, _ = self.factor(f"{name}/sync", node.inputs[0], node.attr["T"].type)
        synced = self.synced_mean(f"{name}/sync", node.output(0), factor, FORWARD)
        for c, pos in readers:
            c.set_input(pos, synced)
        by_tensor = {}
        for reader, pos in entries:
            by_tensor.setdefault(reader.inputs[pos], []).append((reader, pos))
        for gradient, readers in by_tensor.items():
            scope = f"{readers[0][0].name}/sync"
            total = self.all_reduce(scope, gradient, _chain_of(readers[0][0].name))
            scaled = self.op("Mul", f"{scope}/scaled", [total, factor])
            for reader, pos in readers:
                reader.set_input(pos, scaled)
        self.renames[0].append((node, self.g.unique_name(f"{name}/replica_rows")))
        self.renames[1].append((synced.node, name))

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
