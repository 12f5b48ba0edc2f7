"""merge_summaries: scalar summaries report the mean over replicas, not replica 0's value.

    loss ─┐                                loss, replica_1/loss, ... ─> AddN / R ─┐
          └─> ScalarSummary("loss")   =>                                          └─> ScalarSummary

Only the master's summaries change (the ones a user fetches, usually through
MergeSummary); the replicas' copies keep their own value. Summaries of values that do
not depend on the batch (a learning rate) are left alone. Between-graph, a graph holds
its own worker's replicas, so the mean is over that worker's replicas.
"""

from tensorflow.python.framework import dtypes

from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.pass_manager import Pass

SCALAR_SUMMARIES = frozenset(("ScalarSummary",))


class MergeSummariesPass(Pass):
    name = "merge_summaries"
    requires = frozenset({"replicas"})

    def applies(self, ctx):
        return ctx.num_local_replicas > 1

    def run(self, graph, ctx):
        rm = ctx.replicas
        if rm.num_local == 1:
            return False
        variant = set(rm.variant)
        changed = False
        for node in graph.nodes:
            if node.op not in SCALAR_SUMMARIES or rm.replica_of(graph, node.name) != 0:
                continue
            value = node.inputs[1]
            if value.node.name not in variant:
                continue
            copies = [rm.tensor(graph, i, value.name) for i in rm.built]
            dt = dtypes.as_dtype(dtype_of(value))
            scope = f"{node.name}/mean_over_replicas"
            total = make_op(graph, "AddN", f"{scope}/sum", [copies], device=rm.global_device).output(0)
            mean = make_op(graph, "RealDiv", scope,
                           [total, const(graph, f"{scope}/replicas", rm.num_local, dt.name, rm.global_device)],
                           device=rm.global_device).output(0)
            node.set_input(1, mean)
            changed = True
        return changed
