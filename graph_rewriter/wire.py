"""Protobuf wire-format primitives for writing serialized GraphDefs directly (the
export assembles bytes instead of building message objects; see graph_io)."""

from graph_rewriter.ir import COLOCATION_ATTR
from graph_rewriter.protos import attr_value_pb2, node_def_pb2


def encode_varint(n):
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Every length below 2**14 (one or two varint bytes: names, input fields, most nodes),
# encoded once: export asks for two lengths per node.
SHORT = 1 << 14
VARINTS = [encode_varint(i) for i in range(SHORT)]


def varint(n):
    return VARINTS[n] if n < SHORT else encode_varint(n)


def string_field(tag, text):
    """A length-delimited field: ``tag`` (the field's key byte), length, UTF-8 text."""
    data = text.encode("utf-8")
    return tag + varint(len(data)) + data


def colocation_entry(names):
    """The NodeDef attr-map entry ``_class: {list {s: "loc:@name" ...}}`` (field 5)."""
    value = attr_value_pb2.AttrValue()
    value.list.s.extend(("loc:@" + name).encode() for name in names)
    entry = string_field(b"\x0a", COLOCATION_ATTR)
    v = value.SerializeToString(deterministic=True)
    entry += b"\x12" + varint(len(v)) + v
    return b"\x2a" + varint(len(entry)) + entry


def attrs_bytes(d):
    """A NodeDef's fields other than name, op, device and inputs, serialized (attrs)."""
    rest = node_def_pb2.NodeDef()
    rest.CopyFrom(d)
    rest.ClearField("name")
    rest.ClearField("op")
    rest.ClearField("device")
    rest.ClearField("input")
    return rest.SerializeToString(deterministic=True)
