"""step_sequence: a between-graph job's collective steps take their step ids from a
sequence of their own, not one shared with every other job on the same servers.

TensorFlow's collectives find each other across workers by step id as well as by keys,
so the masters of a between-graph job must give the same step the same id. They take the
ids from a sequence per *collective graph key*, which the group leader starts and every
master then advances by one per collective step it runs. The key is a hash of the
instance keys of the step's V1 collectives (the ``instance_key`` attribute); a step whose
collectives are all V2 (keys as inputs, as graph_rewriter emits) gets one fixed key, the
same for every graph. So every job on a set of servers shares one sequence: after an
in-graph job, whose one master advanced worker 0's copy alone, a between-graph job's
workers give the same step different ids and its first collective waits until the
timeout (found with raw collectives on TF 2.21: between-graph, in-graph, between-graph on
one cluster hangs in the third job; the hierarchical all-reduce's cluster test hung this
way after the 2x1 between-graph and in-graph hierarchical cases).

This pass gives each collective of a between-graph graph (whose collectives span tasks)
a control input that carries a V1 collective which never runs: a CollectiveReduce on the
true branch of a v1 cond whose predicate is always false (the time is never negative;
a predicate TensorFlow cannot fold, so Grappler keeps the branch). It sits in every step
that runs a collective, so the step's key is the hash of its instance key, which is the
job's own (from the plan, as every worker of the job computes it alike). A between-graph
job's steps then share a sequence with that job's other workers only; in-graph jobs
need no sequence across masters and keep TensorFlow's fixed key.

    graph_rewriter/step_sequence/now    = Timestamp()
    graph_rewriter/step_sequence/never  = Less(now, 0.0)
    graph_rewriter/step_sequence/switch = Switch([0.0], never)
    graph_rewriter/step_sequence/key    = CollectiveReduce(switch:1, instance_key=<the job's>)   (dead)
    graph_rewriter/step_sequence        = Merge(key, switch:0)
    every collective of the graph      <- ^graph_rewriter/step_sequence
"""

from graph_rewriter.collectives import NEVER_RUNS, STEP_SEQUENCE, step_sequence_key
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.op_vocabulary import COLLECTIVES
from graph_rewriter.pass_manager import Pass


class StepSequencePass(Pass):
    name = "step_sequence"
    requires = frozenset({"plan", "replicas"})
    # every pass that adds a collective (the init ops meta_graph names must not run
    # the marker: they hold no collective, and a step with the marker takes an id)
    after = frozenset({"mirror_variables", "allreduce", "allgather", "sync_queues", "meta_graph"})

    def applies(self, ctx):
        plan = ctx.plan
        return ctx.cluster.task is not None and len(ctx.cluster.compute_tasks) > 1 and (
            any(vp.placement == "mirrored" for vp in plan.variables)
            or any(c.sync in ("allreduce", "allgather") for c in plan.cuts))

    def run(self, graph, ctx):
        collectives = [n for n in graph if n.op in COLLECTIVES]
        if not collectives:
            return False
        host = ctx.cluster.device(ctx.cluster.task, "CPU", 0)
        with graph.adding_to_replica(GLOBAL):
            now = make_op(graph, "Timestamp", f"{STEP_SEQUENCE}/now", [], device=host)
            never = make_op(graph, "Less", f"{STEP_SEQUENCE}/never",
                            [now.output(0), const(graph, f"{STEP_SEQUENCE}/zero", 0.0, "float64", host)], device=host)
            switch = make_op(graph, "Switch", f"{STEP_SEQUENCE}/switch",
                             [const(graph, f"{STEP_SEQUENCE}/value", [0.0], "float32", host), never.output(0)],
                             device=host)
            key = make_op(graph, "CollectiveReduce", f"{STEP_SEQUENCE}/key", [switch.output(1)], device=host,
                          attrs={"group_size": len(ctx.cluster.compute_tasks), "group_key": step_sequence_key(ctx.plan),
                                 "instance_key": step_sequence_key(ctx.plan), "merge_op": "Add", "final_op": "Id",
                                 "subdiv_offsets": [0], NEVER_RUNS: True})
            marker = make_op(graph, "Merge", STEP_SEQUENCE, [[key.output(0), switch.output(0)]], device=host)
            assert marker.name == STEP_SEQUENCE
        for n in collectives:
            n.add_control_input(marker)
        return True
