"""Rows moved within the batch that every replica can move as one device does.

Mixup mixes each row with another row of the batch: ``lam * x + (1 - lam) *
tf.reverse(x, [0])``, ``x[::-1]``, ``tf.roll(x, 1, 0)`` or a gather of
``tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=s)``. A replica holding its own n = B / R
rows would mix them among themselves. Where the moved rows come from the batch alone
(the input and what is computed from it without variables, so no gradient goes back
through them), every replica instead moves every replica's rows and keeps its own:

    replica r:  x_r ─> CollectiveGatherV2 ─> x [B rows] ─> the move ─> y [B rows]
                y ─> StridedSlice[r n : (r + 1) n] ─> y_r ─> what read the move

y_r is one device's rows r n to (r + 1) n of the moved batch, so the mixed batch the
replicas hold, shard by shard, is one device's. The move's indices computed from the
batch's count of rows (the shuffled ``tf.range(tf.shape(x)[0])``) are computed again
from R times the replica's count; a seeded shuffle's copy draws one device's
permutation, the same on every replica (the same seeds, the same count), so the mixup of
the images and of their labels pair the same rows.

A seeded draw of samples per row from the rows' own values, ``tf.random.categorical(logits,
k, seed)`` (a policy's actions), takes the same path: its kernel draws row b from its
seeds skipped ahead by b, so a replica's clone would draw for its rows what one device
draws for the batch's first rows. It has no gradient, so its logits may come from
variables.

``find`` returns the moves (the plan stores them, passes/row_moves.py builds them) and,
for each move it cannot take, why.
"""

import dataclasses

from graph_rewriter.product_heads import (holds_batch_rows, is_seeded_shuffle, names_in_order, recomputed_from_rows,
                                          tensors_in_order)

# variables: rows computed from one would need their gradients back on other replicas
_VARIABLE_OPS = frozenset(("VariableV2", "Variable", "VarHandleOp"))
# draws of samples per row from each row's values (tf.random.categorical), which take
# the same path: every replica draws every replica's rows (row b of the kernel's draw
# depends on its seeds and b only) and keeps its own
SAMPLES = frozenset(("Multinomial", "StatelessMultinomial"))


@dataclasses.dataclass
class RowMoves:
    moves: list         # the moves (op names) every replica computes over every replica's rows
    gathered: list      # [[tensor, [[reader, input position]]]]: the rows they (or their copied ops) read
    copied_ops: list    # ops computing their indices from the batch's count of rows, computed again
    count_leaves: list  # the Shapes and Sizes of the batch's rows among them: R times the replica's
    copied: list        # [[tensor, [[reader, input position]]]]: their values the moves read


def find(order, moves, seed_nodes, variant0, scopes, elsewhere):
    """(RowMoves or None, {move name: why it cannot be moved as one device does}) for the
    ``moves`` (nodes: forward ops moving the batch's rows, the analysis' moved_rows).
    ``order``: the graph's nodes in topological order; ``seed_nodes``: the batch
    inputs' nodes; ``variant0``: the nodes that depend on the batch; ``scopes``: the
    graph's named gradient scopes; ``elsewhere``: names of nodes other passes rewrite."""
    position = {n: i for i, n in enumerate(order)}
    gathered, copied, chain, leaves, taken, obstacles = {}, {}, set(), set(), [], {}
    for m in sorted(moves, key=position.get):
        why, found = _obstacle(m, seed_nodes, variant0, scopes, elsewhere)
        if why is not None:
            obstacles[m.name] = why
            continue
        taken.append(m.name)
        gathered.setdefault(m.inputs[0], []).append([m.name, 0])
        for t, (ops, rows, counts) in found.items():
            copied.setdefault(t[0], []).append([m.name, t[1]])
            chain |= ops
            leaves |= counts
            for r, readers in rows.items():
                gathered.setdefault(r, []).extend(readers)
    if not taken:
        return None, obstacles
    return RowMoves(
        moves=taken,
        gathered=tensors_in_order(gathered, position),
        copied_ops=names_in_order(chain, position),
        count_leaves=names_in_order(leaves, position),
        copied=tensors_in_order(copied, position)), \
        obstacles


def _obstacle(move, seed_nodes, variant0, scopes, elsewhere):
    """(why ``move`` cannot be moved over every replica's rows, None) or (None, {(its
    input, position): what recomputed_from_rows found for it})."""
    from graph_rewriter.analysis import _FUNCTIONAL, loop_frames
    if move.name in elsewhere:
        return f"it is rewritten for another reason ({elsewhere[move.name]})", None
    if loop_frames(move) or move.op in _FUNCTIONAL:
        return "it runs in a while loop", None
    rows = move.inputs[0]
    if not holds_batch_rows(rows, seed_nodes):
        return f"'{rows.name}', the value it reads, does not hold the batch's rows", None
    if move.op == "RandomShuffle" and not is_seeded_shuffle(move):
        return "an unseeded shuffle draws another order on every replica", None
    # (a draw of samples has no gradient: its rows may come from variables)
    held = None if move.op in SAMPLES else _variable_above(rows.node, seed_nodes)
    if held is not None:
        return (f"the rows it moves are computed from the variable '{held}', so their gradients would go back "
                "to other replicas"), None
    found = {}
    for pos, t in enumerate(move.inputs[1:], start=1):
        if t.node not in variant0:
            continue
        got = recomputed_from_rows(t, seed_nodes, variant0, scopes, elsewhere, draws_ok=True)
        if got is None:
            return f"'{t.name}', its indices, is computed from the batch otherwise than from its count of rows", None
        found[(t, pos)] = got
    return None, found


def _variable_above(node, seed_nodes, limit=4096):
    """The name of a variable ``node`` is computed from (above the batch inputs), or
    None; also when the walk passes ``limit`` nodes, not knowing."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or n in seed_nodes:
            continue
        seen.add(n)
        if n.op in _VARIABLE_OPS or len(seen) > limit:
            return n.name
        stack.extend(t.node for t in n.inputs)
    return None

