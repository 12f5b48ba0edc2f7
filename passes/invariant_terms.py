"""invariant_terms: a gradient term every replica computes alike is computed once.

A gradient's AddN may add a term computed from variables and constants alone (weight
decay's ``wd * w``: graph_rewriter/invariant_terms.py). It is the same on every
replica, and the all-reduce averages it back to itself, so for every AddN the plan lists
(plan.invariant_terms) the replica of group rank 0 adds the term R times and every
other replica leaves it out:

    replica 0:        AddN(g_0, t)  ─>  AddN(g_0, t x R)
    replicas 1..R-1:  AddN(g_k, t)  ─>  AddN(g_k)

    mean over the replicas: (g_0 + ... + g_{R-1} + R t) / R  =  mean(g) + t

which is one device's gradient as before (rounded differently: R t once, not t added R
times). The other replicas' copies of the term stay in the graph, unread by the
gradient; TensorFlow runs only what a fetch needs, so a run of the train op no longer
computes them there (nor what only they read: the weight-decay loss's backward and,
when the loss is not fetched, its forward). A fetch of the term by its name still
reads it. A template replica stands for replicas 1..R-1, so it leaves the term out for
all of them. Between-graph, only the task holding group rank 0 scales.
"""

from graph_rewriter import dtypes
from graph_rewriter.invariant_terms import ordered_ops
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass


class InvariantTermsPass(Pass):
    name = "invariant_terms"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"replicate"})   # it edits every replica's AddN

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.invariant_terms)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        if rm.group_size == 1 or not plan.invariant_terms:
            return False
        variables = {cut.key: set(cut.variables) for cut in plan.cuts}   # what each cut updates
        for i in rm.built:
            first = rm.first_replica + i == 0
            for key, name, terms in plan.invariant_terms:
                total = rm.node(graph, i, name)
                wanted = set(terms)
                positions = [pos for pos, t in enumerate(total.inputs) if _original_name(rm, i, t) in wanted]
                if first:
                    with graph.adding_to_replica(i):
                        for pos in positions:
                            total.set_input(pos, _times(graph, total.inputs[pos], rm.group_size, rm.devices[i]))
                else:
                    names = variables[key] | {rm.prefixes[i] + v for v in variables[key]}
                    waits = ordered_ops(total, positions, names)
                    total.set_inputs([t for pos, t in enumerate(total.inputs) if pos not in positions])
                    total.set_attr("N", len(total.inputs))
                    for n in waits:
                        total.add_control_input(n)
        return True


def _original_name(rm, i, tensor):
    """The original graph's name of replica ``i``'s ``tensor`` (its clone's name
    without the replica's prefix)."""
    prefix = rm.prefixes[i]
    name = tensor.name
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _times(graph, tensor, factor, device):
    """``tensor`` times the replica count, in its dtype."""
    name = f"{tensor.node.name}/times_{factor}"
    value = const(graph, f"{name}/factor", factor, dtypes.as_dtype(dtype_of(tensor)).name, device)
    return make_op(graph, "Mul", name, [tensor, value], device=device).output(0)
