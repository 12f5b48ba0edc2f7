"""replicate: clone the compute once per extra replica.

    before                      after (R = 2)
    x ─> MatMul ─> loss         x ─> split ─┬─> MatMul ─> loss            (replica 0)
         w ─┘                               └─> replica_1/MatMul ─> ...   (replica 1)
                                     w ─┘   replica_1/w ─┘

Replica 0 keeps the original names; replica i gets ``replica_i/<name>``. Everything is
cloned except the nodes that exist once: placeholders, the tf.data pipeline and the
saver. Clones get their own v1 loop frame names and shared_names (two VarHandleOps with
one shared_name on one device are one variable), except a shared_name naming a node that
exists once (its resource is shared: a tf.train.batch's SparseTensorsMap), and colocation
follows the clone.
Ops nothing reads (the train op, the init op) run every replica's copy: the original
gains control edges on its clones, so running it by name runs the whole step.

With three or more local replicas, only replica 1 is cloned and stands for
replicas 1..R-1 (``ReplicaMap.template``): the later passes build their per-replica ops
once for it, and the export writes it R-1 times. The output is the same graph as with
every replica built (``materialize_replicas=True``), at a fraction of the cost.
"""

from graph_rewriter.analysis import analyze, statistic_update_readers
from graph_rewriter.collectives import host_group, replica_group
from graph_rewriter.op_vocabulary import PLACEHOLDERS, VARIABLE_OPS
from graph_rewriter.traversal import absorb_exclusive_ancestors, gradient_readers, topological_order
from graph_rewriter.ir import GLOBAL
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import ReplicaMap

_PREFIX_FAMILIES = ("replica_", "gr_replica_", "graph_rewriter_replica_")


class ReplicatePass(Pass):
    name = "replicate"
    requires = frozenset({"plan"})
    provides = frozenset({"replicas"})

    def run(self, graph, ctx):
        analysis = analyze(graph, ctx.options.gradients)
        rm = ctx.replicas = replica_map(graph, ctx)
        graph.infer_replicas = True
        rm.template = use_template(ctx, rm)
        # (a product head's values are the whole batch's on every replica: fetched as replica 0's)
        head = set((ctx.plan.product_head or {}).get("head", ()))
        rm.variant = sorted(n.name for n in analysis.variant if n.name not in head)
        global_nodes = _global_nodes(graph, analysis, ctx.plan)
        shared_initial = _shared_initial_values(graph, ctx, global_nodes)
        cloned = [n for n in graph if n not in global_nodes and n not in shared_initial]
        # Optimizers colocate their non-slot state (Adam's beta powers) with the first
        # variable; a per-replica copy cannot follow a variable that moved to a ps task.
        on_ps = {graph.node(v.name) for v in ctx.plan.variables if v.placement == "ps"}
        for n in cloned:
            if any(t in on_ps for t in n.colocate_with):
                n.set_colocation([t for t in n.colocate_with if t not in on_ps])
        # Devices: the original graph's placement is for one device. Keep only its CPU
        # pins (as the replica's host CPU); the place pass decides the rest.
        pinned = {n for n in graph if ctx.options.device_type == "GPU" and "CPU" in n.device.upper()}
        for n in graph:
            n.device = (rm.global_device if n in global_nodes else rm.hosts[0]) if n in pinned else ""
        r = rm.num_local
        for n in graph:
            n.replica = GLOBAL if n in global_nodes else 0
        if r == 1:
            graph.touch()
            return True
        _drop_outer_colocation_in_functions(graph)
        roots = [n for n in cloned if n.is_sink]
        # (not a shared_name that names a node existing once: a TF1 batch's
        # TakeManySparseFromTensorsMap names the map its global AddSparseToTensorsMap made)
        shared_name_nodes = [n for n in cloned if "shared_name" in n.attr and n.attr["shared_name"].s
                             and not _names_global(n.attr["shared_name"].s, graph, global_nodes)]
        frame_nodes = [n for n in cloned if n.op in ("Enter", "RefEnter")]
        clones_of_roots = []
        # A replica's node read only by nodes that exist once (global_step's bump after
        # the mirrored updates, under strategy ps) has copies nothing would run: the other
        # replicas' updates and the collectives they wait for. The readers wait for every
        # replica's copy.
        waits = _read_only_by_global(cloned, global_nodes)
        for i in rm.built[1:]:
            prefix = rm.prefixes[i]
            mapping = graph.clone_nodes(cloned, prefix)
            for n, readers in waits:
                for reader in readers:
                    reader.add_control_input(mapping[n])
            for n in shared_name_nodes:
                mapping[n].set_attr("shared_name", prefix.encode() + n.attr["shared_name"].s)
            for n in frame_nodes:
                mapping[n].set_attr("frame_name", prefix.encode() + n.attr["frame_name"].s)
            clones_of_roots.append([mapping[n] for n in roots])
            for n in pinned:
                if n in mapping:
                    mapping[n].device = rm.hosts[i]
            for c in mapping.values():
                c.replica = i
        # Running a root by its name runs every replica's copy. Added after all cloning:
        # a root cloned after getting these edges would carry them into every later
        # replica (quadratic in the replicas).
        for clones in clones_of_roots:
            for n, c in zip(roots, clones):
                n.add_control_input(c)
        ctx.info(f"replicate: {len(cloned)} nodes cloned {r - 1} times"
                 + (" (replica 1 built, the template of the others)" if rm.template else "")
                 + f", {len(global_nodes)} global, {len(roots)} root ops run every replica")
        return True


def _names_global(shared_name, graph, global_nodes):
    """Whether ``shared_name`` is the name of a node that exists once: the resource it
    names is that node's (a SparseTensorsMap is named after the op that made it when
    its own shared_name is empty), the same for every replica."""
    name = shared_name.decode()
    return name in graph and graph.node(name) in global_nodes


def _read_only_by_global(cloned, global_nodes):
    """[(cloned node, its readers)] for cloned nodes all of whose readers are global."""
    out = []
    for n in cloned:
        readers = list(dict.fromkeys(n.readers()))
        if readers and all(r in global_nodes for r in readers):
            out.append((n, readers))
    return out


def use_template(ctx, rm):
    """Whether replica 1 can stand for replicas 1..R-1: three or more local replicas
    (with two there is nothing to save), whatever the strategy. Between-graph, only the
    chief's replica 0 differs in role (it broadcasts the initial values); it is built
    either way. Under ps and hybrid, replica 1's accumulator applies and its "gradients
    applied" marker are template nodes like any other (on the ps device, which is no
    replica's), and the single nodes waiting for them (the takes, the token wait) wait
    for every replica's copy in the export. A hierarchical all-reduce gives each
    worker's first replica a role of its own (it talks across machines): fine
    between-graph, where that is replica 0, but in-graph over several workers those
    replicas are among 1..R-1."""
    plan = ctx.plan
    leaders_among_others = (any(p.algorithm == "hierarchical" for p in plan.packs)
                            and rm.num_local > plan.devices_per_worker)
    return not ctx.options.materialize_replicas and not leaders_among_others and rm.num_local >= 3


def _global_nodes(graph, analysis, plan):
    """Nodes that exist once: batch inputs, the tf.data pipeline, the Saver, and for
    parameter-server variables the variables themselves with the ops that write them
    (synchronous training applies one update; asynchronous, each replica applies its own
    but the initializers still run once), what only those ops read, and what reads only
    them (the optimizer's reads-after-writes and groups of its ps updates)."""
    placeholders = {n for n in graph if n.op in PLACEHOLDERS}
    region = analysis.saver_nodes | analysis.input_pipeline | placeholders
    on_ps = [analysis.variables[v.name] for v in plan.variables if v.placement == "ps"]
    updates = set()
    for var in on_ps:
        region.add(var.node)
        if plan.sync:
            updates.update(var.writers)
        elif var.initializer is not None:
            updates.add(var.initializer)
    mirrored = {analysis.variables[v.name].node for v in plan.variables if v.placement == "mirrored"}
    if plan.sync:
        # Everything computed from an accumulated gradient is the one update: it reads the
        # average, never a replica's own gradient (Keras Nadam's sparse update mixes it
        # with mirrored optimizer state, which alone would make it look per-replica).
        accumulated = {c.variable for c in plan.cuts if c.sync == "accumulate"}
        mirrored_writers = {w for v in plan.variables if v.placement == "mirrored"
                            for w in analysis.variables[v.name].writers}
        for cut in analysis.cuts:
            if cut.variable not in accumulated:
                continue
            if cut.role == "state":
                # a batch statistic: only its moving average's update reads the average;
                # the forward pass (BatchNorm normalising with it) keeps each replica's own
                stack = [c for c, _ in statistic_update_readers(cut.values, cut.variables)]
            else:
                stack = [c for c, _ in gradient_readers(cut.values, cut.indices)]
            while stack:
                n = stack.pop()
                if n in updates or n in analysis.variant or n in mirrored_writers:
                    continue
                updates.add(n)
                stack.extend(c for c, _ in n.consumers())
    region |= updates
    variant = analysis.variant
    # What is computed from an all-reduced or gathered gradient (post-processing, the
    # mirrored updates) runs on every replica, from that replica's average.
    per_replica = set()
    stack = []
    planned = plan.cut_index()
    for cut in analysis.cuts:
        if planned[cut.key].sync != "accumulate":
            stack += [c for c, _ in gradient_readers(cut.values, cut.indices)]
    while stack:
        n = stack.pop()
        if n not in per_replica:
            per_replica.add(n)
            stack.extend(c for c, _ in n.consumers())
            stack.extend(n.control_consumers)

    def keep_out(n):
        return (n in variant or n in mirrored or n in per_replica
                or n.op in ("VarHandleOp", "VariableV2"))

    order = topological_order(graph) if updates else []
    while True:
        region = absorb_exclusive_ancestors(region, keep_out=keep_out)
        grown = False
        for n in order:  # forward: ops that only follow ps updates run once with them
            if n in region or keep_out(n):
                continue
            producers = [t.node for t in n.inputs] + list(n.control_inputs)
            if producers and all(p in region for p in producers) and any(p in updates for p in producers):
                region.add(n)
                updates.add(n)
                grown = True
        if not grown:
            return region


def _shared_initial_values(graph, ctx, global_nodes):
    """In-graph, the nodes that only compute mirrored variables' initial values. They are
    not cloned: every copy's initializer reads the master's initial value anyway (one
    random draw per run, see mirror_variables), so clones of them would be dead nodes.
    Between-graph, the copies receive the chief's values instead and nothing is shared."""
    if ctx.cluster.task is not None or ctx.num_replicas < 2:
        return set()
    inits = {graph.node(vp.initializer) for vp in ctx.plan.variables
             if vp.placement == "mirrored" and vp.initializer and vp.initializer in graph}
    region = absorb_exclusive_ancestors(
        inits, keep_out=lambda n: n in global_nodes or n.op in VARIABLE_OPS or n in inits)
    return region - inits


def _drop_outer_colocation_in_functions(graph):
    """Function bodies (v2 cond/while branches) are shared by every replica's call, but
    their nodes may carry colocation groups (Keras BatchNorm's moving-average update
    names one after the variable). When TensorFlow inlines the calls, every replica's
    copy joins the same group and would have to sit on one device: it refuses. Resource
    ops are colocated with their resource anyway, so the hints go."""
    if graph.library is None:
        return
    for fn in graph.library.function:
        for nd in fn.node_def:
            if "_class" in nd.attr:
                del nd.attr["_class"]
    graph.touch()


def replica_map(graph, ctx):
    """Names and devices of this graph's replicas, and of the whole group.

    In-graph (no task), the graph holds every replica of every worker; between-graph,
    only the replicas of its own task, which are group members
    ``task_index * devices_per_worker ...`` (the chief is compute task 0)."""
    cluster, opts = ctx.cluster, ctx.options
    dpw = opts.devices_per_worker
    group = replica_group(cluster, opts.device_type, dpw)
    group_hosts = [host for host in host_group(cluster) for _ in range(dpw)]
    if cluster.task is None:
        first, local = 0, len(group)
    else:
        first, local = cluster.compute_tasks.index(cluster.task) * dpw, dpw
    family = next(f for f in _PREFIX_FAMILIES
                  if not any(n.startswith(f) for n in graph.names()))
    prefixes = [""] + [f"{family}{i}/" for i in range(1, local)]
    devices = group[first:first + local]
    hosts = group_hosts[first:first + local]
    return ReplicaMap(prefixes=prefixes, devices=devices, hosts=hosts, global_device=hosts[0],
                      group_devices=group, first_replica=first, chief=first == 0)
