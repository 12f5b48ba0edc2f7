"""lower_conds: a v2 cond that holds a batch statistic to synchronise becomes v1 control flow.

tf_keras' BatchNormalization called behind the Keras learning phase (``model(x)`` in a
TF1 graph, no ``training=True``) computes its fused BatchNorm in the branch function of
a v2 cond, an ``If`` op, and tf.gradients builds its backward pass as a second ``If`` on
the same predicate, whose branches read the forward branch's intermediates (the
reserve spaces, wrapped in ``OptionalFromValue``) through extra outputs of the first.
The batch_statistics pass rewrites ops of the graph, not of functions. So, when the
rewrite is to synchronise batch statistics and one is inside such a cond, this pass
lowers the cond as TensorFlow's runtime lowers it before running it anyway (an ``If``
carries ``_lower_using_switch_merge``): a Switch on the predicate per input, each
branch's body inlined reading its arguments from the Switch's output for that branch,
a Merge per output, the readers of the ``If``'s outputs reading the Merges.

The backward ``If`` on the same predicate is lowered with it, the way tf.gradients
builds the backward of a v1 cond: its branch reads the forward branch's values directly
(one predicate: both branches live or dead together) and an ``OptionalGetValue`` of an
``OptionalFromValue`` becomes the value itself. The forward's intermediate outputs then
have no reader but the unread Identities cond_v2 puts after every output (and the
ZerosLikes tf.gradients feeds the backward as their gradients), and go. What
is left is what ``tf.cond`` in v1 control flow builds: the FusedBatchNorm's reserve
spaces read only by its FusedBatchNormGrad, which the batch_statistics pass replaces.

Inlined nodes are named ``<if>/then/<body node>`` and ``<if>/else/<body node>`` (a body's
own ``gradients/`` scope becomes ``grad/``, so the backward ops stay in the scope of the
tf.gradients call that built the backward ``If``). ``ctx.lowered_statistics`` maps the
analysis' name of a statistic in a function (``call:function:node``) to its lowered
node's name, so the option and the plan's notes name it either way.

A v2 cond whose branch slices or splits a value of the batch's rows is lowered too,
whatever the options (DANN's label predictor on the source rows, ``tf.cond(train,
lambda: tf.slice(feature, [0, 0], [B // 2, -1]), lambda: feature)``): the analysis reads
the graph, not functions, and lowered, those rows taken by position start a product
head (graph_rewriter/product_heads.py). Its backward If needs only the cond's inputs,
not its intermediates, so it is found by its gradient scope (``gradients/<cond>_grad/``).
Nothing else is lowered: a graph without such a cond is unchanged.
"""

import re

from graph_rewriter import dtypes, opdefs
from graph_rewriter.analysis import _POSITIONAL, _SHAPE_ONLY, _reaches_rows, analyze
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import COLOCATION_ATTR
from graph_rewriter.op_builder import make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.protos import types_pb2
from graph_rewriter.traversal import unread_ancestors

_IFS = frozenset(("If", "StatelessIf"))
_BRANCHES = (("then", "then_branch", 1), ("else", "else_branch", 0))   # (name, attr, Switch output)


class LowerCondsPass(Pass):
    name = "lower_conds"
    provides = frozenset({"lowered_statistics"})
    after = frozenset({"saver"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and _syncs_statistics(ctx)

    def applies_to(self, graph, ctx):
        if ctx.num_replicas < 2:
            return False
        return _syncs_statistics(ctx) or bool(_positional_ifs(graph, _functions(graph)))

    def run(self, graph, ctx):
        ctx.lowered_statistics = {}
        functions = _functions(graph)
        ifs = [n for n in graph.nodes if n.op in _IFS]
        positional = _positional_ifs(graph, functions)
        analysis = analyze(graph, ctx.options.gradients)
        statistics = {}   # call -> [(function, body node, analysis name)]
        if _syncs_statistics(ctx):
            for name in analysis.batch_statistics:
                if name.count(":") == 2:
                    call, function, node = name.split(":")
                    statistics.setdefault(call, []).append((function, node, name))
        rows = {t.node for t in analysis.batch_inputs}
        taking = [c.name for c in positional if any(_reaches_rows(t, rows, strict=True) for t in c.inputs[1:])]
        holding = ["batch statistics"] * bool(statistics) + ["rows taken by position"] * bool(taking)
        for name in taking:
            statistics.setdefault(name, [])
        added, dropped, lowered, calls, renames = [], [], [], [], {}
        for call_name, found in statistics.items():
            call = graph.get(call_name)
            if call is not None and call_name in taking and not _lowerable(call, functions):
                _refuse_rows_in_unlowerable(call, functions)
            if call is None or not _lowerable(call, functions):
                continue   # the plan refuses the statistic, naming the function it is in
            # (the backward If reads the forward's intermediates, or, where it needs none,
            # only the forward's inputs: then its gradient scope's name tells it)
            scope = re.compile(r"(?:^|/)gradients(?:_\d+)?/" + re.escape(call.name) + "_grad/")
            candidates = [c for c, _ in call.consumers()] + [g for g in ifs if scope.search(g.name)]
            backward = [g for g in dict.fromkeys(candidates)
                        if g.op in _IFS and g.inputs[0] == call.inputs[0] and _lowerable(g, functions)]
            branch_of = {call.attr[attr].func.name: branch for branch, attr, _ in _BRANCHES}
            shared = {}
            for c in [call] + backward:
                done = _lower(graph, c, functions, shared, added, dropped)
                calls.append(c)
                if done is not None:
                    renames[done] = c.name
            for function, node, name in found:
                ctx.lowered_statistics[name] = f"{call_name}/{branch_of[function]}/{_body_name(node)}"
            lowered.append(f"'{call_name}'" + (f" (and its backward {', '.join(repr(g.name) for g in backward)})"
                                               if backward else ""))
        if not added:
            return False
        graph.remove_nodes(calls)   # (at once: each removal rebuilds the graph's name table)
        graph.rename_nodes(renames)
        ctx.info(f"lower_conds: {len(lowered)} v2 cond(s) holding {' or '.join(holding)} lowered to Switch and Merge: "
                 + ", ".join(lowered[:3]) + (f" and {len(lowered) - 3} more" if len(lowered) > 3 else ""))
        _bypass_optionals(graph, added)
        _remove_unread(graph, added + dropped)
        return True


def _syncs_statistics(ctx):
    given = ctx.plan is not None and ctx.plan.sync_batch_statistics
    return bool(ctx.options.sync_batch_statistics or given)


def _functions(graph):
    return {f.signature.name: f for f in graph.library.function} if graph.library is not None else {}


def _positional_ifs(graph, functions):
    """The v2 conds whose branch slices or splits a value of its arguments."""
    return [n for n in graph.nodes if n.op in _IFS and _branches_take_positions(n, functions)]


# ops that may take rows by their position (the analysis' own, but for a Reshape: a
# branch's own reshapes rarely group rows, and Keras' conds have many)
_TAKES_POSITIONS = _POSITIONAL - {"Reshape"}


def _branches_take_positions(call, functions):
    """True if a branch of the If ``call`` slices or splits a value computed from one of
    its arguments (not from a shape of one): DANN's ``tf.cond(train, lambda:
    tf.slice(feature, [0, 0], [B // 2, -1]), lambda: feature)``. The analysis looks at
    the graph, not into functions; lowered, the cond's rows taken by position are the
    graph's, and the product head computes them from every replica's rows."""
    for _, attr, _ in _BRANCHES:
        fn = functions.get(call.attr[attr].func.name)
        if fn is None:
            continue
        reached = {a.name for a in fn.signature.input_arg}
        for nd in _body_order(fn):
            reads = [i.split(":")[0] for i in nd.input if not i.startswith("^")]
            if nd.op in _SHAPE_ONLY or not any(r in reached for r in reads):
                continue
            if nd.op in _TAKES_POSITIONS:
                return True
            reached.add(nd.name)
    return False


def _refuse_rows_in_unlowerable(call, functions):
    """Refuses a v2 cond that takes the batch's rows by position (a slice or split along
    axis 0 in a branch) and cannot be lowered: left a function, each replica would take
    the positions of its own rows where one device takes the batch's, silently (a
    branch run for its effects too, a print or an assign inside a tf.function's cond:
    0.59 from one device in the loss after 3 steps at 2 replicas). A slice of the
    features only (``h[:, :2]``) takes no rows and is left as it is."""
    taken = _rows_taken_by_position(call, functions)
    if taken is None:
        return
    function, node = taken
    fn = functions[function]
    why = ("ops it runs for their effects (control outputs: a print, an assign)"
           if fn.control_ret or fn.signature.control_output else "attribute placeholders")
    raise GraphRewriteError(
        f"the v2 cond '{call.name}' takes the batch's rows by position in its branch '{function}' "
        f"('{node.name}', a {node.op} along axis 0), and that branch has {why}, which graph_rewriter "
        "cannot inline: each replica would take the positions of its own rows, not one device's",
        hint="take the rows outside the cond (slice first, then tf.cond on the slice), or move the "
             "print or assign out of the branch")


def _rows_taken_by_position(call, functions):
    """(function, NodeDef) of the first op in a branch of the If ``call`` that takes rows
    by position along axis 0 of a value computed from its arguments (a slice, a split, a
    gather along axis 0; a slice whose axis-0 bounds are no constants counts), or None."""
    for _, attr, _ in _BRANCHES:
        fn = functions.get(call.attr[attr].func.name)
        if fn is None:
            continue
        consts = {nd.name: nd for nd in fn.node_def if nd.op == "Const"}
        reached = {a.name for a in fn.signature.input_arg}
        for nd in _body_order(fn):
            reads = [i.split(":")[0] for i in nd.input if not i.startswith("^")]
            if nd.op in _SHAPE_ONLY or not any(r in reached for r in reads):
                continue
            value = 1 if nd.op == "Split" else 0   # (Split reads its axis first)
            if nd.op in _TAKES_ROWS and len(reads) > value and reads[value] in reached and _along_axis_0(nd, consts):
                return fn.signature.name, nd
            reached.add(nd.name)
    return None


# the ops of a branch _rows_taken_by_position looks at
_TAKES_ROWS = _TAKES_POSITIONS | {"Gather", "GatherV2", "ResourceGather"}


def _along_axis_0(nd, consts):
    """True if a body NodeDef takes rows along axis 0 of its value (its bounds or axis
    read from the body's constants; unknown ones count)."""
    def first(position):
        if position >= len(nd.input):
            return None
        c = consts.get(nd.input[position].split(":")[0])
        values = list(dtypes.int_values(c.attr["value"].tensor)) if c is not None else []
        return values[0] if values else None
    if nd.op == "StridedSlice":
        masks = {k: nd.attr[k].i for k in ("begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask",
                                            "new_axis_mask")}
        if masks["ellipsis_mask"] & 1 or masks["new_axis_mask"] & 1:
            return False
        whole = masks["begin_mask"] & 1 and masks["end_mask"] & 1 and not masks["shrink_axis_mask"] & 1
        return not (whole and first(3) in (1, None) and (first(3) == 1 or len(nd.input) < 4))
    if nd.op == "Slice":
        return not (first(1) == 0 and first(2) == -1)
    if nd.op == "Split":
        return first(0) in (0, None)
    if nd.op == "SplitV":
        return first(2) in (0, None)
    if nd.op in ("GatherV2", "ResourceGather"):
        return nd.op == "ResourceGather" or first(2) in (0, None)
    return nd.op == "Gather"


def _lowerable(call, functions):
    """An If whose two branches are library functions without control outputs or
    attribute placeholders (what inlining can copy as it is)."""
    if call.op not in _IFS:
        return False
    for _, attr, _ in _BRANCHES:
        fn = functions.get(call.attr[attr].func.name)
        if fn is None or fn.control_ret or fn.signature.control_output:
            return False
        if any(v.placeholder for nd in fn.node_def for v in nd.attr.values()):
            return False
    return True


def _body_name(name):
    return "grad/" + name[len("gradients/"):] if name.startswith("gradients/") else name


def _lower(graph, call, functions, shared, added, dropped):
    """Puts Switches, the two inlined branches and Merges in place of the If ``call``
    (left unread, for the caller to remove; returns the NoOp its control consumers now
    wait for, or None), appending the nodes it adds to ``added`` and the readers of its
    intermediates (cond_v2's Identities, tf.gradients' ZerosLikes for the backward If)
    to ``dropped``. ``shared``
    maps (branch, tensor of the graph) to the value a cond lowered before on the same
    predicate gives that branch for it (its branch's output for the Merge of one of its
    outputs, its Switch's for one of its inputs); it is read, and extended."""
    pred, controls, device = call.inputs[0], list(call.control_inputs), call.device
    tout = list(call.attr["Tout"].list.type)

    def op(op_type, suffix, inputs, control_inputs=()):
        node = make_op(graph, op_type, f"{call.name}/{suffix}", inputs, device=device, control_inputs=control_inputs)
        added.append(node)
        return node

    switch_pred = op("Switch", "switch_pred", [pred, pred], controls)
    pivots = {branch: op("Identity", f"pivot_{branch[0]}", [switch_pred.output(side)]) for branch, _, side in _BRANCHES}
    switches = {}

    def argument(branch, side, position):
        t = call.inputs[1 + position]
        if (branch, t) in shared:
            return shared[(branch, t)]
        if position not in switches:
            switches[position] = op("Switch", "Switch", [t, pred], controls)
        return switches[position].output(side)

    outputs = {}
    for branch, attr, side in _BRANCHES:
        fn = functions[call.attr[attr].func.name]
        args = {a.name: i for i, a in enumerate(fn.signature.input_arg)}
        outputs[branch] = _inline(graph, fn, f"{call.name}/{branch}/", device, pivots[branch], added,
                                  lambda arg, b=branch, s=side: argument(b, s, args[arg]))
    merges = [op("Merge", "Merge", [[f, t]]) for f, t in zip(outputs["else"], outputs["then"])]
    for k, merge in enumerate(merges):
        shared[("else", merge.output(0))], shared[("then", merge.output(0))] = outputs["else"][k], outputs["then"][k]
        if tout[k] == types_pb2.DT_VARIANT:
            dropped += [r for r, _ in call.consumers(k)]   # may go with the Merge, once unread
        graph.replace_all_uses(call.output(k), merge.output(0))
    for position, t in enumerate(call.inputs[1:]):
        if position in switches:
            for branch, _, side in _BRANCHES:
                shared.setdefault((branch, t), switches[position].output(side))
    if call.control_consumers:   # they wait for a NoOp that takes the If's name once it is gone
        done = op("NoOp", "done", [], [m for k, m in enumerate(merges) if tout[k] != types_pb2.DT_VARIANT])
        graph.replace_control_uses(call, done)
        return done
    return None


def _inline(graph, fn, prefix, device, pivot, added, argument):
    """Adds the body of ``fn`` under ``prefix`` (appending its nodes to ``added``);
    ``argument(name)`` gives the tensor an argument reads. A node with no inputs waits
    for ``pivot``, so that it is dead with its branch. Returns the tensors of the
    function's outputs, in order."""
    defs = {nd.name: nd for nd in fn.node_def}
    made = {}

    def tensor(ref):
        parts = ref.split(":")
        if len(parts) == 1:
            return argument(ref)
        return made[parts[0]].output(_flat_index(graph, defs[parts[0]], parts[1], int(parts[2])))

    colocated = []
    for nd in _body_order(fn):
        inputs = [tensor(s) for s in nd.input if not s.startswith("^")]
        controls = [made[s[1:]] for s in nd.input if s.startswith("^")] or ([] if inputs else [pivot])
        attrs = {k: v for k, v in nd.attr.items() if k != COLOCATION_ATTR}
        node = graph.add_node(graph.unique_name(prefix + _body_name(nd.name)), nd.op, inputs, controls,
                              attrs=attrs, device=nd.device or device)
        made[nd.name] = node
        added.append(node)
        if COLOCATION_ATTR in nd.attr:
            colocated.append((node, [s.decode()[len("loc:@"):] for s in nd.attr[COLOCATION_ATTR].list.s]))
    for node, names in colocated:   # (with the body's nodes; one outside it is not the body's to name)
        node.set_colocation([made[n] for n in names if n in made])
    return [tensor(fn.ret[a.name]) for a in fn.signature.output_arg]


def _body_order(fn):
    """The body's NodeDefs, each after the body nodes it reads (Kahn's algorithm; a
    FunctionDef lists them in any order)."""
    defs = {nd.name: nd for nd in fn.node_def}
    producers = {nd.name: {s.lstrip("^").split(":")[0] for s in nd.input} & defs.keys() for nd in fn.node_def}
    readers = {name: [] for name in defs}
    for name, ps in producers.items():
        for p in ps:
            readers[p].append(name)
    ready = [name for name in defs if not producers[name]]
    out = []
    while ready:
        name = ready.pop()
        out.append(defs[name])
        for r in readers[name]:
            producers[r].discard(name)
            if not producers[r]:
                ready.append(r)
    return out


def _flat_index(graph, nd, arg_name, index):
    """The output position of ``arg_name:index`` of a body node."""
    position = opdefs.output_position(nd, arg_name, index, graph.library)
    if position is None:
        raise KeyError(f"'{nd.name}' ({nd.op}) has no output argument '{arg_name}'")
    return position


def _bypass_optionals(graph, added):
    """An ``OptionalGetValue`` of an ``OptionalFromValue`` of one value reads the value:
    cond_v2 wraps a branch's intermediates in Optionals for the backward branches that
    do not have them; lowered, each backward branch reads its own forward branch's."""
    for n in added:
        if n.op == "OptionalGetValue" and n.graph.get(n.name) is n:
            source = n.inputs[0].node
            if source.op == "OptionalFromValue" and len(source.inputs) == 1:
                graph.replace_all_uses(n.output(0), source.inputs[0])


def _remove_unread(graph, candidates):
    """Removes the ``candidates`` that nothing but other such candidates reads and that
    change no state: the unread Switches, Merges, Optionals and the branch halves no
    output needs."""
    alive = [n for n in dict.fromkeys(candidates) if graph.get(n.name) is n]
    keep = set(alive)
    graph.remove_nodes(unread_ancestors(alive, (), lambda n: n in keep and not opdefs.is_stateful(n)))
