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
keeps. Counts of the batch's rows the head reads (``tf.range(tf.shape(q)[0])`` as the
labels, a ``tf.eye`` of the batch) are recomputed from R times the replica's count.

``find`` returns the head (the plan stores it, passes/product_heads.py builds it) or
the reason it cannot be built, for the plan's note.
"""

import dataclasses
import re

from graph_rewriter import dtypes, opdefs
from graph_rewriter.op_builder import dtype_of

COUNT_OPS = frozenset(("Shape", "Size"))
# ops that sum the gradients a tensor receives from its readers (tf.gradients' aggregation)
_AGGREGATIONS = frozenset(("AddN", "AccumulateNV2", "Identity"))
# stateful ops a head may hold: summaries of its values
_SUMMARIES = frozenset(("ScalarSummary", "HistogramSummary", "MergeSummary", "WriteScalarSummary",
                        "WriteHistogramSummary"))
_BACKWARD = re.compile(r"(?:^|(?<=/))gradients(?:_\d+)?/")


@dataclasses.dataclass
class ProductHead:
    products: list    # the in-batch products (MatMul names)
    head: list        # the forward ops computed over every replica's rows, in graph order
    gathered: list    # [[tensor, [[reader, input position]]]]: rows the head reads, gathered
    count_ops: list   # nodes computing counts of rows the head reads, from a Shape or Size up
    count_leaves: list  # those Shapes and Sizes of the batch's rows: R times the replica's
    counts: list      # [[tensor, [[reader, input position]]]]: those counts, R times the replica's
    gradients: list   # [[tensor, [[reader, input position]]]]: the head's gradients of rows

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def in_backward(name, scopes=()):
    """True if a node is in a backward pass tf.gradients built, its aggregation and its
    seed included ("gradients/AddN", "gradients/Fill"), not only an op's "_grad/" scope."""
    return _BACKWARD.search(name) is not None or any(name.startswith(s) or "/" + s in name for s in scopes)


def find(order, products, seed_nodes, variant0, scopes, elsewhere):
    """(ProductHead, None) for the in-batch ``products`` (nodes), or (None, why not).
    ``order``: the graph's nodes in topological order; ``seed_nodes``: the batch
    inputs' nodes; ``variant0``: the nodes that depend on the batch; ``scopes``: the
    graph's named gradient scopes; ``elsewhere``: names of nodes other passes rewrite
    (normalizers, batch statistics, ...), which a head must not hold."""
    from graph_rewriter.analysis import (_FUNCTIONAL, _holds_rows, _reaches_rows, gradient_scopes,
                                         in_gradients_scope, loop_frames)
    position = {n: i for i, n in enumerate(order)}
    head, stack = set(), list(products)
    while stack:
        n = stack.pop()
        if n in head:
            continue
        head.add(n)
        stack.extend(c for c, _ in n.consumers() if not in_backward(c.name, scopes))
    for n in sorted(head, key=position.get):
        if n.name in elsewhere:
            return None, f"'{n.name}' in it is rewritten for another reason ({elsewhere[n.name]})"
        if n.op in _FUNCTIONAL or loop_frames(n):
            return None, f"'{n.name}' ({n.op}) in it runs functions or a while loop"
        if (opdefs.is_stateful(n) and n.op not in _SUMMARIES) or opdefs.resource_positions(n):
            return None, f"'{n.name}' ({n.op}) in it has state (a random op, a variable's update)"

    def holds_rows(t):
        return _holds_rows(t, seed_nodes) and _reaches_rows(t, seed_nodes, strict=True)

    def count_chain(t, limit=256):
        """The nodes between ``t`` and the counts of rows it is computed from, or None
        if it reads the batch's values."""
        chain, stack = set(), [t.node]
        while stack:
            n = stack.pop()
            if n in chain or n not in variant0:
                continue
            if len(chain) > limit or n in seed_nodes or n.op in _FUNCTIONAL or loop_frames(n) \
                    or opdefs.is_stateful(n) or in_backward(n.name, scopes):
                return None
            chain.add(n)
            if n.op in COUNT_OPS and _reaches_rows(n.inputs[0], seed_nodes, strict=True):
                leaves.add(n)
                continue
            stack.extend(i.node for i in n.inputs)   # (a Shape of a count's one-hot: its copy's)
        return chain if leaves & chain else None

    gathered, counts, chain, leaves = {}, {}, set(), set()
    for h in sorted(head, key=position.get):
        for pos, t in enumerate(h.inputs):
            if t.node in head or t.node not in variant0:
                continue
            if t in gathered or holds_rows(t):
                gathered.setdefault(t, []).append([h.name, pos])
                continue
            found = count_chain(t) if t not in counts else set()
            if found is None:
                return None, (f"'{h.name}' in it reads '{t.name}', a value of the batch that is neither "
                              "its rows nor a count of them")
            chain |= found
            counts.setdefault(t, []).append([h.name, pos])
    if not any(dtypes.as_dtype(dtype_of(t)).is_floating for t in gathered):
        return None, "it reads no floating-point rows of the batch"

    backward = set()
    for members in gradient_scopes(order, {n.name: n for n in head}).values():
        backward.update(members)
    for b in sorted(backward, key=position.get):
        for pos, t in enumerate(b.inputs):
            if t.node in backward or t.node in head:
                continue
            if t in gathered:
                gathered[t].append([b.name, pos])
            elif t in counts:
                counts[t].append([b.name, pos])
            elif t.node in variant0 and not in_backward(t.node.name, scopes):
                return None, f"its backward '{b.name}' reads '{t.name}', a forward value of the batch"

    # the backward of the forward ops the gathered rows come from: where their gradients go
    encoder, stack = set(), [t.node for t in gathered]
    while stack:
        n = stack.pop()
        if n in encoder or n in head or n not in variant0 or n in seed_nodes:
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
                gradients.setdefault(c.inputs[pos], []).append([c.name, pos])

    ordered = sorted(head, key=position.get)
    return ProductHead(
        products=[n.name for n in products], head=[n.name for n in ordered],
        gathered=[[t.name, readers] for t, readers in sorted(gathered.items(), key=lambda e: _key(e[0], position))],
        count_ops=[n.name for n in sorted(chain, key=position.get)],
        count_leaves=[n.name for n in sorted(leaves, key=position.get)],
        counts=[[t.name, readers] for t, readers in sorted(counts.items(), key=lambda e: _key(e[0], position))],
        gradients=[[t.name, readers] for t, readers in
                   sorted(gradients.items(), key=lambda e: _key(e[0], position))]), None


def _key(tensor, position):
    return position[tensor.node], tensor.index
