"""TF1 SavedModels in and out (graph_rewriter/saved_model.py): a directory written by
tf.compat.v1.saved_model.Builder is rewritten into a SavedModel directory that
tf.compat.v1.saved_model.loader.load restores (the original checkpoint, copied
unchanged) and that trains like the original graph on one device. The rejected
SavedModels and TF2 artefacts are in the bad-input corpus (test_bad_input.py).

The helpers that write SavedModels here are imported by test_bad_input.py.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.session import session_config

tf1 = tf.compat.v1
GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
TIMEOUT = 180
CPU2 = dict(devices_per_worker=2, device_type="CPU")
W0 = np.array([[0.1], [-0.2], [0.3], [0.4]], np.float32)
B0 = np.array([0.5], np.float32)


# ----- SavedModels to rewrite -----------------------------------------------------------

def write_train_saved_model(folder, tag_sets=(("train",),), optimizer="adam"):
    """A TF1 training graph (x [None,4], y [None,1] -> resource variables w, b; mean
    squared loss "loss"; ``optimizer`` "train_op" with global_step; a Saver), its
    variables initialised to W0 and B0, saved by tf.compat.v1.saved_model.Builder at
    ``folder`` with one MetaGraphDef per tag set (the first holds the variables) and a
    "train" signature. Returns the folder's path."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", initializer=W0, use_resource=True)
        b = tf1.get_variable("b", initializer=B0, use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y)), name="loss")
        step = tf1.train.get_or_create_global_step()
        opt = (tf1.train.AdamOptimizer(0.05) if optimizer == "adam"
               else tf1.train.GradientDescentOptimizer(0.1))
        train_op = opt.minimize(loss, global_step=step, name="train_op")
        init = tf1.global_variables_initializer()
        saver = tf1.train.Saver()
        signature = tf1.saved_model.signature_def_utils.build_signature_def(
            inputs={"x": tf1.saved_model.utils.build_tensor_info(x),
                    "y": tf1.saved_model.utils.build_tensor_info(y)},
            outputs={"loss": tf1.saved_model.utils.build_tensor_info(loss)},
            method_name="train")
        with tf1.Session(graph=graph) as sess:
            sess.run(init)
            builder = tf1.saved_model.Builder(str(folder))
            builder.add_meta_graph_and_variables(sess, list(tag_sets[0]), saver=saver,
                                                 signature_def_map={"train": signature})
            for tags in tag_sets[1:]:
                builder.add_meta_graph(list(tags), saver=saver, signature_def_map={"train": signature})
            builder.save()
    assert train_op.name == "train_op"
    return str(folder)


TF2_SAVED_MODEL = textwrap.dedent('''
    import sys
    import tensorflow as tf

    class Model(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.ones([4, 1]), name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([None, 1])])
        def train_step(self, x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, self.w) - y))
            self.w.assign_sub(0.1 * tape.gradient(loss, self.w))
            return loss

    tf.saved_model.save(Model(), sys.argv[1])
''')


def write_tf2_saved_model(folder):
    """A TF2 SavedModel (tf.saved_model.save of a tf.Module with a train step), written
    by a child process: the tests run TensorFlow in graph mode (conftest.py), and
    tf.saved_model.save is an eager-mode tool."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", TF2_SAVED_MODEL, str(folder)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return str(folder)


def concrete_function_graph_def():
    """The graph of a TF2 train step's concrete function: the optimizer updates a
    tf.Variable captured as a resource placeholder (no VarHandleOp in the graph)."""
    with tf.Graph().as_default():
        w = tf.Variable(tf.ones([4, 1]), name="w")
        opt = tf1.train.GradientDescentOptimizer(0.1)

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss

        function = train_step.get_concrete_function(tf.TensorSpec([None, 4]), tf.TensorSpec([None, 1]))
    gd = function.graph.as_graph_def()
    assert not any(n.op == "VarHandleOp" for n in gd.node)
    return gd


def batch(seed, rows=8):
    rng = np.random.default_rng(seed)
    return {"x:0": rng.normal(size=(rows, 4)).astype(np.float32),
            "y:0": rng.normal(size=(rows, 1)).astype(np.float32)}


def saved_model_proto(folder):
    with open(os.path.join(folder, "saved_model.pb"), "rb") as f:
        return saved_model_pb2.SavedModel.FromString(f.read())


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def train_once(folder, feed, config=None):
    """Loads the SavedModel at ``folder`` (tag train) with the plain TF1 loader, returns
    its variables by name as restored, and after one run of train_op on ``feed``."""
    with tf1.Session(graph=tf.Graph(), config=config) as sess:
        tf1.saved_model.loader.load(sess, ["train"], folder)
        variables = tf1.global_variables()
        names = [v.op.name for v in variables]
        restored = dict(zip(names, sess.run(variables)))
        sess.run("train_op", feed)
        trained = dict(zip(names, sess.run(variables)))
    return restored, trained


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_train_saved_model(tmp_path_factory.mktemp("sm") / "train_model")


@pytest.fixture(scope="module")
def rewritten(saved, tmp_path_factory):
    """The SavedModel rewritten for 2 CPU replicas, saved as a SavedModel directory."""
    result = gr.rewrite(saved, tag="train", **CPU2)
    out = str(tmp_path_factory.mktemp("sm_out") / "train_2cpu")
    assert result.save(out) == out
    return result, out


# ----- SavedModel in, SavedModel out ------------------------------------------------------

def test_the_output_directory_holds_the_rewritten_meta_graph_and_the_input_checkpoint(saved, rewritten):
    result, out = rewritten
    assert sorted(os.listdir(out)) == ["saved_model.pb", "variables"]
    for name in os.listdir(os.path.join(saved, "variables")):
        assert read_bytes(os.path.join(out, "variables", name)) == \
            read_bytes(os.path.join(saved, "variables", name)), name
    original = saved_model_proto(saved).meta_graphs[0]
    (mg,) = saved_model_proto(out).meta_graphs
    assert list(mg.meta_info_def.tags) == ["train"]
    assert mg.signature_def == original.signature_def
    assert mg.saver_def == original.saver_def
    assert set(original.collection_def) <= set(mg.collection_def)   # plus the ones the rewrite adds (meta_graph)
    assert {"savers", "init_op", "local_init_op", "ready_op"} <= set(mg.collection_def)
    names = {n.name for n in mg.graph_def.node}
    assert "replica_1/loss" in names and "graph_rewriter/metadata" in names
    # the list of ops the graph uses follows the new graph (collectives added)
    assert {op.name for op in mg.meta_info_def.stripped_op_list.op} == {n.op for n in mg.graph_def.node}
    loaded = gr.load(out)
    assert loaded.num_replicas == 2 and loaded.saved_model_dir == out


def test_the_loader_restores_the_checkpoint_and_one_step_trains_like_one_device(saved, rewritten):
    result, out = rewritten
    feed = batch(0)
    restored, one_device = train_once(saved, feed)
    config = session_config(result.metadata["session_config"])
    assert config.device_count["CPU"] == 2
    restored2, two_replicas = train_once(out, feed, config)
    assert set(restored2) == set(restored) >= {"w", "b", "global_step"}
    np.testing.assert_array_equal(restored2["w"], W0)
    np.testing.assert_array_equal(restored2["b"], B0)
    for name in restored:
        np.testing.assert_array_equal(restored2[name], restored[name], err_msg=name)
    assert two_replicas["global_step"] == one_device["global_step"] == 1
    for name in one_device:
        np.testing.assert_allclose(two_replicas[name], one_device[name], rtol=1e-5, err_msg=name)
    assert not np.allclose(two_replicas["w"], W0)   # the step trained


def test_the_path_of_saved_model_pb_is_a_saved_model_input(saved, tmp_path):
    result = gr.rewrite(os.path.join(saved, "saved_model.pb"), **CPU2)
    assert result.saved_model_dir == saved
    assert list(result.meta_graph.meta_info_def.tags) == ["train"]
    out = str(tmp_path / "out.meta")   # a graph suffix: one MetaGraphDef file
    result.save(out)
    mg = graph_io.load_graph(out).meta_graph
    assert mg.saver_def == saved_model_proto(saved).meta_graphs[0].saver_def
    result.save(str(tmp_path / "as_dir"))
    assert sorted(os.listdir(tmp_path / "as_dir")) == ["saved_model.pb", "variables"]


def test_tag_picks_the_meta_graph_of_that_tag_set(tmp_path):
    folder = write_train_saved_model(tmp_path / "multi", tag_sets=(("train",), ("serve", "gpu")))
    for tag, tags in (("train", ["train"]), ("serve,gpu", ["gpu", "serve"]), ("gpu, serve", ["gpu", "serve"]),
                      (["serve", "gpu"], ["gpu", "serve"])):
        result = gr.rewrite(folder, tag=tag, **CPU2)
        assert sorted(result.meta_graph.meta_info_def.tags) == tags, tag
    out = tmp_path / "out"
    gr.rewrite(folder, tag="serve,gpu", **CPU2).save(str(out))
    (mg,) = saved_model_proto(str(out)).meta_graphs
    assert sorted(mg.meta_info_def.tags) == ["gpu", "serve"]


def test_an_empty_existing_directory_is_written_into(saved, rewritten, tmp_path):
    result, first = rewritten
    out = tmp_path / "empty"
    out.mkdir()
    result.save(str(out))
    assert read_bytes(out / "saved_model.pb") == read_bytes(os.path.join(first, "saved_model.pb"))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".graph-rewrite-")]


def test_a_non_empty_directory_or_a_file_is_refused_and_left_alone(rewritten, tmp_path):
    result, _ = rewritten
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for out, expect in ((full, "not empty"), (a_file, "is a file")):
        with pytest.raises(gr.GraphRewriteError) as info:
            result.save(str(out))
        assert str(out) in str(info.value) and expect in str(info.value)
        assert "To fix this" in str(info.value)
    assert os.listdir(full) == ["keep.txt"] and a_file.read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "full"]


# ----- the command line ------------------------------------------------------------------------

def run_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "GRAPH_REWRITE_DEBUG")}
    return subprocess.run([GRAPH_REWRITE, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_cli_rewrites_a_saved_model_directory_into_one(saved, rewritten, tmp_path):
    result, api_out = rewritten
    out = tmp_path / "cli_out"
    proc = run_cli(saved, out, "--tag", "train", "--devices-per-worker", "2", "--device-type", "CPU")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and "wrote" in proc.stdout
    assert sorted(os.listdir(out)) == ["saved_model.pb", "variables"]
    # the same input and options through the API: the same bytes
    assert read_bytes(out / "saved_model.pb") == read_bytes(os.path.join(api_out, "saved_model.pb"))
    # from another working directory, the input given relative to it: the same bytes
    again = tmp_path / "cli_again"
    proc = run_cli(os.path.basename(saved), again, "--tag", "train", "--devices-per-worker", "2",
                   "--device-type", "CPU", cwd=os.path.dirname(saved))
    assert proc.returncode == 0, proc.stderr
    assert read_bytes(again / "saved_model.pb") == read_bytes(out / "saved_model.pb")
    proc = run_cli("inspect", out)
    assert proc.returncode == 0, proc.stderr
    assert "CPU:1" in proc.stdout
