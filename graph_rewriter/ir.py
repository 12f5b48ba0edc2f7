"""GraphItem: the in-memory IR of one TensorFlow GraphDef.

Nodes are objects and data edges are ``Tensor(node, index)`` pairs; the strings
``"x:1"``, ``"^x"`` and ``"loc:@x"`` exist only in the serialized form and are parsed on
load and printed on export (see ``graph_io``). Every edge mutation goes through the few
methods here, which keep each producer's consumer and control-consumer tables in step
with its consumers' input lists, so passes can ask "who reads this?" in O(1).

Attributes stay inside each node's NodeDef proto (never decoded wholesale): a clone
shares its original's proto until one of them changes an attribute (copy on write),
which keeps cloning a 30,000-node graph sixteen times cheap.

TensorFlow quirks handled here:
- Colocation (``_class = ["loc:@x"]``) names nodes, so it is kept as a list of Node
  references and follows renames and clones like an edge would.
- v1 loops have back-edges (NextIteration -> Merge): edges are resolved after all
  nodes exist, so a graph with cycles loads like any other.
"""

import collections
import contextlib
import types

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.protos import attr_value_pb2

Tensor = collections.namedtuple("Tensor", ["node", "index"])
Changes = collections.namedtuple("Changes", ["edges", "attrs", "bulk", "order_ok"])
Changes.__doc__ = "Nodes changed since the verifier last ran (GraphItem.pending_changes)."
Tensor.__doc__ = "One output of a node: the endpoint of a data edge."
Tensor.__repr__ = lambda self: f"Tensor({self.node.name}:{self.index})"
Tensor.name = property(lambda self: f"{self.node.name}:{self.index}")

COLOCATION_ATTR = "_class"
UNKNOWN_REPLICA = -1   # Node.replica before replication, and for nodes passes add later
GLOBAL = -2            # Node.replica of a node that exists once (inputs, saver, ps updates)


class Node:
    """One operation. ``name``, ``inputs`` (Tensors), ``control_inputs`` (Nodes) and
    ``colocate_with`` are plain attributes to read, never to assign: change them only
    through the methods below (and GraphItem.rename_node), which keep the producers'
    consumer tables and the graph's name table consistent. The edges are tuples,
    replaced on every edit, so a reader can keep one and iterate it while the node
    changes; reading them costs no call and no copy (the export, the verifier and every
    walk read them per node)."""

    __slots__ = ("graph", "name", "op", "_device", "_def", "_shared_def",
                 "inputs", "control_inputs", "_consumers", "_control_consumers",
                 "colocate_with", "replica", "arg_info", "_ord", "_by_output", "__weakref__")

    def __init__(self, graph, name, op, device, node_def, shared_def=False):
        self.graph = graph
        self.name = name
        self.op = op
        self._device = device
        self._ord = 0.0               # position in the graph's maintained topological order
        self._def = node_def          # NodeDef holding attrs; its name/input fields are unused
        self._shared_def = shared_def  # True while a clone shares its original's proto
        self.inputs = ()
        self.control_inputs = ()
        self._consumers = {}          # (consumer Node, input position) -> None, ordered
        self._by_output = None        # {output index: {(consumer, position): None}}, see consumers()
        self._control_consumers = {}  # consumer Node -> None, ordered
        self.colocate_with = ()       # Node references (or unresolved names, flagged by the verifier)
        self.replica = UNKNOWN_REPLICA  # set by replication: the replica index, or GLOBAL
        self.arg_info = None          # opdefs' cache: OpDef argument facts for this node's attrs

    def __repr__(self):
        return f"<Node {self.name} ({self.op})>"


    @property
    def device(self):
        return self._device

    @device.setter
    def device(self, value):
        if value != self._device:
            self._device = value
            self.graph._touch(self)

    # ----- attributes -------------------------------------------------------------
    @property
    def attr(self):
        """The NodeDef attr map, for reading. Use set_attr to change it."""
        return self._def.attr

    @property
    def node_def(self):
        """The NodeDef holding this node's attributes, for reading (shared with clones
        until one changes an attribute; its name, op, device and input fields are stale:
        read those from the node)."""
        return self._def

    def _own_def(self):
        self.arg_info = None
        if self._shared_def:
            own = type(self._def)()
            own.CopyFrom(self._def)
            self._def = own
            self._shared_def = False
        else:   # about to change in place: its serialized form goes
            self.graph._attr_bytes.pop(id(self._def), None)
        return self._def

    def set_attr(self, key, value):
        """Sets attr ``key`` from an AttrValue, or from a python str/bytes/int/float/bool."""
        attr = self._own_def().attr[key]
        if isinstance(value, attr_value_pb2.AttrValue):
            attr.CopyFrom(value)
        elif isinstance(value, bool):
            attr.b = value
        elif isinstance(value, int):
            attr.i = value
        elif isinstance(value, float):
            attr.f = value
        elif isinstance(value, str):
            attr.s = value.encode()
        elif isinstance(value, bytes):
            attr.s = value
        else:
            raise TypeError(f"unsupported attr value for {self.name}.{key}: {value!r}")
        self.graph._touch(self)

    def del_attr(self, key):
        if key in self._def.attr:
            del self._own_def().attr[key]
            self.graph._touch(self)

    def output(self, index=0):
        return Tensor(self, index)

    # ----- edges ------------------------------------------------------------------



    @property
    def num_consumers(self):
        """How many (consumer, input position) pairs read this node's outputs."""
        return len(self._consumers)

    @property
    def is_sink(self):
        """Nothing reads this node, by data or control edge: it runs only if fetched."""
        return not self._consumers and not self._control_consumers

    def readers(self):
        """Every node reading this one: once per data input that reads it, then each
        control consumer (a fresh list, for walks over the graph)."""
        out = [c for c, _ in self._consumers]
        out.extend(self._control_consumers)
        return out

    def consumers(self, index=None):
        """[(consumer Node, input position)] reading this node's outputs (one output if index)."""
        if index is None:
            return list(self._consumers)
        by_output = self._by_output
        if by_output is None:
            if len(self._consumers) <= _INDEX_CONSUMERS_ABOVE:
                return [(c, p) for (c, p) in self._consumers if c.inputs[p].index == index]
            # A node with many outputs and readers (a gradient IdentityN feeding every
            # variable's update): asking per output would cost its whole fan-out each time.
            by_output = self._by_output = {}
            for key in self._consumers:
                by_output.setdefault(key[0].inputs[key[1]].index, {})[key] = None
        return list(by_output.get(index, ()))

    @property
    def control_consumers(self):
        return list(self._control_consumers)

    def consumer_nodes(self):
        """Distinct nodes reading any output, in a stable order."""
        return list(dict.fromkeys(c for c, _ in self._consumers))

    def set_input(self, position, tensor):
        old = self.inputs[position]
        _unlink(old, self, position)
        self.inputs = self.inputs[:position] + (tensor,) + self.inputs[position + 1:]
        _link(tensor, self, position)
        self.graph._edge(tensor.node, self)

    def add_input(self, tensor):
        self.inputs += (tensor,)
        _link(tensor, self, len(self.inputs) - 1)
        self.graph._edge(tensor.node, self)

    def set_inputs(self, tensors):
        for pos, t in enumerate(self.inputs):
            _unlink(t, self, pos)
        self.inputs = tuple(tensors)
        for pos, t in enumerate(self.inputs):
            _link(t, self, pos)
        self.graph._touch(self, edges=True)
        for t in self.inputs:
            self.graph._edge(t.node, self)

    def add_control_input(self, node):
        if self in node._control_consumers:
            return
        self.control_inputs += (node,)
        node._control_consumers[self] = None
        self.graph._edge(node, self)

    def remove_control_input(self, node):
        i = self.control_inputs.index(node)
        self.control_inputs = self.control_inputs[:i] + self.control_inputs[i + 1:]
        del node._control_consumers[self]
        self.graph._touch(self, edges=True)

    def set_control_inputs(self, nodes):
        for n in self.control_inputs:
            del n._control_consumers[self]
        self.control_inputs = tuple(dict.fromkeys(nodes))
        for n in self.control_inputs:
            n._control_consumers[self] = None
        self.graph._touch(self, edges=True)
        for n in self.control_inputs:
            self.graph._edge(n, self)

    def set_colocation(self, targets):
        """Colocate with these nodes (an empty list removes the constraint)."""
        self.colocate_with = tuple(targets)
        self.graph._touch(self)


_INDEX_CONSUMERS_ABOVE = 64
_AFTER = 2.0 ** -20   # a new node's offset after its latest producer in the order


def _link(tensor, consumer, position):
    """Records that ``consumer`` reads ``tensor`` at ``position`` in the producer's tables."""
    p = tensor.node
    p._consumers[(consumer, position)] = None
    if p._by_output is not None:
        p._by_output.setdefault(tensor.index, {})[(consumer, position)] = None


def _unlink(tensor, consumer, position):
    p = tensor.node
    del p._consumers[(consumer, position)]
    if p._by_output is not None:
        p._by_output[tensor.index].pop((consumer, position), None)


class GraphItem:
    """A GraphDef as a mutable graph of Node objects, plus what travels with it:
    the function library, versions, and (when loaded from one) the MetaGraphDef parts."""

    def __init__(self):
        self._nodes = {}             # name -> Node, insertion-ordered: export order
        self.versions = None         # VersionDef
        self.library = None          # FunctionDefLibrary
        self.meta_graph = None       # MetaGraphDef without its graph_def, or None
        self.source = "<graph>"      # what it was loaded from, for error messages
        # once the graph is replicated, a node added later takes its producers' replica,
        # or the one a pass names for what it adds (adding_to_replica)
        self.infer_replicas = False
        self._adding_replica = None
        self.version = 0             # bumped by every mutation; keys cached analyses
        self._cache = {}
        self._suffixes = {}          # unique_name's last suffix per base name
        # id(attr proto) -> (its serialized attributes, the proto kept alive), for every
        # export of this graph (the plan's fingerprint, then the output): protos change
        # only through Node._own_def, which drops their entry
        self._attr_bytes = {}
        # Incremental verification: nodes changed since the verifier last ran (edges, or
        # attributes/devices/colocation), and a topological order kept valid on every
        # new edge (Node._ord), so "no new cycle" costs the edges added, not the graph.
        self._dirty_edges = {}
        self._dirty_attrs = {}
        self._dirty_bulk = False     # clone_nodes ran: clones are not queued one by one
        self._next_ord = 0.0
        self._first_ord = 0.0        # below every position given so far (for source nodes)
        self._order_ok = True

    @classmethod
    def from_node_defs(cls, node_defs, source, colocation_names):
        """A graph of ``node_defs``, which become the nodes' attr protos (their input and
        colocation fields are parsed into edges and cleared). Two passes: every node
        first, then the edges, so loops load too. ``colocation_names`` turns a ``_class``
        AttrValue into node names."""
        item = cls()
        item.source = source
        nodes = item._nodes
        pending = []
        for nd in node_defs:
            name = nd.name
            if name in nodes:
                raise GraphRewriteError(f"{source}: two nodes are named '{name}'",
                                        hint="node names must be unique in a GraphDef")
            if not name:
                raise GraphRewriteError(f"{source}: a node of op {nd.op!r} has no name")
            node = Node(item, name, nd.op, nd.device, nd)
            nodes[name] = node
            pending.append((node, nd))
        for node, nd in pending:
            inputs = []
            controls = []
            for s in nd.input:
                if s.startswith("^"):
                    producer = nodes.get(s[1:])
                    if producer is None:
                        raise GraphRewriteError(
                            f"{source}: node '{node.name}' has control input '{s}', but no node "
                            f"'{s[1:]}' exists", hint="the graph is truncated or was edited by hand")
                    if node not in producer._control_consumers:
                        controls.append(producer)
                        producer._control_consumers[node] = None
                    continue
                op_name, sep, idx = s.rpartition(":")
                if sep and idx.isdigit():
                    index = int(idx)
                else:
                    op_name, index = s, 0
                producer = nodes.get(op_name)
                if producer is None:
                    raise GraphRewriteError(
                        f"{source}: node '{node.name}' reads input '{s}', but no node "
                        f"'{op_name}' exists", hint="the graph is truncated or was edited by hand")
                producer._consumers[(node, len(inputs))] = None
                inputs.append(Tensor(producer, index))
            node.inputs = tuple(inputs)
            node.control_inputs = tuple(controls)
            del nd.input[:]
            if COLOCATION_ATTR in nd.attr:
                node.colocate_with = tuple(nodes.get(n, n) for n in colocation_names(nd.attr[COLOCATION_ATTR]))
                del nd.attr[COLOCATION_ATTR]
        item.renumber()
        item.clean()
        return item

    def touch(self):
        """Records an edit the IR cannot see itself (a function body's attributes, the
        replica indices), so cached analyses of the old version are not reused."""
        self._touch()

    def pending_changes(self):
        """What changed since ``clean()``, for the verifier's incremental check: the live
        nodes whose edges changed, those whose attributes/device/colocation changed,
        whether a bulk clone ran, and whether the maintained topological order still
        holds (False after an edge closed a cycle)."""
        live = self._nodes
        return Changes([n for n in self._dirty_edges if live.get(n.name) is n],
                       [n for n in self._dirty_attrs if live.get(n.name) is n],
                       self._dirty_bulk, self._order_ok)

    def _touch(self, node=None, edges=False):
        self.version += 1
        if node is not None:
            (self._dirty_edges if edges else self._dirty_attrs)[node] = None

    def _edge(self, producer, consumer):
        """Records a new edge producer -> consumer and keeps the topological order."""
        self.version += 1
        self._dirty_edges[consumer] = None
        if self._order_ok and producer._ord >= consumer._ord:
            keep_order(self, producer, consumer)

    def reset_order(self, order):
        """Takes ``order`` (every node, producers first) as the maintained order."""
        for i, n in enumerate(order):
            n._ord = float(i)
        self._next_ord = float(len(order))
        self._first_ord = 0.0
        self._order_ok = True

    def renumber(self):
        """Takes a full topological sort as the maintained order; on a cycle, gives the
        order up (the verifier's full check then names the cycle)."""
        from graph_rewriter.traversal import any_topological_order
        try:
            self.reset_order(any_topological_order(self))
        except GraphRewriteError:
            self._order_ok = False

    def topological_nodes(self):
        """Every node, producers first (loop back-edges aside). The IR keeps a
        topological order on every new edge, so while it holds this is that order, read
        off the nodes' positions (a sort of numbers, not of the graph); when an edge
        broke it, a full sort becomes the order again, which raises naming the cycle if
        there is one."""
        if self._order_ok:
            return sorted(self._nodes.values(), key=_position)
        from graph_rewriter.traversal import any_topological_order
        order = any_topological_order(self)
        self.reset_order(order)
        return order

    def clean(self):
        """Forgets the changes so far (the verifier has checked them)."""
        self._dirty_edges = {}
        self._dirty_attrs = {}
        self._dirty_bulk = False

    def cached(self, key, compute):
        """Returns compute(self), computed once per graph version (analysis caching)."""
        hit = self._cache.get(key)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        value = compute(self)
        self._cache[key] = (self.version, value)
        return value

    # ----- lookup -----------------------------------------------------------------
    def __len__(self):
        return len(self._nodes)

    def __iter__(self):
        return iter(list(self._nodes.values()))

    def __contains__(self, name):
        return name in self._nodes

    @property
    def nodes(self):
        """All nodes in export order (a snapshot list)."""
        return list(self._nodes.values())

    def attr_bytes_cache(self):
        """The export's cache of serialized attribute protos (see __init__), shared by
        every export of this graph: most protos do not change between the fingerprint of
        the single-device graph and the output."""
        return self._attr_bytes

    def table(self):
        """The name -> Node table, read-only (a live view until the next rename or removal,
        which rebuild it): for checks that look up every node's name."""
        return types.MappingProxyType(self._nodes)

    def names(self):
        """The node names in export order (a live view: copy it to keep a snapshot)."""
        return self._nodes.keys()

    def node(self, name):
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphRewriteError(f"{self.source}: no node named '{name}'") from None

    def get(self, name):
        return self._nodes.get(name)

    def tensor(self, name):
        """Parses 'op', 'op:0' or 'op:2' into a Tensor of this graph."""
        op_name, index = split_tensor_name(name)
        return Tensor(self.node(op_name), index)

    def unique_name(self, base):
        """``base``, or ``base_<i>`` with the first free i (remembered per base, so a pass
        creating thousands of same-named nodes does not probe from 1 each time)."""
        if base not in self._nodes:
            return base
        i = self._suffixes.get(base, 0) + 1
        while f"{base}_{i}" in self._nodes:
            i += 1
        self._suffixes[base] = i
        return f"{base}_{i}"

    # ----- mutation ---------------------------------------------------------------
    def add_node(self, name, op, inputs=(), control_inputs=(), attrs=None, device="",
                 colocate_with=(), shared_def=None):
        """Creates a node; ``attrs`` maps names to AttrValue or python scalars.
        ``shared_def`` is a NodeDef holding the node's attributes, shared (copy on
        write) with other nodes made from it: op_builder's templates."""
        from graph_rewriter.protos import node_def_pb2
        if name in self._nodes:
            raise GraphRewriteError(f"{self.source}: a node named '{name}' already exists")
        if shared_def is not None:
            node = Node(self, name, op, device, shared_def, shared_def=True)
        else:
            node = Node(self, name, op, device, node_def_pb2.NodeDef())
        inputs, control_inputs = list(inputs), list(control_inputs)   # read twice below
        node._ord = self._position_after(inputs, control_inputs)
        self._nodes[name] = node
        self._dirty_edges[node] = None
        self._dirty_attrs[node] = None
        for key, value in (attrs or {}).items():
            node.set_attr(key, value)
        for t in inputs:
            node.add_input(t)
        for c in control_inputs:
            node.add_control_input(c)
        node.colocate_with = tuple(colocate_with)
        if self._adding_replica is not None:
            node.replica = self._adding_replica
        elif self.infer_replicas:
            node.replica = _replica_from_producers(node)
        self._touch()
        return node

    def _position_after(self, inputs, control_inputs):
        """An order position for a new node: just after its latest producer, not at the
        end. A pass inserting ops between a value and its readers (a gradient's
        allreduce) then rewires readers that already sit after the new ops, so no edge
        needs the order repaired; a node with no producers (a Const) goes first."""
        ords = [t.node._ord for t in inputs]
        ords.extend(c._ord for c in control_inputs)
        if not ords:
            self._first_ord -= 1.0
            return self._first_ord
        return max(ords) + _AFTER

    def set_devices(self, devices):
        """Gives each node of ``{node: device}`` its device (one bulk edit: placement
        sets every node's). Returns the nodes whose device changed."""
        changed = [n for n, d in devices.items() if n._device != d]
        dirty = self._dirty_attrs
        for n in changed:
            n._device = devices[n]
            dirty[n] = None
        if changed:
            self.version += 1
        return changed

    @contextlib.contextmanager
    def adding_to_replica(self, replica):
        """Nodes added inside the block belong to ``replica``: for a pass that builds one
        replica's ops from global inputs only (a sharded lookup reading the batch split
        and the parameter servers' parts), which inference would make global."""
        saved, self._adding_replica = self._adding_replica, replica
        try:
            yield
        finally:
            self._adding_replica = saved

    def mark_new_global(self, names_before):
        """Nodes added since ``names_before`` (a set of names) whose replica is still
        unknown become global: for passes that add ops existing once (a parameter
        server's accumulator take, token queues) that read replicas' values."""
        for n in self._nodes.values():
            if n.replica == UNKNOWN_REPLICA and n.name not in names_before:
                n.replica = GLOBAL

    def clone_node(self, node, name, device=None):
        """A copy of ``node`` (op, attrs, device, colocation) with no edges; it shares
        the original's attr proto until either changes an attribute."""
        if name in self._nodes:
            raise GraphRewriteError(f"{self.source}: a node named '{name}' already exists")
        node._shared_def = True
        clone = Node(self, name, node.op, node.device if device is None else device,
                     node._def, shared_def=True)
        clone.colocate_with = node.colocate_with
        clone._ord = self._next_ord
        self._next_ord += 1.0
        self._nodes[name] = clone
        self._touch(clone, edges=True)
        self._dirty_attrs[clone] = None
        return clone

    def clone_nodes(self, nodes, prefix):
        """Clones ``nodes`` under ``prefix + name``. Edges between cloned nodes lead to the
        clones; edges from other nodes (and colocation with them) stay as they were.
        Returns {original: clone}. One bulk operation: this is the replication hot path.
        Clones of valid nodes are valid, so they are not queued for verification."""
        mapping = {}
        table = self._nodes
        for n in nodes:  # check every name first: a rejected clone leaves the graph as it was
            if prefix + n.name in table:
                raise GraphRewriteError(f"{self.source}: a node named '{prefix + n.name}' already exists")
        if not nodes:
            return mapping
        # clones keep their originals' topological order, shifted after every existing node
        lowest = min(n._ord for n in nodes)
        shift = self._next_ord - lowest
        for n in nodes:
            name = prefix + n.name
            n._shared_def = True
            c = Node(self, name, n.op, n._device, n._def, shared_def=True)
            c.arg_info = n.arg_info
            c._ord = n._ord + shift
            table[name] = c
            mapping[n] = c
        self._next_ord = max(n._ord for n in nodes) + shift + 1.0
        self._dirty_bulk = True
        get = mapping.get
        new_tensor = tuple.__new__
        for n, c in mapping.items():
            ins = []
            for pos, t in enumerate(n.inputs):
                p = get(t[0])
                if p is None:   # a node not cloned: the same (immutable) Tensor
                    p = t[0]
                    ins.append(t)
                else:
                    ins.append(new_tensor(Tensor, (p, t[1])))
                p._consumers[(c, pos)] = None   # _link, inlined: this loop runs per edge of R x N
                if p._by_output is not None:
                    p._by_output.setdefault(t[1], {})[(c, pos)] = None
            c.inputs = tuple(ins)
            if n.control_inputs:
                cis = []
                for q in n.control_inputs:
                    q2 = get(q, q)
                    cis.append(q2)
                    q2._control_consumers[c] = None
                c.control_inputs = tuple(cis)
            if n.colocate_with:
                c.colocate_with = tuple(get(t, t) if isinstance(t, Node) else t for t in n.colocate_with)
        self._touch()
        return mapping

    def rename_node(self, node, new_name):
        self.rename_nodes({node: new_name})

    def rename_nodes(self, renames):
        """Gives each node of ``{node: new name}`` its new name, in its place in the export
        order: one rebuild of the name table for all of them (a dict cannot rename a key
        in place). The new names must be free."""
        renames = {n: new for n, new in renames.items() if new != n.name}
        if not renames:
            return
        for new in renames.values():
            if new in self._nodes:
                raise GraphRewriteError(f"{self.source}: a node named '{new}' already exists")
        if len(set(renames.values())) != len(renames):
            raise GraphRewriteError(f"{self.source}: two nodes would be renamed to one name")
        by_old = {n.name: new for n, new in renames.items()}
        self._nodes = {by_old.get(k, k): v for k, v in self._nodes.items()}
        for n, new in renames.items():
            n.name = new
            self._touch(n, edges=True)

    def remove_node(self, node):
        """Removes a node that nothing reads any more (data or control)."""
        self.remove_nodes([node])

    def remove_nodes(self, nodes):
        """Removes a set of nodes that only read each other (dead-code elimination)."""
        nodes = list(dict.fromkeys(nodes))   # checked in the order given: a stable error
        doomed = set(nodes)
        for n in nodes:
            for c, _ in n._consumers:
                if c not in doomed:
                    raise GraphRewriteError(f"cannot remove node '{n.name}': still read by '{c.name}'")
            for c in n._control_consumers:
                if c not in doomed:
                    raise GraphRewriteError(f"cannot remove node '{n.name}': still a control input of '{c.name}'")
        for n in doomed:
            for pos, t in enumerate(n.inputs):
                t.node._consumers.pop((n, pos), None)
                if t.node._by_output is not None:
                    t.node._by_output.get(t.index, {}).pop((n, pos), None)
            for c in n.control_inputs:
                c._control_consumers.pop(n, None)
            n.inputs = ()
            n.control_inputs = ()
        for n in self._nodes.values():
            if n.colocate_with and any(isinstance(t, Node) and t in doomed for t in n.colocate_with):
                n.colocate_with = tuple(t for t in n.colocate_with if t not in doomed)
        self._nodes = {k: v for k, v in self._nodes.items() if v not in doomed}
        self._touch()

    def replace_all_uses(self, old, new, only=None):
        """Makes every reader of tensor ``old`` read ``new`` instead (restricted to the
        consumer nodes in ``only`` when given). Returns the consumers it changed."""
        changed = []
        for consumer, pos in old.node.consumers(old.index):
            if only is not None and consumer not in only:
                continue
            if consumer is new.node:
                continue  # never make the replacement read itself
            consumer.set_input(pos, new)
            changed.append((consumer, pos))
        return changed

    def replace_control_uses(self, old, new, only=None):
        """Moves control edges ``old -> X`` to ``new -> X``. Returns the changed X."""
        changed = []
        for consumer in list(old._control_consumers):
            if only is not None and consumer not in only:
                continue
            consumer.remove_control_input(old)
            if consumer is not new:
                consumer.add_control_input(new)
            changed.append(consumer)
        return changed


def keep_order(graph, x, y):
    """A new edge x -> y arrived with x not before y in the maintained topological order
    (Pearce and Kelly's dynamic topological sort, searching both ways at once). Either
    the nodes after y that precede x move just after x, or the nodes before x that follow
    y move just before y, whichever set is smaller; finding y behind x (or x after y)
    means a cycle, which the verifier then reports with a full check."""
    if y.op in _MERGES and x.op in _NEXT_ITERATIONS:
        return  # a loop back-edge
    if not y._consumers and not y._control_consumers:
        y._ord = graph._next_ord  # nothing follows y: it can go last
        graph._next_ord += 1.0
        return
    if not x.inputs and not x.control_inputs:   # nothing precedes x: it can go first
        x._ord = min(s._ord for s in _successors(x)) - 1.0
        return
    lo, hi = y._ord, x._ord
    fwd, fwd_seen, fwd_stack = [], {y}, [y]
    bwd, bwd_seen, bwd_stack = [], {x}, [x]
    while fwd_stack and bwd_stack:
        n = fwd_stack.pop()
        fwd.append(n)
        for c in _successors(n):
            if c is x:
                graph._order_ok = False
                return
            if c._ord < hi and c not in fwd_seen:
                fwd_seen.add(c)
                fwd_stack.append(c)
        n = bwd_stack.pop()
        bwd.append(n)
        for p in _predecessors(n):
            if p is y:
                graph._order_ok = False
                return
            if p._ord > lo and p not in bwd_seen:
                bwd_seen.add(p)
                bwd_stack.append(p)
    if not fwd_stack:   # move what follows y (and precedes x) to just after x
        moved = set(fwd)
        outside = [c._ord for n in fwd for c in _successors(n) if c not in moved]
        _spread(graph, sorted(fwd, key=lambda n: n._ord), hi, min(outside) if outside else None)
    else:               # move what precedes x (and follows y) to just before y
        moved = set(bwd)
        outside = [p._ord for n in bwd for p in _predecessors(n) if p not in moved]
        _spread(graph, sorted(bwd, key=lambda n: n._ord), max(outside) if outside else lo - len(bwd) - 1.0, lo)


def _spread(graph, nodes, lo, hi):
    """Gives ``nodes`` (in order) positions strictly between lo and hi (None: the end)."""
    if hi is None:
        for n in nodes:
            n._ord = graph._next_ord
            graph._next_ord += 1.0
        return
    step = (hi - lo) / (len(nodes) + 1)
    if step <= abs(hi) * 1e-12:
        # No room between the two neighbours (ties, or float positions worn thin by many
        # insertions): renumber the whole graph once. The edge just added closed no
        # cycle (the search says so); another edge of the same batch still may.
        graph.renumber()
        return
    for i, n in enumerate(nodes, 1):
        n._ord = lo + i * step


def _successors(n):
    outs = [c for c, _ in n._consumers]
    outs.extend(n._control_consumers)
    if n.op in _NEXT_ITERATIONS:
        outs = [c for c in outs if c.op not in _MERGES]
    return outs


def _predecessors(n):
    ins = [t.node for t in n.inputs]
    ins.extend(n.control_inputs)
    if n.op in _MERGES:
        ins = [p for p in ins if p.op not in _NEXT_ITERATIONS]
    return ins


_MERGES = frozenset(("Merge", "RefMerge"))
_NEXT_ITERATIONS = frozenset(("NextIteration", "RefNextIteration"))


def _position(node):
    return node._ord


def _replica_from_producers(node):
    """A node a pass adds after replication belongs where its data inputs do: to their
    replica if any belongs to one, else it is global if any is; else unknown (a Const).
    Passes that add global ops reading replicas (an accumulator's take) say so themselves."""
    seen_global = False
    for t in node.inputs:
        r = t.node.replica
        if r >= 0:
            return r
        if r == GLOBAL:
            seen_global = True
    return GLOBAL if seen_global else UNKNOWN_REPLICA


def split_tensor_name(name):
    """'x' -> ('x', 0); 'x:2' -> ('x', 2). Control names ('^x') are not tensors."""
    if name.startswith("^"):
        raise GraphRewriteError(f"'{name}' names a control edge, not a tensor")
    op_name, sep, index = name.rpartition(":")
    if sep and index.isdigit():
        return op_name, int(index)
    return name, 0
