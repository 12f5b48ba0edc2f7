"""TensorFlow's data types as the rewrite uses them, without importing TensorFlow.

A ``DType`` has TensorFlow's name ("float32", "int64_ref"), enum, size and numpy type, and
``make_tensor_proto`` builds a Const's TensorProto byte for byte as TensorFlow's
``tensor_util.make_tensor_proto`` does for a numpy array. tests/test_tf_tables.py checks
both against the installed TensorFlow.
"""

import numpy as np

from graph_rewriter.protos import tensor_pb2, tensor_shape_pb2

REF_OFFSET = 100   # DT_FLOAT_REF = DT_FLOAT + 100

# enum: (name, bytes per element, floating, numpy type name or None)
_TYPES = {
    1: ("float32", 4, True, "float32"), 2: ("float64", 8, True, "float64"),
    3: ("int32", 4, False, "int32"), 4: ("uint8", 1, False, "uint8"),
    5: ("int16", 2, False, "int16"), 6: ("int8", 1, False, "int8"),
    7: ("string", 0, False, "object"), 8: ("complex64", 8, False, "complex64"),
    9: ("int64", 8, False, "int64"), 10: ("bool", 1, False, "bool"),
    11: ("qint8", 1, False, None), 12: ("quint8", 1, False, None), 13: ("qint32", 4, False, None),
    14: ("bfloat16", 2, True, None), 15: ("qint16", 2, False, None), 16: ("quint16", 2, False, None),
    17: ("uint16", 2, False, "uint16"), 18: ("complex128", 16, False, "complex128"),
    19: ("float16", 2, True, "float16"), 20: ("resource", 0, False, None), 21: ("variant", 0, False, None),
    22: ("uint32", 4, False, "uint32"), 23: ("uint64", 8, False, "uint64"),
    24: ("float8_e5m2", 1, True, None), 25: ("float8_e4m3fn", 1, True, None),
    26: ("float8_e4m3fnuz", 1, True, None), 27: ("float8_e4m3b11fnuz", 1, True, None),
    28: ("float8_e5m2fnuz", 1, True, None), 29: ("int4", 1, False, None), 30: ("uint4", 1, False, None),
    31: ("int2", 1, False, None), 32: ("uint2", 1, False, None), 33: ("float4_e2m1fn", 1, True, None),
}

# Where make_tensor_proto puts a dtype's values when it does not use tensor_content.
_VALUE_FIELDS = {
    "float32": "float_val", "float64": "double_val", "int32": "int_val", "uint8": "int_val",
    "int16": "int_val", "int8": "int_val", "uint16": "int_val", "int64": "int64_val",
    "uint32": "uint32_val", "uint64": "uint64_val", "bool": "bool_val", "float16": "half_val",
    "complex64": "scomplex_val", "complex128": "dcomplex_val", "string": "string_val",
}
# The real types whose scalars ``number`` reads.
_NUMBERS = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16"}
# TensorFlow's _TENSOR_CONTENT_TYPES, among the types _VALUE_FIELDS covers: arrays of more
# than one element of these go into tensor_content as raw bytes.
_CONTENT_TYPES = {"float16", "float32", "float64", "int32", "uint8", "int16", "int8", "int64",
                  "uint32", "uint64"}


class DType:
    """One TensorFlow data type (a ref type when ``as_datatype_enum`` > 100)."""
    __slots__ = ("as_datatype_enum",)

    def __init__(self, enum):
        if enum % REF_OFFSET not in _TYPES or enum > 2 * REF_OFFSET:
            raise TypeError(f"{enum} is not a TensorFlow DataType enum")
        self.as_datatype_enum = enum

    @property
    def _facts(self):
        return _TYPES[self.as_datatype_enum % REF_OFFSET]

    @property
    def name(self):
        return self._facts[0] + ("_ref" if self.as_datatype_enum > REF_OFFSET else "")

    @property
    def base_dtype(self):
        return DType(self.as_datatype_enum % REF_OFFSET)

    @property
    def size(self):
        return self._facts[1]

    @property
    def is_floating(self):
        return self._facts[2]

    @property
    def as_numpy_dtype(self):
        if self._facts[3] is None:
            raise TypeError(f"graph_rewriter makes no constants of dtype {self.name}")
        return np.dtype(self._facts[3]).type

    def __eq__(self, other):
        return isinstance(other, DType) and other.as_datatype_enum == self.as_datatype_enum

    def __hash__(self):
        return self.as_datatype_enum

    def __repr__(self):
        return f"graph_rewriter.dtypes.{self.name}"


_BY_NAME = {facts[0]: enum for enum, facts in _TYPES.items()}


def as_dtype(value):
    """A DType from an enum, a name ("float32", "int64_ref"), a DType (ours or
    TensorFlow's) or a numpy dtype."""
    if isinstance(value, DType):
        return value
    if hasattr(value, "as_datatype_enum"):
        return DType(value.as_datatype_enum)
    if isinstance(value, int) and not isinstance(value, bool):
        return DType(value)
    if isinstance(value, str):
        base = value[:-4] if value.endswith("_ref") else value
        if base in _BY_NAME:
            return DType(_BY_NAME[base] + (REF_OFFSET if base != value else 0))
        raise TypeError(f"{value!r} is not the name of a TensorFlow dtype")
    np_name = "object" if np.dtype(value) == np.dtype(object) else np.dtype(value).name
    for enum, facts in _TYPES.items():
        if facts[3] == np_name:
            return DType(enum)
    raise TypeError(f"numpy dtype {np_name} has no TensorFlow dtype here")


int32, int64, float32, float64 = DType(3), DType(9), DType(1), DType(2)
bool_, string = DType(10), DType(7)


def make_tensor_proto(array, dtype):
    """The TensorProto TensorFlow's ``tensor_util.make_tensor_proto(array, dtype=dtype)``
    makes of the numpy ``array`` (already of ``dtype``'s numpy type): the same fields in
    the same order, so that emitted Consts are byte for byte what TensorFlow writes."""
    dt = as_dtype(dtype)
    if dt.name not in _VALUE_FIELDS:
        raise TypeError(f"graph_rewriter makes no constants of dtype {dt.name}")
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                   for d in array.shape])
    proto = tensor_pb2.TensorProto(dtype=dt.as_datatype_enum, tensor_shape=shape)
    if dt.name in _CONTENT_TYPES and array.size > 1:
        proto.tensor_content = array.tobytes()
        return proto
    flat = array.ravel()
    field = getattr(proto, _VALUE_FIELDS[dt.name])
    if dt.name == "string":
        field.extend(x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in flat)
    elif dt.name == "float16":
        field.extend(flat.view(np.uint16).tolist())
    elif dt.name.startswith("complex"):
        field.extend(np.column_stack([flat.real, flat.imag]).ravel().tolist())
    else:
        field.extend(flat.tolist())
    return proto


def int_values(proto):
    """Every value of an integer TensorProto, flattened (a repeated single value, as
    TensorFlow stores a filled tensor, counts once per element when the shape says so)."""
    count = int(np.prod([d.size for d in proto.tensor_shape.dim])) if proto.tensor_shape.dim else 1
    if proto.tensor_content:
        return [int(v) for v in np.frombuffer(proto.tensor_content, dtype=DType(proto.dtype).as_numpy_dtype)]
    values = [int(v) for v in (proto.int_val or proto.int64_val)]
    if values and len(values) < count:
        values += [values[-1]] * (count - len(values))
    return values


def number(proto):
    """The value of a real scalar TensorProto (a Const of any integer or floating type,
    one element) as a Python float, or None for anything else."""
    if proto.tensor_shape.dim and int(np.prod([d.size for d in proto.tensor_shape.dim])) != 1:
        return None
    dt = DType(proto.dtype)
    if dt.name not in _NUMBERS:
        return None
    if proto.tensor_content:
        return float(np.frombuffer(proto.tensor_content, dtype=dt.as_numpy_dtype)[0])
    if dt.name == "float16":
        return float(np.array(proto.half_val[:1] or [0], np.uint16).view(np.float16)[0])
    values = proto.float_val or proto.double_val or proto.int_val or proto.int64_val
    return float(values[0]) if values else 0.0


def int_scalar(proto):
    """The first value of an integer TensorProto (a Const's ``value``): from int_val or
    int64_val, else from tensor_content; 0 when it holds none (a proto's default)."""
    values = proto.int_val or proto.int64_val
    if values:
        return int(values[0])
    if proto.tensor_content:
        return int(np.frombuffer(proto.tensor_content, dtype=DType(proto.dtype).as_numpy_dtype)[0])
    return 0
