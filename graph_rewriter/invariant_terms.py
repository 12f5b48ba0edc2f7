"""Gradient terms every replica computes alike: found here, taken by passes/invariant_terms.py.

A variable's gradient is an AddN of what each of its uses contributes. A contribution
computed from variables and constants alone, and not from the batch (weight decay's
``wd * w``, the gradient of ``wd * tf.nn.l2_loss(w)``), is the same on every replica.
Every replica computing it and the all-reduce averaging it gives it back unchanged, so
one replica can add it R times and the others leave it out: the mean is the same (up
to rounding), and the others skip its work (on replicas that share a machine's cores,
that is the step's time; docs/performance.md).

A term counts as the same on every replica when every op its value depends on (through
data edges) is outside the batch's reach and reads nothing that may differ between the
replicas: no placeholder (a fed value may be split), no stateful op but a variable's
read (a random draw, a queue), no v1 control flow or function call (their predicates
and bodies are not looked into), and no variable each replica keeps rows of its own in
(a stateful RNN's state). Variables the rewrite keeps equal (weights, slots, step
counters, averaged statistics) may be read.

Leaving the terms out must not unorder what they ordered. TensorFlow runs a fetched
op as soon as its inputs are ready, and in one device's graph the update of a
variable waited for the reads its weight-decay term made (and, through the backward
pass's gating tuples, for the forward pass's ``l2_loss`` of it, which a fetched loss
reads): once replica k's sum no longer reads the term, a loss fetched with the train op
could read the variable after its update. So replica k's sum waits for the ops
``ordered_ops`` names: the reads of its own variables among everything the terms
depended on, data or control (a resource variable's read is a snapshot, and costs
nothing when nothing else needs it), the ops there that read a ref variable of its
own outside the terms (a ref read is no snapshot: the op itself must run first), and
the stateful ops there (a random draw's state advances as before).
"""

from graph_rewriter import opdefs
from graph_rewriter.op_vocabulary import FUNCTION_CALLS, PASS_THROUGH, PLACEHOLDERS, VARIABLE_OPS

# v1 control flow: a value through a Switch depends on its predicate, which this walk
# does not follow into the other input's meaning; a loop's values on its iteration.
_CONTROL_FLOW = frozenset(("Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
                           "NextIteration", "RefNextIteration", "LoopCond"))
# stateful ops that only read a variable: the same value on every replica when the
# variable's copies are equal
_VARIABLE_READS = frozenset(("ReadVariableOp",))
_LIMIT = 4096   # ops a term's value may depend on before the walk gives up (every replica keeps it)


def find_invariant_terms(cuts, variant, variables, local_rows):
    """[(cut key, AddN node, [input positions])]: the dense gradient cuts whose value
    is an AddN (or one scaled by a value the same on every replica: a loss scale's
    unscaling) with at least one input that is the same on every replica (module doc)
    and one that is not. ``variant``: the nodes whose value depends on the batch;
    ``variables``: {name: Variable}; ``local_rows``: names of variables each replica
    keeps rows of its own in."""
    good, out = set(), []
    library = cuts[0].values.node.graph.library if cuts else None
    functions = {f.signature.name for f in library.function} if library is not None else set()

    def alike(node):
        return _same_on_every_replica(node, variant, variables, local_rows, functions, good)
    for cut in cuts:
        if cut.role != "gradient" or cut.kind != "dense":
            continue
        total = _summed_by(cut.values, alike)
        if total is None:
            continue
        positions = [pos for pos, t in enumerate(total.inputs) if alike(t.node)]
        if positions and len(positions) < len(total.inputs):
            out.append((cut.key, total, positions))
    return out


def _summed_by(values, alike):
    """The AddN whose sum ``values`` is, through ops linear in it whose other operand
    is ``alike`` on every replica (Identity; a Mul or RealDiv by a loss scale), each
    the only reader of the one before; or None."""
    t = values
    for _ in range(16):
        n = t.node
        if n.op == "AddN":
            return n if t.index == 0 else None
        if n.op == "Identity":
            pos = 0
        elif n.op in ("Mul", "RealDiv") and alike(n.inputs[1].node):
            pos = 0
        elif n.op == "Mul" and alike(n.inputs[0].node):
            pos = 1
        else:
            return None
        t = n.inputs[pos]
        if [c for c, _ in t.node.consumers()] != [n]:
            return None
    return None


def ordered_ops(order, sums):
    """For each ``(total, positions, variable_names)`` of ``sums``, the ops that the sum
    ``total`` leaving out its inputs at ``positions`` must wait for (module doc), sorted
    by name, but those its other inputs wait for anyway. ``variable_names``: the names
    of the variables its cut updates (of the replica's copies too, once they exist).
    ``order``: the graph's nodes, producers before consumers. One walk back over
    ``order`` marks, for every node, which sums' terms depend on it (data or control),
    which by data alone, and which sums' other inputs depend on it."""
    from graph_rewriter.analysis import variable_of
    reached, data, kept = {}, {}, {}
    for j, (total, positions, _) in enumerate(sums):
        for pos, t in enumerate(total.inputs):
            marks = (reached, data) if pos in positions else (kept,)
            for mark in marks:
                mark[t.node] = mark.get(t.node, 0) | 1 << j
        for c in total.control_inputs:
            kept[c] = kept.get(c, 0) | 1 << j
    for n in reversed(order):
        r, d, k = reached.get(n, 0), data.get(n, 0), kept.get(n, 0)
        if not (r or k):
            continue
        for t in n.inputs:
            if r:
                reached[t.node] = reached.get(t.node, 0) | r
            if d:
                data[t.node] = data.get(t.node, 0) | d
            if k:
                kept[t.node] = kept.get(t.node, 0) | k
        for c in n.control_inputs:
            if r:
                reached[c] = reached.get(c, 0) | r
            if k:
                kept[c] = kept.get(c, 0) | k
    names = [found for _, _, found in sums]
    waits = [[] for _ in sums]
    for n, r in reached.items():
        r &= ~kept.get(n, 0)
        if not r or n.op in VARIABLE_OPS:
            continue
        if n.op in _VARIABLE_READS:
            var = variable_of(n.inputs[0])
            for j in _bits(r):
                if var is not None and var.name in names[j]:
                    waits[j].append(n)
        elif opdefs.is_stateful(n):
            for j in _bits(r):
                waits[j].append(n)
        elif n.op not in PASS_THROUGH:
            refs = [var.name for var in map(variable_of, n.inputs)
                    if var is not None and VARIABLE_OPS[var.op] == "ref"]
            for j in _bits(r & ~data.get(n, 0)) if refs else ():
                if any(name in names[j] for name in refs):
                    waits[j].append(n)
    return [sorted(w, key=lambda n: n.name) for w in waits]


def _bits(mask):
    """The positions of the bits set in ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _same_on_every_replica(node, variant, variables, local_rows, functions, good):
    """Whether ``node``'s value is the same on every replica (module doc); ``good``
    collects the nodes found so, for the next call."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in good or n in seen:
            continue
        if n in variant or len(seen) >= _LIMIT or not _reads_alike(n, variables, local_rows, functions):
            return False
        seen.add(n)
        stack.extend(t.node for t in n.inputs)
    good |= seen
    return True


def _reads_alike(n, variables, local_rows, functions):
    """Whether op ``n`` itself computes the same on every replica from equal inputs."""
    if n.op in VARIABLE_OPS:
        var = variables.get(n.name)
        return var is not None and var.name not in local_rows
    if n.op in PLACEHOLDERS or n.op in _CONTROL_FLOW or n.op in FUNCTION_CALLS or n.op in functions:
        return False   # (``functions``: the graph library's, which a node can call by name)
    return n.op in _VARIABLE_READS or not opdefs.is_stateful(n)
