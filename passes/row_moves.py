"""row_moves: every replica moves every replica's rows within the batch, and keeps its own.

Mixup's ``lam * x + (1 - lam) * tf.reverse(x, [0])`` (or ``x[::-1]``, ``tf.roll(x, 1, 0)``,
a gather of a seeded ``tf.random.shuffle(tf.range(n))``) mixes a row with another row of
the batch; a replica holding n = B / R rows would mix them among themselves. For the
moves the plan lists (plan.row_moves, found by the analysis: graph_rewriter/row_moves.py),
each replica

- gathers, in replica order, the rows the moves read (CollectiveGatherV2);
- computes again the moves' indices from the batch's count of rows: a copy of the ops
  between the count and the move, reading R times the replica's Shape or Size (a
  seeded shuffle's copy draws one device's permutation);
- moves the whole batch, and keeps its own rows of the result:

    replica r:  x_r ─> CollectiveGatherV2 ─> x ─> the move ─> y [B rows]
                y ─> StridedSlice[r n : (r + 1) n] ─> what read the move

The move is renamed ``<name>/every_replica`` and the slice takes its name, so a fetch of
the move returns the replicas' rows concatenated: one device's. The gathers run one
after the other and take the instance keys after the product head's.

A while loop over the rows that draws at every step (tf.map_fn's random flip per image)
is not copied: its ops that read the batch's rows read the gathered rows instead, so it
runs over the whole batch, and its stacks of results are the moves whose own rows the
replica keeps.
"""

from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import replica_ranks
from graph_rewriter.whole_batch import own_rows, read_every_replicas_rows


class RowMovesPass(Pass):
    name = "row_moves"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"product_heads"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.row_moves)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        moves = plan.row_moves
        if rm.group_size == 1 or not moves:
            return False
        ranks = replica_ranks(graph, rm, "graph_rewriter/row_moves")
        r = rm.group_size
        renames = []
        for i in rm.built:
            device = rm.devices[i]
            read_every_replicas_rows(graph, rm, i, plan, "row_moves")
            with graph.adding_to_replica(i):
                for name in moves["moves"]:
                    move = rm.node(graph, i, name)
                    readers = move.consumers(0)
                    own = own_rows(graph, move.output(0), ranks.output(i), r, device, scaled=False)
                    for reader, pos in readers:
                        reader.set_input(pos, own)
                    graph.replace_control_uses(move, own.node)
                    renames.append((move, own.node, move.name))
        # the moves leave their names first; their replica's rows take them
        graph.rename_nodes({move: graph.unique_name(f"{name}/every_replica") for move, _, name in renames})
        graph.rename_nodes({own: name for _, own, name in renames})
        graph.touch()
        return True
