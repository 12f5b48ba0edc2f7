"""loss_sums: a loss summed over the batch's rows counts every replica's rows.

One device's ``tf.reduce_sum(tf.square(p - y))`` (or ``tf.nn.l2_loss(p - y)``, or a
``tf.compat.v1.losses`` loss with ``reduction=SUM``) over the R replicas' batches is the
sum of the replicas' sums, and its gradient is the sum of theirs. The replicas' gradients
are averaged (all-reduce, parameter-server accumulators), which would divide it by R.
For every sum the plan lists (plan.loss_sums, found by the analysis), each replica's
sum counts R times, in the forward pass and in its gradient:

    forward:   Sum ─> × R ─> what read it (the loss, summaries)      (takes the name "Sum")
    backward:  dL/dSum ─> × R·k ─> Sum_grad (broadcast to the rows)

so the mean of the replicas' losses is one device's loss on their R batches, and the
mean of their gradients is one device's gradient. The analysis lists a sum only when
everything between it and the loss is linear in it with coefficients the same on every
replica (its gradient does not depend on the batch), so scaling the sum scales its
share of the loss and of the gradient and nothing else: a weight-decay term added to it
keeps its own (averaged) gradient. With accumulation over k micro-batches the gradient
is averaged over them too, so the backward pass scales by R·k (as do backward ops that
read the sum's value); a run's loss is still the sum over the run's rows.

The sum itself is renamed ``<name>/replica_rows``, and every reader of the sum reads
the scaled value. A statistic that adds the loss up (``total.assign_add(loss)``) then
adds R times the replica's sum, which the analysis marks to be averaged across the
replicas (not summed, as a plain sum over the rows is): one device's total. The
communication passes run after this one, so they reduce the scaled value.
"""

from graph_rewriter import dtypes
from graph_rewriter.analysis import gradient_entries, in_gradients_scope, loop_frames, named_gradient_scopes
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass


class LossSumsPass(Pass):
    name = "loss_sums"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"replicate", "split_inputs"})   # it scales every replica's sum

    def applies(self, ctx):
        return bool(ctx.plan.loss_sums) and ctx.num_replicas * ctx.plan.accumulation_steps > 1

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        if not plan.loss_sums:
            return False
        forward_factor = plan.num_replicas
        backward_factor = plan.num_replicas * plan.accumulation_steps
        sums = {name: rm.node(graph, 0, name) for name in plan.loss_sums}
        mine = [n for n in graph.nodes if "_grad/" in n.name and rm.replica_of(graph, n.name) == 0]
        scopes = named_gradient_scopes(graph.nodes)   # tf.gradients(name=...)'s, before the products below
        entries = gradient_entries(mine, sums)
        moved, taken = {}, {}   # sum -> its new name; the product -> the sum's name
        for i in rm.built:
            for name in plan.loss_sums:
                total = rm.node(graph, i, name)
                with graph.adding_to_replica(i):
                    scaled = {}
                    for c, pos in total.consumers(0):
                        factor = backward_factor if in_gradients_scope(c.name, scopes) else forward_factor
                        if factor not in scaled:
                            scaled[factor] = _times(graph, total.output(0), factor, f"{total.name}/times_{factor}",
                                                    rm.devices[i])
                        c.set_input(pos, scaled[factor])
                    for _, (reader, pos) in entries.get(name, []):
                        entry = rm.node(graph, i, reader.name)
                        grad = entry.inputs[pos]
                        entry.set_input(pos, _times(graph, grad, backward_factor,
                                                    f"{entry.name}/times_{backward_factor}", rm.devices[i]))
                if forward_factor in scaled:
                    moved[total] = graph.unique_name(f"{total.name}/replica_rows")
                    taken[scaled[forward_factor].node] = total.name
        graph.rename_nodes(moved)   # the sums leave their names before their products take them
        graph.rename_nodes(taken)
        graph.touch()
        return True


def _times(graph, tensor, factor, name, device):
    """``tensor`` times the constant ``factor``, in its dtype; in a v1 while loop the
    constant joins the loop's frame by a control input, as TensorFlow's own do."""
    value = const(graph, f"{name}/factor", factor, dtypes.as_dtype(dtype_of(tensor)).name, device)
    if loop_frames(tensor.node):
        value.node.add_control_input(tensor.node)
    return make_op(graph, "Mul", name, [tensor, value], device=device).output(0)
