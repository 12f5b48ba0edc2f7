"""Writing a graph whose replica 1 is a template (``ReplicaMap.template``): every single
node once, and replica 1's nodes once for each replica 1..R-1.

Replica k's copy of a template node differs from replica 1's in exactly these places:

- every string that names a template node starts with replica k's prefix instead of
  replica 1's: the node's name, its inputs and control inputs, its colocation targets,
  and the ``shared_name`` and v1 ``frame_name`` the replicate pass made per replica;
- its device, where it is replica 1's device or host, is replica k's;
- an input from a per-replica output (the batch split's output 1) reads output k.

A single node that refers to template nodes refers to every replica's copy (the fan-in
of the root ops' control edges, of a summary's mean): each such reference is expanded
in place, in replica order, and a list argument's length attribute (``N``) follows.

Replicas whose substituted strings have the same lengths serialize to the same bytes
except at those places ("holes"). So the template is serialized once per group of such
replicas, noting where its holes are, and every other replica of the group is a copy of
those bytes with its own strings written at the holes: numpy does that per replica, not
Python per node.
"""

import numpy as np
from tensorflow.core.framework import node_def_pb2

from graph_rewriter import opdefs
from graph_rewriter.graph_io import _string_field, _varint, attrs_bytes
from graph_rewriter.ir import COLOCATION_ATTR, UNKNOWN_REPLICA, Node

PREFIX, INDEX, DEVICE, HOST = range(4)   # kinds of hole
_RENAMED_ATTRS = ("shared_name", "frame_name")   # made per replica by the replicate pass


def write_replicated_nodes(item, out, nodes_bytes):
    """Appends every node of the expanded graph to ``out``: the single nodes (through
    graph_io's ``nodes_bytes``), then replica 1, 2, ... R-1's copies of the template."""
    rm = item.replicas
    prefix = rm.prefixes[1]
    template, plain, fan_in = [], [], []
    for n in item._nodes.values():
        if n._name.startswith(prefix):
            template.append(n)
        elif _refers_to_template(n, prefix):
            fan_in.append(n)
        else:
            plain.append(n)
    nodes_bytes(plain, out)
    replicas = range(1, rm.num_local)
    for n in fan_in:
        nd = _fan_in_node_def(n, rm, prefix, replicas)
        data = nd.SerializeToString(deterministic=True)
        out += b"\x0a" + _varint(len(data)) + data
    renderer = _TemplateRenderer(template, rm)
    for group in _groups(rm, replicas):
        block, holes = renderer.render(group[0])
        out += block
        if len(group) == 1:
            continue
        base = np.frombuffer(block, dtype=np.uint8)
        where = {kind: (np.asarray(offsets, dtype=np.int64)[:, None]
                        + np.arange(len(renderer.value(kind, group[0])), dtype=np.int64)).ravel()
                 for kind, offsets in holes.items() if offsets}
        for k in group[1:]:
            copy = base.copy()
            for kind, index in where.items():
                value = np.frombuffer(renderer.value(kind, k), dtype=np.uint8)
                copy[index] = np.tile(value, len(index) // len(value))
            out += copy.data


def _groups(rm, replicas):
    """Replicas grouped by the lengths of their substituted strings, in replica order."""
    groups = {}
    for k in replicas:
        key = (len(rm.prefixes[k]), len(str(k)), len(rm.devices[k]), len(rm.hosts[k]))
        groups.setdefault(key, []).append(k)
    return sorted(groups.values())


def _refers_to_template(n, prefix):
    for t in n._inputs:
        if t.node._name.startswith(prefix):
            return True
    for c in n._control_inputs:
        if c._name.startswith(prefix):
            return True
    for c in n._colocate:
        if isinstance(c, Node) and c._name.startswith(prefix):
            return True
    return False


def _fan_in_node_def(n, rm, prefix, replicas):
    """The NodeDef of a single node, each reference to a template node expanded to every
    replica's copy; list arguments' length attributes follow their inputs."""
    nd = node_def_pb2.NodeDef()
    nd.CopyFrom(n._def)
    nd.name = n._name
    nd.op = n.op
    if n.device:
        nd.device = n.device
    cut = len(prefix)

    def expand(name):
        if not name.startswith(prefix):
            return [name]
        return [rm.prefixes[k] + name[cut:] for k in replicas]

    grown = {}   # data input position -> how many inputs it became
    for pos, t in enumerate(n._inputs):
        names = expand(t.node._name)
        grown[pos] = len(names)
        nd.input.extend(name if t.index == 0 else f"{name}:{t.index}" for name in names)
    for c in n._control_inputs:
        nd.input.extend("^" + name for name in expand(c._name))
    if n._colocate:
        targets = [name for c in n._colocate for name in expand(c._name if isinstance(c, Node) else c)]
        nd.attr[COLOCATION_ATTR].list.s.extend(("loc:@" + t).encode() for t in targets)
    if any(g != 1 for g in grown.values()):
        _fix_list_lengths(n, nd, grown)
    return nd


def _fix_list_lengths(n, nd, grown):
    """A list argument (AddN's ``inputs``) that gained inputs: its ``number_attr`` or
    ``type_list_attr`` now counts them."""
    od = opdefs.require_op_def(n)
    slices = opdefs.input_arg_slices(n)
    for arg in od.input_arg:
        first, count = slices[arg.name]
        new = sum(grown[p] for p in range(first, first + count))
        if new == count:
            continue
        if arg.number_attr:
            nd.attr[arg.number_attr].i = new
        elif arg.type_list_attr:
            types = list(nd.attr[arg.type_list_attr].list.type)
            expanded = [t for p, t in zip(range(first, first + count), types) for _ in range(grown[p])]
            del nd.attr[arg.type_list_attr].list.type[:]
            nd.attr[arg.type_list_attr].list.type.extend(expanded)


class _TemplateRenderer:
    """Serializes the template nodes as replica k's copies, noting the holes' offsets."""

    def __init__(self, template, rm):
        self.template = template
        self.rm = rm
        self.prefix = rm.prefixes[1]
        self.indexed = frozenset(rm.per_replica_outputs)
        self._attrs = {}     # id(attr proto) -> (serialized attrs, proto) when no hole
        self._literal = {}   # input or control string -> its serialized field

    def value(self, kind, k):
        rm = self.rm
        if kind == PREFIX:
            return rm.prefixes[k].encode()
        if kind == INDEX:
            return str(k).encode()
        if kind == DEVICE:
            return rm.devices[k].encode()
        return rm.hosts[k].encode()

    def render(self, k):
        """(replica k's serialized nodes, {kind: [offset of each hole]})."""
        rm, prefix, cut = self.rm, self.prefix, len(self.prefix)
        pk = rm.prefixes[k]
        kk = str(k)
        dev1, host1 = rm.devices[1], rm.hosts[1]
        holes = {PREFIX: [], INDEX: [], DEVICE: [], HOST: []}
        out = bytearray()
        for n in self.template:
            body = _Body()
            body.string(b"\x0a", pk + n._name[cut:], [(PREFIX, 0)])
            body.literal(_string_field(b"\x12", n.op))
            for t in n._inputs:
                p = t.node
                name = p._name
                if name.startswith(prefix):
                    body.string(b"\x1a", pk + name[cut:] + (f":{t.index}" if t.index else ""), [(PREFIX, 0)])
                elif name in self.indexed:
                    if t.index != 1:
                        raise AssertionError(f"template node {n.name} reads output {t.index} of "
                                             f"per-replica output {name}, expected output 1")
                    body.string(b"\x1a", f"{name}:{kk}", [(INDEX, len(name.encode()) + 1)])
                else:
                    body.literal(self._field(name if t.index == 0 else f"{name}:{t.index}"))
            for c in n._control_inputs:
                if c._name.startswith(prefix):
                    body.string(b"\x1a", "^" + pk + c._name[cut:], [(PREFIX, 1)])
                else:
                    body.literal(self._field("^" + c._name))
            device = n.device
            replica = n.replica if n.replica != UNKNOWN_REPLICA else 1
            if device and replica == 1 and device == dev1:
                body.string(b"\x22", rm.devices[k], [(DEVICE, 0)])
            elif device and replica == 1 and device == host1:
                body.string(b"\x22", rm.hosts[k], [(HOST, 0)])
            elif device:
                body.literal(_string_field(b"\x22", device))
            self._attributes(n, body, pk)
            if n._colocate:
                self._colocation(n, body, pk)
            data, local = body.finish()
            head = b"\x0a" + _varint(len(data))
            base = len(out) + len(head)
            for kind, offset in local:
                holes[kind].append(base + offset)
            out += head
            out += data
        return bytes(out), holes

    def _field(self, text):
        field = self._literal.get(text)
        if field is None:
            field = self._literal[text] = _string_field(b"\x1a", text)
        return field

    def _attributes(self, n, body, pk):
        d = n._def
        renamed = [key for key in _RENAMED_ATTRS
                   if key in d.attr and self.prefix.encode() in d.attr[key].s]
        if not renamed:
            cached = self._attrs.get(id(d))
            if cached is None or cached[1] is not d:
                cached = self._attrs[id(d)] = (attrs_bytes(d), d)
            body.literal(cached[0])
            return
        # Deterministic serialization writes the attr map sorted by key, then the other
        # fields: the same here, with the renamed strings' prefixes as holes.
        for key in sorted(d.attr):
            if key in renamed:
                parts = d.attr[key].s.split(self.prefix.encode())
                value = _Body()
                value.string(b"\x12", pk.encode().join(parts),
                             _prefix_holes(parts, len(pk.encode())))
                entry = _Body()
                entry.literal(_string_field(b"\x0a", key))
                entry.nested(b"\x12", value)
                body.nested(b"\x2a", entry)
            else:
                single = node_def_pb2.NodeDef()
                single.attr[key].CopyFrom(d.attr[key])
                body.literal(single.SerializeToString(deterministic=True))
        rest = node_def_pb2.NodeDef()
        rest.CopyFrom(d)
        rest.ClearField("attr")
        body.literal(attrs_bytes(rest))

    def _colocation(self, n, body, pk):
        cut = len(self.prefix)
        items = _Body()
        for t in n._colocate:
            name = t._name if isinstance(t, Node) else t
            if name.startswith(self.prefix):
                items.string(b"\x12", "loc:@" + pk + name[cut:], [(PREFIX, 5)])
            else:
                items.literal(_string_field(b"\x12", "loc:@" + name))
        value = _Body()
        value.nested(b"\x0a", items)
        entry = _Body()
        entry.literal(_string_field(b"\x0a", COLOCATION_ATTR))
        entry.nested(b"\x12", value)
        body.nested(b"\x2a", entry)


def _prefix_holes(parts, width):
    """Offsets of the prefixes joining ``parts`` (a string split at every prefix)."""
    holes, offset = [], 0
    for part in parts[:-1]:
        offset += len(part)
        holes.append((PREFIX, offset))
        offset += width
    return holes


class _Body:
    """Serialized protobuf fields under construction, with hole offsets (kind, offset)."""
    __slots__ = ("parts", "size", "holes")

    def __init__(self):
        self.parts, self.size, self.holes = [], 0, []

    def literal(self, data):
        self.parts.append(data)
        self.size += len(data)

    def string(self, tag, text, holes):
        """A length-delimited field holding ``text``; holes are offsets within the text."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        head = tag + _varint(len(data))
        start = self.size + len(head)
        self.holes.extend((kind, start + offset) for kind, offset in holes)
        self.parts.append(head)
        self.parts.append(data)
        self.size += len(head) + len(data)

    def nested(self, tag, inner):
        """A length-delimited field holding the message built in ``inner``."""
        data, holes = inner.finish()
        self.string(tag, data, holes)

    def finish(self):
        return b"".join(self.parts), self.holes
