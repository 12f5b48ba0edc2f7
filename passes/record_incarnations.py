"""record_incarnations: the init ops record, on each compute host, the incarnations of
the peers its collectives are about to form groups with.

TensorFlow refuses, for good, a collective peer whose server restarted on every server
that formed a group with its earlier incarnation (graph_rewriter/incarnations.py). Every
server ``start_server`` starts holds its own number (``graph_rewriter/server_incarnation``);
this pass makes the graph's init ops, the Saver's restore op and the MetaGraphDef's init
and local init ops (a MonitoredTrainingSession client runs the local init op at every
session it creates) write every compute task's number, in the cluster's compute-task
order, into ``graph_rewriter/collective_peers`` on the hosts this graph runs on
(in-graph: every compute host; between-graph: its own). A task whose server holds no
number (one graph_rewriter did not start) counts as 0. Read-only twins of each host's
record and number are what a client reads to see whether the cluster has settled; serve
compares its own host's record with its peers' numbers and replaces its server when a
peer restarted since.

    graph_rewriter/incarnations/worker_0/live  = server_incarnation on worker:0, or 0
    graph_rewriter/incarnations/worker_1/live  = server_incarnation on worker:1, or 0
    graph_rewriter/incarnations/numbers        = Pack(live...)
    graph_rewriter/incarnations/worker_k/record: collective_peers on worker:k := numbers
    init, restore_all, init_op, local_init_op  <- ^record (each host this graph runs on)
"""

from graph_rewriter import dtypes
from graph_rewriter.health import task_label
from graph_rewriter.incarnations import INCARNATION, RECORD, SCOPE, host_device
from graph_rewriter.ir import GLOBAL, split_tensor_name
from graph_rewriter.op_builder import make_op, read_or_default, shape_attr
from graph_rewriter.op_vocabulary import COLLECTIVES
from graph_rewriter.pass_manager import Pass
from graph_rewriter.ps_state import init_ops


class RecordIncarnationsPass(Pass):
    name = "record_incarnations"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"meta_graph"})   # it adds to the init and local init ops meta_graph names

    def applies(self, ctx):
        # collectives span tasks: mirrored variables (broadcasts, all-reduces), gathers
        plan = ctx.plan
        return len(ctx.cluster.compute_tasks) > 1 and (
            any(vp.placement == "mirrored" for vp in plan.variables)
            or any(c.sync in ("allreduce", "allgather") for c in plan.cuts))

    def run(self, graph, ctx):
        cluster, rm = ctx.cluster, ctx.replicas
        tasks = list(cluster.compute_tasks)
        hosts = [cluster.task] if cluster.task is not None else tasks
        roots = list(dict.fromkeys(init_ops(graph, ctx.plan, rm) + _ended_init_ops(graph, ctx.plan, rm)
                                   + _meta_graph_init_ops(graph)))
        with graph.adding_to_replica(GLOBAL):
            live = []
            for task in tasks:
                device = host_device(task)
                number = make_op(graph, "VarHandleOp", f"{SCOPE}/{task_label(task)}/number", [], device=device,
                                 attrs={"dtype": dtypes.int64, "shape": shape_attr([]), "shared_name": INCARNATION})
                live.append(read_or_default(graph, f"{SCOPE}/{task_label(task)}/live", number.output(0),
                                            "int64", 0, device))
            numbers = make_op(graph, "Pack", f"{SCOPE}/numbers", [live], attrs={"axis": 0},
                              device=rm.global_device)
            records = []
            for task in tasks:
                device = host_device(task)
                record = make_op(graph, "VarHandleOp", f"{SCOPE}/{task_label(task)}/peers", [], device=device,
                                 attrs={"dtype": dtypes.int64, "shape": shape_attr([len(tasks)]),
                                        "shared_name": RECORD})
                make_op(graph, "ReadVariableOp", f"{SCOPE}/{task_label(task)}/recorded", [record.output(0)],
                        attrs={"dtype": dtypes.int64}, device=device)
                if task in hosts:
                    records.append(make_op(graph, "AssignVariableOp", f"{SCOPE}/{task_label(task)}/record",
                                           [record.output(0), numbers.output(0)], device=device))
        for root in roots:
            for record in records:
                root.add_control_input(record)
        return True


def _ended_init_ops(graph, plan, rm):
    """The init NoOps that wait for the initializers through a collective (a workers'
    barrier ending the init op, sync_queues): forward from the initializers, through
    NoOps and collectives, every NoOp of replica 0 or global."""
    out, seen = [], set()
    stack = [graph.get(vp.initializer) for vp in plan.variables if vp.initializer]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for consumer in node.control_consumers:
            if consumer.op in COLLECTIVES:
                stack.append(consumer)
            elif consumer.op == "NoOp" and rm.replica_of(graph, consumer.name) in (0, None):
                out.append(consumer)
                stack.append(consumer)
    return out


def _meta_graph_init_ops(graph):
    """The MetaGraphDef's init and local init ops (meta_graph built them)."""
    meta = graph.meta_graph
    out = []
    if meta is None:
        return out
    for key in ("init_op", "local_init_op"):
        if key in meta.collection_def:
            for name in meta.collection_def[key].node_list.value:
                node = graph.get(split_tensor_name(name.lstrip("^"))[0])
                if node is not None and node.op == "NoOp":
                    out.append(node)
    return out
