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

A while loop over the batch's rows that runs a seeded stateful random op, tf.map_fn's
random flip or crop per image, takes it too: it runs a step per row and each step draws
from its kernel's state, so a replica's loop over its n rows would draw what one device
draws for the batch's first n rows. Where the loop reads the batch alone, every replica
runs it over every replica's rows, gathered, and keeps its own rows of the loop's
stacked values (the moves here are those stacks):

    replica r:  x_r ─> CollectiveGatherV2 ─> x [B rows] ─> the loop (B steps) ─> stack [B rows]
                stack ─> StridedSlice[r n : (r + 1) n] ─> what read the stack

Its kernel then draws, step by step, what one device's draws over the batch, and its
state goes on from where one device's does. The loop is not copied: its region, the
ops between the rows it reads and its stacks, reads the gathered rows instead.

``find`` returns the moves (the plan stores them, passes/row_moves.py builds them), for
each move or loop it cannot take, why, and each loop's stacks.
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


def find(order, moves, seed_nodes, variant0, scopes, elsewhere, loops=None):
    """(RowMoves or None, {move or loop name: why it cannot be moved as one device does},
    {loop name: its stacks, [] if not taken}) for the ``moves`` (nodes: forward ops moving
    the batch's rows, the analysis' moved_rows) and the ``loops`` ({name: nodes to start
    its region from}: loops over the rows that draw, the analysis' looped_draws).
    ``order``: the graph's nodes in topological order; ``seed_nodes``: the batch
    inputs' nodes; ``variant0``: the nodes that depend on the batch; ``scopes``: the
    graph's named gradient scopes; ``elsewhere``: names of nodes other passes rewrite."""
    position = {n: i for i, n in enumerate(order)}
    gathered, copied, chain, leaves, taken, obstacles = {}, {}, set(), set(), [], {}
    stacks = {}
    for name, starts in (loops or {}).items():
        why, found = loop_region(starts, seed_nodes, variant0, scopes, elsewhere)
        if why is not None:
            obstacles[name], stacks[name] = why, []
            continue
        ends, rows = found
        stacks[name] = names_in_order(ends, position)
        taken += ends
        for t, readers in rows.items():
            gathered.setdefault(t, []).extend(readers)
    for m in sorted(moves, key=position.get):
        why, found = _obstacle(m, seed_nodes, variant0, scopes, elsewhere)
        if why is not None:
            obstacles[m.name] = why
            continue
        taken.append(m)
        gathered.setdefault(m.inputs[0], []).append([m.name, 0])
        for t, (ops, rows, counts) in found.items():
            copied.setdefault(t[0], []).append([m.name, t[1]])
            chain |= ops
            leaves |= counts
            for r, readers in rows.items():
                gathered.setdefault(r, []).extend(readers)
    if not taken:
        return None, obstacles, stacks
    return RowMoves(
        moves=names_in_order(taken, position),
        gathered=tensors_in_order(gathered, position),
        copied_ops=names_in_order(chain, position),
        count_leaves=names_in_order(leaves, position),
        copied=tensors_in_order(copied, position)), \
        obstacles, stacks


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


def loop_region(starts, seed_nodes, variant0, scopes, elsewhere, limit=4096):
    """(why the loop of ``starts`` cannot run over every replica's rows, None) or (None,
    (its stacks: nodes, {tensor of the batch's rows: [[reader, input position]]})). No
    ``starts``: the loop's count of steps is a static batch's constant, not taken.

    The region is the closure of ``starts`` under the batch-dependent inputs of its
    nodes (stopping at tensors that hold the batch's rows, which are gathered) and the
    readers of its nodes' values, except those of a stack: a TensorArrayGatherV3 of a v1
    TensorArray, or a TensorListStack of a v2 loop's TensorList, sized by the batch's
    count of rows (tf.map_fn's results), whose readers keep the replica's rows. The
    loop must read the batch alone: no variable above a gathered tensor or among the
    region's inputs (no gradient may go back through a gather), no op another rule
    rewrites, nothing of the backward pass."""
    from graph_rewriter.analysis import in_backward
    if not starts:   # (the analysis found its count of steps a constant)
        return ("its count of steps is a constant, the static batch (each replica takes a batch of its own): "
                "it cannot run over every replica's rows"), None
    region, stacks, rows, stack, readers = set(), [], {}, list(starts), []
    outside = set()   # the region's inputs that do not depend on the batch (constants, variables)
    while stack or readers:
        # (the region's inputs first: a variable above the loop is what to report)
        n = stack.pop() if stack else readers.pop()
        if n in region:
            continue
        if n.name in elsewhere:
            return f"'{n.name}' in it is rewritten for another reason ({elsewhere[n.name]})", None
        if in_backward(n.name, scopes):
            return f"its values reach the backward pass ('{n.name}') other than through stacks of the rows", None
        if len(region) > limit:
            return f"it reaches more than {limit} ops before its values are stacks of the rows", None
        region.add(n)
        for pos, t in enumerate(n.inputs):
            if t.node in region:
                continue
            if holds_batch_rows(t, seed_nodes):
                held = None if t in rows else _variable_above(t.node, seed_nodes)
                if held is not None:
                    return f"the rows it reads ('{t.name}') are computed from the variable '{held}'", None
                rows.setdefault(t, []).append([n.name, pos])
            elif t.node in seed_nodes:
                return f"it reads '{t.name}', an input that does not hold the batch's rows", None
            elif t.node in variant0:
                stack.append(t.node)
            else:
                outside.add(t.node)
        if _stacks_rows(n, seed_nodes):
            stacks.append(n)
            continue
        readers.extend(c for c, _ in n.consumers() if c not in region)
    for n in outside:
        held = _variable_above(n, seed_nodes)
        if held is not None:
            return f"it reads the variable '{held}'", None
    if not stacks:
        return "none of its values is a stack of the batch's rows", None
    return None, (stacks, rows)


def _stacks_rows(node, seed_nodes):
    """True if ``node`` stacks one value per row of the batch: a TensorArrayGatherV3 of
    every element (``Range(0, count)``) of a TensorArrayV3 whose size is the count of a
    tensor of the batch's rows, or a TensorListStack of a v2 loop's list reserved with
    such a count (tf.map_fn's results, v1 and v2)."""
    from graph_rewriter.analysis import _WHILES, _first_int, _strip_identity
    if node.op == "TensorArrayGatherV3":
        array, indices = _strip_identity(node.inputs[0]).node, _strip_identity(node.inputs[1]).node
        return array.op == "TensorArrayV3" and _row_count(array.inputs[0], seed_nodes) and indices.op == "Range" \
            and _first_int(indices.inputs[0]) == 0 and _first_int(indices.inputs[2]) == 1 \
            and _row_count(indices.inputs[1], seed_nodes)
    if node.op == "TensorListStack":
        out = _strip_identity(node.inputs[0])
        if out.node.op not in _WHILES:
            return False
        reserved = _strip_identity(out.node.inputs[out.index]).node
        return reserved.op == "TensorListReserve" and _row_count(reserved.inputs[1], seed_nodes)
    return False


def _row_count(tensor, seed_nodes):
    """True if ``tensor`` is ``tf.shape(x)[0]`` of a tensor x of the batch's rows."""
    from graph_rewriter.analysis import _is_scalar_slice, _leading_rows, _starts_at_0, _strip_identity
    n = _strip_identity(tensor).node
    if not (_is_scalar_slice(n) and _starts_at_0(n)):
        return False
    rows = _leading_rows(n.inputs[0])
    return rows is not None and holds_batch_rows(rows, seed_nodes)


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

