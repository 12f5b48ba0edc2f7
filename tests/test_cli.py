"""The `graph-rewrite` command, run as a user runs it: the installed console script in a
subprocess (every run with a timeout), on a small training graph written once per session
as .pb, .pbtxt and .meta.

Error contract checked for every rejected run: exit status 2, stderr is exactly one line
starting with "graph-rewrite: error: ", no traceback anywhere, and OUT is neither created
nor modified (nor is a temporary file left next to it).
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

import graph_rewriter as gr

GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
TIMEOUT = 180
PASSES = ["saver", "lower_conds", "plan", "replicate", "split_inputs", "normalizers", "loop_bounds", "gather_rows", "product_heads", "row_moves",
          "batch_statistics", "random_draws",
          "loss_sums", "invariant_terms", "mirror_variables", "micro_batches", "allreduce", "allgather", "communication", "accumulate", "sync_queues", "shard_variables", "row_defaults", "merge_outputs",
          "meta_graph", "heartbeat", "record_incarnations", "step_sequence", "place", "metadata"]
# the passes an allreduce rewrite of the test graph (dense and sparse gradients) needs;
# the others are skipped
RAN = ["saver", "plan", "replicate", "split_inputs", "mirror_variables", "allreduce", "allgather",
       "merge_outputs", "meta_graph", "place", "metadata"]
CPU2 = ["--device-type", "CPU", "--devices-per-worker", "2"]
ERROR_PREFIX = "graph-rewrite: error: "


# ----- helpers -------------------------------------------------------------------------

def run_cli(*args, cwd=None, timeout=TIMEOUT):
    """Runs the installed console script; returns the CompletedProcess (text mode)."""
    env = dict(os.environ)
    for var in ("TF_CONFIG", "GRAPH_REWRITE_DEBUG"):
        env.pop(var, None)
    return subprocess.run([GRAPH_REWRITE, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def describe(proc):
    return f"exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"


def assert_ok(proc):
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, describe(proc)


def assert_rejected(proc, *names, out=None, before=None):
    """Exit 2, one error line naming ``names``, no traceback, OUT untouched."""
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, describe(proc)
    assert lines[0].startswith(ERROR_PREFIX), describe(proc)
    assert len(lines[0]) > len(ERROR_PREFIX) + 10, describe(proc)
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    assert "wrote" not in proc.stdout, describe(proc)
    if out is not None:
        out = str(out)
        if before is None:
            assert not os.path.exists(out), f"{out} was created by a rejected run"
        else:
            with open(out, "rb") as f:
                assert f.read() == before, f"{out} was modified by a rejected run"
        leftovers = glob.glob(os.path.join(os.path.dirname(os.path.abspath(out)), ".graph-rewrite-*"))
        assert not leftovers, f"temporary files left behind: {leftovers}"
    return lines[0]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def build_training_graph():
    """x [None,4], y [None,1], ids [None] -> embedding (resource, sparse gradient) + dense
    weight; mean loss "loss"; Adam "train_op" with global_step; "init"; a Saver."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        emb = tf.compat.v1.get_variable("emb", [10, 2], use_resource=True)
        w = tf.compat.v1.get_variable("w", [6, 1], use_resource=True)
        h = tf.concat([x, tf.nn.embedding_lookup(emb, ids)], axis=1)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(h, w) - y)), name="loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step,
                                                        name="train_op")
        init = tf.compat.v1.global_variables_initializer()
        assert init.name == "init"
        saver = tf.compat.v1.train.Saver()
    return graph, saver


@pytest.fixture(scope="session")
def graphs(tmp_path_factory):
    """Paths of the training graph as .pb, .pbtxt and .meta, and its variable names."""
    folder = tmp_path_factory.mktemp("cli_graphs")
    graph, saver = build_training_graph()
    tf.io.write_graph(graph, str(folder), "train.pb", as_text=False)
    tf.io.write_graph(graph, str(folder), "train.pbtxt", as_text=True)
    tf.compat.v1.train.export_meta_graph(str(folder / "train.meta"), graph=graph,
                                         saver_def=saver.as_saver_def())
    variables = sorted(n.name for n in graph.as_graph_def().node if n.op == "VarHandleOp")
    assert {"emb", "w", "global_step"} <= set(variables)
    return {"pb": folder / "train.pb", "pbtxt": folder / "train.pbtxt",
            "meta": folder / "train.meta", "variables": variables, "folder": folder}


@pytest.fixture(scope="module")
def rewritten(graphs, tmp_path_factory):
    """`graph-rewrite train.pb OUT --device-type CPU --devices-per-worker 2`, run once."""
    out = tmp_path_factory.mktemp("cli_out") / "out.pb"
    proc = run_cli(graphs["pb"], out, *CPU2)
    return proc, out


@pytest.fixture(scope="module")
def plan_doc(graphs):
    """`graph-rewrite plan train.pb --device-type CPU --devices-per-worker 2 > plan.json`."""
    proc = run_cli("plan", graphs["pb"], *CPU2)
    return proc


# ----- rewriting -----------------------------------------------------------------------

def test_rewrite_pb_writes_a_loadable_two_replica_graph(rewritten):
    proc, out = rewritten
    assert_ok(proc)
    stdout_lines = proc.stdout.splitlines()
    assert len(stdout_lines) == 1, describe(proc)
    assert "wrote" in stdout_lines[0] and str(out) in stdout_lines[0], describe(proc)
    assert proc.stderr == "", describe(proc)
    result = gr.load(str(out))
    assert result.num_replicas == 2
    assert [d.replace("/device:", "") for d in result.devices] == ["CPU:0", "CPU:1"]
    # The file is a plain binary GraphDef that TensorFlow imports.
    gd = graph_pb2.GraphDef()
    gd.ParseFromString(read_bytes(out))
    with tf.Graph().as_default():
        tf.compat.v1.import_graph_def(gd, name="")


def test_same_input_and_flags_give_byte_identical_output(graphs, rewritten, tmp_path):
    proc, out = rewritten
    assert_ok(proc)
    again = tmp_path / "out.pb"  # same flags, same file name, another folder
    assert_ok(run_cli(graphs["pb"], again, *CPU2))
    assert read_bytes(again) == read_bytes(out)


def test_output_does_not_depend_on_the_working_directory(graphs, tmp_path):
    """The same file given relative to two working directories and as an absolute path:
    the same bytes (the metadata records the input's base name, not the path as typed)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = [("train.pb", graphs["folder"]), (os.path.relpath(graphs["pb"], elsewhere), elsewhere),
            (graphs["pb"], elsewhere)]
    outputs = []
    for i, (source, cwd) in enumerate(runs):
        out = tmp_path / f"out{i}.pb"
        assert_ok(run_cli(source, out, *CPU2, cwd=cwd))
        outputs.append(read_bytes(out))
    assert outputs[0] == outputs[1] == outputs[2]
    assert gr.load(str(tmp_path / "out0.pb")).metadata["source"] == "train.pb"


def test_pbtxt_in_pbtxt_out(graphs, tmp_path):
    out = tmp_path / "out.pbtxt"
    proc = run_cli(graphs["pbtxt"], out, *CPU2)
    assert_ok(proc)
    text = read_bytes(out).decode("utf-8")  # text, not binary
    gd = text_format.Parse(text, graph_pb2.GraphDef())
    assert any(n.name.startswith("replica_1/") for n in gd.node)
    assert gr.load(str(out)).num_replicas == 2


def test_meta_in_meta_out_keeps_saver_def(graphs, tmp_path):
    original = meta_graph_pb2.MetaGraphDef()
    original.ParseFromString(read_bytes(graphs["meta"]))
    assert original.HasField("saver_def")
    out = tmp_path / "out.meta"
    proc = run_cli(graphs["meta"], out, *CPU2)
    assert_ok(proc)
    mg = meta_graph_pb2.MetaGraphDef()
    mg.ParseFromString(read_bytes(out))
    assert mg.HasField("saver_def")
    assert mg.saver_def.restore_op_name == original.saver_def.restore_op_name
    assert mg.saver_def.filename_tensor_name == original.saver_def.filename_tensor_name
    names = {n.name for n in mg.graph_def.node}
    assert mg.saver_def.restore_op_name.split(":")[0] in names
    assert mg.saver_def.save_tensor_name.split(":")[0] in names
    assert len(mg.graph_def.node) > len(original.graph_def.node)
    assert gr.load(str(out)).num_replicas == 2


def test_verbose_prints_per_pass_timings_on_stderr(graphs, tmp_path):
    out = tmp_path / "out.pb"
    proc = run_cli(graphs["pb"], out, *CPU2, "-v")
    assert_ok(proc)
    assert "wrote" in proc.stdout
    timed = []
    for line in proc.stderr.splitlines():
        m = re.search(r"\bpass\s+(\w+)\s+([0-9]+(?:\.[0-9]+)?)\s*ms\b", line)
        if m:
            timed.append(m.group(1))
    assert timed == RAN, proc.stderr
    skipped = re.findall(r"\bpass\s+(\w+)\s+skipped: this plan does not need it", proc.stderr)
    assert skipped == [p for p in PASSES if p not in RAN], proc.stderr
    for name in PASSES:  # and none of that on stdout
        assert f"pass {name}" not in proc.stdout


def test_dump_after_replicate_writes_the_intermediate_graph(graphs, tmp_path):
    out = tmp_path / "out.pb"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    proc = run_cli(graphs["pb"], out, *CPU2, "--dump-after", "replicate", "--dump-dir", dumps)
    assert_ok(proc)
    assert sorted(os.listdir(dumps)) == ["after_replicate.pbtxt"]
    gd = text_format.Parse(read_bytes(dumps / "after_replicate.pbtxt").decode("utf-8"),
                           graph_pb2.GraphDef())
    names = {n.name for n in gd.node}
    assert any(n.startswith("replica_1/") for n in names)
    assert "graph_rewriter/metadata" not in names  # the graph after replicate, not the final one
    assert gr.load(str(out)).num_replicas == 2


def test_dump_after_unknown_pass_is_rejected_naming_the_passes(graphs, tmp_path):
    out = tmp_path / "out.pb"
    proc = run_cli(graphs["pb"], out, *CPU2, "--dump-after", "nosuchpass", "--dump-dir", tmp_path)
    line = assert_rejected(proc, "nosuchpass", "--dump-after", out=out)
    for name in PASSES:
        assert name in line


# ----- plan ------------------------------------------------------------------------------

def test_plan_prints_json_naming_the_variables(plan_doc):
    assert_ok(plan_doc)
    doc = json.loads(plan_doc.stdout)
    cuts = {c["variable"]: c for c in doc["cuts"]}
    assert set(cuts) == {"emb", "w"}
    assert cuts["emb"]["kind"] == "sparse" and cuts["emb"]["sync"] == "allgather"
    assert cuts["w"]["kind"] == "dense" and cuts["w"]["sync"] == "allreduce"
    assert doc["num_replicas"] == 2


def test_edited_plan_is_applied(graphs, plan_doc, rewritten, tmp_path):
    assert_ok(plan_doc)
    doc = json.loads(plan_doc.stdout)
    for cut in doc["cuts"]:
        if cut["variable"] == "emb":
            assert cut["sync"] == "allgather"
            cut["sync"] = "allreduce"
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(doc, indent=2))
    out = tmp_path / "out.pb"
    proc = run_cli(graphs["pb"], out, *CPU2, "--plan", plan_path)
    assert_ok(proc)
    result = gr.load(str(out))
    assert {c.variable: c.sync for c in result.plan.cuts} == {"emb": "allreduce", "w": "allreduce"}
    ops = {n.op for n in result.graph_def.node}
    assert "CollectiveGatherV2" not in ops and "CollectiveReduceV2" in ops
    # ... whereas the default plan gathers the embedding's rows.
    default_ops = {n.op for n in gr.load(str(rewritten[1])).graph_def.node}
    assert "CollectiveGatherV2" in default_ops


def test_plan_naming_an_unknown_variable_is_rejected(graphs, plan_doc, tmp_path):
    assert_ok(plan_doc)
    doc = json.loads(plan_doc.stdout)
    doc["cuts"][0]["variable"] = "ghost_var"
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(doc))
    out = tmp_path / "out.pb"
    before = b"an existing OUT that a failed run must not touch\n"
    out.write_bytes(before)
    proc = run_cli(graphs["pb"], out, *CPU2, "--plan", plan_path)
    assert_rejected(proc, "ghost_var", out=out, before=before)


# ----- inspect -----------------------------------------------------------------------------

def test_inspect_prints_replicas_devices_variables_and_passes(graphs, rewritten):
    assert_ok(rewritten[0])
    proc = run_cli("inspect", rewritten[1])
    assert_ok(proc)
    text = proc.stdout
    assert re.search(r"replicas?:\s*2\b", text), text
    assert "CPU:0" in text and "CPU:1" in text
    for var in graphs["variables"]:
        assert re.search(rf"(^|\s){re.escape(var)}(\s|$)", text, re.M), f"{var} missing:\n{text}"
    assert "pass" in text
    for name in RAN:
        assert name in text


def test_inspect_json(graphs, rewritten):
    assert_ok(rewritten[0])
    proc = run_cli("inspect", rewritten[1], "--json")
    assert_ok(proc)
    rep = json.loads(proc.stdout)
    assert rep["num_replicas"] == 2
    assert len(rep["replicas"]) == 2
    assert sorted(v["name"] for v in rep["variables"]) == graphs["variables"]
    assert rep["passes"] == RAN


def test_inspect_rejects_a_graph_not_written_by_graph_rewrite(graphs):
    proc = run_cli("inspect", graphs["pb"])
    assert_rejected(proc, "train.pb")
    assert proc.stdout == ""


# ----- help ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sub", [None, "plan", "inspect", "serve", "demo"],
                         ids=["main", "plan", "inspect", "serve", "demo"])
def test_help_exits_0_and_shows_an_example(sub):
    args = ([sub] if sub else []) + ["--help"]
    proc = run_cli(*args, timeout=60)
    assert_ok(proc)
    assert proc.stdout.startswith("usage:"), describe(proc)
    assert "example" in proc.stdout.lower()
    lines = [l.strip() for l in proc.stdout.splitlines()]
    if sub is None:
        assert any(re.match(r"graph-rewrite \S+\.(pb|pbtxt|meta) \S+", l) for l in lines), proc.stdout
    else:
        assert any(l.startswith(f"graph-rewrite {sub}") for l in lines), proc.stdout


# ----- usage errors --------------------------------------------------------------------------

@pytest.mark.parametrize("existing", [False, True], ids=["no-out", "existing-out"])
def test_bad_flag_value_is_one_line_and_leaves_out_alone(graphs, tmp_path, existing):
    out = tmp_path / "out.pb"
    before = None
    if existing:
        before = b"previous contents"
        out.write_bytes(before)
    proc = run_cli(graphs["pb"], out, "--device-type", "CPU", "--devices-per-worker", "abc")
    assert_rejected(proc, "--devices-per-worker", "abc", out=out, before=before)


def test_missing_arguments_are_one_line():
    proc = run_cli(timeout=60)
    assert_rejected(proc, "IN")


def test_rewriting_an_output_onto_itself_is_rejected_and_leaves_it_byte_identical(graphs, tmp_path):
    """IN is a graph graph-rewrite wrote, and OUT is that same file: rejected after the
    graph was read, and the file stays exactly as it was."""
    good = tmp_path / "good.pb"
    assert_ok(run_cli(graphs["pb"], good, *CPU2))
    before = read_bytes(good)
    proc = run_cli(good, good, *CPU2)  # rewriting the output, onto itself
    assert_rejected(proc, "good.pb", out=good, before=before)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "hybrid"])
def test_demo_trains_on_a_local_cluster_like_one_device_and_ends_its_processes(strategy):
    proc = run_cli("demo", "--strategy", strategy, "--steps", "6", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "1 ps + 2 workers" in out and f"strategy {strategy}, between-graph" in out
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 5], out
    for _, one, cluster in rows:
        assert abs(float(one) - float(cluster)) <= 1e-4
    assert "the same training, on 4 replicas in 2 processes" in out
    # every server process the demo started has ended
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
    assert len(pids) == 3
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
            f"server process {pid} is still running"


def test_demo_rejects_a_bad_step_count():
    proc = run_cli("demo", "--steps", "0")
    assert proc.returncode == 2
    assert proc.stderr.startswith(ERROR_PREFIX) and "--steps" in proc.stderr
    assert "Traceback" not in proc.stderr
