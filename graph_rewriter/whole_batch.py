"""Ops that compute values of the whole batch on a replica from every replica's rows.

A replica that gathered every replica's rows of a tensor (CollectiveGatherV2, in replica
order: rows r n to (r + 1) n are replica r's) computes from them what one device
computes from the batch: copies of the ops between the rows and the value, with each
Shape or Size of the replica's rows taken R times (the batch splits into equal shards),
and takes its own rows back out of a value of the whole batch's rows. Used by the
passes that compute an in-batch product's head (passes/product_heads.py) and rows moved
within the batch (passes/row_moves.py) on every replica.
"""

from graph_rewriter import dtypes
from graph_rewriter.collectives import gather_in_order
from graph_rewriter.ir import Tensor
from graph_rewriter.op_builder import const, dtype_of, make_op


def read_every_replicas_rows(graph, rm, i, plan, field):
    """Replica i's readers of the plan's ``field`` (a product head, row moves: a dict
    with "gathered", "copied_ops", "count_leaves" and "copied") read every replica's
    rows: it gathers them (collectives.gather_in_order), copies the ops computing values
    from them and counts of them (copies_from_rows), and the readers of those values read
    the copies. Returns {replica i's tensor: the gathered one}."""
    entry = getattr(plan, field)
    # (a reader the field copies keeps the replica's rows: its copy reads these)
    every = gather_in_order(graph, rm, i, plan, field, entry["gathered"], keep=set(entry["copied_ops"]))
    with graph.adding_to_replica(i):
        copies = copies_from_rows(graph, rm, i, entry["copied_ops"], set(entry["count_leaves"]), every,
                                  rm.group_size, rm.devices[i])
        for name, readers in entry["copied"]:
            t = rm.tensor(graph, i, name)
            for reader, pos in readers:
                rm.node(graph, i, reader).set_input(pos, Tensor(copies[t.node], t.index))
    return every


def copies_from_rows(graph, rm, i, names, leaves, every, r, device):
    """{replica i's node: its copy} for the ops ``names`` (graph order) computed
    again from every replica's rows (a head's, a move's): a Shape or Size of the batch's rows (``leaves``)
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


def own_rows(graph, gradient, rank, r, device, scaled=True):
    """R times (``scaled``) the replica's rows of a tensor of the whole batch's rows (a
    gradient): rows [rank n, (rank + 1) n) of its B = R n."""
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
    if not scaled:
        return own
    return make_op(graph, "Mul", f"{scope}/times_replicas",
                   [own, const(graph, f"{scope}/replicas_f", r, dtypes.as_dtype(dtype_of(gradient)).name, device)],
                   device=device).output(0)
