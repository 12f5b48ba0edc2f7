"""heartbeat: between-graph, every worker's client shows its peers that it is alive.

A worker whose client process dies while its server lives on never runs its share of
the next collective (or never feeds the parameter servers' accumulators); its peers'
steps wait for it until the session's deadline (``timeout_seconds``, 600 s by default).
TensorFlow cannot tell them sooner: the peer's server is healthy. So each compute task
gets a float64 scalar on its own host, ``graph_rewriter/heartbeat/<job>_<index>``, which
its client sets to its clock every ``heartbeat_seconds / 5`` seconds (``beat``, an
assignment that needs no initializer) and to -1 when it leaves cleanly (``leave``); every graph reads its peers'
(``<job>_<index>/read``). The runtime side, ``graph_rewriter.health``, is what
``gr.Session`` (and ``HeartbeatHook`` for MonitoredTrainingSession) runs: a peer that was
seen beating and stops for ``heartbeat_seconds`` fails this client's waiting step.
Values are compared with the peer's own earlier values, never with this machine's
clock, so clock skew between machines does not matter.
"""

from graph_rewriter import dtypes
from graph_rewriter.health import LEFT, SCOPE, task_label
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, make_op, shape_attr
from graph_rewriter.pass_manager import Pass


class HeartbeatPass(Pass):
    name = "heartbeat"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"meta_graph"})   # not a variable the Saver or the init ops should know

    def applies(self, ctx):
        return (ctx.cluster.task is not None and len(ctx.cluster.compute_tasks) > 1
                and ctx.options.heartbeat_seconds > 0)

    def run(self, graph, ctx):
        cluster = ctx.cluster
        with graph.adding_to_replica(GLOBAL):
            handles = {}
            for task in cluster.compute_tasks:
                name = f"{SCOPE}/{task_label(task)}"
                handles[task] = make_op(graph, "VarHandleOp", name, [], device=cluster.device(task, "CPU", 0),
                                        attrs={"dtype": dtypes.float64, "shape": shape_attr([]),
                                               "shared_name": name})
            me = cluster.device(cluster.task, "CPU", 0)
            own = handles[cluster.task].output(0)
            now = make_op(graph, "Timestamp", f"{SCOPE}/now", [], device=me)
            make_op(graph, "AssignVariableOp", f"{SCOPE}/beat", [own, now.output(0)], device=me)
            make_op(graph, "AssignVariableOp", f"{SCOPE}/leave",
                    [own, const(graph, f"{SCOPE}/left", LEFT, "float64", me)], device=me)
            for task, handle in handles.items():
                if task != cluster.task:
                    make_op(graph, "ReadVariableOp", f"{SCOPE}/{task_label(task)}/read", [handle.output(0)],
                            attrs={"dtype": dtypes.float64}, device=cluster.device(task, "CPU", 0))
        return True
