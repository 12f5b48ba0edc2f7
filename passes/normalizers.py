"""normalizers: a loss divided by a sum over the batch is divided by the replicas' mean of it.

A sequence model's loss is often a masked mean, ``reduce_sum(xent * mask) /
reduce_sum(mask)``, or ``tf.compat.v1.losses.*(weights=mask)``, which divides by the count
of non-zero weights. One device divides the batch's sum N by the batch's count Y. A
replica r holds N_r and Y_r of its shard; dividing by Y_r and averaging the replicas'
gradients would weight every shard alike, whatever its count of tokens. So every
replica's divisor (plan.normalizers, found by the analysis) is replaced, for every op
that reads it, forward and backward, by the mean over the replicas:

    replica r:  Y_r ─> CollectiveReduceV2(Add, Div) ─> Ȳ = Y / R ─> what read Y_r

Replica r's loss is then N_r / Ȳ, the mean of the replicas' losses is N / Y (one
device's), and the mean of their gradients is Σ ∇N_r / Y (one device's). A divisor
clamped or shifted by constants, ``tf.maximum(count, 1.0)`` or ``count + 1e-5``, is
f(count): the count below the clamps is summed instead, and the clamps are copied onto
the sum, so every replica divides by f(Σ_r count_r) / R, one device's divisor over R (the
mean of the replicas' f(count_r) is not that where a replica counts 0).

A mean over rows a condition on the batch selects, ``reduce_mean(tf.boolean_mask(xent,
labelled))`` (plan.selected_means), divides by a count of rows as well, inside the Mean:
one device by the batch's count C, replica r by its C_r. Each replica's mean is scaled by
C_r / C̄, forward and at the entry of its backward pass (the Mean's backward divides by
C_r again):

    forward:   Mean ─> MulNoNan(·, C_r / C̄) ─> what read it   (takes the name "Mean")
    backward:  dL/dMean ─> × C_r / C̄ ─> Mean_grad (broadcast, ÷ C_r)

so replica r's loss is S_r / C̄ and the mean of the replicas' is S / C (one device's). A
replica that selects no rows has mean NaN (0/0) and factor 0, and MulNoNan makes its
share 0, as its rows' share of one device's mean is. The mean is renamed
``<name>/replica_rows``; C_r is the Size of the mean's input, and C̄ is reduced in the
same chain as the normalizers, after them. The chain reduces one after the other, so
every replica issues them in the same order.
"""

from graph_rewriter import dtypes
from graph_rewriter.analysis import gradient_entries, sum_and_clamps
from graph_rewriter.collectives import all_reduce_mean, group_key, normalizer_instance_key
from graph_rewriter.ir import Tensor
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass

_SHAPE_READERS = frozenset(("Shape", "ShapeN", "Size", "Rank"))


class NormalizersPass(Pass):
    name = "normalizers"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.normalizers or ctx.plan.selected_means)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        divisors, means = plan.normalizers or [], plan.selected_means or []
        if rm.group_size == 1 or not (divisors or means):
            return False
        gkey = group_key(rm.group_devices)
        mine = [n for n in graph.nodes if "_grad/" in n.name and rm.replica_of(graph, n.name) == 0]
        entries = gradient_entries(mine, {name: rm.node(graph, 0, name) for name in means}) if means else {}
        renames = []
        for i in rm.built:
            previous = None   # the chain's last all-reduce

            def averaged(k, tensor, final_op="Div"):
                with graph.adding_to_replica(i):
                    return all_reduce_mean(graph, f"{rm.prefixes[i]}normalizers/{k}", tensor, rm.group_size, gkey,
                                           normalizer_instance_key(plan, k), rm.devices[i],
                                           control_inputs=[previous] if previous is not None else [],
                                           final_op=final_op)

            for k, name in enumerate(divisors):
                divisor = rm.tensor(graph, i, name)
                readers = divisor.node.consumers(divisor.index)
                count, above = _clamped_count(divisor)
                if above:   # the count summed, then clamped as one device clamps it
                    previous = averaged(k, count, final_op="Id")
                    with graph.adding_to_replica(i):
                        mean = _clamped_over_replicas(graph, above, count, previous.output(0), rm.group_size,
                                                      rm.devices[i])
                else:
                    previous = averaged(k, divisor)
                    mean = previous.output(0)
                for c, pos in readers:
                    c.set_input(pos, mean)
                _remove_unread(graph, above[::-1])
            for k, name in enumerate(means, start=len(divisors)):
                mean = rm.node(graph, i, name)
                with graph.adding_to_replica(i):
                    count = _rows_of(graph, mean, rm.devices[i])
                previous = averaged(k, count)
                renames.append(_scale_mean(graph, rm, i, mean, entries[name], count, previous.output(0)))
        graph.rename_nodes(dict(r for r, _ in renames))   # the means leave their names first
        graph.rename_nodes(dict(t for _, t in renames))
        graph.touch()
        return True


def _clamped_count(divisor):
    """(the count below the clamps, [the clamps and casts above it, bottom up]) for a
    divisor clamped or shifted by constants, ``tf.maximum(tf.reduce_sum(positives), 1.0)``
    (a detector's count of positive anchors) or ``reduce_sum(weights) + 1e-5`` (BERT's
    masked LM); (None, []) when none is (the divisor is a Sum through casts)."""
    _, chain = sum_and_clamps(divisor.node)
    clamped = [n for n in chain if n.op not in ("Cast", "Identity")]
    if not clamped:
        return None, []
    deepest = chain.index(clamped[-1])
    count = next(t for t in clamped[-1].inputs if t.node.op != "Const")
    return count, chain[deepest::-1]


def _remove_unread(graph, clamps):
    """Removes the replica's own clamps of its count (top down) once nothing reads them:
    left in the graph, fetching one would run the replica's collectives and not the
    others' (a count of the rows below a threshold that a synced statistic sets)."""
    for node in clamps:
        if node.readers():
            return
        graph.remove_node(node)


def _clamped_over_replicas(graph, above, count, total, r, device):
    """One device's divisor over R, the divisor every replica's share divides by: the
    clamps ``above`` copied onto the replicas' ``total`` of the ``count``, then divided by
    R. The mean of the replicas' clamped counts is not it: a replica with no positive
    anchors clamps its 0 to 1 where one device counts the whole batch's."""
    copies = {}
    for node in above:
        copy = graph.clone_node(node, graph.unique_name(f"{node.name}/every_replica"), device=device)
        copy.set_inputs([total if t == count else Tensor(copies[t.node], t.index) if t.node in copies else t
                         for t in node.inputs])
        copies[node] = copy
    clamped = copies[above[-1]].output(0)
    replicas = const(graph, f"{above[-1].name}/every_replica/replicas", r, dtypes.as_dtype(dtype_of(clamped)).name,
                     device)
    return make_op(graph, "RealDiv", f"{above[-1].name}/every_replica/mean", [clamped, replicas],
                   device=device).output(0)


def _rows_of(graph, mean, device):
    """The count of elements a Mean divides by, in its dtype: the Size of its input."""
    size = make_op(graph, "Size", f"{mean.name}/rows", [mean.inputs[0]],
                   type_attrs={"out_type": dtypes.as_dtype("int32").as_datatype_enum}, device=device)
    return make_op(graph, "Cast", f"{mean.name}/count", [size.output(0)],
                   type_attrs={"DstT": mean.attr["T"].type}, device=device).output(0)


def _scale_mean(graph, rm, i, mean, entries, count, mean_count):
    """Replica i's selected mean times its ``count`` over the replicas' ``mean_count``,
    for its readers and at its backward pass's ``entries``; returns the renames (the
    mean -> <name>/replica_rows, the product -> its name)."""
    device = rm.devices[i]
    readers = [(c, pos) for c, pos in mean.consumers(0) if c.op not in _SHAPE_READERS]
    with graph.adding_to_replica(i):
        factor = make_op(graph, "RealDiv", f"{mean.name}/factor", [count, mean_count], device=device).output(0)
        product = make_op(graph, "MulNoNan", f"{mean.name}/scaled", [mean.output(0), factor], device=device)
        for c, pos in readers:
            c.set_input(pos, product.output(0))
        for _, (reader, pos) in entries:
            entry = rm.node(graph, i, reader.name)
            entry.set_input(pos, make_op(graph, "Mul", f"{entry.name}/scaled", [entry.inputs[pos], factor],
                                         device=device).output(0))
    return (mean, graph.unique_name(f"{mean.name}/replica_rows")), (product, mean.name)
