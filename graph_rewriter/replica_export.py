"""Writing a graph whose replica 1 is a template (``ReplicaMap.template``): every single
node once, and replica 1's nodes once for each replica 1..R-1.

Replica k's copy of a template node differs from replica 1's in exactly these places:

- every string that names a template node starts with replica k's prefix instead of
  replica 1's: the node's name, its inputs and control inputs, its colocation targets,
  and the ``shared_name`` and v1 ``frame_name`` the replicate pass made per replica;
- its device, where it is replica 1's device or host, is replica k's (unless placement
  put it there because a global node is there: ``ReplicaMap.fixed_devices``);
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

import array

import numpy as np

from graph_rewriter import opdefs
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import COLOCATION_ATTR, UNKNOWN_REPLICA, Node
from graph_rewriter.protos import node_def_pb2
from graph_rewriter.wire import attrs_bytes, colocation_entry, string_field, varint

PREFIX, INDEX, DEVICE, HOST = range(4)   # kinds of hole
_RENAMED_ATTRS = ("shared_name", "frame_name")   # made per replica by the replicate pass


def write_replicated_nodes(item, rm, out, nodes_bytes):
    """Appends every node of the expanded graph to ``out``: the single nodes (through
    graph_io's ``nodes_bytes``), then replica 1, 2, ... R-1's copies of the template."""
    prefix = rm.prefixes[1]
    template, plain, fan_in = [], [], []
    for n in item.nodes:
        if n.name.startswith(prefix):
            template.append(n)
        elif _refers_to_template(n, prefix):
            fan_in.append(n)
        else:
            plain.append(n)
    attr_bytes = item.attr_bytes_cache()   # a template node shares its attribute proto with its original
    nodes_bytes(plain, out, attr_bytes)
    replicas = range(1, rm.num_local)
    for n in fan_in:
        nd = _fan_in_node_def(n, rm, prefix, replicas)
        data = nd.SerializeToString(deterministic=True)
        out += b"\x0a" + varint(len(data)) + data
    renderer = _TemplateRenderer(rm, attr_bytes)
    groups = _groups(rm, replicas)
    rendered = renderer.render(template, [group[0] for group in groups])
    del template
    for group, (block, holes) in zip(groups, rendered):
        out += block
        if len(group) == 1:
            continue
        # Within a group the values differ in a few bytes only (the digits of
        # "replica_3/" and "replica_4/"): write just those.
        writes = []
        for kind, offsets in holes.items():
            values = [renderer.value(kind, k) for k in group]
            differ = [j for j in range(len(values[0])) if len({v[j] for v in values}) > 1]
            if offsets and differ:
                index = (np.frombuffer(offsets, dtype=np.int64)[:, None] + np.asarray(differ)).ravel()
                writes.append((index, [bytes(v[j] for j in differ) for v in values], len(offsets)))
        copy = np.frombuffer(block, dtype=np.uint8).copy()
        for member in range(1, len(group)):
            for index, values, count in writes:
                copy[index] = np.tile(np.frombuffer(values[member], dtype=np.uint8), count)
            out += copy.data


def _groups(rm, replicas):
    """Replicas grouped by the lengths of their substituted strings, in replica order."""
    groups = {}
    for k in replicas:
        key = (len(rm.prefixes[k]), len(str(k)), len(rm.devices[k]), len(rm.hosts[k]))
        groups.setdefault(key, []).append(k)
    return sorted(groups.values())


def _refers_to_template(n, prefix):
    for t in n.inputs:
        if t.node.name.startswith(prefix):
            return True
    for c in n.control_inputs:
        if c.name.startswith(prefix):
            return True
    for c in n.colocate_with:
        if isinstance(c, Node) and c.name.startswith(prefix):
            return True
    return False


def _fan_in_node_def(n, rm, prefix, replicas):
    """The NodeDef of a single node, each reference to a template node expanded to every
    replica's copy; list arguments' length attributes follow their inputs."""
    nd = node_def_pb2.NodeDef()
    nd.CopyFrom(n.node_def)   # the attribute proto: its name, op, device and inputs are stale
    nd.ClearField("input")
    nd.ClearField("device")
    nd.name = n.name
    nd.op = n.op
    if n.device:
        nd.device = n.device
    cut = len(prefix)

    def expand(name):
        if not name.startswith(prefix):
            return [name]
        return [rm.prefixes[k] + name[cut:] for k in replicas]

    grown = {}   # data input position -> how many inputs it became
    for pos, t in enumerate(n.inputs):
        names = expand(t.node.name)
        grown[pos] = len(names)
        nd.input.extend(name if t.index == 0 else f"{name}:{t.index}" for name in names)
    for c in n.control_inputs:
        nd.input.extend("^" + name for name in expand(c.name))
    if n.colocate_with:
        targets = [name for c in n.colocate_with for name in expand(c.name if isinstance(c, Node) else c)]
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
    """Serializes the template nodes as replica k's copies, noting the holes' offsets.

    Each node is turned into a recipe: serialized fields where nothing depends on the
    replica, and for the rest the pieces around each hole. Rendering it for a replica
    then only joins pieces and computes lengths."""

    def __init__(self, rm, attr_bytes):
        self.rm = rm
        self.prefix = rm.prefixes[1]
        self.indexed = frozenset(rm.per_replica_outputs)
        self.fixed = frozenset(rm.fixed_devices)
        self._attrs = attr_bytes   # id(attr proto) -> (serialized attrs, proto), as graph_io's
        self._literal = {}   # input or control string -> its serialized field
        self._ops = {}       # op type -> its serialized field
        self._devices = {}   # a device no hole substitutes -> its serialized field
        self._marker = self.prefix.encode()

    def value(self, kind, k):
        rm = self.rm
        if kind == PREFIX:
            return rm.prefixes[k].encode()
        if kind == INDEX:
            return str(k).encode()
        if kind == DEVICE:
            return rm.devices[k].encode()
        return rm.hosts[k].encode()

    def render(self, template, replicas):
        """Per replica in ``replicas``: (its copies of the ``template`` nodes serialized,
        {hole kind: [offset of each hole]}). One recipe per node serves every replica."""
        values = [[self.value(kind, k) for kind in (PREFIX, INDEX, DEVICE, HOST)] for k in replicas]
        blocks = [(bytearray(), {kind: array.array("q") for kind in (PREFIX, INDEX, DEVICE, HOST)})
                  for _ in replicas]
        for n in template:
            if self._is_simple(n):
                # most nodes: written directly, no recipe (the same bytes and holes)
                for (out, holes), vals in zip(blocks, values):
                    self._append_simple(n, vals, out, holes)
                continue
            recipe = self._recipe(n)
            for (out, holes), vals in zip(blocks, values):
                _append_node(out, holes, *_evaluate(recipe, vals))
        return blocks

    def _is_simple(self, n):
        """Whether no attribute of a node was renamed per replica (``shared_name``, v1
        ``frame_name``): those are written from a recipe."""
        attr = n.node_def.attr
        marker = self._marker
        for key in _RENAMED_ATTRS:
            if key in attr and marker in attr[key].s:
                return False
        return True

    def _append_simple(self, n, vals, out, holes):
        """Appends a simple node (``_is_simple``) as the replica of ``vals`` to ``out``,
        noting its holes in ``holes``: what ``_recipe`` then ``_evaluate`` give for it,
        without building the recipe (the export's hot path)."""
        prefix, cut = self.prefix, len(self.prefix)
        value = vals[PREFIX]
        local = []   # (kind, offset in the node's body)
        tail = n.name[cut:].encode()
        length = varint(len(value) + len(tail))
        local.append((PREFIX, 1 + len(length)))
        body = [b"\x0a", length, value, tail, self._op_field(n.op)]
        size = 1 + len(length) + len(value) + len(tail) + len(body[-1])
        for t in n.inputs:
            name = t.node.name
            if name.startswith(prefix):
                data = (name[cut:] + (f":{t.index}" if t.index else "")).encode()
                length = varint(len(value) + len(data))
                local.append((PREFIX, size + 1 + len(length)))
                body += (b"\x1a", length, value, data)
                size += 1 + len(length) + len(value) + len(data)
            elif name in self.indexed:
                _check_reads_replica_1(n, name, t)
                lead, index = f"{name}:".encode(), vals[INDEX]
                length = varint(len(lead) + len(index))
                local.append((INDEX, size + 1 + len(length) + len(lead)))
                body += (b"\x1a", length, lead, index)
                size += 1 + len(length) + len(lead) + len(index)
            else:
                field = self._field(name if t.index == 0 else f"{name}:{t.index}")
                body.append(field)
                size += len(field)
        for c in n.control_inputs:
            if c.name.startswith(prefix):
                data = c.name[cut:].encode()
                length = varint(1 + len(value) + len(data))
                local.append((PREFIX, size + 2 + len(length)))
                body += (b"\x1a", length, b"^", value, data)
                size += 2 + len(length) + len(value) + len(data)
            else:
                field = self._field("^" + c.name)
                body.append(field)
                size += len(field)
        device = n.device
        if device:
            kind = self._device_hole(n, device)
            if kind is None:
                field = self._device_field(device)
                body.append(field)
                size += len(field)
            else:
                data = vals[kind]
                length = varint(len(data))
                local.append((kind, size + 1 + len(length)))
                body += (b"\x22", length, data)
                size += 1 + len(length) + len(data)
        d = n.node_def
        cached = self._attrs.get(id(d))
        if cached is None or cached[1] is not d:
            cached = self._attrs[id(d)] = (attrs_bytes(d), d)
        body.append(cached[0])
        size += len(cached[0])
        if n.colocate_with:
            names = [t.name if isinstance(t, Node) else t for t in n.colocate_with]
            if any(name.startswith(prefix) for name in names):
                self._append_colocation(names, value, size, body, local)
            else:
                body.append(colocation_entry(names))
        _append_node(out, holes, b"".join(body), local)

    def _append_colocation(self, names, value, size, body, local):
        """The ``_class`` attr entry (what ``_colocation`` makes a recipe of) appended to
        ``body`` at offset ``size``, a hole at each template target's prefix."""
        prefix, cut = self.prefix, len(self.prefix)
        parts, holes, listed = [], [], 0   # the AttrValue's list: one "loc:@name" each
        for name in names:
            if name.startswith(prefix):
                data = name[cut:].encode()
                length = varint(5 + len(value) + len(data))
                holes.append(listed + 1 + len(length) + 5)
                parts += (b"\x12", length, b"loc:@", value, data)
                listed += 1 + len(length) + 5 + len(value) + len(data)
            else:
                field = string_field(b"\x12", "loc:@" + name)
                parts.append(field)
                listed += len(field)
        list_head = b"\x0a" + varint(listed)                        # AttrValue.list
        lead = _CLASS_KEY + b"\x12" + varint(len(list_head) + listed) + list_head   # entry's key, value
        head = b"\x2a" + varint(len(lead) + listed)                  # NodeDef.attr entry
        start = size + len(head) + len(lead)
        local.extend((PREFIX, start + offset) for offset in holes)
        body += (head, lead)
        body += parts

    def _op_field(self, op):
        return _memo_field(self._ops, b"\x12", op)

    def _device_field(self, device):
        return _memo_field(self._devices, b"\x22", device)

    def _device_hole(self, n, device):
        """DEVICE or HOST when the template node's ``device`` is replica 1's device or host
        (replica k's copy takes replica k's), else None: written as it is (a node of no
        replica, or one placement put on a global node's device: ``fixed``)."""
        replica = n.replica if n.replica != UNKNOWN_REPLICA else 1
        if replica != 1 or n.name in self.fixed:
            return None
        if device == self.rm.devices[1]:
            return DEVICE
        if device == self.rm.hosts[1]:
            return HOST
        return None

    def _recipe(self, n):
        prefix, cut = self.prefix, len(self.prefix)
        items = [(PREFIX, b"\x0a", b"", n.name[cut:].encode()), string_field(b"\x12", n.op)]
        for t in n.inputs:
            name = t.node.name
            if name.startswith(prefix):
                items.append((PREFIX, b"\x1a", b"", (name[cut:] + (f":{t.index}" if t.index else "")).encode()))
            elif name in self.indexed:
                _check_reads_replica_1(n, name, t)
                items.append((INDEX, b"\x1a", f"{name}:".encode(), b""))
            else:
                items.append(self._field(name if t.index == 0 else f"{name}:{t.index}"))
        for c in n.control_inputs:
            if c.name.startswith(prefix):
                items.append((PREFIX, b"\x1a", b"^", c.name[cut:].encode()))
            else:
                items.append(self._field("^" + c.name))
        device = n.device
        kind = self._device_hole(n, device) if device else None
        if kind is not None:
            items.append((kind, b"\x22", b"", b""))
        elif device:
            items.append(string_field(b"\x22", device))
        self._attributes(n, items)
        if n.colocate_with:
            self._colocation(n, items)
        return _merge_literals(items)

    def _field(self, text):
        return _memo_field(self._literal, b"\x1a", text)

    def _attributes(self, n, items):
        d = n.node_def
        marker = self.prefix.encode()
        renamed = [key for key in _RENAMED_ATTRS if key in d.attr and marker in d.attr[key].s]
        if not renamed:
            cached = self._attrs.get(id(d))
            if cached is None or cached[1] is not d:
                cached = self._attrs[id(d)] = (attrs_bytes(d), d)
            items.append(cached[0])
            return
        # Deterministic serialization writes the attr map sorted by key, then the other
        # fields: the same here, with the renamed strings' prefixes as holes.
        for key in sorted(d.attr):
            if key in renamed:
                value = [(_JOINED, b"\x12", d.attr[key].s.split(marker))]
                entry = [string_field(b"\x0a", key), (_NESTED, b"\x12", value)]
                items.append((_NESTED, b"\x2a", entry))
            else:
                single = node_def_pb2.NodeDef()
                single.attr[key].CopyFrom(d.attr[key])
                items.append(single.SerializeToString(deterministic=True))
        rest = node_def_pb2.NodeDef()
        rest.CopyFrom(d)
        rest.ClearField("attr")
        items.append(attrs_bytes(rest))

    def _colocation(self, n, items):
        prefix, cut = self.prefix, len(self.prefix)
        names = [t.name if isinstance(t, Node) else t for t in n.colocate_with]
        if not any(name.startswith(prefix) for name in names):
            items.append(colocation_entry(names))
            return
        targets = []
        for name in names:
            if name.startswith(prefix):
                targets.append((PREFIX, b"\x12", b"loc:@", name[cut:].encode()))
            else:
                targets.append(string_field(b"\x12", "loc:@" + name))
        value = [(_NESTED, b"\x0a", targets)]
        entry = [string_field(b"\x0a", COLOCATION_ATTR), (_NESTED, b"\x12", value)]
        items.append((_NESTED, b"\x2a", entry))


_CLASS_KEY = string_field(b"\x0a", COLOCATION_ATTR)   # the colocation attr entry's key field
_NESTED, _JOINED = 4, 5   # recipe items beside the hole kinds: a message field, a joined string


def _merge_literals(items):
    """The recipe with neighbouring serialized fields joined (fewer pieces to render)."""
    out = []
    for item in items:
        if type(item) is bytes and out and type(out[-1]) is bytes:
            out[-1] += item
        else:
            out.append(item)
    return out


def _evaluate(items, values):
    """Serializes a recipe with the replica's strings (``values``, indexed by hole kind):
    (bytes, [(kind, offset)]). An item is serialized fields (bytes); a string field
    ``(kind, tag, lead, tail)`` holding lead + the replica's value + tail; a message field
    ``(_NESTED, tag, items)``; or ``(_JOINED, tag, chunks)``, a string of the chunks
    joined by the replica's prefix."""
    parts, holes, size = [], [], 0
    for item in items:
        if type(item) is bytes:
            parts.append(item)
            size += len(item)
            continue
        kind, tag = item[0], item[1]
        if kind == _NESTED:
            data, inner = _evaluate(item[2], values)
            head = tag + varint(len(data))
            start = size + len(head)
            holes.extend((k, start + offset) for k, offset in inner)
        elif kind == _JOINED:
            chunks, value = item[2], values[PREFIX]
            data = value.join(chunks)
            head = tag + varint(len(data))
            offset = size + len(head)
            for chunk in chunks[:-1]:
                offset += len(chunk)
                holes.append((PREFIX, offset))
                offset += len(value)
        else:
            lead, value, tail = item[2], values[kind], item[3]
            data = lead + value + tail
            head = tag + varint(len(data))
            holes.append((kind, size + len(head) + len(lead)))
        parts.append(head)
        parts.append(data)
        size += len(head) + len(data)
    return b"".join(parts), holes


def _check_reads_replica_1(n, name, t):
    """A template node reads output 1 of a per-replica output (the batch split's): the
    export writes output k for replica k. Anything else is a bug of a pass."""
    if t.index != 1:
        raise GraphRewriteError(
            f"internal: template node '{n.name}' reads output {t.index} of the "
            f"per-replica output '{name}', expected output 1 (replica 1's)",
            hint="rewrite with materialize_replicas=True")


def _memo_field(cache, tag, text):
    """The serialized string field ``tag`` + ``text``, made once per text (``cache``)."""
    field = cache.get(text)
    if field is None:
        field = cache[text] = string_field(tag, text)
    return field


def _append_node(out, holes, data, local):
    """Appends one serialized NodeDef ``data`` to ``out`` as a GraphDef's node field,
    noting its holes (``local``: (kind, offset in data)) at their offsets in ``out``."""
    head = b"\x0a" + varint(len(data))
    base = len(out) + len(head)
    for kind, offset in local:
        holes[kind].append(base + offset)
    out += head
    out += data
