"""Creating TensorFlow ops as IR nodes, with their type attributes taken from the OpDef.

``make_op(graph, "ConcatV2", name, [[a, b], axis])`` fills ``T``, ``N`` and ``Tidx`` from
the inputs' dtypes and the OpDef's argument declarations, and every other attribute from
the OpDef's defaults unless given, so a pass states only what is particular to it.
List arguments (``number_attr`` or ``type_list_attr``) are passed as python lists.
"""

import numpy as np

from graph_rewriter import dtypes, opdefs
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import Tensor
from graph_rewriter.protos import attr_value_pb2, node_def_pb2, tensor_shape_pb2


def dtype_of(tensor):
    """The (base) DataType enum of a tensor of the IR."""
    return opdefs.base_dtype(opdefs.output_dtypes(tensor.node)[tensor.index])


def _attr_value(value):
    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    a = attr_value_pb2.AttrValue()
    if hasattr(value, "as_datatype_enum"):   # a DType, ours or TensorFlow's
        a.type = value.as_datatype_enum
    elif isinstance(value, bool):
        a.b = value
    elif isinstance(value, int):
        a.i = value
    elif isinstance(value, float):
        a.f = value
    elif isinstance(value, (str, bytes)):
        a.s = value.encode() if isinstance(value, str) else value
    elif isinstance(value, (list, tuple)):
        if all(hasattr(v, "as_datatype_enum") for v in value):
            a.list.type.extend(v.as_datatype_enum for v in value)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            a.list.i.extend(value)
        elif all(isinstance(v, (str, bytes)) for v in value):
            a.list.s.extend(v.encode() if isinstance(v, str) else v for v in value)
        else:
            raise TypeError(f"unsupported list attr {value!r}")
    else:
        raise TypeError(f"unsupported attr {value!r}")
    return a


def make_op(graph, op_type, name, inputs=(), attrs=None, device="", control_inputs=(),
            colocate_with=(), type_attrs=None, replica=None):
    """A new node of ``op_type`` named ``graph.unique_name(name)``.

    ``type_attrs`` gives dtype enums for type attrs that cannot be read off inputs
    (an op's output type); everything else comes from the inputs or the OpDef defaults.
    ``replica`` (an index, or ir.GLOBAL) says which replica the node belongs to when its
    inputs do not tell.
    """
    od = opdefs.registered_op(op_type)
    if od is None:
        raise GraphRewriteError(f"op '{op_type}' is not registered in this TensorFlow")
    given = dict(attrs or {})
    values = {}
    flat = []
    if len(inputs) != len(od.input_arg):
        raise GraphRewriteError(
            f"internal: {op_type} takes {len(od.input_arg)} arguments, got {len(inputs)}")
    for arg, value in zip(od.input_arg, inputs):
        if arg.number_attr or arg.type_list_attr:
            items = list(value)
            flat += items
            if arg.number_attr:
                values.setdefault(arg.number_attr, len(items))
                if arg.type_attr and items:
                    values.setdefault(arg.type_attr, dtypes.as_dtype(dtype_of(items[0])))
            else:
                values.setdefault(arg.type_list_attr, [dtypes.as_dtype(dtype_of(t)) for t in items])
        else:
            flat.append(value)
            if arg.type_attr:
                values.setdefault(arg.type_attr, dtypes.as_dtype(dtype_of(value)))
    for k, v in (type_attrs or {}).items():
        values[k] = dtypes.as_dtype(v)
    values.update(given)
    key = _template_key(op_type, values)
    entry = _TEMPLATES.get(key) if key is not None else None
    if entry is None:
        entry = [_attrs_node_def(od, values), None]   # the attributes, and the OpDef facts they imply
        if key is not None:
            _remember(_TEMPLATES, key, entry)
    node = graph.add_node(graph.unique_name(name), op_type, inputs=flat,
                          control_inputs=control_inputs, device=device, colocate_with=colocate_with,
                          shared_def=entry[0])
    if entry[1] is None:
        entry[1] = opdefs.arg_info(node)
    else:
        node.arg_info = entry[1]
    if replica is not None:
        node.replica = replica
    return node


def _attrs_node_def(od, values):
    """A NodeDef holding the attributes ``values`` gives, and the OpDef's defaults for the
    others."""
    nd = node_def_pb2.NodeDef()
    for a in od.attr:
        if a.name in values:
            nd.attr[a.name].CopyFrom(_attr_value(values[a.name]))
        elif a.HasField("default_value"):
            nd.attr[a.name].CopyFrom(a.default_value)
    for k, v in values.items():  # internal attrs (leading underscore) the OpDef does not list
        if k.startswith("_"):
            nd.attr[k].CopyFrom(_attr_value(v))
    return nd


def function_node(function, op_type, name, inputs=(), attrs=None):
    """Appends a node to a FunctionDef's body and returns it. Unlike a graph's edges, a
    body's inputs are strings ``node:output_arg:index`` (``x:output:0`` for a Const);
    ``attrs`` must give every type attribute (there are no IR tensors to read them off),
    the OpDef's defaults fill the rest."""
    od = opdefs.registered_op(op_type)
    if od is None:
        raise GraphRewriteError(f"op '{op_type}' is not registered in this TensorFlow")
    nd = function.node_def.add()
    nd.CopyFrom(_attrs_node_def(od, dict(attrs or {})))
    nd.name, nd.op = name, op_type
    nd.input.extend(inputs)
    return nd


def function_const(function, name, value, dtype):
    """Appends a Const to a FunctionDef's body; returns its output as the body writes it."""
    nd = function.node_def.add()
    nd.CopyFrom(_const_attrs(value, dtype))
    nd.name, nd.op = name, "Const"
    return f"{name}:output:0"


# Attribute sets already built, shared (copy on write) by the nodes made from them: a
# pass makes the same Reshape or Const for every gradient of every replica. Pure facts
# of TensorFlow's OpDefs, so sharing them across graphs is safe.
_TEMPLATES = {}
_CONSTS = {}


def _remember(cache, key, value):
    if len(cache) > 100000:
        cache.clear()
    cache[key] = value


def _template_key(op_type, values):
    """A hashable key for an op's attribute values, or None when one is not hashable
    (an AttrValue given as is)."""
    items = []
    for k in sorted(values):
        v = _hashable(values[k])
        if v is None:
            return None
        items.append((k, v))
    return (op_type, tuple(items))


def _hashable(v):
    if hasattr(v, "as_datatype_enum"):
        return ("dtype", v.as_datatype_enum)
    if isinstance(v, (bool, int, float, str, bytes)):
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        items = tuple(_hashable(x) for x in v)
        return None if None in items else ("list", items)
    return None


def _const_attrs(value, dtype):
    """The (dtype, value) AttrValues of a constant, made once per distinct constant:
    passes create the same shape and axis constants for every replica."""
    dt = dtypes.as_dtype(dtype)
    key = (dt.as_datatype_enum, repr(value))
    hit = _CONSTS.get(key)
    if hit is None:
        proto = dtypes.make_tensor_proto(np.asarray(value, dtype=dt.as_numpy_dtype), dt)
        hit = node_def_pb2.NodeDef()
        hit.attr["dtype"].CopyFrom(_attr_value(dt))
        hit.attr["value"].CopyFrom(attr_value_pb2.AttrValue(tensor=proto))
        _remember(_CONSTS, key, hit)
    return hit


def const(graph, name, value, dtype, device="", replica=None):
    """A Const node holding ``value`` (anything numpy converts) as ``dtype``; returns its Tensor."""
    node = graph.add_node(graph.unique_name(name), "Const", device=device,
                          shared_def=_const_attrs(value, dtype))
    if replica is not None:
        node.replica = replica
    return Tensor(node, 0)


def run_after(graph, roots, ops):
    """Running each of ``roots`` by its name (a train op: nothing reads it) also runs
    ``ops``, after it: the original moves to ``<name>/before_sync`` and ``<name>`` becomes
    a NoOp (or, if it had an output, an Identity of it) waiting for both. Returns the new
    nodes. (The roots are renamed in one go: a model's BatchNorm layers leave hundreds of
    such roots, and each rename rebuilds the graph's name table.)"""
    roots = list(roots)
    names = [root.name for root in roots]
    graph.rename_nodes({root: graph.unique_name(f"{root.name}/before_sync") for root in roots})
    out = []
    for root, name in zip(roots, names):
        if opdefs.num_outputs(root):
            node = make_op(graph, "Identity", name, [root.output(0)], control_inputs=list(ops))
        else:
            node = graph.add_node(name, "NoOp", control_inputs=[root] + list(ops))
        node.device = root.device
        out.append(node)
    return out


def own_op(var, suffix, op_type):
    """The op tf.compat.v1 made beside a variable, ``<var>/<suffix>`` of ``op_type`` and
    reading it (e.g. "Read/ReadVariableOp", "IsInitialized/VarIsInitializedOp"): a pass
    reuses it instead of adding its twin. None when the graph has none."""
    for c, _ in var.consumers(0):
        if c.op == op_type and c.name == f"{var.name}/{suffix}":
            return c
    return None


def shape_attr(shape):
    """An AttrValue holding a TensorShapeProto (None: unknown rank; -1: unknown dim)."""
    proto = tensor_shape_pb2.TensorShapeProto()
    if shape is None:
        proto.unknown_rank = True
    else:
        for d in shape:
            proto.dim.add(size=d)
    return attr_value_pb2.AttrValue(shape=proto)


def out(node, index=0):
    return Tensor(node, index)


def dedup_rows(graph, scope, values, indices, device):
    """(summed values, unique indices): how TensorFlow's optimizers deduplicate the rows
    of an IndexedSlices gradient (Unique, then UnsortedSegmentSum by position)."""
    unique = make_op(graph, "Unique", f"{scope}/unique", [indices], attrs={"out_idx": dtypes.int64},
                     device=device)
    count = make_op(graph, "Size", f"{scope}/count", [unique.output(0)], attrs={"out_type": dtypes.int64},
                    device=device)
    summed = make_op(graph, "UnsortedSegmentSum", f"{scope}/sum",
                     [values, unique.output(1), count.output(0)], device=device)
    return summed.output(0), unique.output(0)


def read_or_default(graph, name, handle, dtype, default, device):
    """A resource variable's value, or ``default`` when the variable is not initialized
    (a v1 cond: the read runs only on the branch where ``VarIsInitializedOp`` is true,
    so a variable another server may not hold never fails the step). Returns the Merge's
    value tensor."""
    initialized = make_op(graph, "VarIsInitializedOp", f"{name}/is_initialized", [handle], device=device)
    switch = make_op(graph, "Switch", f"{name}/switch", [initialized.output(0), initialized.output(0)],
                     device=device)
    absent = make_op(graph, "Identity", f"{name}/absent", [switch.output(0)], device=device)
    present = make_op(graph, "Identity", f"{name}/present", [switch.output(1)], device=device)
    read = make_op(graph, "ReadVariableOp", f"{name}/read", [handle], attrs={"dtype": dtypes.as_dtype(dtype)},
                   device=device, control_inputs=[present])
    fallback = const(graph, f"{name}/default", default, dtype, device)
    fallback.node.add_control_input(absent)
    return make_op(graph, "Merge", name, [[read.output(0), fallback]], device=device).output(0)
