"""Rewriting without TensorFlow: the shipped protos, op table, kernel tables and dtypes
must say what the installed TensorFlow says, and a rewrite in a process where TensorFlow
cannot be imported must give the bytes a rewrite with TensorFlow gives.

If a table test fails after a TensorFlow upgrade: python tools/gen_tf_tables.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2 as tf_graph_pb2
from tensorflow.python.framework import dtypes as tf_dtypes
from tensorflow.python.framework import tensor_util

import graph_rewriter as gr
from graph_rewriter import dtypes, opdefs, protos
from graph_rewriter.testing import models

DATA = os.path.join(os.path.dirname(opdefs.__file__), "data")
TIMEOUT = 300
# Runs the rest of the command line as `python -c` would, in a process where
# `import tensorflow` fails (as on a machine without it), and says so if anything
# imported it anyway.
BLOCKED = textwrap.dedent("""
    import sys
    sys.modules["tensorflow"] = None     # import tensorflow -> ImportError
    code = sys.argv[1]
    sys.argv = sys.argv[1:]
    exec(compile(code, "<blocked>", "exec"))
    """)


def run_without_tensorflow(code, *args, cwd=None):
    return subprocess.run([sys.executable, "-c", BLOCKED, textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd)


def run_cli_without_tensorflow(*args):
    return run_without_tensorflow(
        "import sys\nfrom graph_rewriter.cli import main\nsys.exit(main(sys.argv[1:]))", *args)


# ----- the tables against the installed TensorFlow --------------------------------------

def test_the_tables_were_generated_from_this_tensorflow_release():
    with open(os.path.join(DATA, "cpu_kernels.json")) as f:
        shipped = json.load(f)["tensorflow"]
    assert shipped.split(".")[:2] == tf.__version__.split(".")[:2], (
        f"tables from TensorFlow {shipped}, installed {tf.__version__}: run tools/gen_tf_tables.py")


def test_shipped_op_table_matches_the_live_registry():
    with open(os.path.join(DATA, "op_defs.pb"), "rb") as f:
        shipped = {od.name: od.SerializeToString(deterministic=True)
                   for od in protos.op_def_pb2.OpList.FromString(f.read()).op}
    live = {od.name: od.SerializeToString(deterministic=True) for od in opdefs.live_op_list().op}
    assert set(shipped) == set(live), sorted(set(shipped) ^ set(live))[:10]
    differing = sorted(op for op in live if live[op] != shipped[op])
    assert not differing, f"regenerate graph_rewriter/data/op_defs.pb: {differing[:10]}"


def test_shipped_cpu_kernel_table_matches_the_live_registry():
    live = opdefs.registered_kernels(("CPU", "DEFAULT"))
    shipped = opdefs._kernel_table(opdefs._CPU_TABLE)
    canon = lambda kernels: sorted(sorted(k.items()) for k in kernels)  # noqa: E731
    differing = sorted(op for op in set(live) | set(shipped) if canon(live.get(op, [])) != canon(shipped.get(op, [])))
    assert not differing, f"regenerate graph_rewriter/data/cpu_kernels.json: {differing[:10]}"


def test_shipped_protos_are_tensorflows():
    with open(protos.SHIPPED, "rb") as f:
        shipped = f.read()
    assert shipped == protos.live_descriptor_set().SerializeToString(deterministic=True), (
        "regenerate graph_rewriter/data/tf_protos.pb")


@pytest.mark.parametrize("enum", sorted(v for v in tf_dtypes._TYPE_TO_STRING if v))
def test_dtype_facts_match_tensorflow(enum):
    ours, theirs = dtypes.as_dtype(enum), tf_dtypes.as_dtype(enum)
    assert (ours.name, ours.is_floating, ours.base_dtype.as_datatype_enum) == (
        theirs.name, theirs.is_floating, theirs.base_dtype.as_datatype_enum)
    assert dtypes.as_dtype(theirs.name) == ours
    if theirs.base_dtype.name not in ("resource", "variant", "string"):
        assert ours.size == theirs.size


@pytest.mark.parametrize("value, dtype", [
    (0, "int32"), (7, "int64"), ([-1], "int32"), ([2, 3], "int64"), ([[1, 2], [3, 4]], "int32"),
    (1.5, "float32"), ([0.5, 0.25, 2.0], "float32"), (2.5, "float64"), ([1.0, -1.0], "float64"),
    (1.5, "float16"), ([1.5, 2.0], "float16"), (True, "bool"), ([True, False], "bool"),
    ("a", "string"), (["a", "bc"], "string"), ([], "int32"), ([[]], "float32"), (3, "uint8"),
    ([1 + 2j, 3j], "complex64"), (5, "uint64"),
])
def test_constants_are_tensorflows_bytes(value, dtype):
    dt = dtypes.as_dtype(dtype)
    array = np.asarray(value, dtype=dt.as_numpy_dtype)
    ours = dtypes.make_tensor_proto(array, dt).SerializeToString(deterministic=True)
    theirs = tensor_util.make_tensor_proto(array, dtype=tf_dtypes.as_dtype(dtype))
    assert ours == theirs.SerializeToString(deterministic=True)


# ----- rewriting in a process that cannot import TensorFlow ------------------------------

@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tf_free")
    paths = {}
    for name, model, optimizer in (("dense", "mlp", "momentum"), ("sparse", "embedding", "adagrad"),
                                   ("cond", "cond", "adam")):
        path = folder / f"{name}.pb"
        path.write_bytes(models.build(model, optimizer).graph_def.SerializeToString())
        paths[name] = path
    return paths


@pytest.mark.parametrize("name, flags", [
    ("dense", ["--device-type", "CPU", "--devices-per-worker", "2"]),
    ("dense", ["--devices-per-worker", "4"]),
    ("dense", ["--cluster", '{"ps": ["p:1"], "worker": ["a:1", "b:1"]}', "--strategy", "ps"]),
    ("cond", ["--cluster", '{"worker": ["a:1", "b:1"]}', "--devices-per-worker", "2"]),
])
def test_rewriting_without_tensorflow_gives_tensorflows_bytes(graphs, tmp_path, name, flags):
    out = tmp_path / "out.pb"
    proc = run_cli_without_tensorflow(graphs[name], out, *flags)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    kwargs = gr_keywords(flags)
    expected = bytes(gr.rewrite(str(graphs[name]), **kwargs).serialized())
    assert out.read_bytes() == expected


def gr_keywords(flags):
    """rewrite() keywords of the few CLI flags the test above uses."""
    kwargs, it = {}, iter(flags)
    for flag in it:
        value = next(it)
        key = flag[2:].replace("-", "_")
        kwargs["cluster_spec" if key == "cluster" else key] = (
            int(value) if key == "devices_per_worker" else json.loads(value) if key == "cluster" else value)
    return kwargs


def test_sparse_gradients_without_tensorflow_leave_rows_per_example_unknown(graphs, tmp_path):
    """The one question put to TensorFlow's shape inference: without it the plan says
    "unknown" (the graph itself is the same as with TensorFlow)."""
    proc = run_cli_without_tensorflow("plan", graphs["sparse"], "--device-type", "CPU",
                                      "--devices-per-worker", "2")
    assert proc.returncode == 0, proc.stderr
    (cut,) = [c for c in json.loads(proc.stdout)["cuts"] if c["kind"] == "sparse"]
    assert cut["rows_per_example"] is None
    with_tf = gr.rewrite(str(graphs["sparse"]), device_type="CPU", devices_per_worker=2).plan
    (cut_tf,) = [c for c in with_tf.cuts if c.kind == "sparse"]
    assert cut_tf.rows_per_example == 1


def test_plan_and_inspect_without_tensorflow(graphs, tmp_path):
    out = tmp_path / "out.pb"
    assert run_cli_without_tensorflow(graphs["dense"], out, "--device-type", "CPU",
                                      "--devices-per-worker", "2").returncode == 0
    proc = run_cli_without_tensorflow("inspect", out)
    assert proc.returncode == 0, proc.stderr
    assert "replicas:   2" in proc.stdout


@pytest.mark.parametrize("command, needs", [
    (["demo", "--steps", "1"], "graph-rewrite demo"),
    (["serve", "--cluster", '{"worker": ["localhost:1"]}', "--task", "worker:0", "--no-supervise"],
     "graph-rewrite serve"),
])
def test_running_graphs_without_tensorflow_says_to_install_it(command, needs):
    proc = run_cli_without_tensorflow(*command)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"graph-rewrite: error: {needs} needs TensorFlow, which is not installed")
    assert "pip install 'graph-rewriter[cpu]'" in proc.stderr and "Traceback" not in proc.stderr


def test_session_without_tensorflow_says_to_install_it():
    proc = run_without_tensorflow("""
        import graph_rewriter as gr
        try:
            gr.Session
        except gr.GraphRewriteError as e:
            print(e)
        """)
    assert proc.returncode == 0, proc.stderr
    assert "graph_rewriter.Session needs TensorFlow, which is not installed" in proc.stdout


def test_the_cli_does_not_import_tensorflow_to_rewrite(graphs, tmp_path):
    """With TensorFlow installed, a rewrite that needs no shape inference leaves it
    unimported: the 4 s import is the CLI's whole cost otherwise."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from graph_rewriter.cli import main
        assert main(sys.argv[1:]) == 0
        print("tensorflow imported:", "tensorflow" in sys.modules)
        """), str(graphs["dense"]), str(tmp_path / "o.pb"), "--devices-per-worker", "4"],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert "tensorflow imported: False" in proc.stdout


def test_a_result_made_before_tensorflow_is_imported_is_tensorflows_class(graphs):
    """rewrite() before `import tensorflow` uses the shipped classes; its graph_def is
    TensorFlow's own once TensorFlow is imported, as tf.import_graph_def needs."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import graph_rewriter as gr
        from graph_rewriter import protos
        data = open(sys.argv[1], "rb").read()
        result = gr.rewrite(protos.graph_pb2.GraphDef.FromString(data), device_type="CPU", devices_per_worker=2)
        first = bytes(result.serialized())
        assert not protos.USING_TENSORFLOW
        import tensorflow as tf
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(result.graph_def, name="")
        print("imported", len(graph.get_operations()))
        again = gr.rewrite(tf.compat.v1.GraphDef.FromString(data), device_type="CPU", devices_per_worker=2)
        print("same", bytes(again.serialized()) == first)
        """), str(graphs["dense"])], capture_output=True, text=True, timeout=TIMEOUT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported" in proc.stdout and "same True" in proc.stdout, proc.stdout


def test_protos_convert_between_the_two_classes():
    gd = tf_graph_pb2.GraphDef()
    gd.node.add(name="a", op="NoOp")
    assert protos.is_message(gd, "tensorflow.GraphDef")
    assert not protos.is_message(gd, "tensorflow.MetaGraphDef")
    assert protos.as_class(gd, tf_graph_pb2.GraphDef) is gd
