"""Which node belongs to which replica, once the graph has been replicated.

Replica 0 (the master) keeps the original names, so the saver, the init op and every
name a user knows keep working; replica i > 0 holds clones named ``prefix_i + name``.
Nodes that exist once (batch inputs, the input pipeline, the saver) are global.

A graph holds the *local* replicas: all of them in-graph, one task's in between-graph
replication. ``group_devices`` lists every replica of the synchronisation group (all
workers), in the order that defines replica ranks; local replica i is group member
``first_replica + i``.

Template replicas: replicas 1..R-1 are identical up to their name prefix, their device
and host, and the batch slice they read. When ``template`` is set, the IR builds only
replicas 0 and 1 (``built``), and replica 1 stands for every replica from 1 on: the
export writes its nodes once per replica, substituting the prefix, the device and the
replica-relative output index (see replica_export), and expands every reference a single
node makes to a replica-1 node into references to all of them. Passes loop over
``built``; everything that depends on the replica count (group sizes, split counts,
means) reads ``num_local``/``group_size``, which always count every replica.

Merged outputs: the merge_outputs pass gives an output's original name to a node that
merges every replica's value, and renames replica 0's node (``merged``: original name
-> replica 0's new name), so ``node``, ``tensor`` and ``name`` of replica 0 still find
replica 0's own node after it.
"""

import dataclasses

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GLOBAL, UNKNOWN_REPLICA


@dataclasses.dataclass
class ReplicaMap:
    prefixes: list          # "" for local replica 0, then e.g. "replica_1/"
    devices: list           # the device each local replica computes on
    hosts: list             # the host CPU of each local replica's machine
    global_device: str      # where this graph's global nodes (inputs, saver) live
    group_devices: list = None  # every replica of the group, local or not
    first_replica: int = 0  # group rank of local replica 0
    chief: bool = True      # this graph is the chief's (or the only one)
    variant: list = dataclasses.field(default_factory=list)  # original nodes that differ per replica
    # (replica, original tensor name) -> the Tensor that replica's readers of it now read
    rerouted: dict = dataclasses.field(default_factory=dict)
    template: bool = False  # replica 1 stands for replicas 1..num_local-1 (module doc)
    # names of single nodes whose output i is read by replica i (the batch split): a
    # template reader of output 1 reads output k in replica k
    per_replica_outputs: list = dataclasses.field(default_factory=list)
    # names of template nodes on replica 1's device or host because a global node is
    # there (placement says which): the export writes their device as it is, not per
    # replica
    fixed_devices: list = dataclasses.field(default_factory=list)
    # original op name -> the name replica 0's node took when merge_outputs gave the
    # original name to the merge of every replica's value
    merged: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.group_devices is None:
            self.group_devices = list(self.devices)

    @property
    def num_local(self):
        return len(self.prefixes)

    @property
    def built(self):
        """The local replicas whose nodes exist in the IR (all, or 0 and the template)."""
        return range(2) if self.template else range(self.num_local)

    @property
    def group_size(self):
        return len(self.group_devices)

    def name(self, replica, original):
        if replica == 0:
            return self.merged.get(original, original)
        return self.prefixes[replica] + original

    def node(self, graph, replica, original):
        """Replica ``replica``'s copy of original node ``original`` (the global node itself
        when it was not cloned), or None if neither exists."""
        if replica >= 2 and self.template:
            # replica k > 1 exists only in the export; falling back to the global node
            # here would silently wire it to the master
            raise GraphRewriteError(
                f"internal: replica {replica}'s copy of '{original}' was asked for, but only "
                "replicas 0 and 1 are built (ReplicaMap.template)",
                hint="loop over ReplicaMap.built, or rewrite with materialize_replicas=True")
        if replica == 0 and original in self.merged:
            return graph.get(self.merged[original])
        n = graph.get(self.prefixes[replica] + original)
        return n if n is not None else graph.get(original)

    def tensor(self, graph, replica, original_tensor_name):
        """Replica ``replica``'s version of an original tensor: its clone, or what a pass
        put between the clone and its readers (``reroute``)."""
        from graph_rewriter.ir import Tensor, split_tensor_name
        op, index = split_tensor_name(original_tensor_name)
        hit = self.rerouted.get((replica, op, index))
        if hit is not None:
            return hit
        n = self.node(graph, replica, op)
        return None if n is None else Tensor(n, index)

    def read_by(self, graph, replica, reader, position):
        """What replica ``replica``'s copy of the original node ``reader`` reads at input
        ``position``: its clone of the original input, or, for a batch input (a global
        node), its part of the batch's split."""
        return self.node(graph, replica, reader).inputs[position]

    def reroute(self, replica, original_tensor_name, tensor):
        """Records that replica ``replica``'s readers of an original tensor now read
        ``tensor``, so later passes that look the original up find what is read."""
        from graph_rewriter.ir import split_tensor_name
        op, index = split_tensor_name(original_tensor_name)
        self.rerouted[(replica, op, index)] = tensor

    def is_cloned(self, graph, original):
        return self.num_local > 1 and (self.prefixes[1] + original) in graph

    def replica_of(self, graph, name):
        """The replica a node name belongs to, or None for a global node."""
        node = graph.get(name)
        if node is not None and node.replica != UNKNOWN_REPLICA:
            return None if node.replica == GLOBAL else node.replica
        for i in range(self.num_local - 1, 0, -1):
            if name.startswith(self.prefixes[i]):
                return i
        if self.num_local == 1 or self.is_cloned(graph, name):
            return 0
        return None

    def expanded_size(self, graph):
        """The node count of the exported graph: the template's nodes count once per
        replica it stands for."""
        if not self.template:
            return len(graph)
        prefix = self.prefixes[1]
        template = sum(1 for name in graph.names() if name.startswith(prefix))
        return len(graph) + template * (self.num_local - 2)

    def to_dict(self):
        return dataclasses.asdict(self)


def replica_ranks(graph, rm, scope):
    """One global host node (``scope + "/rank"``) whose output i is local replica i's
    rank in the group: a template replica reading output 1 reads output k in replica k
    (ReplicaMap.per_replica_outputs)."""
    from graph_rewriter.op_builder import const, make_op
    values = const(graph, f"{scope}/ranks", [rm.first_replica + i for i in range(rm.num_local)], "int32",
                   rm.global_device)
    values.node.replica = GLOBAL
    ranks = make_op(graph, "Unpack", f"{scope}/rank", [values],
                    attrs={"num": rm.num_local, "axis": 0}, device=rm.global_device, replica=GLOBAL)
    if rm.template:
        rm.per_replica_outputs.append(ranks.name)   # replica k reads output k
    return ranks


def merge_over_replicas(graph, rm, name, how):
    """Renames replica 0's op of the original tensor ``name`` (``replica_0/<op>``, the
    first free name; ``rm.merged`` records it) and builds the ``how`` ("concat" along
    axis 0 in replica order, "sum", "mean") of every local replica's value under the
    original name, on the global device; returns its output. Only names move: every
    reader of replica 0's value keeps reading it. (A template replica's copy in the
    list stands for replicas 1..R-1: the export writes every one.)"""
    from graph_rewriter import dtypes
    from graph_rewriter.ir import Tensor, split_tensor_name
    from graph_rewriter.op_builder import const, dtype_of, make_op
    op, index = split_tensor_name(name)
    master = graph.node(op)
    renamed = graph.unique_name(_master_prefix(rm) + op)
    graph.rename_node(master, renamed)
    rm.merged[op] = renamed
    copies = [Tensor(rm.node(graph, i, op), index) for i in rm.built]
    device = rm.global_device
    scope = f"{op}/merge_over_replicas"   # the helpers' names (global nodes, like the merge)
    with graph.adding_to_replica(GLOBAL):
        if how == "concat":
            axis = const(graph, f"{scope}/axis", 0, "int32", device)
            node = make_op(graph, "ConcatV2", op, [copies, axis], device=device)
        elif how == "sum":
            node = make_op(graph, "AddN", op, [copies], device=device)
        else:
            total = make_op(graph, "AddN", f"{scope}/sum", [copies], device=device).output(0)
            divisor = const(graph, f"{scope}/replicas", rm.num_local,
                            dtypes.as_dtype(dtype_of(total)).name, device)
            node = make_op(graph, "RealDiv", op, [total, divisor], device=device)
    if node.name != op:
        raise GraphRewriteError(f"internal: the merge of '{name}' could not take the name '{op}'")
    return node.output(0)


def _master_prefix(rm):
    """Replica 0's prefix in the family of the others' ("replica_1/" -> "replica_0/")."""
    return rm.prefixes[1][:-len("1/")] + "0/"
