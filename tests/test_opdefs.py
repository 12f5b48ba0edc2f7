"""Kernel facts used by placement: they must not depend on which TensorFlow wheel the
rewriting machine has (tensorflow-cpu registers no GPU kernels at all)."""

import pytest
from tensorflow.core.framework import types_pb2

from graph_rewriter import opdefs

FLOAT, STRING, INT32 = types_pb2.DT_FLOAT, types_pb2.DT_STRING, types_pb2.DT_INT32


def _gpu(op, **dtypes):
    return opdefs._has_device_kernel(op, "GPU", tuple(sorted(dtypes.items())))


@pytest.mark.parametrize("op, dtypes, expected", [
    ("MatMul", {"T": FLOAT}, True),
    ("Conv2D", {"T": FLOAT}, True),
    ("ConcatV2", {"T": FLOAT}, True),
    ("CollectiveReduceV2", {"T": FLOAT}, True),
    ("ResourceApplyMomentum", {"T": FLOAT}, True),
    ("StringJoin", {}, False),
    ("DecodeCSV", {}, False),
    ("SaveV2", {}, False),
    ("Fill", {"T": STRING}, False),
    ("Cast", {"SrcT": FLOAT, "DstT": INT32}, True),
])
def test_gpu_kernels_known_without_a_gpu_build(op, dtypes, expected):
    # On tensorflow-cpu this exercises the shipped table; on a CUDA build, the live registry.
    assert _gpu(op, **dtypes) is expected


def test_cpu_kernels_come_from_the_live_registry():
    assert opdefs._has_device_kernel("StringJoin", "CPU", ())
    assert opdefs._has_device_kernel("MatMul", "CPU", (("T", FLOAT),))


def test_shipped_table_matches_the_live_gpu_registry():
    """When this machine's TensorFlow is a CUDA build, the table must say what it says, so
    CPU-only machines place ops exactly as a GPU machine would."""
    if opdefs.gpu_kernel_source() != "registry":
        pytest.skip("this TensorFlow registers no GPU kernels (tensorflow-cpu): the table is in use")
    _, live = opdefs.registered_gpu_kernels()
    shipped = opdefs._kernel_table(opdefs._GPU_TABLE)
    canon = lambda kernels: sorted(sorted(k.items()) for k in kernels)  # noqa: E731
    differing = sorted(op for op in set(live) | set(shipped) if canon(live.get(op, [])) != canon(shipped.get(op, [])))
    assert not differing, f"regenerate graph_rewriter/data/gpu_kernels.json: {differing[:10]}"


def test_output_position_counts_the_tensors_of_earlier_output_arguments():
    """A FunctionDef body names an output by its OpDef argument and an index within it:
    Unique's "idx:0" is its output 1; a list argument stands for as many tensors as
    its attribute says (Split's "output:1" follows nothing, Unpack's too)."""
    from graph_rewriter.analysis import _Body
    from graph_rewriter.protos import graph_pb2, types_pb2
    fn = graph_pb2.GraphDef().library.function.add()
    unique = fn.node_def.add(name="u", op="Unique")
    unique.attr["T"].type = types_pb2.DT_INT64
    unique.attr["out_idx"].type = types_pb2.DT_INT32
    split = fn.node_def.add(name="s", op="SplitV")
    split.attr["num_split"].i = 3
    assert opdefs.output_position(unique, "idx", 0) == 1
    assert opdefs.output_position(unique, "y", 0) == 0
    assert opdefs.output_position(split, "output", 2) == 2
    assert opdefs.output_position(unique, "nope", 0) is None
    assert opdefs.output_position(fn.node_def.add(name="f", op="no_such_function"), "out", 0) is None
    body = _Body(fn)
    assert [body.tensor(ref).index for ref in ("u:idx:0", "u:y:0", "s:output:2", "an_argument")] == [1, 0, 2, 0]
