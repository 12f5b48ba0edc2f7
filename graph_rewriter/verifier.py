"""Checks the invariants every graph between passes must hold (DESIGN.md, "Verifier").

- node names are unique and every input names an existing output of its producer;
- there is no cycle except v1 loop back-edges;
- ops are known to TensorFlow or defined by the graph's function library;
- devices parse and name a task and a device that exist in the cluster;
- colocation targets exist;
- each collective group has one size, members on distinct devices, and each instance
  key is used once per device (and by no more members than the group has);
- v1 loop frames and variables' shared_names are never shared between replicas.
"""

import re

from graph_rewriter import opdefs
from graph_rewriter.collectives import key_of
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import Node
from graph_rewriter.op_vocabulary import COLLECTIVES

_DEVICE = re.compile(
    r"^(?:/job:(?P<job>[A-Za-z0-9_]+))?(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?"
    r"(?:/device:(?P<type>[A-Za-z_]+):(?P<index>\d+|\*))?$")
_ISOLATED = frozenset(("Enter", "RefEnter"))
SHARED_RESOURCE_OPS = frozenset(("VarHandleOp", "VariableV2", "HashTableV2", "MutableHashTableV2",
                                 "FIFOQueueV2", "ConditionalAccumulator",
                                 "SparseConditionalAccumulator", "ResourceConditionalAccumulator"))


def verify(graph, ctx=None):
    """Checks the whole graph. Raises GraphRewriteError naming the first broken
    invariant; returns a topological order.

    "No cycle" is the topological order the IR keeps on every new edge (the loader
    sorted the whole graph, and every edge added since kept the order or was
    checked), so it is read off the IR; a full sort runs when an edge broke it."""
    _check_edges(graph, graph.nodes)
    order = graph.topological_nodes()
    cluster = ctx.cluster if ctx is not None else None
    options = ctx.options if ctx is not None else None
    _check_devices(graph, graph.nodes, cluster, options)
    _check_colocation(graph, graph.nodes)
    _check_collectives(graph)
    _check_replica_isolation(graph, ctx)
    graph.clean()
    return order


def verify_changes(graph, ctx=None):
    """Checks what changed since the graph was last verified, which is enough when it was
    valid then: the edges, devices and colocation of the nodes a pass touched; "no cycle"
    from the topological order the IR keeps on every new edge (a full check when an edge
    broke it); collective groups and replica isolation over the few nodes they concern."""
    edged, attred, bulk, order_ok = graph.pending_changes()
    _check_edges(graph, edged)
    if not order_ok:
        graph.topological_nodes()   # a full sort: raises, naming the cycle, if there is one
    cluster = ctx.cluster if ctx is not None else None
    options = ctx.options if ctx is not None else None
    _check_devices(graph, attred, cluster, options)
    _check_colocation(graph, attred)
    # The two checks below span the whole graph; a change can only break them through
    # the nodes they concern, so they run when such a node changed.
    changed = edged + attred
    if bulk or any(_concerns_collectives(n) for n in changed):
        _check_collectives(graph)
    if bulk or any(n.op in _ISOLATED or n.op in SHARED_RESOURCE_OPS for n in changed):
        _check_replica_isolation(graph, ctx)
    graph.clean()


def _concerns_collectives(n):
    """A collective, or a constant feeding one (its group and instance keys)."""
    return n.op in COLLECTIVES or (n.op == "Const" and any(c.op in COLLECTIVES for c, _ in n.consumers()))


def _check_edges(graph, nodes):
    counts = {}
    live = graph.table()
    for n in nodes:
        if live.get(n.name) is not n:
            raise GraphRewriteError(f"node '{n.name}' is not registered under its own name")
        for pos, t in enumerate(n.inputs):
            p = t.node
            if live.get(p.name) is not p:
                raise GraphRewriteError(
                    f"node '{n.name}' input {pos} reads '{p.name}', which is not in the graph")
            count = counts.get(p)
            if count is None:
                count = counts[p] = opdefs.num_outputs(p)  # raises for unknown ops
            if t.index >= count:
                raise GraphRewriteError(
                    f"node '{n.name}' reads '{p.name}:{t.index}', but '{p.name}' ({p.op}) has "
                    f"{count} output{'s' if count != 1 else ''}",
                    hint=f"read one of its outputs, '{p.name}:0' to '{p.name}:{count - 1}'")
        for c in n.control_inputs:
            if live.get(c.name) is not c:
                raise GraphRewriteError(
                    f"node '{n.name}' has a control input on '{c.name}', which is not in the graph")
        if n not in counts:
            opdefs.require_op_def(n)


def _check_devices(graph, nodes, cluster, options):
    seen = {"": None}
    for n in nodes:
        dev = n.device
        ok = seen.get(dev, False)
        if ok is False:
            ok = seen[dev] = _device_problem(dev, cluster, options)
        if ok:
            raise GraphRewriteError(f"node '{n.name}' has device '{dev}': {ok}")


def _device_problem(dev, cluster, options):
    norm = re.sub(r"/(gpu|cpu|GPU|CPU):", lambda m: f"/device:{m.group(1).upper()}:", dev)
    m = _DEVICE.match(norm)
    if m is None:
        return "not a TensorFlow device name"
    if cluster is None or options is None:
        return None
    job, task = m.group("job"), m.group("task")
    if cluster.is_local:
        if job not in (None, "localhost"):
            return "names a job, but the rewrite is for this machine only"
    else:
        if job is not None and job not in cluster.jobs:
            return f"job '{job}' is not in the cluster"
        if job is not None and task is not None and int(task) >= len(cluster.jobs[job]):
            return f"task {task} does not exist in job '{job}'"
    dtype, index = m.group("type"), m.group("index")
    if dtype is None or index == "*":
        return None
    if dtype not in ("CPU", "GPU"):
        return f"device type '{dtype}' is neither CPU nor GPU"
    if dtype == options.device_type and int(index) >= options.devices_per_worker and int(index) > 0:
        return f"index {index} exceeds devices_per_worker={options.devices_per_worker}"
    if dtype == "GPU" and options.device_type == "CPU":
        return "a GPU device, but the rewrite is for CPU replicas"
    return None


def _check_colocation(graph, nodes):
    for n in nodes:
        for t in n.colocate_with:
            if not isinstance(t, Node) or graph.get(t.name) is not t:
                name = t if isinstance(t, str) else t.name
                raise GraphRewriteError(
                    f"node '{n.name}' is colocated with '{name}', which is not in the graph")


def _check_collectives(graph):
    groups = {}     # group_key -> (group_size, set of devices)
    instances = {}  # (group_key, instance_key, device) -> node name
    members = {}    # (group_key, instance_key) -> count
    for n in graph.nodes:
        if n.op not in COLLECTIVES:
            continue
        if n.op.endswith("V2"):
            size, gkey, ikey = (key_of(n, arg) for arg in ("group_size", "group_key", "instance_key"))
        else:
            size, gkey, ikey = n.attr["group_size"].i, n.attr["group_key"].i, n.attr["instance_key"].i
        if size is None or gkey is None or ikey is None:
            continue  # computed at run time: nothing to check statically
        g = groups.setdefault(gkey, (size, set(), n.name))
        if g[0] != size:
            raise GraphRewriteError(
                f"collective '{n.name}' gives group {gkey} size {size}, another member gave {g[0]}")
        g[1].add(n.device)
        key = (gkey, ikey, n.device)
        if key in instances:
            raise GraphRewriteError(
                f"collectives '{instances[key]}' and '{n.name}' share group {gkey}, instance "
                f"{ikey} on device '{n.device}'")
        instances[key] = n.name
        members[(gkey, ikey)] = members.get((gkey, ikey), 0) + 1
        if members[(gkey, ikey)] > size:
            raise GraphRewriteError(
                f"collective instance {ikey} of group {gkey} has more than its {size} members "
                f"(at '{n.name}')")
    for gkey, (size, devices, member) in groups.items():
        if len(devices) > size:
            raise GraphRewriteError(
                f"collective group {gkey} (member '{member}') spans {len(devices)} devices "
                f"but has size {size}")


def check_collectives_run(graph, ctx=None):
    """Every replica's copy of a collective runs when the ops that run a step run: a
    collective whose copy in another replica is not reached from the same root op (the
    train op, the init op) would wait for that copy forever. Checked once, on the final
    graph: it follows every edge back from the graph's roots."""
    rm = ctx.replicas if ctx is not None else None
    if rm is None or rm.num_local < 2:
        return
    members = {}
    for n in graph.nodes:
        if n.op in COLLECTIVES:
            r = rm.replica_of(graph, n.name)
            if r is None:
                continue
            prefix = rm.prefixes[r]
            members.setdefault(n.name[len(prefix):], []).append(n)
    if not members:
        return
    roots = [n for n in graph.nodes if n.is_sink]
    bit = {n: 1 << i for i, n in enumerate(roots)}
    # reached[n]: the roots whose run runs n. Consumers come first in reverse order, so
    # each node's set is complete when it passes it on to what it reads.
    reached = dict(bit)
    for n in reversed(graph.topological_nodes()):
        r = reached.get(n, 0)
        if r:
            for t in n.inputs:
                reached[t.node] = reached.get(t.node, 0) | r
            for p in n.control_inputs:
                reached[p] = reached.get(p, 0) | r
    for name, copies in members.items():
        first = reached.get(copies[0], 0)
        for other in copies[1:]:
            missing = first ^ reached.get(other, 0)
            if missing:
                root = next(n for n in roots if bit[n] & missing)
                runs, idle = (copies[0], other) if bit[root] & first else (other, copies[0])
                raise GraphRewriteError(
                    f"running '{root.name}' runs collective '{runs.name}' but not its copy "
                    f"'{idle.name}' in another replica, so the step would wait for it until "
                    f"the timeout", hint="this is a graph_rewriter bug for this graph's "
                    "structure: please report it; meanwhile strategy allreduce or a gradients= "
                    "hint may avoid it")


def _check_replica_isolation(graph, ctx):
    replicas = ctx.replicas if ctx is not None else None
    if replicas is None or replicas.num_local < 2:
        return
    frames = {}
    shared = {}
    for n in graph.nodes:
        if n.op in ("Enter", "RefEnter"):
            frame = n.attr["frame_name"].s
            r = replicas.replica_of(graph, n.name)
            other = frames.setdefault(frame, (r, n.name))
            if other[0] != r:
                raise GraphRewriteError(
                    f"loop frame '{frame.decode()}' is entered by '{other[1]}' and '{n.name}', "
                    f"which belong to different replicas")
        elif n.op in SHARED_RESOURCE_OPS and "shared_name" in n.attr and n.attr["shared_name"].s:
            key = (n.device, n.attr["container"].s if "container" in n.attr else b"", n.attr["shared_name"].s)
            r = replicas.replica_of(graph, n.name)
            other = shared.setdefault(key, (r, n.name))
            if other[0] != r:
                raise GraphRewriteError(
                    f"'{other[1]}' and '{n.name}' share shared_name "
                    f"'{key[2].decode()}' on one device, so the replicas would alias one resource")
