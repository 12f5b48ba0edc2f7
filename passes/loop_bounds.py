"""loop_bounds: while loops that draw at every step run to the batch's bound on every replica.

tf.compat.v1.nn.dynamic_rnn runs its while loop to the batch's longest sequence,
``reduce_max(sequence_length)``. A replica computes that Max over its own rows, so its
loop runs fewer steps than one device's when the longest sentences are another
replica's. Its values are still one device's (dynamic_rnn copies a finished row's state
through and writes zeros past its end), but a stateful random op in the loop (a
DropoutWrapper's mask, ``tf.nn.dropout`` in the cell) draws once per step it runs: its
state then advances less than one device's, and every later draw differs. For every
bound the plan lists (plan.loop_bounds: the analysis' loop bounds whose loops draw),
each replica reads the replicas' maximum (a Min: minimum) instead of its own:

    replica r:  Max_r ─> Cast(float64) ─> CollectiveReduceV2(Max, Id) ─> Cast ─> what read Max_r

so every replica's loop runs the batch's steps, and its draws (each replica drawing
every replica's rows: passes/random_draws.py) are one device's at every step, in this
run and the next. The collective's merge_op is the bound's own op, Max or Min. An
integer bound is reduced as float64 (exact to 2**53): a GPU's kernels for int32 keep
their tensors in host memory, which a collective's merge cannot read. The bounds reduce
one after the other, so every replica issues them in the same order; they take the
instance keys after the normalizers' and the selected means'.
"""

from graph_rewriter import dtypes
from graph_rewriter.collectives import all_reduce, counted_down_start, group_key, normalizer_instance_key
from graph_rewriter.op_builder import make_op
from graph_rewriter.pass_manager import Pass

class LoopBoundsPass(Pass):
    name = "loop_bounds"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"normalizers"})

    def applies(self, ctx):
        return ctx.num_replicas > 1 and bool(ctx.plan.loop_bounds)

    def run(self, graph, ctx):
        rm, plan = ctx.replicas, ctx.plan
        bounds = plan.loop_bounds or []
        if rm.group_size == 1 or not bounds:
            return False
        gkey = group_key(rm.group_devices)
        first_key = counted_down_start(plan, "loop_bounds")
        for i in rm.built:
            previous = None   # the chain's last all-reduce
            for k, name in enumerate(bounds):
                bound = rm.node(graph, i, name)
                readers = bound.consumers(0)
                device = rm.devices[i]
                dtype = bound.attr["T"].type
                with graph.adding_to_replica(i):
                    value = bound.output(0)
                    if not dtypes.as_dtype(dtype).is_floating:
                        value = make_op(graph, "Cast", f"{bound.name}/batch/to_float", [value],
                                        type_attrs={"DstT": dtypes.as_dtype("float64").as_datatype_enum},
                                        device=device).output(0)
                    previous = all_reduce(graph, f"{bound.name}/batch", value, rm.group_size, gkey,
                                          normalizer_instance_key(plan, first_key + k), device, bound.op,
                                          control_inputs=[previous] if previous is not None else [])
                    reduced = previous.output(0)
                    if not dtypes.as_dtype(dtype).is_floating:
                        reduced = make_op(graph, "Cast", f"{bound.name}/batch/value", [reduced],
                                          type_attrs={"DstT": dtype}, device=device).output(0)
                for c, pos in readers:
                    c.set_input(pos, reduced)
        graph.touch()
        return True
