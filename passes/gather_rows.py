"""gather_rows: updates that write the batch's rows into a variable read every replica's rows.

MoCo keeps a queue of the last K keys in a variable, ``assign(queue, tf.concat([keys,
queue], 0)[:K])``, or ``scatter_update(queue, ptr + tf.range(n), keys)`` with ``ptr =
(ptr + n) % K``. One device enqueues the batch's B keys; a replica would enqueue its own
n = B / R, and no average of the replicas' queues is one device's. For every tensor the
plan lists (plan.gathered_rows: forward tensors holding the replica's rows, found by the
analysis, with the update ops that read them), each replica's readers read every
replica's rows instead, gathered in replica order:

    replica r:  keys_r ─> CollectiveGatherV2 ─> [keys_0; ...; keys_{R-1}] ─> the update's readers
                     └──────────────────────────────────────────────────> the forward pass

The batch is split into the replicas' shards in rank order, so the gathered rows are
the batch's rows in one device's order, and every replica's update (its mirrored copy
of the queue and of its pointer, advanced by the gathered row count) is one device's.
The gathers run one after the other, so every replica issues them in the same order;
they take the instance keys after the loop bounds'.
"""

from graph_rewriter.collectives import gather_in_order
from graph_rewriter.pass_manager import Pass


class GatherRowsPass(Pass):
    name = "gather_rows"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"loop_bounds"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.gathered_rows)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        entries = plan.gathered_rows or []
        if rm.group_size == 1 or not entries:
            return False
        for i in rm.built:
            gather_in_order(graph, rm, i, plan, "gathered_rows", entries)
        graph.touch()
        return True
