"""random_draws: each replica draws the random numbers one device draws for its rows.

A dropout mask is ``random_uniform(tf.shape(x), seed=...)``: one value per row of the
batch. The replicas' clones keep the op's seeds, so replica k of R, given rows
k*n .. (k+1)*n - 1 of the batch, would draw the numbers one device draws for rows
0 .. n-1: the same mask on every replica, and not one device's. For every seeded draw
the plan lists (plan.random_draws, found by the analysis), each replica draws the R
replicas' rows with the same seeds and keeps its own:

    shape [n, d...] ─> [R*n, d...] ─> RandomUniform (seeds kept) ─> rows k*n .. (k+1)*n-1 ─> readers

The op is renamed ``<name>/every_replica`` and the replica's rows take its name, so a
fetch of the draw by name reads the replica's rows (merged across replicas: one
device's draw).

A random op fills its output element by element from its seeds (Philox counters in the
output's order), so rows k*n .. (k+1)*n-1 of the [R*n, ...] draw are what one device
draws for those rows of its batch of R*n, and a stateful op's state advances on every
replica as on one device. Replica k's rank comes from one host node, an Unpack of the
local replicas' group ranks, whose output k replica k reads (a template replica reads
output 1, and the export writes output k for replica k).

A draw in a v1 while loop (a DropoutWrapper's mask in dynamic_rnn) is rewritten in
place: the new constants join the loop's frame by a control input on the shape, and
the rank enters every frame the draw runs in (an Enter per level, a loop constant).
A draw in a function of a v2 cond or while loop (plan entry ``call:function:node``) is
rewritten in a copy of the functions the call runs, ``<function>_replica_rows``, which
take the rank as one more argument (a loop's body returns it unchanged); every
replica's call passes its own and calls the copies (other callers of the functions keep
the originals).

The price is R times the drawing: a given plan with ``"random_draws": []`` keeps the
clones' draws.
"""

from graph_rewriter import dtypes, opdefs
from graph_rewriter.analysis import called_functions, loop_frames
from graph_rewriter.op_builder import const, function_const, function_node, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import replica_ranks
from graph_rewriter.protos import attr_value_pb2

RANK_ARG = "graph_rewriter_replica_rank"


class RandomDrawsPass(Pass):
    name = "random_draws"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.random_draws)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        if rm.group_size == 1 or not plan.random_draws:
            return False
        ranks = replica_ranks(graph, rm, "graph_rewriter/random_draws")
        in_functions = {}   # call -> {function: [draw node]}
        moved, kept = {}, {}   # draw -> its new name; the rows kept -> the draw's name
        for entry in plan.random_draws:
            call, _, rest = entry.partition(":")
            if rest:
                function, _, draw = rest.partition(":")
                in_functions.setdefault(call, {}).setdefault(function, []).append(draw)
        for i in rm.built:
            for name in plan.random_draws:
                if ":" in name:
                    continue
                draw = rm.node(graph, i, name)
                readers = draw.consumers(0)
                frames = loop_frames(draw)
                with graph.adding_to_replica(i):
                    emit = _GraphEmitter(graph, f"{draw.name}/replica_rows", rm.devices[i],
                                         anchor=draw.inputs[0].node if frames else None)
                    rank = _entered(emit, ranks.output(i), frames)
                    shape, rows = _every_replicas_rows(emit, draw.inputs[0], draw.output(0), rank,
                                                       rm.group_size, _index_dtype(draw), _draw_dtype(draw))
                draw.set_input(0, shape)
                for c, pos in readers:
                    c.set_input(pos, rows)
                moved[draw] = graph.unique_name(f"{draw.name}/every_replica")
                kept[rows.node] = draw.name
        graph.rename_nodes(moved)
        graph.rename_nodes(kept)
        for call, draws in in_functions.items():
            copies = _rewritten_functions(graph, graph.node(call), draws, rm.group_size)
            for i in rm.built:
                node = rm.node(graph, i, call)
                with graph.adding_to_replica(i):   # (a v2 cond in a v1 loop: the rank enters it)
                    rank = _entered(_GraphEmitter(graph, f"{node.name}/replica_rows", rm.devices[i]),
                                    ranks.output(i), loop_frames(node))
                _call_copies(node, copies, rank)
        graph.touch()
        return True


def _entered(emit, rank, frames):
    """``rank`` entered into the v1 while loop frames ``frames`` (outermost first), as a
    loop constant of each."""
    for k, enter in enumerate(frames):
        rank = emit.op("Enter", f"rank/enter_{k}", [rank],
                       {"T": dtypes.int32, "frame_name": enter.attr["frame_name"].s, "is_constant": True,
                        "parallel_iterations": enter.attr["parallel_iterations"].i})
    return rank


def _index_dtype(draw):
    """The dtype of a draw's shape (int32 or int64), from its OpDef's first argument
    (``draw``: a graph node or a function body's NodeDef)."""
    return dtypes.as_dtype(draw.attr[opdefs.registered_op(draw.op).input_arg[0].type_attr].type)


def _draw_dtype(draw):
    return dtypes.as_dtype(draw.attr[opdefs.registered_op(draw.op).output_arg[0].type_attr].type)


def _every_replicas_rows(emit, shape, drawn, rank, replicas, index, dtype):
    """The ops that make a draw of ``shape`` draw ``replicas`` times its rows, and keep
    the rows of the replica of ``rank``: returns (the new shape, the kept rows), written
    by ``emit`` in the graph or in a function body."""
    def vector(name, value):
        return emit.const(name, [value], index)

    def strided_slice(name, x, begin, end, dt, end_mask=0):
        return emit.op("StridedSlice", name, [x, begin, end, vector(f"{name}/strides", 1)],
                       {"T": dt, "Index": index, "begin_mask": 0, "end_mask": end_mask, "ellipsis_mask": 0,
                        "new_axis_mask": 0, "shrink_axis_mask": 0})

    rows = strided_slice("rows", shape, vector("rows/begin", 0), vector("rows/end", 1), index)
    rest = strided_slice("rest", shape, vector("rest/begin", 1), vector("rest/end", 0), index, end_mask=1)
    all_rows = emit.op("Mul", "all_rows", [rows, vector("replicas", replicas)], {"T": index})
    whole = emit.op("ConcatV2", "shape", [all_rows, rest, emit.const("shape/axis", 0, dtypes.int32)],
                    {"N": 2, "T": index, "Tidx": dtypes.int32})
    if index != dtypes.int32:
        rank = emit.op("Cast", "rank", [rank], {"SrcT": dtypes.int32, "DstT": index, "Truncate": False})
    begin = emit.op("Mul", "begin", [rows, rank], {"T": index})
    end = emit.op("AddV2", "end", [begin, rows], {"T": index})
    return whole, strided_slice("own", drawn, begin, end, dtype)


class _GraphEmitter:
    """Writes _every_replicas_rows' ops as nodes of the graph (inputs and outputs are
    Tensors). In a v1 while loop, a constant joins the loop's frame by a control input on
    ``anchor`` (a node of the frame), as TensorFlow's own constants in a loop body do."""

    def __init__(self, graph, scope, device, anchor=None):
        self.graph, self.scope, self.device, self.anchor = graph, scope, device, anchor

    def const(self, name, value, dtype):
        t = const(self.graph, f"{self.scope}/{name}", value, dtype, self.device)
        if self.anchor is not None:
            t.node.add_control_input(self.anchor)
        return t

    def op(self, op_type, name, inputs, attrs):
        if op_type == "ConcatV2":
            inputs = [inputs[:-1], inputs[-1]]
        return make_op(self.graph, op_type, f"{self.scope}/{name}", inputs, attrs=attrs,
                       device=self.device).output(0)


class _BodyEmitter:
    """Writes them into a FunctionDef's body (inputs and outputs are body references,
    ``node:output_arg:index``)."""

    def __init__(self, fn, scope):
        self.fn, self.scope = fn, scope
        self.taken = {nd.name for nd in fn.node_def}

    def _fresh(self, name):
        base = f"{self.scope}/{name}"
        out, i = base, 0
        while out in self.taken:
            i += 1
            out = f"{base}_{i}"
        self.taken.add(out)
        return out

    def const(self, name, value, dtype):
        return function_const(self.fn, self._fresh(name), value, dtype)

    def op(self, op_type, name, inputs, attrs):
        nd = function_node(self.fn, op_type, self._fresh(name), inputs, attrs)
        return f"{nd.name}:{opdefs.registered_op(op_type).output_arg[0].name}:0"


def _rewritten_functions(graph, call, draws, replicas):
    """Copies of every function the v2 cond or while loop ``call`` runs, each taking the
    replica's rank as its last argument (a while loop's body also returns it, a loop
    constant), with the listed draws rewritten; {original: copy}."""
    functions = {f.signature.name: f for f in graph.library.function}
    copies = {}
    for key, name in called_functions(call):
        copy = f"{name}_replica_rows"
        if copy not in functions:
            fn = functions[copy] = graph.library.function.add()
            fn.CopyFrom(functions[name])
            fn.signature.name = copy
            arg = fn.signature.input_arg.add()
            arg.name, arg.type = RANK_ARG, dtypes.int32.as_datatype_enum
            if key == "body":
                out = fn.signature.output_arg.add()
                out.name, out.type = RANK_ARG, dtypes.int32.as_datatype_enum
                fn.ret[RANK_ARG] = RANK_ARG
            for draw_name in draws.get(name, []):
                _rewrite_body_draw(fn, draw_name, replicas)
        copies[name] = copy
    return copies


def _rewrite_body_draw(fn, draw_name, replicas):
    draw = next(nd for nd in fn.node_def if nd.name == draw_name)
    od = opdefs.registered_op(draw.op)
    drawn = f"{draw.name}:{od.output_arg[0].name}:0"
    readers = [(nd, k) for nd in fn.node_def for k, ref in enumerate(nd.input) if ref == drawn]
    returns = [key for key, ref in fn.ret.items() if ref == drawn]
    emit = _BodyEmitter(fn, f"{draw.name}/replica_rows")
    shape, rows = _every_replicas_rows(emit, draw.input[0], drawn, RANK_ARG, replicas,
                                       _index_dtype(draw), _draw_dtype(draw))
    draw.input[0] = shape
    for nd, k in readers:
        nd.input[k] = rows
    for key in returns:
        fn.ret[key] = rows


def _call_copies(node, copies, rank):
    """Makes a replica's v2 cond or while loop call the copies, passing its rank last (a
    while loop also returns it: one more output, a scalar)."""
    for key, _ in called_functions(node):
        value = attr_value_pb2.AttrValue()
        value.CopyFrom(node.attr[key])
        for f in (value.list.func if value.HasField("list") else [value.func]):
            f.name = copies.get(f.name, f.name)
        node.set_attr(key, value)
    types = "T" if "body" in node.attr else "Tin"
    value = attr_value_pb2.AttrValue()
    value.CopyFrom(node.attr[types])
    value.list.type.append(dtypes.int32.as_datatype_enum)
    node.set_attr(types, value)
    if types == "T" and "output_shapes" in node.attr:
        shapes = attr_value_pb2.AttrValue()
        shapes.CopyFrom(node.attr["output_shapes"])
        shapes.list.shape.add()
        node.set_attr("output_shapes", shapes)
    node.add_input(rank)
