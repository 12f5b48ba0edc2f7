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
