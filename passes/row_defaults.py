"""row_defaults: a value with a row per row of the batch, fed by its name, reaches every
replica.

A recurrent language model carries its state from step to step through the feed: TensorFlow's
PTB tutorial and char-rnn build ``initial_state = cell.zero_state(batch_size, tf.float32)``,
fetch the final state with each step and feed it back for the zero state's tensors,
``feed_dict[c] = state.c``. Every replica computes its own zeros (replica 0 under the
original name), so a fed value would replace replica 0's alone: the other replicas would
start every step from zeros, silently. For every such value the plan lists
(plan.row_defaults: a Const or Fill with a row per row of the batch, which the analysis
finds), the original name gives every local replica's rows and each replica reads its own:

    zeros (replica 0)  ──┐                                          ┌─:0─> replica 0's readers
    replica_1/zeros  ────┴─> ConcatV2 = "zeros" ─> Split(R) ────────┴─:1─> replica 1's readers
    (replica 0's op is renamed replica_0/zeros)

Not fed, each replica reads its own rows, as before. Fed with every replica's rows (R x B
with static batches of B, the whole batch's otherwise), each replica reads its rows of
the value, in replica order, as a fed batch placeholder splits. A reader that exists once
(a PlaceholderWithDefault of the state, a batch input split by split_inputs) reads the
whole value. The concat and split run on the host, like the batch split. (A state fed through a
placeholder_with_default over the zero state is a batch input, split by split_inputs,
which gives it every replica's default.)

A value whose rows another replica's copy is computed from (a fill shaped by a tensor
downstream of an exchange between the replicas) is left alone and logged: rerouting
would make a cycle.
"""

from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import merge_over_replicas
from graph_rewriter.traversal import ancestors


class RowDefaultsPass(Pass):
    name = "row_defaults"
    requires = frozenset({"plan", "replicas"})
    # It renames replica 0's copy of each value, so every pass that finds replica 0's
    # nodes by their original names runs first (as for merge_outputs, which runs after it
    # and finds these names global, merged already).
    after = frozenset({"replicate", "split_inputs", "loss_sums", "mirror_variables", "micro_batches", "allreduce",
                       "allgather", "communication", "accumulate", "sync_queues", "shard_variables",
                       "random_draws", "batch_statistics", "row_moves", "product_heads", "gather_rows",
                       "loop_bounds", "normalizers"})

    def applies(self, ctx):
        return ctx.num_local_replicas > 1 and bool(ctx.plan.row_defaults)

    def run(self, graph, ctx):
        rm = ctx.replicas
        if rm.num_local == 1:
            return False
        changed = False
        for op in ctx.plan.row_defaults:
            if not rm.is_cloned(graph, op):
                ctx.info(f"row_defaults: {op}:0 is left alone: it exists once")
                continue
            copies = [rm.node(graph, i, op) for i in rm.built]
            readers = [(c, pos) for copy in copies for c, pos in copy.consumers(0)]
            if {c for c, _ in readers} & ancestors(copies, data_only=True):
                ctx.info(f"row_defaults: {op}:0 is left alone: a replica's copy of it is computed "
                         "from another replica's readers of it")
                continue
            merged = merge_over_replicas(graph, rm, f"{op}:0", "concat")
            device = rm.global_device
            with graph.adding_to_replica(GLOBAL):
                axis = const(graph, f"{op}/rows_for_replicas/axis", 0, "int32", device)
                split = make_op(graph, "Split", f"{op}/rows_for_replicas", [axis, merged],
                                attrs={"num_split": rm.num_local}, device=device)
            if rm.template:
                rm.per_replica_outputs.append(split.name)   # replica k reads output k
            for c, pos in readers:
                replica = rm.replica_of(graph, c.name)
                c.set_input(pos, merged if replica is None else split.output(replica))
            ctx.info(f"row_defaults: {op}:0 holds every replica's rows ({rm.num_local}); "
                     f"each replica reads its own; replica 0's value is {rm.name(0, op)}:0")
            changed = True
        return changed

