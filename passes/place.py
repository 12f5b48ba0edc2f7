"""place: give every op without a device the device it runs on.

Nodes that already have a device keep it: the passes that created them chose it
(collectives on their replica, accumulators on their parameter server, the batch split
on the host), and the replicate pass kept the original graph's CPU pins as the
replica's host CPU. For the others:

- replica i's ops go to replica i's device (GPU:i of its worker, or CPU:i);
- global ops (inputs, the input pipeline, the saver, the parameter-server updates) go to
  this graph's host CPU;
- a parameter-server variable goes to its ps task (this machine's host CPU when there is
  no cluster);
- an op TensorFlow has no kernel for on the replica's device type (string ops, savers,
  summaries, dataset ops, ...) goes to its replica's host CPU; the kernel registry says
  which, checking the kernel's dtype constraints;
- a resource (variable, iterator, accumulator, ...) and every op using its handle or
  ref share one device (TensorFlow cannot use a resource from another device): the host
  CPU if any of them has no kernel on the replica's device, the resource's otherwise;
- an op colocated (``_class``) with another takes that op's device.
"""

from graph_rewriter import opdefs
from graph_rewriter.analysis import variable_of
from graph_rewriter.op_vocabulary import PASS_THROUGH
from graph_rewriter.pass_manager import Pass


class PlacePass(Pass):
    name = "place"
    requires = frozenset({"plan", "replicas"})
    # it places every node, so every pass that adds nodes comes first
    after = frozenset({"replicate", "split_inputs", "mirror_variables", "micro_batches", "allreduce",
                       "allgather", "accumulate", "sync_queues", "shard_variables", "merge_outputs",
                       "meta_graph"})

    def run(self, graph, ctx):
        rm = ctx.replicas
        device_type = ctx.options.device_type
        nodes = graph.nodes
        pinned = {n for n in nodes if n.device}
        placed = {n: n.device for n in pinned}
        for vp in ctx.plan.variables:
            if vp.placement == "ps" and vp.name in graph and not graph.node(vp.name).device:
                task = vp.ps_task if vp.ps_task is not None else 0
                placed[graph.node(vp.name)] = ctx.cluster.ps_device(task)
                pinned.add(graph.node(vp.name))
        devices, hosts, global_device = rm.devices, rm.hosts, rm.global_device
        # Kernel and resource facts depend only on a node's op and attributes, which
        # clones (and nodes made from one template) share: ask once per attribute proto.
        kernel_of, positions_of = {}, {}

        def has_kernel(n):
            key = (id(n.node_def), n.op)
            ok = kernel_of.get(key)
            if ok is None:
                ok = kernel_of[key] = opdefs.has_kernel(n, device_type)
            return ok

        def replica(n):
            r = n.replica
            if r < 0:
                r = rm.replica_of(graph, n.name)
                r = -1 if r is None else r
            return r

        def host_of(n):
            r = replica(n)
            return global_device if r < 0 else hosts[r]

        lacking = set()   # unpinned nodes with no kernel on the replica's device type
        for n in nodes:
            if n in pinned:
                continue
            r = n.replica
            if r < 0:
                r = replica(n)
                if r < 0:
                    placed[n] = global_device
                    continue
            ok = kernel_of.get((id(n.node_def), n.op))   # has_kernel, inlined: this loop runs per node
            if ok is None:
                ok = has_kernel(n)
            if ok:
                placed[n] = devices[r]
            else:
                placed[n] = hosts[r]
                lacking.add(n)
        # A resource (variable, iterator, table...) and every op using it share a device.
        groups = {}
        for n in nodes:
            if not n.inputs:
                continue
            key = (id(n.node_def), n.op, len(n.inputs))
            positions = positions_of.get(key)
            if positions is None:
                positions = positions_of[key] = opdefs.resource_positions(n)
            if positions:
                groups.setdefault(_resource_root(n.inputs[positions[0]]), []).append(n)
        # Nodes whose device is a global node's (a global resource's, a global colocation
        # target's), though they belong to a replica: see the end.
        global_derived = set()
        for root, users in groups.items():
            members = [root] + users
            if root in pinned:
                target = placed[root]
            elif any(m in lacking or (m in pinned and not has_kernel(m)) for m in members):
                target = host_of(root)
            else:
                target = placed[root]
            for m in members:
                if m not in pinned or m is root:
                    placed[m] = target
                    if replica(root) < 0:
                        global_derived.add(m)
        users = {m for members in groups.values() for m in members}
        # Colocation (_class) follows its target (twice: a target may itself follow one).
        colocated = [n for n in nodes if n.colocate_with and not isinstance(n.colocate_with[0], str)
                     and n not in pinned and n not in groups and n not in users]
        for _ in range(2):
            for n in colocated:
                target = n.colocate_with[0]
                if target in placed:
                    placed[n] = placed[target]
                    if replica(target) < 0 or target in global_derived:
                        global_derived.add(n)
                    else:
                        global_derived.discard(n)
        if rm.template:
            # A template node's device is written per replica where it is replica 1's
            # device or host; one that is there because a global node is (a v1 cond's
            # Switch colocated with a placeholder, on a machine whose host CPU is the
            # global device) keeps it in every replica.
            rm.fixed_devices = sorted(n.name for n in global_derived if replica(n) == 1
                                      and placed[n] in (devices[1], hosts[1]))
        changed = bool(graph.set_devices(placed))
        for n in [n for n in nodes if n.colocate_with]:
            # TensorFlow's placer treats colocation as a hard constraint. Where a resource
            # (or a pass) put a node elsewhere than its colocation target, e.g. Adam's
            # beta powers colocated with a variable now on a parameter server, the
            # resource wins and the stale hint goes.
            if any(not isinstance(t, str) and placed.get(t) != placed[n] for t in n.colocate_with):
                n.set_colocation([t for t in n.colocate_with if isinstance(t, str) or placed.get(t) == placed[n]])
                changed = True
        return changed


def _resource_root(t):
    """The node that created the resource (or ref) a tensor carries."""
    var = variable_of(t)
    if var is not None:
        return var
    n = t.node
    while n.op in PASS_THROUGH and n.inputs:
        n = n.inputs[0].node
    return n
