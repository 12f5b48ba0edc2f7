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
device's), and the mean of their gradients is Σ ∇N_r / Y (one device's). The
normalizers are reduced in a chain, each after the previous one, so every replica issues
them in the same order.
"""

from graph_rewriter.collectives import all_reduce_mean, group_key, normalizer_instance_key
from graph_rewriter.pass_manager import Pass


class NormalizersPass(Pass):
    name = "normalizers"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.normalizers)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        if rm.group_size == 1 or not plan.normalizers:
            return False
        gkey = group_key(rm.group_devices)
        for i in rm.built:
            previous = None
            for k, name in enumerate(plan.normalizers):
                divisor = rm.tensor(graph, i, name)
                readers = divisor.node.consumers(divisor.index)
                with graph.adding_to_replica(i):
                    mean = all_reduce_mean(graph, f"{rm.prefixes[i]}normalizers/{k}", divisor, rm.group_size, gkey,
                                           normalizer_instance_key(plan, k), rm.devices[i],
                                           control_inputs=[previous] if previous is not None else [])
                for c, pos in readers:
                    c.set_input(pos, mean.output(0))
                previous = mean
        return True
