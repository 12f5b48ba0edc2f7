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
from graph_rewriter.analysis import PASS_THROUGH, variable_of
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import topological_order


class PlacePass(Pass):
    name = "place"
    requires = frozenset({"replicated", "plan"})
    ensures = frozenset({"placed"})

    def run(self, graph, ctx):
        rm = graph.replicas
        device_type = ctx.options.device_type
        order = topological_order(graph)
        pinned = {n for n in order if n.device}
        placed = {n: n.device for n in pinned}
        host_of = {}
        for vp in ctx.plan.variables:
            if vp.placement == "ps" and vp.name in graph and not graph.node(vp.name).device:
                task = vp.ps_task if vp.ps_task is not None else 0
                placed[graph.node(vp.name)] = ctx.cluster.ps_device(task)
                pinned.add(graph.node(vp.name))
        for n in order:
            r = rm.replica_of(graph, n.name)
            device, host = (rm.global_device, rm.global_device) if r is None else (rm.devices[r], rm.hosts[r])
            host_of[n] = host
            if n not in pinned:
                placed[n] = device if opdefs.has_kernel(n, device_type) else host
        # A resource (variable, iterator, table...) and every op using it share a device.
        groups = {}
        for n in order:
            for pos, t in enumerate(n._inputs):
                if _carries_resource(n, pos):
                    groups.setdefault(_resource_root(t), []).append(n)
                    break
        for root, users in groups.items():
            members = [root] + users
            if root in pinned:
                target = placed[root]
            elif any(not opdefs.has_kernel(m, device_type) for m in members):
                target = host_of[root]
            else:
                target = placed[root]
            for m in members:
                if m not in pinned or m is root:
                    placed[m] = target
        bound = pinned | set(groups) | {m for users in groups.values() for m in users}
        for n in order:  # colocation constraints (_class) follow their target
            if n._colocate and not isinstance(n._colocate[0], str) and n not in bound:
                placed[n] = placed.get(n._colocate[0], placed[n])
        changed = False
        for n in order:
            if n.device != placed[n]:
                n.device = placed[n]
                changed = True
            # TensorFlow's placer treats colocation as a hard constraint. Where a resource
            # (or a pass) put a node elsewhere than its colocation target, e.g. Adam's
            # beta powers colocated with a variable now on a parameter server, the
            # resource wins and the stale hint goes.
            if n._colocate and any(not isinstance(t, str) and placed.get(t) != placed[n] for t in n._colocate):
                n.set_colocation([t for t in n._colocate if isinstance(t, str) or placed.get(t) == placed[n]])
                changed = True
        graph._touch()
        return changed


def _carries_resource(node, pos):
    dts = opdefs.input_dtypes(node)
    if pos < len(dts) and dts[pos] == opdefs.DT_RESOURCE:
        return True
    refs = opdefs.input_is_ref(node)
    return pos < len(refs) and refs[pos]


def _resource_root(t):
    """The node that created the resource (or ref) a tensor carries."""
    var = variable_of(t)
    if var is not None:
        return var
    n = t.node
    while n.op in PASS_THROUGH and n._inputs:
        n = n._inputs[0].node
    return n
