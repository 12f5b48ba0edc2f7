"""split_inputs: give each replica its slice of the global batch.

    x (global batch, host CPU) ─> Split(num_split=R) ─┬─:0─> replica 0's readers of x
                                                      └─:1─> replica 1's readers of x

Batch inputs are placeholders with an unknown first dimension and tf.data iterator
outputs (the plan lists them). The split runs on the host CPU where the batch arrives; a
batch whose rows do not divide evenly by R fails the step with TensorFlow's error from
this Split (the Session wrapper checks fed batches first and names the input).
"""

from graph_rewriter.op_builder import const, make_op
from graph_rewriter.pass_manager import Pass


class SplitInputsPass(Pass):
    name = "split_inputs"
    requires = frozenset({"replicated", "plan"})
    ensures = frozenset({"inputs_split"})

    def run(self, graph, ctx):
        rm = graph.replicas
        r = rm.num_local
        if r == 1:
            return False
        for name in ctx.plan.batch_inputs:
            x = graph.tensor(name)
            readers = [(c, pos) for c, pos in x.node.consumers(x.index)]
            axis = const(graph, f"{x.node.name}/split_for_replicas/axis", 0, "int32", rm.global_device)
            split = make_op(graph, "Split", f"{x.node.name}/split_for_replicas", [axis, x],
                            attrs={"num_split": r}, device=rm.global_device)
            for c, pos in readers:
                replica = rm.replica_of(graph, c.name)
                if replica is None:
                    continue  # a global reader (e.g. a summary of the raw input) keeps the batch
                c.set_input(pos, split.output(replica))
        return bool(ctx.plan.batch_inputs)
