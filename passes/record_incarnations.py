"""record_incarnations: an op that records, on each compute host the graph runs on, the
incarnations of the peers its collectives are about to form groups with.

TensorFlow refuses, for good, a collective peer whose server restarted on every server
that formed a group with its earlier incarnation (graph_rewriter/incarnations.py). Every
server ``start_server`` starts holds its own number (``graph_rewriter/server_incarnation``);
this pass adds ``graph_rewriter/incarnations/record``, which writes every compute task's
number, in the cluster's compute-task order, into ``graph_rewriter/collective_peers`` on
the hosts this graph runs on (in-graph: every compute host; between-graph: its own). A
task whose server holds no number (one graph_rewriter did not start) counts as 0. It also
adds read-only twins of each host's record and number, which a client reads to see
whether the cluster has settled; serve compares its own host's record with its peers'
numbers and replaces its server when a peer restarted since.

The record is an op of its own, which ``gr.Session`` and ``HeartbeatHook(master=...)``
run before the first collective, and not a part of the init ops: between-graph, every
worker's steps that run collectives share TensorFlow's step ids (one sequence per
cluster), and a step of one worker with ops on another worker's host would have its
rendezvous there aborted when the other worker's step of the same id ends ("Cleanup
<step id>"). The record's step runs no collective, so its step id is its own.

    graph_rewriter/incarnations/worker_0/live  = server_incarnation on worker:0, or 0
    graph_rewriter/incarnations/worker_1/live  = server_incarnation on worker:1, or 0
    graph_rewriter/incarnations/numbers        = Pack(live...)
    graph_rewriter/incarnations/worker_k/write: collective_peers on worker:k := numbers
    graph_rewriter/incarnations/record         = NoOp(^write of each host this graph runs on)
"""

from graph_rewriter import dtypes
from graph_rewriter.health import task_label
from graph_rewriter.incarnations import INCARNATION, RECORD, RECORD_OP, SCOPE
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import make_op, read_or_default, shape_attr
from graph_rewriter.pass_manager import Pass


class RecordIncarnationsPass(Pass):
    name = "record_incarnations"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"meta_graph"})   # not a variable the Saver or the collections should know

    def applies(self, ctx):
        # collectives span tasks: mirrored variables (broadcasts, all-reduces), gathers
        return len(ctx.cluster.compute_tasks) > 1 and ctx.plan.uses_collectives()

    def run(self, graph, ctx):
        cluster, rm = ctx.cluster, ctx.replicas
        tasks = list(cluster.compute_tasks)
        hosts = [cluster.task] if cluster.task is not None else tasks
        with graph.adding_to_replica(GLOBAL):
            live = []
            for task in tasks:
                device = cluster.device(task, "CPU", 0)
                number = make_op(graph, "VarHandleOp", f"{SCOPE}/{task_label(task)}/number", [], device=device,
                                 attrs={"dtype": dtypes.int64, "shape": shape_attr([]), "shared_name": INCARNATION})
                live.append(read_or_default(graph, f"{SCOPE}/{task_label(task)}/live", number.output(0),
                                            "int64", 0, device))
            numbers = make_op(graph, "Pack", f"{SCOPE}/numbers", [live], attrs={"axis": 0},
                              device=rm.global_device)
            writes = []
            for task in tasks:
                device = cluster.device(task, "CPU", 0)
                record = make_op(graph, "VarHandleOp", f"{SCOPE}/{task_label(task)}/peers", [], device=device,
                                 attrs={"dtype": dtypes.int64, "shape": shape_attr([len(tasks)]),
                                        "shared_name": RECORD})
                make_op(graph, "ReadVariableOp", f"{SCOPE}/{task_label(task)}/recorded", [record.output(0)],
                        attrs={"dtype": dtypes.int64}, device=device)
                if task in hosts:
                    writes.append(make_op(graph, "AssignVariableOp", f"{SCOPE}/{task_label(task)}/write",
                                          [record.output(0), numbers.output(0)], device=device))
            node = graph.add_node(RECORD_OP, "NoOp", control_inputs=writes, device=rm.global_device)
            assert node.name == RECORD_OP
        return True
