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
times). The other replicas' copies of the term, and the ops only they read (the
weight-decay loss's backward), are removed; the ops they waited for stay, and the sum
waits for those (graph_rewriter/invariant_terms.py: ``ordered_ops``), and a copy a
merged fetch names (the ``merge`` and ``outputs`` options) stays too. TensorFlow runs
only what a fetch needs, so unless the loss is fetched the weight-decay loss's forward
no longer runs there either. A template replica stands for replicas 1..R-1, so it
leaves the term out for all of them. Between-graph, only the task holding group rank 0
scales.
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
        kept = set(ctx.options.merge or ()) | set(ctx.options.outputs or ())   # fetched by name: merged
        kept = {name.split(":")[0] for name in kept}
        for i in rm.built:
            entries = [(key, rm.node(graph, i, name), set(terms)) for key, name, terms in plan.invariant_terms]
            sums = [(total, [pos for pos, t in enumerate(total.inputs) if _original_name(rm, i, t) in terms],
                     variables[key] | {rm.prefixes[i] + v for v in variables[key]})
                    for key, total, terms in entries]
            if rm.first_replica + i == 0:
                with graph.adding_to_replica(i):
                    for total, positions, _ in sums:
                        for pos in positions:
                            total.set_input(pos, _times(graph, total.inputs[pos], rm.group_size, rm.devices[i]))
                continue
            left_out = []
            for (total, positions, _), waits in zip(sums, ordered_ops(graph.topological_nodes(), sums)):
                left_out += [total.inputs[pos].node for pos in positions]
                total.set_inputs([t for pos, t in enumerate(total.inputs) if pos not in positions])
                total.set_attr("N", len(total.inputs))
                for n in waits:
                    total.add_control_input(n)
            graph.remove_nodes(_unread(rm, i, left_out, kept))
        return True


def _unread(rm, i, starts, kept):
    """Replica ``i``'s nodes, from ``starts`` up, that nothing reads any more once the
    terms are left out (the other replicas' copies of a term would be ops only a fetch of
    a replica's own name runs: the final check takes each such op for a step that runs
    one replica's collectives). ``kept``: original names a merged fetch reads."""
    dead, stack = set(), list(starts)
    while stack:
        n = stack.pop()
        if n in dead or n.replica != i or _original_name(rm, i, n) in kept:
            continue
        if all(r in dead for r in n.readers()):
            dead.add(n)
            stack.extend(t.node for t in n.inputs)
            stack.extend(n.control_inputs)
    return dead


def _original_name(rm, i, tensor):
    """The original graph's name of replica ``i``'s ``tensor`` or node (its clone's
    name without the replica's prefix)."""
    prefix = rm.prefixes[i]
    name = tensor.name
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _times(graph, tensor, factor, device):
    """``tensor`` times the replica count, in its dtype."""
    name = f"{tensor.node.name}/times_{factor}"
    value = const(graph, f"{name}/factor", factor, dtypes.as_dtype(dtype_of(tensor)).name, device)
    return make_op(graph, "Mul", name, [tensor, value], device=device).output(0)
