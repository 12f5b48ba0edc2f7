"""replicate: clone the compute once per extra replica.

    before                      after (R = 2)
    x ─> MatMul ─> loss         x ─> split ─┬─> MatMul ─> loss            (replica 0)
         w ─┘                               └─> replica_1/MatMul ─> ...   (replica 1)
                                     w ─┘   replica_1/w ─┘

Replica 0 keeps the original names; replica i gets ``replica_i/<name>``. Everything is
cloned except the nodes that exist once: placeholders, the tf.data pipeline and the
saver. Clones get their own v1 loop frame names and shared_names (two VarHandleOps with
one shared_name on one device are one variable), and colocation follows the clone.
Ops nothing reads (the train op, the init op) run every replica's copy: the original
gains control edges on its clones, so running it by name runs the whole step.
"""

from graph_rewriter.analysis import PLACEHOLDERS, absorb_exclusive_ancestors, analyze
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import ReplicaMap

_PREFIX_FAMILIES = ("replica_", "gr_replica_", "graph_rewriter_replica_")


class ReplicatePass(Pass):
    name = "replicate"
    requires = frozenset({"plan"})
    ensures = frozenset({"replicated"})

    def run(self, graph, ctx):
        analysis = analyze(graph, ctx.options.gradients)
        r = ctx.num_replicas
        graph.replicas = replica_map(graph, ctx)
        graph.replicas.variant = sorted(n.name for n in analysis.variant)
        if r == 1:
            return False
        placeholders = {n for n in graph if n.op in PLACEHOLDERS}
        global_nodes = analysis.saver_nodes | analysis.input_pipeline | placeholders
        global_nodes = absorb_exclusive_ancestors(global_nodes, keep_out=lambda n: n.op in ("VarHandleOp", "VariableV2"))
        cloned = [n for n in graph if n not in global_nodes]
        roots = [n for n in cloned if not n._consumers and not n._control_consumers]
        shared_name_nodes = [n for n in cloned if "shared_name" in n.attr and n.attr["shared_name"].s]
        frame_nodes = [n for n in cloned if n.op in ("Enter", "RefEnter")]
        for i in range(1, r):
            prefix = graph.replicas.prefixes[i]
            mapping = graph.clone_nodes(cloned, prefix)
            for n in shared_name_nodes:
                mapping[n].set_attr("shared_name", prefix.encode() + n.attr["shared_name"].s)
            for n in frame_nodes:
                mapping[n].set_attr("frame_name", prefix.encode() + n.attr["frame_name"].s)
            for n in roots:
                n.add_control_input(mapping[n])
        ctx.info(f"replicate: {len(cloned)} nodes cloned {r - 1} times, "
                 f"{len(global_nodes)} global, {len(roots)} root ops run every replica")
        return True


def replica_map(graph, ctx):
    """Names and devices of every replica of this rewrite."""
    r = ctx.num_replicas
    family = next(f for f in _PREFIX_FAMILIES
                  if not any(n.startswith(f) for n in graph._nodes))
    prefixes = [""] + [f"{family}{i}/" for i in range(1, r)]
    cluster, opts = ctx.cluster, ctx.options
    devices, hosts = [], []
    for i in range(r):
        task = cluster.compute_tasks[i // opts.devices_per_worker]
        devices.append(cluster.device(task, opts.device_type, i % opts.devices_per_worker))
        hosts.append(cluster.device(task, "CPU", 0))
    rm = ReplicaMap(prefixes=prefixes, devices=devices, hosts=hosts, global_device=hosts[0])
    return rm
