"""Which node belongs to which replica, once the graph has been replicated.

Replica 0 (the master) keeps the original names, so the saver, the init op and every
name a user knows keep working; replica i > 0 holds clones named ``prefix_i + name``.
Nodes that exist once (batch inputs, the input pipeline, the saver) are global.
"""

import dataclasses


@dataclasses.dataclass
class ReplicaMap:
    prefixes: list          # "" for replica 0, then e.g. "replica_1/"
    devices: list           # the device each replica computes on
    hosts: list             # the host CPU of each replica's machine
    global_device: str      # where global nodes (inputs, saver) live
    variant: list = dataclasses.field(default_factory=list)  # original nodes that differ per replica

    @property
    def num_replicas(self):
        return len(self.prefixes)

    def name(self, replica, original):
        return self.prefixes[replica] + original

    def node(self, graph, replica, original):
        """Replica ``replica``'s copy of original node ``original`` (the global node itself
        when it was not cloned), or None if neither exists."""
        n = graph.get(self.prefixes[replica] + original)
        return n if n is not None else graph.get(original)

    def tensor(self, graph, replica, original_tensor_name):
        from graph_rewriter.ir import Tensor, split_tensor_name
        op, index = split_tensor_name(original_tensor_name)
        n = self.node(graph, replica, op)
        return None if n is None else Tensor(n, index)

    def is_cloned(self, graph, original):
        return self.num_replicas > 1 and (self.prefixes[1] + original) in graph

    def replica_of(self, graph, name):
        """The replica a node name belongs to, or None for a global node."""
        for i in range(self.num_replicas - 1, 0, -1):
            if name.startswith(self.prefixes[i]):
                return i
        if self.num_replicas == 1 or self.is_cloned(graph, name):
            return 0
        return None

    def to_dict(self):
        return dataclasses.asdict(self)
