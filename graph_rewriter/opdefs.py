"""What TensorFlow's own registries say about an op: argument names and positions,
output counts and dtypes, statefulness, and which devices have a kernel for it.

Positions are computed from the OpDef (an argument can expand to several inputs through
``number_attr`` or ``type_list_attr``), never from hand-written tables: from the registry
itself, or from the tables tools/gen_tf_tables.py generated from it. Calls of library
functions are resolved through the function's signature.
"""

import functools
import json
import os

from graph_rewriter import protos
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.protos import types_pb2

DT_RESOURCE = types_pb2.DT_RESOURCE
DT_VARIANT = types_pb2.DT_VARIANT
DT_STRING = types_pb2.DT_STRING
_REF_OFFSET = 100  # DT_FLOAT_REF = DT_FLOAT + 100

_DATA = os.path.join(os.path.dirname(__file__), "data")
_OP_TABLE = os.path.join(_DATA, "op_defs.pb")
_CPU_TABLE = os.path.join(_DATA, "cpu_kernels.json")
_GPU_TABLE = os.path.join(_DATA, "gpu_kernels.json")


# ----- where the facts come from: the live registry, or the tables ---------------------
# With TensorFlow imported (protos.USING_TENSORFLOW), its own registries answer: they
# know the ops that libraries loaded with tf.load_op_library register. Without it, the
# tables tools/gen_tf_tables.py generated from TensorFlow answer, so that the CLI and a
# TensorFlow-free install rewrite without the 4 s import.

@functools.lru_cache(maxsize=None)
def _op_table():
    with open(_OP_TABLE, "rb") as f:
        ops = protos.op_def_pb2.OpList.FromString(f.read())
    return {od.name: od for od in ops.op}


@functools.lru_cache(maxsize=None)
def _lookup():
    if protos.USING_TENSORFLOW:
        from tensorflow.python.framework import op_def_registry
        return op_def_registry.get
    return _op_table().get


def registered_op(op):
    """The OpDef TensorFlow registers for ``op`` (live registry or shipped table), or None."""
    return _lookup()(op)


@functools.lru_cache(maxsize=None)
def _kernel_table(path):
    with open(path) as f:
        return json.load(f)["kernels"]


def live_op_list():
    """Every op the imported TensorFlow registers, as an OpList (for gen_tf_tables.py)."""
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session
    return op_def_pb2.OpList.FromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))


def live_tensorflow_version():
    import tensorflow as tf
    return tf.__version__


def registered_kernels(device_types):
    """{op: [kernel, ...]} where a kernel is {constraint attr: [allowed dtype enums]}: the
    kernels the imported TensorFlow registers for ``device_types`` ("CPU", "GPU",
    "DEFAULT"), as the kernel tables ship them."""
    from tensorflow.python.framework import kernels
    table = {}
    for k in kernels.get_all_registered_kernels().kernel:
        if k.device_type not in device_types:
            continue
        constraints = {c.name: sorted(c.allowed_values.list.type) for c in k.constraint
                       if c.allowed_values.list.type}
        entry = table.setdefault(k.op, [])
        if constraints not in entry:
            entry.append(constraints)
    return table


def op_def(op, library=None):
    """The OpDef of a registered op, or the signature of a library function, or None."""
    od = registered_op(op)
    if od is not None:
        return od
    if library is not None:
        for fn in library.function:
            if fn.signature.name == op:
                return fn.signature
    return None


def require_op_def(node):
    od = op_def(node.op, node.graph.library)
    if od is None:
        raise GraphRewriteError(
            f"{node.graph.source}: node '{node.name}' uses op '{node.op}', which "
            f"{'this TensorFlow' if protos.USING_TENSORFLOW else 'TensorFlow (the op table shipped with graph_rewriter)'} "
            f"does not know and the graph's function library does not define",
            hint="in Python, import TensorFlow and load the library that registers the op "
                 "(tf.load_op_library) before graph_rewriter's first rewrite in the process; or check "
                 "that the graph was written by a compatible TensorFlow")
    return od


def arg_length(arg, attrs):
    """How many tensors the OpDef argument ``arg`` stands for on a node with ``attrs``."""
    if arg.number_attr:
        return attrs[arg.number_attr].i if arg.number_attr in attrs else 0
    if arg.type_list_attr:
        return len(attrs[arg.type_list_attr].list.type) if arg.type_list_attr in attrs else 0
    return 1


def output_position(node_def, arg_name, index, library=None):
    """The flat output position of ``arg_name:index`` of a FunctionDef body's NodeDef (a
    body names an output by its OpDef argument, which may stand for several tensors:
    Unique's ``idx:0`` is output 1), or None when the op is unknown or has no such
    argument."""
    od = op_def(node_def.op, library)
    if od is None:
        return None
    position = 0
    for arg in od.output_arg:
        if arg.name == arg_name:
            return position + index
        position += arg_length(arg, node_def.attr)
    return None


def _arg_dtypes(arg, attrs):
    if arg.number_attr:
        dt = arg.type if arg.type else attrs[arg.type_attr].type if arg.type_attr in attrs else 0
        return [dt] * arg_length(arg, attrs)
    if arg.type_list_attr:
        return list(attrs[arg.type_list_attr].list.type) if arg.type_list_attr in attrs else []
    if arg.type:
        return [arg.type]
    return [attrs[arg.type_attr].type if arg.type_attr in attrs else 0]


class _ArgInfo:
    """Per-signature facts about an op's arguments (cached: computed once per op and
    type attributes, not once per node)."""
    __slots__ = ("slices", "names", "refs", "in_dtypes", "out_dtypes", "kernels", "resource_positions")

    def __init__(self, od, attrs):
        self.kernels = {}  # device type -> has a kernel (filled by has_kernel)
        self.slices, self.names, self.refs, self.in_dtypes = {}, [], [], []
        pos = 0
        for arg in od.input_arg:
            n = arg_length(arg, attrs)
            self.slices[arg.name] = (pos, n)
            pos += n
            self.names += [arg.name] * n
            self.refs += [arg.is_ref] * n
            self.in_dtypes += _arg_dtypes(arg, attrs)
        self.resource_positions = tuple(i for i, dt in enumerate(self.in_dtypes)
                                        if dt == DT_RESOURCE or self.refs[i])
        self.out_dtypes = []
        for arg in od.output_arg:
            for dt in _arg_dtypes(arg, attrs):
                self.out_dtypes.append(dt + _REF_OFFSET if arg.is_ref and dt < _REF_OFFSET else dt)


@functools.lru_cache(maxsize=None)
def _signature_attrs(op):
    od = registered_op(op)
    names = set()
    for arg in list(od.input_arg) + list(od.output_arg):
        for a in (arg.number_attr, arg.type_attr, arg.type_list_attr):
            if a:
                names.add(a)
    for a in od.attr:  # every type attr: kernels are registered per dtype (VarHandleOp's dtype)
        if a.type in ("type", "list(type)"):
            names.add(a.name)
    return tuple(sorted(names))


def _attr_key(v):
    kind = v.WhichOneof("value")
    if kind == "type":
        return v.type
    if kind == "i":
        return v.i
    if kind == "list":
        return tuple(v.list.type)
    return None


_INFO_CACHE = {}


def _info(node):
    info = node.arg_info
    if info is not None:
        return info
    info = node.arg_info = _compute_info(node)
    return info


def arg_info(node):
    """The node's OpDef argument facts (cached on the node). Nodes sharing an attribute
    proto share them: op_builder hands them on with its templates."""
    return _info(node)


def _compute_info(node):
    if registered_op(node.op) is None:
        return _ArgInfo(require_op_def(node), node.attr)
    attrs = node.attr
    key = (node.op,) + tuple(_attr_key(attrs[a]) if a in attrs else None
                             for a in _signature_attrs(node.op))
    info = _INFO_CACHE.get(key)
    if info is None:
        info = _INFO_CACHE[key] = _ArgInfo(registered_op(node.op), attrs)
    return info


def input_arg_slices(node):
    """{arg name: (first position, count)} for this node's data inputs."""
    return _info(node).slices


def input_position(node, arg_name):
    """The data-input position of single argument ``arg_name``, or None if the op has none."""
    sl = _info(node).slices.get(arg_name)
    if sl is None or sl[1] != 1:
        return None
    return sl[0]


def input_arg_names(node):
    """The argument name of each data input position, in order."""
    return _info(node).names


def input_is_ref(node):
    """Per data-input position: True where the argument is a ref (the op may write it)."""
    return _info(node).refs


def output_dtypes(node):
    """The dtype enum of each output (refs reported as their base type + 100)."""
    return _info(node).out_dtypes


def resource_positions(node):
    """Input positions that carry a resource handle or a ref (the op uses a resource)."""
    return _info(node).resource_positions


def input_dtypes(node):
    return _info(node).in_dtypes


def num_outputs(node):
    return len(_info(node).out_dtypes)


def is_stateful(node):
    od = op_def(node.op, node.graph.library)
    return bool(od is not None and getattr(od, "is_stateful", False))


def base_dtype(dt):
    return dt - _REF_OFFSET if dt > _REF_OFFSET else dt


@functools.lru_cache(maxsize=None)
def gpu_kernel_source():
    """Where GPU kernel facts come from: "registry" when the imported TensorFlow build
    registers GPU kernels, else "table". The tensorflow-cpu wheel registers none, yet
    rewriting for GPU machines must work on CPU-only ones, so a table generated from a
    CUDA build ships with the package (tools/gen_kernel_table.py)."""
    if not protos.USING_TENSORFLOW:
        return "table"
    from tensorflow.python.framework import kernels
    live = kernels.get_registered_kernels_for_op("MatMul").kernel
    return "registry" if any(k.device_type == "GPU" for k in live) else "table"


def registered_gpu_kernels():
    """(TensorFlow version, {op: [kernel, ...]}): the GPU and DEVICE_DEFAULT kernels the
    imported build registers, what tools/gen_kernel_table.py writes as the shipped table
    (and the tests compare with it)."""
    return live_tensorflow_version(), registered_kernels(("GPU", "DEFAULT"))


@functools.lru_cache(maxsize=None)
def _kernel_constraints(op, device_type):
    """The kernels registered for ``op`` on ``device_type`` or for DEVICE_DEFAULT, each as
    {attr: allowed dtypes}; an attr without a list of allowed dtypes is left out. For GPU
    on a build without GPU kernels, the shipped GPU table answers (it holds both kinds:
    the CPU wheel registers a different set of DEVICE_DEFAULT kernels); without
    TensorFlow imported, the shipped CPU table answers for CPU."""
    if device_type == "GPU" and gpu_kernel_source() == "table":
        return tuple({name: frozenset(types) for name, types in k.items()}
                     for k in _kernel_table(_GPU_TABLE).get(op, ()))
    if not protos.USING_TENSORFLOW:
        if device_type != "CPU":
            raise GraphRewriteError(
                f"no kernel table for device type {device_type} ships with graph_rewriter",
                hint="import TensorFlow before rewriting (its registry then answers), or place on CPU or GPU")
        return tuple({name: frozenset(types) for name, types in k.items()}
                     for k in _kernel_table(_CPU_TABLE).get(op, ()))
    from tensorflow.python.framework import kernels
    return tuple({c.name: frozenset(c.allowed_values.list.type)
                  for c in k.constraint if c.allowed_values.list.type}
                 for k in kernels.get_registered_kernels_for_op(op).kernel
                 if k.device_type in (device_type, "DEFAULT"))


@functools.lru_cache(maxsize=None)
def _has_device_kernel(op, device_type, attr_items):
    attrs = dict(attr_items)
    return any(all(name not in attrs or attrs[name] in allowed for name, allowed in k.items())
               for k in _kernel_constraints(op, device_type))


@functools.lru_cache(maxsize=None)
def allowed_types(op, attr):
    """The dtype names an op's type attr accepts, from its OpDef (all, if unconstrained)."""
    from graph_rewriter import dtypes
    for a in registered_op(op).attr:
        if a.name == attr:
            return tuple(dtypes.as_dtype(t).name for t in a.allowed_values.list.type)
    raise GraphRewriteError(f"op {op} has no attr '{attr}'")


def has_kernel(node, device_type):
    """True if TensorFlow registers a kernel for this node on ``device_type`` (checking the
    kernel's dtype constraints). Function calls run wherever their caller runs."""
    if registered_op(node.op) is None:
        return True  # a library function: its body's ops are placed when it runs
    info = _info(node)  # one per op and dtype attrs: shared by clones and equal nodes
    known = info.kernels.get(device_type)
    if known is None:
        attr_items = tuple(sorted((k, v.type) for k, v in node.attr.items() if v.WhichOneof("value") == "type"))
        known = info.kernels[device_type] = _has_device_kernel(node.op, device_type, attr_items)
    return known
