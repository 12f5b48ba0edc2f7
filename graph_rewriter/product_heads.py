"""The head of an in-batch product: what the forward pass computes from rows that meet
every other row of the batch, and what a replica must exchange to compute it as one device.

A dual encoder's ``tf.matmul(queries, documents, transpose_b=True)`` meets every query
with every document of the batch; the loss over those logits (each query against its
own document among all of them) is the "head". A replica holding its own n = B / R
rows would meet each query with n documents, not B. Instead every replica computes the
head over every replica's rows, and keeps its own rows' share of the gradient:

    replica r:  q_r, d_r ─> CollectiveGatherV2 ─> q, d [B rows] ─> the head ─> loss (one device's)
                                                   the head's backward ─> dq, dd [B rows]
                dq_r = R * dq[r n : (r+1) n] ─> the backward of the encoders (its own rows)

Every replica's loss is one device's. The head's gradient of a row is one device's
gradient of that row, whichever replica computes it; the replica's encoder turns its own
rows' into J_r^T dq_r, and the all-reduce's mean over the replicas of R times that is
the sum over the rows, one device's gradient. A variable the head reads itself (a
learned temperature) gets one device's whole gradient on every replica, which the mean
keeps. Values the head reads that are computed from the batch's rows and counts of them
(the labels ``tf.range(tf.shape(q)[0])``, a ``tf.eye`` of the batch, a triplet loss's mask
of equal labels) are computed again, from every replica's rows and R times the
replica's count.

``find`` returns the head (the plan stores it, passes/product_heads.py builds it) or
the reason it cannot be built, for the plan's note.
"""

import dataclasses
from graph_rewriter import dtypes, opdefs
from graph_rewriter.op_builder import dtype_of

COUNT_OPS = frozenset(("Shape", "Size"))
# ops that sum the gradients a tensor receives from its readers (tf.gradients' aggregation)
_AGGREGATIONS = frozenset(("AddN", "AccumulateNV2", "Identity"))
# stateful ops a head may hold: summaries, prints and assertions of its values
_HARMLESS_STATE = frozenset(("ScalarSummary", "HistogramSummary", "MergeSummary", "WriteScalarSummary",
                             "WriteHistogramSummary", "Print", "PrintV2", "StringFormat", "Assert"))


@dataclasses.dataclass
class ProductHead:
    products: list    # the in-batch products (MatMul names)
    head: list        # the forward ops computed over every replica's rows, in graph order
    gathered: list    # [[tensor, [[reader, input position]]]]: rows the head reads (or its
    #                   copied ops: those readers keep the replica's, their copies read these), gathered
    copied_ops: list  # nodes the head computes again from every replica's rows (gathered) and
    #                   counts of them (the labels tf.range(tf.shape(q)[0]), a mask of equal labels)
    count_leaves: list  # the Shapes and Sizes of the batch's rows among them: R times the replica's
    copied: list      # [[tensor, [[reader, input position]]]]: their values the head reads
    gradients: list   # [[tensor, [[reader, input position]]]]: the head's gradients of rows


def find(order, products, seed_nodes, variant0, scopes, elsewhere):
    """(ProductHead, None) for the in-batch ``products`` (nodes), or (None, why not).
    ``order``: the graph's nodes in topological order; ``seed_nodes``: the batch
    inputs' nodes; ``variant0``: the nodes that depend on the batch; ``scopes``: the
    graph's named gradient scopes; ``elsewhere``: names of nodes other passes rewrite
    (normalizers, batch statistics, ...), which a head must not hold."""
    from graph_rewriter.analysis import _FUNCTIONAL, gradient_scopes, in_backward, in_gradients_scope, loop_frames
    position = {n: i for i, n in enumerate(order)}
    head, stack = set(), list(products)
    while stack:
        n = stack.pop()
        if n in head:
            continue
        head.add(n)
        stack.extend(c for c, _ in n.consumers() if not in_backward(c.name, scopes))
    grown = True
    while grown:   # (in the graph's order, until no branch adds more: the same head whatever the order)
        grown = False
        for t in sorted({t for n in head for t in n.inputs if t.node not in head},
                        key=lambda t: (position[t.node], t.index)):
            more = branch_back_to_switches(t, head, variant0, seed_nodes) - head
            if more:
                head |= more
                grown = True
    for n in sorted(head, key=position.get):
        if n.name in elsewhere:
            return None, f"'{n.name}' in it is rewritten for another reason ({elsewhere[n.name]})"
        if n.op in _FUNCTIONAL or loop_frames(n):
            return None, f"'{n.name}' ({n.op}) in it runs functions or a while loop"
        if (opdefs.is_stateful(n) and n.op not in _HARMLESS_STATE) or opdefs.resource_positions(n):
            return None, f"'{n.name}' ({n.op}) in it has state (a random op, a variable's update)"

    def holds_rows(t):
        return holds_batch_rows(t, seed_nodes)

    def recomputed(t):
        return recomputed_from_rows(t, seed_nodes, variant0, scopes, elsewhere)

    gathered, copied, chain, leaves = {}, {}, set(), set()
    for h in sorted(head, key=position.get):
        for pos, t in enumerate(h.inputs):
            if t.node in head:
                continue
            if t in gathered or holds_rows(t):   # (a batch input itself among them)
                gathered.setdefault(t, []).append([h.name, pos])
                continue
            if t.node not in variant0:
                continue
            if t not in copied:
                found = recomputed(t)
                if found is None:
                    return None, (f"'{h.name}' in it reads '{t.name}', a value of the batch computed otherwise "
                                  "than from its rows and their count")
                chain |= found[0]
                leaves |= found[2]
                for r, readers in found[1].items():   # (copies read them: passes/product_heads.py)
                    gathered.setdefault(r, []).extend(readers)
            copied.setdefault(t, []).append([h.name, pos])
    if not any(dtypes.as_dtype(dtype_of(t)).is_floating for t in gathered):
        return None, "it reads no floating-point rows of the batch"

    # the backward of the head and of the ops it computes again (a gradient through the
    # copy of ``tf.expand_dims(norms, 0)`` is the gradient of the gathered norms)
    backward = set()
    for members in gradient_scopes(order, lowered_conds_named({n.name: n for n in head | chain})).values():
        backward.update(members)
    backward |= untaken_branch_zeros(backward, head, gathered, scopes)
    for b in sorted(backward, key=position.get):
        for pos, t in enumerate(b.inputs):
            if t.node in backward or t.node in head:
                continue
            if t in gathered:
                gathered[t].append([b.name, pos])
            elif t in copied or t.node in chain:
                copied.setdefault(t, []).append([b.name, pos])
            elif t.node in variant0 and not in_backward(t.node.name, scopes):
                return None, f"its backward '{b.name}' reads '{t.name}', a forward value of the batch"

    # the backward of the forward ops the gathered rows come from: where their gradients go
    encoder, stack = set(), [t.node for t in gathered]
    while stack:
        n = stack.pop()
        if n in encoder or n in head or n in chain or n not in variant0 or n in seed_nodes:
            continue
        encoder.add(n)
        stack.extend(i.node for i in n.inputs)
    into_encoder = set()
    for members in gradient_scopes(order, {n.name: n for n in encoder}).values():
        into_encoder.update(members)

    def destination(c, depth=0):
        """"rows" if the gradient ``c`` reads goes to the encoders' backward (through
        tf.gradients' sums of a tensor's gradients), "other" if elsewhere (a variable the
        head reads), "both" if to both."""
        if c in into_encoder:
            return "rows"
        if c.op in _AGGREGATIONS and in_backward(c.name, scopes) and not in_gradients_scope(c.name, scopes) \
                and depth < 16:
            found = {destination(d, depth + 1) for d, _ in c.consumers()}
            return found.pop() if len(found) == 1 else ("both" if found else "other")
        return "other"

    gradients = {}
    for b in sorted(backward, key=position.get):
        for c, pos in b.consumers():
            if c in backward:
                continue
            if c in head:
                return None, f"'{c.name}' in it reads '{c.inputs[pos].name}' of its backward"
            where = destination(c)
            if where == "both":
                return None, f"'{c.inputs[pos].name}' of its backward is a gradient of rows and of something else"
            if where == "rows":
                t = c.inputs[pos]
                if not dtypes.as_dtype(dtype_of(t)).is_floating:
                    # (a gather's backward hands on an IndexedSlices whose reader densifies
                    # it: its indices and dense shape cross too, and no rows are in them)
                    return None, (f"its backward hands the rows' backward '{t.name}', no gradient of rows "
                                  f"(the indices or shape of a gather's sparse gradient, read by '{c.name}')")
                gradients.setdefault(t, []).append([c.name, pos])

    ordered = sorted(head, key=position.get)
    return ProductHead(
        products=[n.name for n in products], head=[n.name for n in ordered],
        gathered=tensors_in_order(gathered, position),
        copied_ops=names_in_order(chain, position),
        count_leaves=names_in_order(leaves, position),
        copied=tensors_in_order(copied, position),
        gradients=tensors_in_order(gradients, position)), None


def branch_back_to_switches(t, head, variant0, seed_nodes, limit=256):
    """The ops from ``t`` back to the Switches it is computed from when ``t`` is a value
    of the batch computed in a branch of a v1 cond whose predicate is the same on every
    replica (DANN's ``tf.cond(train, lambda: tf.slice(feature, [0, 0], [B // 2, -1]),
    lambda: feature)``), so that the head computes the branch itself from what the
    Switches take: gathered, a Switch's output in the branch not taken would be a dead
    tensor, which no collective gathers. The walk ends at such Switches or at the head's
    own ops (a branch's op reading a Switch an earlier walk added); empty for a value
    computed outside any cond (the walk reaches the batch, or an earlier cond's Merge)."""
    if t.node not in variant0:
        return set()
    found, stack, ends = set(), [t.node], False
    while stack:
        n = stack.pop()
        if n in found:
            continue
        if n in head:
            ends = True
            continue
        if n.op in ("Switch", "RefSwitch"):
            if n.inputs[1].node in variant0:
                return set()   # (a cond the batch decides: not the head's)
            found.add(n)
            ends = True
            continue
        if n in seed_nodes or n.op in ("Merge", "RefMerge", "Enter", "Exit", "NextIteration") or len(found) > limit:
            return set()
        found.add(n)
        stack.extend(i.node for i in n.inputs if i.node in variant0 or i.node in seed_nodes)
    return found if ends else set()


def lowered_conds_named(named):
    """``named`` ({name: node}) with the name of each v2 cond that passes/lower_conds.py
    lowered in it (its ops are ``<cond>/then/...`` and ``<cond>/else/...``): the
    backward of that cond, lowered with it, is named in the cond's gradient scope
    (``gradients/<cond>_grad/...``), and the cond is no op of the graph any more."""
    out = dict(named)
    for name, n in named.items():
        for branch in ("/then/", "/else/"):
            k = name.find(branch)
            if k > 0:
                out.setdefault(name[:k], n)
    return out


# the ops of tf.gradients' zeros for a v1 cond's branch not taken
_ZEROS_OPS = frozenset(("Switch", "Identity", "Shape", "Fill", "Const", "ZerosLike"))


def untaken_branch_zeros(backward, head, gathered, scopes):
    """The ops of tf.gradients' zeros that the backward of a head's v1 cond reads: the
    gradient of a Switch is a Merge of its two outputs' gradients, and the output no
    gradient reaches (its branch's) gets the zeros of ``Fill(Shape(Switch(input)))``,
    named at the root of the gradients scope, not the Switch's. Where that Switch reads
    rows the head takes, those zeros are the head's too (of every replica's rows: the
    Merge adds them to the rows' gradient)."""
    found = set()
    for b in backward:
        for t in b.inputs:
            found |= _zeros_from(t.node, backward, head, gathered, scopes)
    return found


def _zeros_from(start, backward, head, gathered, scopes):
    """The zeros' ops from ``start`` back to a Switch of rows the head takes, or none."""
    from graph_rewriter.analysis import in_backward
    zeros, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in backward or n in zeros:
            continue
        if n.op not in _ZEROS_OPS or not in_backward(n.name, scopes):
            return set()
        zeros.add(n)
        if n.op != "Switch":
            stack.extend(i.node for i in n.inputs)
        elif not (n.inputs[0] in gathered or n.inputs[0].node in head):
            return set()
    return zeros if any(n.op == "Switch" for n in zeros) else set()


def holds_batch_rows(t, seed_nodes):
    """True if tensor ``t`` holds rows of the batch along its first axis (a batch input,
    or computed from one through ops that keep its rows)."""
    from graph_rewriter.analysis import _holds_rows, _reaches_rows
    return _holds_rows(t, seed_nodes) and _reaches_rows(t, seed_nodes, strict=True)


def recomputed_from_rows(t, seed_nodes, variant0, scopes, elsewhere, draws_ok=False, limit=256):
    """(the nodes between ``t`` and the rows and counts of rows it is computed from, which
    a copy computes again from every replica's; {rows among them: [[reader, input
    position]]}; the Shapes and Sizes of rows among them), or None if ``t`` reads the
    batch otherwise (a stateful op, a loop, a function, what another rule rewrites).
    ``draws_ok``: a seeded RandomShuffle may be among them (its copies draw what one
    device draws: the same seeds, the same count of rows)."""
    from graph_rewriter.analysis import _FUNCTIONAL, _reaches_rows, in_backward, loop_frames
    chain, rows, counts_of, stack = set(), {}, set(), [(t, None)]
    while stack:
        u, reader = stack.pop()
        n = u.node
        if u is not t and holds_batch_rows(u, seed_nodes):   # (a batch input among them)
            rows.setdefault(u, []).append(reader)
            continue
        if n in chain or n not in variant0:
            continue
        stateful = opdefs.is_stateful(n) and not (draws_ok and is_seeded_shuffle(n))
        if len(chain) > limit or n in seed_nodes or n.op in _FUNCTIONAL or loop_frames(n) \
                or stateful or in_backward(n.name, scopes) or n.name in elsewhere:
            return None
        chain.add(n)
        if n.op in COUNT_OPS and _reaches_rows(n.inputs[0], seed_nodes, strict=True):
            counts_of.add(n)
            continue
        stack.extend((i, [n.name, pos]) for pos, i in enumerate(n.inputs))   # (a Shape of a count's one-hot)
    return (chain, rows, counts_of) if rows or counts_of else None


def is_seeded_shuffle(n):
    """A RandomShuffle with a seed: every copy of it draws the same permutation."""
    return n.op == "RandomShuffle" and bool(n.attr["seed"].i or n.attr["seed2"].i)


def tensors_in_order(readers_of, position):
    """[[tensor name, its readers]] for {tensor: readers}, in the graph's order
    (``position``: {node: its place}) and then by output index: a plan entry's lists."""
    return [[t.name, readers] for t, readers in sorted(readers_of.items(),
                                                       key=lambda e: (position[e[0].node], e[0].index))]


def names_in_order(nodes, position):
    """The names of ``nodes`` in the graph's order."""
    return [n.name for n in sorted(nodes, key=position.get)]
