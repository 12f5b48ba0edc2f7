"""place: give every op the device it runs on.

- replica i's ops go to replica i's device (GPU:i of its worker, or CPU:i);
- global ops (inputs, the input pipeline, the saver) go to the chief's host CPU;
- an op TensorFlow has no kernel for on the replica's device type (string ops, savers,
  summaries, dataset ops, ...) goes to its replica's host CPU; the kernel registry says
  which, checking the kernel's dtype constraints;
- an op pinned to a CPU (in the original graph, or by a pass) stays on its replica's
  host CPU when the replicas are GPUs;
- a variable, and every op using its handle or ref, share one device (TensorFlow cannot
  read a resource from another device): the host CPU if any of them has no kernel on the
  replica's device, the replica's device otherwise;
- an op colocated (``_class``) with another takes that op's device.
"""

from graph_rewriter import opdefs
from graph_rewriter.analysis import PASS_THROUGH, variable_of
from graph_rewriter.pass_manager import Pass
from graph_rewriter.traversal import topological_order


class PlacePass(Pass):
    name = "place"
    requires = frozenset({"replicated"})
    ensures = frozenset({"placed"})

    def run(self, graph, ctx):
        rm = graph.replicas
        device_type = ctx.options.device_type
        order = topological_order(graph)
        placed = {}
        for n in order:
            r = rm.replica_of(graph, n.name)
            device, host = (rm.global_device, rm.global_device) if r is None else (rm.devices[r], rm.hosts[r])
            pinned_cpu = device_type == "GPU" and "CPU" in n.device.upper()
            placed[n] = host if pinned_cpu or not opdefs.has_kernel(n, device_type) else device
        # A resource (variable, iterator, table, ...) and every op using it share a device.
        groups = {}
        for n in order:
            for pos, t in enumerate(n._inputs):
                if _carries_resource(n, pos):
                    groups.setdefault(_resource_root(t), []).append(n)
                    break
        for root, users in groups.items():
            r = rm.replica_of(graph, root.name)
            host = rm.global_device if r is None else rm.hosts[r]
            members = [root] + users
            if placed[root] == host or any(not opdefs.has_kernel(m, device_type) for m in members):
                target = host
            else:
                target = placed[root]
            for m in members:
                placed[m] = target
        for n in order:  # colocation constraints (_class) follow their target
            if n._colocate and not isinstance(n._colocate[0], str):
                placed[n] = placed.get(n._colocate[0], placed[n])
        changed = False
        for n in order:
            if n.device != placed[n]:
                n.device = placed[n]
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
