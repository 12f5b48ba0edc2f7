"""TensorFlow's protocol buffers (GraphDef, NodeDef, MetaGraphDef, ...) with or without
TensorFlow.

When TensorFlow is already imported, its own generated modules are used, so that what a
rewrite hands back is the class the user's TensorFlow takes (``tf.import_graph_def``
checks the class). Otherwise the same messages are built from the descriptors that
tools/gen_tf_tables.py took from TensorFlow and shipped in data/tf_protos.pb, in a
private descriptor pool: same message names and wire format, a pool of their own so that
a TensorFlow imported later registers its files without a clash. Importing TensorFlow
costs about 4 s; this takes milliseconds. The choice is made once, when this module is
first imported (``USING_TENSORFLOW``); ``as_class`` converts a message between the two.

Usage: ``from graph_rewriter.protos import graph_pb2`` as one would import TensorFlow's.
"""

import os
import types

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

from graph_rewriter import tf_runtime


# module name -> (TensorFlow's module, its .proto file)
_FILES = {
    "attr_value_pb2": ("tensorflow.core.framework.attr_value_pb2", "tensorflow/core/framework/attr_value.proto"),
    "graph_pb2": ("tensorflow.core.framework.graph_pb2", "tensorflow/core/framework/graph.proto"),
    "node_def_pb2": ("tensorflow.core.framework.node_def_pb2", "tensorflow/core/framework/node_def.proto"),
    "op_def_pb2": ("tensorflow.core.framework.op_def_pb2", "tensorflow/core/framework/op_def.proto"),
    "tensor_pb2": ("tensorflow.core.framework.tensor_pb2", "tensorflow/core/framework/tensor.proto"),
    "tensor_shape_pb2": ("tensorflow.core.framework.tensor_shape_pb2", "tensorflow/core/framework/tensor_shape.proto"),
    "types_pb2": ("tensorflow.core.framework.types_pb2", "tensorflow/core/framework/types.proto"),
    "variable_pb2": ("tensorflow.core.framework.variable_pb2", "tensorflow/core/framework/variable.proto"),
    "meta_graph_pb2": ("tensorflow.core.protobuf.meta_graph_pb2", "tensorflow/core/protobuf/meta_graph.proto"),
    "saved_model_pb2": ("tensorflow.core.protobuf.saved_model_pb2", "tensorflow/core/protobuf/saved_model.proto"),
    "saver_pb2": ("tensorflow.core.protobuf.saver_pb2", "tensorflow/core/protobuf/saver.proto"),
    "queue_runner_pb2": ("tensorflow.core.protobuf.queue_runner_pb2", "tensorflow/core/protobuf/queue_runner.proto"),
}
SHIPPED = os.path.join(os.path.dirname(__file__), "data", "tf_protos.pb")

USING_TENSORFLOW = tf_runtime.imported()


def _tensorflow_module(name):
    import importlib
    return importlib.import_module(_FILES[name][0])


def live_descriptor_set():
    """A FileDescriptorSet of TensorFlow's files in _FILES and everything they import, in
    dependency order (what tools/gen_tf_tables.py ships; imports TensorFlow)."""
    seen = {}

    def visit(fd):
        if fd.name not in seen:
            for dep in fd.dependencies:
                visit(dep)
            seen[fd.name] = fd

    for name in _FILES:
        visit(_tensorflow_module(name).DESCRIPTOR)
    out = descriptor_pb2.FileDescriptorSet()
    for fd in seen.values():
        out.file.add().MergeFromString(fd.serialized_pb)
    return out


def _shipped_modules():
    with open(SHIPPED, "rb") as f:
        files = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    pool = descriptor_pool.DescriptorPool()
    for fd in files.file:   # dependency order: each file's imports come before it
        pool.AddSerializedFile(fd.SerializeToString())
    modules = {}
    for name, (_, path) in _FILES.items():
        fd = pool.FindFileByName(path)
        module = types.ModuleType(f"{__name__}.{name}", f"TensorFlow's {path}, from {SHIPPED}")
        module.DESCRIPTOR = fd
        for message in fd.message_types_by_name.values():
            setattr(module, message.name, message_factory.GetMessageClass(message))
        for enum in fd.enum_types_by_name.values():
            setattr(module, enum.name, enum_type_wrapper.EnumTypeWrapper(enum))
            for value in enum.values:
                setattr(module, value.name, value.number)
        modules[name] = module
    return modules


_MODULES = {name: _tensorflow_module(name) for name in _FILES} if USING_TENSORFLOW else _shipped_modules()
attr_value_pb2 = _MODULES["attr_value_pb2"]
graph_pb2 = _MODULES["graph_pb2"]
node_def_pb2 = _MODULES["node_def_pb2"]
op_def_pb2 = _MODULES["op_def_pb2"]
tensor_pb2 = _MODULES["tensor_pb2"]
tensor_shape_pb2 = _MODULES["tensor_shape_pb2"]
types_pb2 = _MODULES["types_pb2"]
variable_pb2 = _MODULES["variable_pb2"]
meta_graph_pb2 = _MODULES["meta_graph_pb2"]
saved_model_pb2 = _MODULES["saved_model_pb2"]
saver_pb2 = _MODULES["saver_pb2"]
queue_runner_pb2 = _MODULES["queue_runner_pb2"]


def is_message(obj, full_name):
    """True if ``obj`` is a protocol message named ``full_name`` ("tensorflow.GraphDef"),
    of TensorFlow's class or of the shipped one."""
    descriptor = getattr(obj, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) == full_name and hasattr(obj, "SerializeToString")


def as_class(message, cls):
    """``message`` as an instance of ``cls`` (the same message type, maybe the other of
    the two classes): itself when it already is one, else a copy through its bytes."""
    if isinstance(message, cls):
        return message
    return cls.FromString(message.SerializeToString())


def for_tensorflow(message):
    """``message`` as TensorFlow's own class when TensorFlow has been imported since this
    module chose the shipped classes (a GraphDef handed to tf.import_graph_def must be
    one); otherwise unchanged."""
    if USING_TENSORFLOW or not tf_runtime.imported():
        return message
    for name, (module, _) in _FILES.items():
        if getattr(_MODULES[name], type(message).__name__, None) is type(message):
            return as_class(message, getattr(_tensorflow_module(name), type(message).__name__))
    return message
