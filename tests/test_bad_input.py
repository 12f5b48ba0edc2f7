"""A corpus of bad inputs: each must be rejected with GraphRewriteError (never another
exception, never silently accepted) and a message naming what is wrong (the file, the node,
the option or the variable). A representative subset goes through the installed
`graph-rewrite` command too: exit 2, one `graph-rewrite: error: ...` line, no traceback,
OUT neither created nor modified.

The bad graphs are made by editing a valid training GraphDef's protobuf; the SavedModels
and TF2 artefacts by the writers of test_saved_model.py. Every rejection also says what to
do: its message ends with "To fix this, ...".
"""

import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

import graph_rewriter as gr
from graph_rewriter import GraphRewriteError
from test_saved_model import concrete_function_graph_def, write_tf2_saved_model, write_train_saved_model

GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
TIMEOUT = 180
CPU2 = dict(devices_per_worker=2, device_type="CPU")
ERROR_PREFIX = "graph-rewrite: error: "
HINT = "To fix this, "


# ----- graphs --------------------------------------------------------------------------

def build_training_graph():
    """x [None,4], y [None,1], ids [None] -> embedding "emb" (sparse gradient) + dense "w";
    mean loss "loss"; Adam "train_op" with global_step; "init"; a Saver."""
    graph = tf.Graph()
    with graph.as_default():
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
        tf.compat.v1.global_variables_initializer()
        tf.compat.v1.train.Saver()
    return graph.as_graph_def()


def inference_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        tf.identity(tf.reduce_sum(x * 2.0, axis=1), name="out")
    return graph.as_graph_def()


def forward_only_graph():
    """Variables, a forward pass and an initializer, but no optimizer."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", [4, 1], use_resource=True)
        tf.identity(tf.matmul(x, w), name="out")
        tf.compat.v1.global_variables_initializer()
    return graph.as_graph_def()


def constant_data_graph():
    """A complete training graph whose data are constants: no input to give the replicas
    (a static batch is no longer refused: tests/test_static_batch.py)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones((8, 4), np.float32), name="x")
        y = tf.constant(np.zeros((8, 1), np.float32), name="y")
        w = tf.compat.v1.get_variable("w", [4, 1], use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w) - y)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph.as_graph_def()


class Base:
    """The valid graph (as GraphDef, bytes and file), its rewrite (result and file)."""

    def __init__(self, folder):
        self.folder = folder
        self.graph_def = build_training_graph()
        self.data = self.graph_def.SerializeToString()
        self.pb = folder / "train.pb"
        self.pb.write_bytes(self.data)
        self.result = gr.rewrite(self.graph_def, **CPU2)
        self.out = folder / "rewritten.pb"
        self.result.save(str(self.out))
        self._tf2 = None

    def tf2_saved_model(self):
        """A TF2 SavedModel (tf.saved_model.save), written once: it takes a child process."""
        if self._tf2 is None:
            self._tf2 = write_tf2_saved_model(self.folder / "tf2_model")
        return self._tf2

    def copy(self):
        gd = graph_pb2.GraphDef()
        gd.CopyFrom(self.graph_def)
        return gd


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return Base(tmp_path_factory.mktemp("bad_input_base"))


def node(gd, name):
    for n in gd.node:
        if n.name == name:
            return n
    raise AssertionError(f"test setup: no node {name!r}")


# ----- the corpus: each case makes (source, kwargs) and names what the message must say --

CASES = []


def case(case_id, *expect):
    def register(make):
        CASES.append(pytest.param(make, expect, id=case_id))
        return make
    return register


# files that are not graphs
@case("empty-file", "empty.pb", "empty")
def _(base, tmp, mp):
    p = tmp / "empty.pb"
    p.write_bytes(b"")
    return str(p), {}


@case("truncated-binary-graphdef", "trunc.pb", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "trunc.pb"
    p.write_bytes(base.data[:len(base.data) // 2])
    return str(p), {}


@case("random-bytes", "random.pb", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "random.pb"
    p.write_bytes(random.Random(1234).randbytes(4096))
    return str(p), {}


@case("text-hello-world", "hello.pbtxt", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "hello.pbtxt"
    p.write_text("hello world\n")
    return str(p), {}


@case("bytes-hello-world", "GraphDef")
def _(base, tmp, mp):
    return b"hello world", {}


@case("json-file", "model.json", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "model.json"
    p.write_text(json.dumps({"node": [{"name": "x", "op": "Placeholder"}]}))
    return str(p), {}


@case("configproto-file", "config.pb", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "config.pb"
    p.write_bytes(tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2,
                                           device_count={"CPU": 2}).SerializeToString())
    return str(p), {}


@case("tensorproto-file", "tensor.pb", "GraphDef")
def _(base, tmp, mp):
    p = tmp / "tensor.pb"
    p.write_bytes(tf.make_tensor_proto(np.arange(6, dtype=np.float32)).SerializeToString())
    return str(p), {}


@case("metagraph-without-graph", "nograph.meta", "no nodes")
def _(base, tmp, mp):
    mg = meta_graph_pb2.MetaGraphDef()
    mg.meta_info_def.tags.append("serve")
    mg.saver_def.restore_op_name = "save/restore_all"
    p = tmp / "nograph.meta"
    p.write_bytes(mg.SerializeToString())
    return str(p), {}


@case("directory-as-input", "a_folder", "directory")
def _(base, tmp, mp):
    p = tmp / "a_folder"
    p.mkdir()
    return str(p), {}


@case("missing-input", "missing.pb", "no such file")
def _(base, tmp, mp):
    return str(tmp / "missing.pb"), {}


@case("not-a-graph-object", "int")
def _(base, tmp, mp):
    return 42, {}


# broken graphs
@case("dangling-data-input", "'loss'", "nope:0")
def _(base, tmp, mp):
    gd = base.copy()
    node(gd, "loss").input[0] = "nope:0"
    return gd, {}


@case("dangling-control-input", "'train_op'", "^nope")
def _(base, tmp, mp):
    gd = base.copy()
    node(gd, "train_op").input.append("^nope")
    return gd, {}


@case("input-index-out-of-range", "'loss'", "x:5")
def _(base, tmp, mp):
    gd = base.copy()
    node(gd, "loss").input[0] = "x:5"  # a Placeholder has one output
    return gd, {}


@case("duplicate-node-names", "'w'")
def _(base, tmp, mp):
    gd = base.copy()
    gd.node.add().CopyFrom(node(gd, "w"))
    return gd, {}


@case("cycle-outside-a-loop", "cycle", "cyc_a", "cyc_b")
def _(base, tmp, mp):
    gd = base.copy()
    for name, other in (("cyc_a", "cyc_b"), ("cyc_b", "cyc_a")):
        n = gd.node.add()
        n.name, n.op = name, "Identity"
        n.input.append(other)
        n.attr["T"].type = types_pb2.DT_FLOAT
    return gd, {}


@case("unknown-op-type", "NoSuchOp", "'weird'")
def _(base, tmp, mp):
    gd = base.copy()
    n = gd.node.add()
    n.name, n.op = "weird", "NoSuchOp"
    n.input.append("x")
    return gd, {}


# graphs that do not train, or not in a way that can be split
@case("inference-only-graph", "no variables")
def _(base, tmp, mp):
    return inference_graph(), {}


@case("variables-but-no-optimizer", "optimizer")
def _(base, tmp, mp):
    return forward_only_graph(), {}


@case("constant-data-no-input", "batch input")
def _(base, tmp, mp):
    return constant_data_graph(), CPU2


@case("already-rewritten-file", "rewritten.pb", "already")
def _(base, tmp, mp):
    return str(base.out), {}


@case("already-rewritten-graphdef", "already")
def _(base, tmp, mp):
    return base.result.graph_def, {}


# options
@case("devices_per_worker-0", "devices_per_worker", "0")
def _(base, tmp, mp):
    return base.copy(), dict(devices_per_worker=0)


@case("devices_per_worker-negative", "devices_per_worker", "-1")
def _(base, tmp, mp):
    return base.copy(), dict(devices_per_worker=-1)


@case("devices_per_worker-string", "devices_per_worker", "'two'")
def _(base, tmp, mp):
    return base.copy(), dict(devices_per_worker="two")


@case("devices_per_worker-float", "devices_per_worker", "2.0")
def _(base, tmp, mp):
    return base.copy(), dict(devices_per_worker=2.0)


@case("unknown-strategy", "strategy", "'bogus'")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="bogus")


@case("unknown-device-type", "device type", "'TPU'")
def _(base, tmp, mp):
    return base.copy(), dict(device_type="TPU")


@case("cost-model-unknown-field", "cost_model", "'bandwidth'")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="auto", cost_model={"bandwidth": 1e9})


@case("cost-model-zero-bandwidth", "cost_model.inter_bandwidth", "positive")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="auto", cost_model={"inter_bandwidth": 0})


for _strategy in ("ps", "hybrid"):
    @case(f"strategy-{_strategy}-without-ps-tasks", f"'{_strategy}'", "'ps' tasks")
    def _(base, tmp, mp, _strategy=_strategy):
        return base.copy(), dict(strategy=_strategy, cluster_spec={"worker": ["localhost:2222"]})


@case("staleness-with-allreduce", "staleness", "allreduce")
def _(base, tmp, mp):
    return base.copy(), dict(staleness=2)


@case("staleness-negative", "staleness", "-1")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="ps", staleness=-1)


for _mode, _opts in (("staleness", dict(staleness=1)), ("async", dict(sync=False))):
    @case(f"hybrid-between-graph-{_mode}", "'w'", "'emb'", "same id")
    def _(base, tmp, mp, _opts=_opts):
        return base.copy(), dict(strategy="hybrid", task="worker:1", cluster_spec={
            "worker": ["localhost:2222", "localhost:2224"], "ps": ["localhost:2223"]}, **_opts)


for _id, _steps, _shown in (("0", 0, "got 0"), ("negative", -2, "got -2"), ("float", 2.0, "got 2.0"),
                             ("string", "2", "got '2'"), ("bool", True, "got True")):
    @case(f"accumulation_steps-{_id}", "accumulation_steps", "integer >= 1", _shown)
    def _(base, tmp, mp, _steps=_steps):
        return base.copy(), dict(accumulation_steps=_steps)


@case("accumulation_steps-with-async", "accumulation_steps", "sync=False")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="ps", sync=False, accumulation_steps=2)


@case("accumulation_steps-hybrid-between-graph", "accumulation_steps=2", "'w'", "'emb'", "between-graph")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="hybrid", task="worker:0", accumulation_steps=2, cluster_spec={
        "worker": ["localhost:2222", "localhost:2224"], "ps": ["localhost:2223"]})


@case("gradient-dtype-collectives-cannot-carry", "'bf_emb'", "bfloat16", "CollectiveGatherV2")
def _(base, tmp, mp):
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        emb = tf.compat.v1.get_variable("bf_emb", [10, 2], dtype=tf.bfloat16, use_resource=True,
                                        initializer=tf.compat.v1.zeros_initializer())
        rows = tf.cast(tf.nn.embedding_lookup(emb, ids), tf.float32)
        loss = tf.identity(tf.reduce_sum(rows), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    return graph.as_graph_def(), dict(devices_per_worker=2, device_type="CPU")


@case("cluster-spec-contradicts-tf_config", "contradicts TF_CONFIG", "localhost:3333")
def _(base, tmp, mp):
    mp.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:3333"]},
                                       "task": {"type": "worker", "index": 0}}))
    return base.copy(), dict(cluster_spec={"worker": ["localhost:2222", "localhost:2223"]})


@case("task-is-a-ps-task", "ps:0", "no client graph")
def _(base, tmp, mp):
    return base.copy(), dict(strategy="ps", cluster_spec={"worker": ["localhost:2222"], "ps": ["localhost:2223"]},
                             task="ps:0")


@case("unknown-compression", "compression", "'zip'")
def _(base, tmp, mp):
    return base.copy(), dict(compression="zip")


@case("negative-bytes_per_pack", "bytes_per_pack", "-1")
def _(base, tmp, mp):
    return base.copy(), dict(bytes_per_pack=-1)


@case("negative-timeout", "timeout_seconds", "-5")
def _(base, tmp, mp):
    return base.copy(), dict(timeout_seconds=-5)


@case("unknown-merge", "merge", "loss:0", "'max'")
def _(base, tmp, mp):
    return base.copy(), dict(merge={"loss:0": "max"})


@case("gradient-hint-unknown-variable", "nosuchvar")
def _(base, tmp, mp):
    return base.copy(), dict(gradients={"nosuchvar": "loss:0"})


@case("gradient-hint-reaching-no-update", "'w'", "'global_step:0'", "reaches no update",
      "'train_op/update_w/ResourceApplyAdam'")
def _(base, tmp, mp):
    return base.copy(), dict(gradients={"w": "global_step:0"})


@case("gradient-hint-not-the-gradient", "hint for variable 'w'", "'y:0'", "does not make its update")
def _(base, tmp, mp):
    return base.copy(), dict(gradients={"w": "y:0"})


# clusters and tasks
@case("cluster-malformed-json", "cluster spec", "JSON")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec='{"worker": ["localhost:2222"')


@case("cluster-file-malformed-json", "cluster.json", "JSON")
def _(base, tmp, mp):
    p = tmp / "cluster.json"
    p.write_text('{"worker": [localhost:2222]}')
    return base.copy(), dict(cluster_spec=str(p))


@case("cluster-file-missing", "no_cluster.json")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec=str(tmp / "no_cluster.json"))


@case("cluster-without-workers", "worker")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"ps": ["localhost:2222"]})


@case("cluster-unknown-job", "'workers'")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"workers": ["localhost:2222"]})


@case("address-without-port", "'localhost'", "address")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"worker": ["localhost"]})


@case("address-port-70000", "localhost:70000")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"worker": ["localhost:70000"]})


@case("task-not-in-cluster", "worker:3")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"worker": ["localhost:2222"]}, task="worker:3")


@case("task-not-job-index", "worker-1")
def _(base, tmp, mp):
    return base.copy(), dict(cluster_spec={"worker": ["localhost:2222"]}, task="worker-1")


@case("tf_config-malformed", "TF_CONFIG")
def _(base, tmp, mp):
    mp.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:2222"]')
    return base.copy(), {}


@case("tf_config-without-cluster", "TF_CONFIG", "cluster")
def _(base, tmp, mp):
    mp.setenv("TF_CONFIG", json.dumps({"task": {"type": "worker", "index": 0}}))
    return base.copy(), {}


@case("tf_config-task-not-in-cluster", "worker:5")
def _(base, tmp, mp):
    mp.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:2222"]},
                                       "task": {"type": "worker", "index": 5}}))
    return base.copy(), {}


# plans
@case("plan-naming-unknown-variable", "ghost_var")
def _(base, tmp, mp):
    plan = base.result.plan
    plan.cuts[0].variable = "ghost_var"
    return base.copy(), dict(strategy=plan)


@case("plan-for-other-replica-count", "2 replicas", "3")
def _(base, tmp, mp):
    return base.copy(), dict(strategy=base.result.plan, devices_per_worker=3)


@case("plan-file-not-a-plan", "not_a_plan.json")
def _(base, tmp, mp):
    p = tmp / "not_a_plan.json"
    p.write_text(json.dumps({"cuts": []}))
    return base.copy(), dict(strategy=str(p))


# SavedModels and TF2 artefacts
def _two_tag_sets(tmp, name="multi_tag"):
    return write_train_saved_model(tmp / name, tag_sets=(("train",), ("serve",)))


@case("saved-model-several-tags-no-tag", "multi_tag", "{serve}", "{train}", "--tag")
def _(base, tmp, mp):
    return _two_tag_sets(tmp), {}


@case("saved-model-unknown-tag", "multi_tag", "{eval}", "{serve}", "{train}")
def _(base, tmp, mp):
    return _two_tag_sets(tmp), dict(tag="eval")


@case("saved-model-pb-path-several-tags", "saved_model.pb", "{serve}", "{train}", "--tag")
def _(base, tmp, mp):
    return os.path.join(_two_tag_sets(tmp), "saved_model.pb"), {}


@case("saved-model-empty-tag", "tag", "''")
def _(base, tmp, mp):
    return _two_tag_sets(tmp), dict(tag="")


@case("tag-for-a-graph-file", "tag 'train'", "train.pb", "not a SavedModel")
def _(base, tmp, mp):
    return str(base.pb), dict(tag="train")


@case("tf2-saved-model", "tf2_model", "TF2 SavedModel", "tf.functions", "export_meta_graph", "Builder")
def _(base, tmp, mp):
    return base.tf2_saved_model(), {}


@case("tf2-saved-model-pb-path", "saved_model.pb", "TF2 SavedModel", "tf.functions")
def _(base, tmp, mp):
    return os.path.join(base.tf2_saved_model(), "saved_model.pb"), {}


@case("tf2-saved-model-meta-graph", "TF2 SavedModel")
def _(base, tmp, mp):
    from tensorflow.core.protobuf import saved_model_pb2
    with open(os.path.join(base.tf2_saved_model(), "saved_model.pb"), "rb") as f:
        return saved_model_pb2.SavedModel.FromString(f.read()).meta_graphs[0], {}


@case("tf2-concrete-function-graph", "TF2 function graph", "captured", "export_meta_graph")
def _(base, tmp, mp):
    return concrete_function_graph_def(), {}


@case("tf2-concrete-function-graph-file", "step.pb", "TF2 function graph", "captured")
def _(base, tmp, mp):
    p = tmp / "step.pb"
    p.write_bytes(concrete_function_graph_def().SerializeToString())
    return str(p), {}


@case("unnamed-sparse-placeholder", "'Placeholder_2'", "SparseTensor's indices", "labels_indices",
      "sparse_placeholder(..., name=")
def _(base, tmp, mp):
    from graph_rewriter.testing.tf1_scripts import ctc_model
    return ctc_model(named=False), {}


@case("per-replica-draws-of-a-dataset-sparse-tensor", "batch_split='per_replica'", "'DeserializeSparse'",
      "drop_remainder=True")
def _(base, tmp, mp):
    from graph_rewriter.testing.tf1_scripts import sparse_feature_records, sparse_features_model
    return sparse_features_model("dataset", records=sparse_feature_records(8)), dict(batch_split="per_replica")


@pytest.mark.parametrize("make, expect", CASES)
def test_api_rejects(base, tmp_path, monkeypatch, make, expect):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    source, kwargs = make(base, tmp_path, monkeypatch)
    kwargs = {**CPU2, **kwargs}
    with pytest.raises(GraphRewriteError) as info:
        gr.rewrite(source, **kwargs)
    message = str(info.value)
    for word in expect:
        assert word in message, f"{word!r} not in: {message}"
    assert "internal error" not in message, message  # a diagnosis, not a caught crash
    assert HINT in message, f"no hint (what to do) in: {message}"


def test_corpus_is_large_and_base_graph_is_accepted(base):
    """The corpus is big enough, and the unedited graph it is made from is accepted
    (so the rejections above are caused by the edits)."""
    assert len(CASES) >= 30
    assert base.result.num_replicas == 2
    assert gr.rewrite(base.copy(), **CPU2).num_replicas == 2
    assert gr.rewrite(str(base.pb), **CPU2).num_replicas == 2


# ----- writing the result ------------------------------------------------------------------

def unwritable_folder(tmp_path):
    """A folder this process cannot create files in (root ignores permission bits, so then
    a read-only system folder), or skip."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return folder
    os.close(fd)
    os.unlink(probe)
    for candidate in ("/sys", "/proc"):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    pytest.skip("no folder this process cannot write to")


def test_save_into_unwritable_folder(base, tmp_path):
    folder = unwritable_folder(tmp_path)
    out = os.path.join(str(folder), "graph_rewriter_test_out.pb")
    with pytest.raises(GraphRewriteError) as info:
        base.result.save(out)
    assert out in str(info.value) and "cannot write" in str(info.value)
    assert HINT in str(info.value)
    assert not os.path.exists(out)


def test_save_into_missing_folder(base, tmp_path):
    out = tmp_path / "no_such_folder" / "out.pb"
    with pytest.raises(GraphRewriteError) as info:
        base.result.save(str(out))
    assert "no_such_folder" in str(info.value) and HINT in str(info.value)
    assert not out.parent.exists()


def test_save_onto_a_directory(base, tmp_path):
    out = tmp_path / "out.pb"
    out.mkdir()
    with pytest.raises(GraphRewriteError) as info:
        base.result.save(str(out))
    assert "out.pb" in str(info.value) and "directory" in str(info.value) and HINT in str(info.value)
    assert out.is_dir() and not os.listdir(out)


@pytest.mark.parametrize("existing", ["non-empty-directory", "file"])
def test_save_of_a_saved_model_onto_an_existing_output(tmp_path, existing):
    """A SavedModel output is a new (or empty) directory: anything else at OUT is refused
    and left as it was."""
    result = gr.rewrite(write_train_saved_model(tmp_path / "model"), **CPU2)
    out = tmp_path / "out_model"
    if existing == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    with pytest.raises(GraphRewriteError) as info:
        result.save(str(out))
    message = str(info.value)
    assert str(out) in message and ("not empty" if existing != "file" else "is a file") in message
    assert HINT in message
    assert (out.read_text() if existing == "file" else (out / "keep.txt").read_text()) == "mine"
    assert sorted(os.listdir(tmp_path)) == ["model", "out_model"]    # no temporary directory


# ----- the Session wrapper: batches that do not split ------------------------------------------

def _feed(rows):
    rng = np.random.default_rng(rows)
    return {"x:0": rng.normal(size=(rows, 4)).astype(np.float32),
            "y:0": rng.normal(size=(rows, 1)).astype(np.float32),
            "ids:0": rng.integers(0, 10, size=rows).astype(np.int32)}


@pytest.mark.parametrize("rows, expect", [(1, "1 row"), (3, "3 rows")],
                         ids=["1-row-for-2-replicas", "3-rows-for-2-replicas"])
def test_session_rejects_a_batch_that_does_not_split(base, rows, expect):
    step = "global_step/Read/ReadVariableOp:0"
    with gr.Session(base.result) as sess:
        sess.run("init")
        assert sess.run(step) == 0
        with pytest.raises(GraphRewriteError) as info:
            sess.run(["loss:0", "train_op"], feed_dict=_feed(rows))
        message = str(info.value)
        assert expect in message and "2 replicas" in message, message
        assert any(f"'{name}'" in message for name in ("x:0", "y:0", "ids:0")), message
        assert sess.run(step) == 0  # rejected before anything trained
        sess.run(["loss:0", "train_op"], feed_dict=_feed(4))  # an even batch trains
        assert sess.run(step) == 1


# ----- the same through the command line ------------------------------------------------------

def run_cli(*args, timeout=TIMEOUT):
    env = dict(os.environ)
    for var in ("TF_CONFIG", "GRAPH_REWRITE_DEBUG"):
        env.pop(var, None)
    return subprocess.run([GRAPH_REWRITE, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _write(path, data):
    path.write_bytes(data)
    return path


def _dangling(base, tmp):
    gd = base.copy()
    node(gd, "loss").input[0] = "nope:0"
    return _write(tmp / "dangling.pb", gd.SerializeToString())


def _inference(base, tmp):
    return _write(tmp / "inference.pb", inference_graph().SerializeToString())


def _folder(tmp):
    (tmp / "a_folder").mkdir()
    return tmp / "a_folder"


def _step_graph(tmp):
    return _write(tmp / "step.pb", concrete_function_graph_def().SerializeToString())


def _unnamed_sparse(tmp):
    from graph_rewriter.testing.tf1_scripts import ctc_model
    return _write(tmp / "ctc.pb", ctc_model(named=False).SerializeToString())


# (id, make IN, extra flags, OUT in tmp (None: OUT given by make_out), existing OUT?, expect)
CLI_CASES = [
    pytest.param(lambda b, t: _unnamed_sparse(t), [], True, ["'Placeholder_2'", "SparseTensor's indices"],
                 id="unnamed-sparse-placeholder-existing-out"),
    pytest.param(lambda b, t: _write(t / "empty.pb", b""), [], False, ["empty.pb", "empty"],
                 id="empty-file"),
    pytest.param(lambda b, t: _write(t / "trunc.pb", b.data[:len(b.data) // 2]), [], True,
                 ["trunc.pb"], id="truncated-binary-existing-out"),
    pytest.param(lambda b, t: _folder(t), [], False, ["a_folder", "directory"],
                 id="directory-as-input"),
    pytest.param(lambda b, t: t / "missing.pb", [], False, ["missing.pb"], id="missing-input"),
    pytest.param(_dangling, [], True, ["'loss'", "nope:0"], id="dangling-input-existing-out"),
    pytest.param(_inference, [], False, ["inference.pb", "no variables"], id="inference-only"),
    pytest.param(lambda b, t: b.out, [], False, ["rewritten.pb", "already"],
                 id="already-rewritten"),
    pytest.param(lambda b, t: b.pb, ["--devices-per-worker", "abc"], False,
                 ["--devices-per-worker", "abc"], id="devices-per-worker-abc"),
    pytest.param(lambda b, t: b.pb, ["--strategy", "auto", "--inter-bandwidth", "0"], True,
                 ["--inter-bandwidth", "positive"], id="auto-zero-bandwidth-existing-out"),
    pytest.param(lambda b, t: b.pb, ["--strategy", "ps", "--cluster", '{"worker": ["localhost:2222"]}'],
                 False, ["'ps'", "'ps' tasks"], id="ps-without-ps-tasks"),
    pytest.param(lambda b, t: b.pb, ["--cluster", '{"worker": ['], False, ["cluster spec", "JSON"],
                 id="cluster-malformed-json"),
    pytest.param(lambda b, t: b.pb, ["--gradient", "w=global_step:0"], True,
                 ["'w'", "'global_step:0'", "reaches no update"],
                 id="gradient-hint-reaching-no-update-existing-out"),
    pytest.param(lambda b, t: b.pb, ["--accumulation-steps", "0"], True,
                 ["accumulation_steps", "integer >= 1", "got 0"], id="accumulation-steps-0-existing-out"),
    pytest.param(lambda b, t: b.pb, ["--accumulation-steps", "-3"], False,
                 ["accumulation_steps", "got -3"], id="accumulation-steps-negative"),
    pytest.param(lambda b, t: b.pb, ["--accumulation-steps", "2.5"], False,
                 ["--accumulation-steps", "'2.5'"], id="accumulation-steps-float"),
    pytest.param(lambda b, t: b.pb, ["--accumulation-steps", "2", "--strategy", "ps", "--async"], False,
                 ["accumulation_steps", "sync=False"], id="accumulation-steps-async"),
    pytest.param(lambda b, t: b.pb, ["--accumulation-steps", "2", "--strategy", "hybrid", "--task", "worker:0",
                                     "--cluster", '{"worker": ["localhost:2222", "localhost:2224"], '
                                                  '"ps": ["localhost:2223"]}'], True,
                 ["accumulation_steps=2", "'w'", "'emb'"], id="accumulation-steps-hybrid-between-graph-existing-out"),
    pytest.param(lambda b, t: _two_tag_sets(t), [], False, ["multi_tag", "{serve}", "{train}", "--tag"],
                 id="saved-model-several-tags-no-tag"),
    pytest.param(lambda b, t: _two_tag_sets(t), ["--tag", "eval"], True, ["{eval}", "{serve}", "{train}"],
                 id="saved-model-unknown-tag-existing-out"),
    pytest.param(lambda b, t: os.path.join(_two_tag_sets(t), "saved_model.pb"), [], False,
                 ["saved_model.pb", "--tag"], id="saved-model-pb-path-several-tags"),
    pytest.param(lambda b, t: b.pb, ["--tag", "train"], False, ["tag 'train'", "train.pb"],
                 id="tag-for-a-graph-file"),
    pytest.param(lambda b, t: b.tf2_saved_model(), [], False, ["tf2_model", "TF2 SavedModel", "export_meta_graph"],
                 id="tf2-saved-model"),
    pytest.param(lambda b, t: _step_graph(t), [], False, ["step.pb", "TF2 function graph", "captured"],
                 id="tf2-concrete-function-graph"),
]


def assert_cli_rejected(proc, expect, out, before):
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, detail
    assert "Traceback" not in proc.stdout + proc.stderr, detail
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), detail
    for word in expect:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"
    assert HINT in lines[0], f"no hint (what to do) in: {lines[0]}"
    assert "wrote" not in proc.stdout, detail
    if before is None:
        assert not os.path.exists(out), f"{out} created by a rejected run"
    else:
        with open(out, "rb") as f:
            assert f.read() == before, f"{out} modified by a rejected run"
    folder = os.path.dirname(os.path.abspath(out))
    assert not glob.glob(os.path.join(folder, ".graph-rewrite-*")), "temporary file left behind"


@pytest.mark.parametrize("make_in, flags, existing, expect", CLI_CASES)
def test_cli_rejects(base, tmp_path, make_in, flags, existing, expect):
    source = make_in(base, tmp_path)
    out = tmp_path / "out.pb"
    before = None
    if existing:
        before = b"the previous OUT, which a rejected run must leave as it is\n"
        out.write_bytes(before)
    proc = run_cli(source, out, "--device-type", "CPU", "--devices-per-worker", "2", *flags)
    assert_cli_rejected(proc, expect, str(out), before)


@pytest.mark.parametrize("existing", ["non-empty-directory", "file"])
def test_cli_rejects_an_existing_saved_model_out_before_rewriting(tmp_path, existing):
    source = write_train_saved_model(tmp_path / "model")
    out = tmp_path / "out_model"
    if existing == "file":
        out.write_bytes(b"mine")
        before = b"mine"
    else:
        out.mkdir()
        (out / "keep.txt").write_bytes(b"mine")
    proc = run_cli(source, out, "--device-type", "CPU", "--devices-per-worker", "2")
    if existing == "file":
        assert_cli_rejected(proc, ["out_model", "is a file"], str(out), before)
    else:
        assert_cli_rejected(proc, ["out_model", "not empty"], str(out / "keep.txt"), b"mine")
        assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["model", "out_model"]


def test_cli_rejects_out_in_missing_folder(base, tmp_path):
    out = tmp_path / "no_such_folder" / "out.pb"
    proc = run_cli(base.pb, out, "--device-type", "CPU", "--devices-per-worker", "2")
    assert_cli_rejected(proc, ["no_such_folder"], str(out), None)
    assert not out.parent.exists()


def test_cli_rejects_unwritable_out_folder(base, tmp_path):
    folder = unwritable_folder(tmp_path)
    out = os.path.join(str(folder), "graph_rewriter_test_out.pb")
    proc = run_cli(base.pb, out, "--device-type", "CPU", "--devices-per-worker", "2")
    assert_cli_rejected(proc, [out, "write"], out, None)


# ----- interrupted runs leave nothing behind ---------------------------------------------------

def _deep_mlp(layers=300):
    """A graph big enough that rewriting it for 16 replicas takes seconds."""
    graph = tf.Graph()
    with graph.as_default():
        h = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        for i in range(layers):
            w = tf.compat.v1.get_variable(f"l{i}", [4, 4], use_resource=True)
            h = tf.nn.relu(tf.matmul(h, w))
        loss = tf.identity(tf.reduce_mean(h), name="loss")
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph.as_graph_def()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_interrupted_rewrite_leaves_no_output_and_no_temporary_file(tmp_path, sig, code):
    src, out = tmp_path / "deep.pb", tmp_path / "out" / "deep16.pb"
    out.parent.mkdir()
    src.write_bytes(_deep_mlp().SerializeToString())
    proc = subprocess.Popen([GRAPH_REWRITE, str(src), str(out), "--devices-per-worker", "16", "-v"],
                            stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                                    if k != "TF_CONFIG"})
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:          # "loaded ...": every pass and the output are still to come
        seen.append(line)
        if "loaded" in line or time.monotonic() > deadline:
            break
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    if proc.returncode == 0:
        pytest.skip("the rewrite finished before the signal arrived")
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] in ("graph-rewrite: interrupted", "graph-rewrite: terminated"), err
    assert "Traceback" not in err
    assert os.listdir(out.parent) == []           # no OUT, no .graph-rewrite-*.tmp


def test_write_interrupted_after_the_data_leaves_no_file(tmp_path, monkeypatch):
    from graph_rewriter import graph_io
    out = tmp_path / "out.pb"

    def interrupted(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(graph_io.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        graph_io.write_atomic(str(out), b"x" * 1_000_000)
    assert os.listdir(tmp_path) == []
