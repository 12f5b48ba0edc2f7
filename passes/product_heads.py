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
replica issues them in the same order; they take the instance keys after the synced
batch statistics'.
"""

from graph_rewriter import dtypes
from graph_rewriter.collectives import gather_in_order
from graph_rewriter.ir import Tensor
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import replica_ranks


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
        copied = set(head["copied_ops"])
        for i in rm.built:
            device = rm.devices[i]
            # (a reader the head copies keeps the replica's rows: its copy reads these)
            every = gather_in_order(graph, rm, i, plan, "product_head", head["gathered"], keep=copied)
            with graph.adding_to_replica(i):
                copies = _copies(graph, rm, i, head["copied_ops"], set(head["count_leaves"]), every, r, device)
                for name, readers in head["copied"]:
                    t = rm.tensor(graph, i, name)
                    for reader, pos in readers:
                        rm.node(graph, i, reader).set_input(pos, Tensor(copies[t.node], t.index))
                for name, readers in head["gradients"]:
                    own = _own_rows(graph, rm.tensor(graph, i, name), ranks.output(i), r, device)
                    for reader, pos in readers:
                        rm.node(graph, i, reader).set_input(pos, own)
        graph.touch()
        return True


def _copies(graph, rm, i, names, leaves, every, r, device):
    """{replica i's node: its copy} for the ops ``names`` (graph order) the head computes
    again from every replica's rows: a Shape or Size of the batch's rows (``leaves``)
    becomes R times the replica's count of rows, and the other ops copies that read the
    copies and every replica's rows (``every``: replica i's tensor -> the gathered one)."""
    copies = {}
    for name in names:
        node = rm.node(graph, i, name)
        if name in leaves:
            copies[node] = _whole_count(graph, node, r, device).node
            continue
        copy = graph.clone_node(node, graph.unique_name(f"{node.name}/every_replica"))
        copy.set_inputs([Tensor(copies[t.node], t.index) if t.node in copies else every.get(t, t)
                         for t in node.inputs])
        copy.set_control_inputs(node.control_inputs)
        copies[node] = copy
    return copies


def _whole_count(graph, count, r, device):
    """R times a Size, or a Shape with its first dimension times R: the batch's."""
    dtype = dtypes.as_dtype(count.attr["out_type"].type)
    scope = f"{count.name}/every_replica"
    if count.op == "Size":
        return make_op(graph, "Mul", scope, [count.output(0), const(graph, f"{scope}/replicas", r, dtype.name,
                                                                     device)], device=device).output(0)

    def part(begin, end, end_mask):
        return make_op(graph, "StridedSlice", f"{scope}/{'rows' if begin == 0 else 'rest'}",
                       [count.output(0), const(graph, f"{scope}/begin", [begin], dtype.name, device),
                        const(graph, f"{scope}/end", [end], dtype.name, device),
                        const(graph, f"{scope}/strides", [1], dtype.name, device)],
                       attrs={"end_mask": end_mask}, device=device).output(0)

    rows = make_op(graph, "Mul", f"{scope}/all_rows", [part(0, 1, 0), const(graph, f"{scope}/replicas", [r],
                                                                             dtype.name, device)],
                   device=device).output(0)
    return make_op(graph, "ConcatV2", scope, [[rows, part(1, 0, 1)], const(graph, f"{scope}/axis", 0, "int32",
                                                                             device)], device=device).output(0)


def _own_rows(graph, gradient, rank, r, device):
    """R times the replica's rows of a gradient of the whole batch's rows: rows
    [rank n, (rank + 1) n) of its B = R n."""
    scope = f"{gradient.node.name}/own_rows"
    shape = make_op(graph, "Shape", f"{scope}/shape", [gradient], type_attrs={"out_type": dtypes.int32},
                    device=device).output(0)
    whole = make_op(graph, "StridedSlice", f"{scope}/rows",
                    [shape, const(graph, f"{scope}/rows/begin", [0], "int32", device),
                     const(graph, f"{scope}/rows/end", [1], "int32", device),
                     const(graph, f"{scope}/rows/strides", [1], "int32", device)], device=device).output(0)
    n = make_op(graph, "FloorDiv", f"{scope}/per_replica", [whole, const(graph, f"{scope}/replicas", [r], "int32",
                                                                         device)], device=device).output(0)
    begin = make_op(graph, "Mul", f"{scope}/begin", [n, rank], device=device).output(0)
    end = make_op(graph, "AddV2", f"{scope}/end", [begin, n], device=device).output(0)
    own = make_op(graph, "StridedSlice", scope, [gradient, begin, end, const(graph, f"{scope}/strides", [1], "int32",
                                                                              device)], device=device).output(0)
    return make_op(graph, "Mul", f"{scope}/times_replicas",
                   [own, const(graph, f"{scope}/replicas_f", r, dtypes.as_dtype(dtype_of(gradient)).name, device)],
                   device=device).output(0)
