"""Where a tensor holds the batch's rows, and where two tensors' rows meet.

A contrastive loss meets every row of the batch with every other in a product over the
features, written in many ways: ``tf.matmul(q, d, transpose_b=True)``, ``tf.matmul(q,
tf.transpose(d))``, ``tf.einsum("id,jd->ij", q, d)``, ``tf.tensordot(q, d, [[1], [1]])``,
``tf.reduce_sum(q[:, None, :] * d[None, :, :], -1)``, pairwise distances
``tf.expand_dims(q, 1) - tf.expand_dims(d, 0)``. Each holds the rows of one operand on one
axis of its output and the rows of the other on another. ``rows_axis`` follows a tensor's
rows from where the strict row walk finds them on axis 0 through the ops that move that
axis (a transpose by a constant permutation, an expand_dims, a new axis by ``x[None]`` or
``x[:, None]``, tf.tensordot's reshape of a transpose to its own shape, an element-wise
op of one operand, a reduction over other axes); ``meets_rows``
says whether an op's operands' rows land on different axes of its output.
"""

from graph_rewriter.op_vocabulary import ELEMENTWISE

# element-wise ops of two operands that broadcast them against each other
# (comparisons too: a metric loss's ``tf.equal(labels, tf.transpose(labels))``, the
# pairs of rows of one class)
_BROADCASTING = frozenset(("Mul", "Sub", "Add", "AddV2", "RealDiv", "Div", "DivNoNan", "MulNoNan",
                           "SquaredDifference", "Maximum", "Minimum", "Pow", "Equal", "NotEqual", "Less",
                           "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr"))
# element-wise ops of one operand: its rows are on the output's same axis
_UNARY = frozenset(("Neg", "Reciprocal", "Square", "Sqrt", "Rsqrt", "Abs", "Sign", "Exp", "Log", "Tanh",
                    "Sigmoid", "Cast", "LogicalNot"))
# the ops meets_rows looks at
MEETING_OPS = frozenset(("MatMul", "Einsum")) | _BROADCASTING


def rows_axis(tensor, holds_rows, depth=0, elementwise=False, memo=None):
    """The axis of ``tensor`` holding the batch's rows (0 where ``holds_rows(tensor)``,
    the strict walk), or None. ``elementwise``: also through element-wise ops, whose
    operands holding rows hold them on one axis counted from the last (SwAV's
    Sinkhorn normalises a transposed [classes, rows] matrix so, step after step: up to
    40 ops deep, each tensor looked at once)."""
    if memo is None:
        memo = {}
    if tensor not in memo:
        memo[tensor] = _rows_axis(tensor, holds_rows, depth, elementwise, memo)
    return memo[tensor]


def _rows_axis(tensor, holds_rows, depth, elementwise, memo):
    """rows_axis' cases, for one tensor."""
    from graph_rewriter.analysis import _STATISTICS, _strip_identity, static_rank
    if holds_rows(tensor):
        return 0
    if depth > (40 if elementwise else 8):
        return None
    t = _strip_identity(tensor)
    n = t.node

    def inner(u):
        return rows_axis(u, holds_rows, depth + 1, elementwise, memo)
    if t is not tensor:
        return inner(t)
    if n.op == "Transpose":
        perm = _const_ints(n.inputs[1])
        a = inner(n.inputs[0])
        return perm.index(a) if perm is not None and a in perm else None
    if n.op == "ExpandDims":
        at, rank = _const_ints(n.inputs[1]), static_rank(n.inputs[0])
        a = inner(n.inputs[0])
        if a is None or not at or len(at) != 1 or (at[0] < 0 and rank is None):
            return None
        c = at[0] + rank + 1 if at[0] < 0 else at[0]
        return a + 1 if c <= a else a
    if n.op == "StridedSlice":
        return sliced_axis(n, inner(n.inputs[0]))
    if n.op == "Reshape" and _tensordot_reshape(n):
        return inner(n.inputs[0])
    if n.op in _UNARY:
        return inner(n.inputs[0])
    if n.op in _STATISTICS:
        # (a reduction over constant axes keeps the rows, on an axis counted again
        # without the reduced ones: a pairwise distance's squared norms of the transposed
        # rows, reduce_sum(square(tf.transpose(f)), [0], keepdims=True), on axis 1)
        a, axes, rank = inner(n.inputs[0]), _const_ints(n.inputs[1]), static_rank(n.inputs[0])
        if a is None or axes is None or (rank is None and any(v < 0 for v in axes)):
            return None
        axes = {v + rank if v < 0 else v for v in axes}
        if a in axes:
            return None
        return a if n.attr["keep_dims"].b else a - sum(1 for v in axes if v < a)
    if elementwise and n.op in _BROADCASTING | ELEMENTWISE:
        ends = set()
        for u in n.inputs:
            a = inner(u)
            if a is not None:
                rank = static_rank(u)
                ends.add(None if rank is None else a - rank)
        rank = static_rank(tensor)
        return rank + ends.pop() if len(ends) == 1 and None not in ends and rank is not None else None
    return None


def meets_rows(node, holds_rows):
    """True if ``node`` puts the rows of its two operands on two different axes of its
    output: a MatMul whose operands' rows are both free (not contracted), an Einsum
    whose operands' row letters differ and are both kept, a broadcasting element-wise op
    whose operands' rows, aligned from the last axis, differ."""
    from graph_rewriter.analysis import static_rank
    if node.op == "MatMul":
        a, b = (rows_axis(t, holds_rows) for t in node.inputs[:2])
        return a == (1 if node.attr["transpose_a"].b else 0) and b == (0 if node.attr["transpose_b"].b else 1)
    if node.op == "Einsum" and len(node.inputs) == 2:
        equation = node.attr["equation"].s.decode().replace(" ", "")
        terms, _, out = equation.partition("->")
        terms = terms.split(",")
        if "." in equation or len(terms) != 2:
            return False
        letters = []
        for term, t in zip(terms, node.inputs):
            a = rows_axis(t, holds_rows)
            if a is None or a >= len(term):
                return False
            letters.append(term[a])
        return letters[0] != letters[1] and all(c in out for c in letters)
    if node.op in _BROADCASTING and len(node.inputs) == 2:
        axes = [rows_axis(t, holds_rows) for t in node.inputs]
        if None in axes:   # (before the ranks: most element-wise ops hold no rows)
            return False
        ranks = [static_rank(t) for t in node.inputs]
        # the axes counted from the last one
        return None not in ranks and axes[0] - ranks[0] != axes[1] - ranks[1]
    return False


def _const_ints(tensor, depth=0):
    """The values of an integer vector computed from constants alone, or None: a
    constant, a ConcatV2 of such vectors along axis 0 (tf.tensordot's permutation), a
    Range, Pack, Sub or AddV2 of such scalars (tf.nn.softmax(x, axis=0) swaps the axis
    with the last by a permutation it builds so from the constant rank)."""
    from graph_rewriter.analysis import _int_const, _strip_identity
    n = _strip_identity(tensor).node
    if depth > 8:
        return None
    if n.op == "ConcatV2" and len(n.inputs) >= 2 and _int_const(n.inputs[-1]) == [0]:
        parts = [_const_ints(t, depth + 1) for t in n.inputs[:-1]]
        return None if None in parts else [v for p in parts for v in p]
    if n.op in ("Range", "Pack", "Sub", "AddV2"):
        args = [_const_ints(t, depth + 1) for t in n.inputs]
        if None in args or any(len(a) != 1 for a in args):
            return None
        a = [v[0] for v in args]
        if n.op == "Range":
            return list(range(*a)) if a[2] else None
        return a if n.op == "Pack" else [a[0] - a[1] if n.op == "Sub" else a[0] + a[1]]
    return _int_const(tensor)


def sliced_axis(n, a):
    """Where a StridedSlice puts input axis ``a``, the rows, when it keeps them all in
    order (``x[:, 0]``, ``x[:, :3]``, new axes by ``x[None, :, :]``, ``x[:, None]``);
    None when it slices the rows or is not read from constants."""
    if a is None or n.attr["ellipsis_mask"].i:
        return None
    strides = _const_ints(n.inputs[3])
    if strides is None:
        return None
    full = n.attr["begin_mask"].i & n.attr["end_mask"].i
    new, shrink = n.attr["new_axis_mask"].i, n.attr["shrink_axis_mask"].i
    out_axis = in_axis = 0
    for i, stride in enumerate(strides):
        if new >> i & 1:
            out_axis += 1
            continue
        if in_axis == a:   # the rows: every one of them, in order
            return out_axis if not shrink >> i & 1 and full >> i & 1 and stride == 1 else None
        in_axis += 1
        out_axis += 0 if shrink >> i & 1 else 1
    return out_axis + (a - in_axis) if a >= in_axis else None


def _tensordot_reshape(n):
    """True for tf.tensordot's Reshape of a transposed rank-2 operand to its own shape:
    a Pack of two Prods, each of a one-entry GatherV2 of the transposed tensor's Shape,
    in the transpose's order."""
    from graph_rewriter.analysis import _int_const, _strip_identity
    transpose, shape = _strip_identity(n.inputs[0]).node, _strip_identity(n.inputs[1]).node
    if transpose.op != "Transpose" or shape.op != "Pack" or len(shape.inputs) != 2:
        return False
    perm = _const_ints(transpose.inputs[1])
    if perm is None or len(perm) != 2:
        return False
    for k, part in enumerate(shape.inputs):
        prod = _strip_identity(part).node
        gather = _strip_identity(prod.inputs[0]).node if prod.op == "Prod" else None
        if gather is None or gather.op != "GatherV2" or _int_const(gather.inputs[2]) != [0]:
            return False
        source = _strip_identity(gather.inputs[0]).node
        if source.op != "Shape" or source.inputs[0].node is not transpose.inputs[0].node \
                or _int_const(gather.inputs[1]) != [perm[k]]:
            return False
    return True

