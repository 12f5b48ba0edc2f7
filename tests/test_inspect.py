"""`graph-rewrite inspect`: golden text on a fixed example, the Graphviz picture parsed by
a DOT parser, the TensorBoard event file read back.

Set GRAPH_REWRITER_UPDATE_GOLDEN=1 to rewrite the golden files after a deliberate change
(and read the diff before committing it)."""

import os
import subprocess
import sys

import pydot
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.testing import models

GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
CLUSTER = {"worker": ["host0:2222", "host1:2222"], "ps": ["ps0:2222"]}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The embedding example (Adam), hybrid, in-graph over 2 workers x 2 GPUs and 1 ps."""
    ex = models.build("embedding", "adam", seed=0)
    path = str(tmp_path_factory.mktemp("inspect") / "hybrid.pb")
    gr.rewrite(ex.graph_def, CLUSTER, strategy="hybrid", devices_per_worker=2, device_type="GPU").save(path)
    return path


def _inspect(*args):
    proc = subprocess.run([GRAPH_REWRITE, "inspect", *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("extra, golden", [((), "inspect_hybrid.txt"),
                                           (("--batch-size", "64"), "inspect_hybrid_batch64.txt")])
def test_inspect_text_matches_the_golden_file(hybrid, extra, golden):
    text = _inspect(hybrid, *extra).stdout
    path = os.path.join(GOLDEN, golden)
    if os.environ.get("GRAPH_REWRITER_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        expected = f.read()
    assert text == expected, f"inspect output changed; if deliberate, rerun with GRAPH_REWRITER_UPDATE_GOLDEN=1\n{text}"


def test_inspect_names_ps_variables_accumulators_and_queues(hybrid, tmp_path):
    text = _inspect(hybrid).stdout
    assert "embedding" in text and "ps accumulator (sparse)" in text
    assert "/job:ps/replica:0/task:0/device:CPU:0" in text
    assert "accumulators (1):" in text and "SparseConditionalAccumulator" in text


def test_dot_output_is_accepted_by_a_dot_parser_and_shows_the_communication(hybrid, tmp_path):
    dot = tmp_path / "hybrid.dot"
    _inspect(hybrid, "--dot", str(dot))
    graphs = pydot.graph_from_dot_data(dot.read_text())
    assert graphs and len(graphs) == 1, "not valid DOT"
    g = graphs[0]
    names = {n.get_name() for n in g.get_nodes()}
    for sub in g.get_subgraphs():
        names |= {n.get_name() for n in sub.get_nodes()}
    assert {f"replica_{i}" for i in range(4)} <= names
    assert "ps_0" in names and "pack_0" in names
    edges = {(e.get_source(), e.get_destination()) for e in g.get_edges()}
    assert {(f"replica_{i}", "pack_0") for i in range(4)} <= edges          # the all-reduce
    assert {(f"replica_{i}", "ps_0") for i in range(4)} <= edges            # gradients to the ps
    assert {("ps_0", f"replica_{i}") for i in range(4)} <= edges            # variables read
    assert len(g.get_subgraphs()) == 2                                     # the two worker machines


def test_dot_escapes_names_with_quotes_and_backslashes():
    from graph_rewriter.inspect_report import to_dot
    rep = {"strategy": 'a"b\\c', "num_replicas": 1, "nodes": 1, "replicas": [{"prefix": "", "device": "/device:CPU:0"}],
           "variables": [{"name": 'v"1\\', "placement": "ps", "device": "/device:CPU:0", "bytes": 4, "sync": "x"}],
           "accumulators": [], "queues": [], "packs": []}
    assert pydot.graph_from_dot_data(to_dot(rep))


def test_tensorboard_event_file_holds_the_rewritten_graph(hybrid, tmp_path):
    logdir = tmp_path / "tb"
    _inspect(hybrid, "--tensorboard", str(logdir))
    events = [f for f in os.listdir(logdir) if f.startswith("events.")]
    assert len(events) == 1
    graphs = []
    for event in tf.compat.v1.train.summary_iterator(str(logdir / events[0])):
        if event.graph_def:
            graphs.append(tf.compat.v1.GraphDef.FromString(event.graph_def))
    assert len(graphs) == 1
    result = gr.load(hybrid)
    assert len(graphs[0].node) == result.num_nodes
    assert {n.device for n in graphs[0].node} >= set(result.devices)


def test_dot_to_an_unwritable_place_is_a_clean_error(hybrid, tmp_path):
    proc = subprocess.run([GRAPH_REWRITE, "inspect", hybrid, "--dot", str(tmp_path / "no" / "such" / "x.dot")],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert proc.stderr.startswith("graph-rewrite: error: ") and "x.dot" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----- the devices of each variable's copies -------------------------------------------

def _expand(notation):
    """Every device a printed device notation names (docs/cli.md: "a-b" and "a,b" in the
    task and the device index; both ranged means every device on every task). Written
    apart from inspect_report's compaction, so the two check each other."""
    def numbers(text):
        out = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
        return out

    devices = []
    for group in notation.split(", "):
        head, _, device = group.rpartition("/device:")
        dtype, _, indices = device.partition(":")
        if "/task:" in head:
            job, _, tasks = head.partition("/task:")
            heads = [f"{job}/task:{t}" for t in numbers(tasks)]
        else:
            heads = [head]
        devices += [f"{h}/device:{dtype}:{i}" for h in heads for i in numbers(indices)]
    return devices


def _emitted_devices(graph_def, variable):
    """The devices of ``variable``'s copies in the emitted graph: its node and every
    replica's clone of it ("replica_<i>/<name>"), read straight off the NodeDefs."""
    return sorted(n.device for n in graph_def.node
                  if n.op in ("VarHandleOp", "VariableV2")
                  and (n.name == variable or (n.name.startswith("replica_")
                                              and n.name.split("/", 1)[1] == variable)))


@pytest.mark.parametrize("kwargs, expected", [
    (dict(devices_per_worker=4, device_type="CPU"), "/device:CPU:0-3 (4 copies)"),
    (dict(devices_per_worker=4, device_type="GPU"), "/device:GPU:0-3 (4 copies)"),
    (dict(cluster_spec={"worker": ["localhost:1", "localhost:2"]}, devices_per_worker=2, device_type="GPU"),
     "/job:worker/replica:0/task:0-1/device:GPU:0-1 (4 copies)"),
    (dict(cluster_spec={"worker": ["localhost:1", "localhost:2", "localhost:3"]}, devices_per_worker=2,
          device_type="CPU", task="worker:2"), "/job:worker/replica:0/task:2/device:CPU:0-1 (2 copies)"),
], ids=["cpu4", "gpu4", "2workers_gpu2", "between_graph_worker2"])
def test_inspect_prints_the_devices_of_every_mirrored_copy(kwargs, expected, tmp_path):
    ex = models.build("mlp", "adam", seed=0)
    result = gr.rewrite(ex.graph_def, **kwargs)
    path = str(tmp_path / "out.pb")
    result.save(path)
    text = _inspect(path).stdout
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and " on " in line}
    for variable in ("hidden/kernel", "output/bias", "global_step", "hidden/kernel/Adam"):
        emitted = _emitted_devices(result.graph_def, variable)
        assert len(emitted) == result.metadata.get("local_replicas", result.num_replicas)
        printed = lines[variable].rsplit(" on ", 1)[1]
        assert printed == expected, lines[variable]
        assert sorted(_expand(printed.split(" (")[0])) == emitted, (printed, emitted)


def test_compact_devices_writes_ranges_lists_and_groups():
    from graph_rewriter.inspect_report import compact_devices
    w = "/job:worker/replica:0/task:"
    assert compact_devices([f"/device:CPU:{i}" for i in (0, 1, 2, 3)]) == "/device:CPU:0-3"
    assert compact_devices(["/device:GPU:0", "/device:GPU:2", "/device:GPU:3"]) == "/device:GPU:0,2-3"
    assert compact_devices([f"{w}{t}/device:GPU:{i}" for t in (0, 1) for i in range(8)]) == f"{w}0-1/device:GPU:0-7"
    # tasks with different devices are separate groups, and so are device types
    assert (compact_devices([f"{w}0/device:GPU:0", f"{w}0/device:GPU:1", f"{w}1/device:GPU:0"])
            == f"{w}0/device:GPU:0-1, {w}1/device:GPU:0")
    assert compact_devices([f"{w}0/device:GPU:0", f"{w}0/device:CPU:0"]) == f"{w}0/device:GPU:0, {w}0/device:CPU:0"
    # what does not parse is listed as it is, once each
    assert compact_devices(["/cpu:0", "/cpu:0", ""]) == "/cpu:0, ?"
    for devices in ([f"{w}{t}/device:GPU:{i}" for t in (0, 2, 3) for i in (1, 2, 5)],
                    [f"/device:CPU:{i}" for i in (7, 0, 3, 1)]):
        assert sorted(_expand(compact_devices(devices))) == sorted(devices)
