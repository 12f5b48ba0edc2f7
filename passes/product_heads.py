"""product_heads: every replica computes the head of the batch's in-batch products over every replica's rows.

A dual encoder's logits ``tf.matmul(q, d, transpose_b=True)`` meet every query with
every document of the batch; a replica holding n = B / R rows would meet each query
with n documents. For the head the plan lists (plan.product_head, found by the
analysis: graph_rewriter/product_heads.py), each replica

- gathers, in replica order, the rows the head reads (CollectiveGatherV2), for the
  head's forward ops and the backward ops that read them;
- computes again the values the head reads that come from the batch's rows and counts
  of them (the labels ``tf.range(tf.shape(q)[0])``, a mask of equal labels): a copy of
  the ops between them and the head, reading the gathered rows and, for a Shape or Size
  of the rows, R times the replica's count;
- keeps its own rows of each gradient the head's backward gives the rows, times R:

    replica r:  q_r ─> CollectiveGatherV2 ─> q ─> head ─> loss ─> head's backward ─> dq [B rows]
                dq ─> StridedSlice[r n : (r+1) n] ─> * R ─> the encoder's backward

so its loss is one device's, and the all-reduce's mean of its gradients is one
device's (module doc of graph_rewriter/product_heads.py). The batch splits into equal
shards (Session and the split refuse others), so a gradient's B rows hold n = B / R
per replica, replica r's at r n. The gathers run one after the other, so every
replica issues them in the same order; they take the instance keys after the gathered
rows' (the synced batch statistics take theirs after the row moves', as each takes
several: collectives._COUNTED_DOWN).
"""

from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import replica_ranks
from graph_rewriter.whole_batch import own_rows, read_every_replicas_rows


class ProductHeadsPass(Pass):
    name = "product_heads"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"gather_rows"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.product_head)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        head = plan.product_head
        if rm.group_size == 1 or not head:
            return False
        ranks = replica_ranks(graph, rm, "graph_rewriter/product_heads") if head["gradients"] else None
        r = rm.group_size
        for i in rm.built:
            device = rm.devices[i]
            read_every_replicas_rows(graph, rm, i, plan, "product_head")
            with graph.adding_to_replica(i):
                for name, readers in head["gradients"]:
                    own = own_rows(graph, rm.tensor(graph, i, name), ranks.output(i), r, device)
                    for reader, pos in readers:
                        rm.node(graph, i, reader).set_input(pos, own)
        graph.touch()
        return True
