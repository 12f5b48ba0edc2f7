"""Property tests (hypothesis):

- random small training graphs (random dense layer stacks, an optional embedding with a
  sparse gradient, ref or resource variables, any v1 optimizer) rewritten for a random
  replica count either rewrite to a graph the verifier accepts that trains exactly like
  one device, or are refused with GraphRewriteError; never another exception;
- random byte mutations of a valid GraphDef never crash the CLI: exit 0 with an output,
  or exit 2 with one line and no output.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graph_rewriter as gr
from graph_rewriter import cli
from graph_rewriter.errors import GraphRewriteError

BATCH = 12          # splits over 1, 2, 3 and 4 replicas
STEPS = 2
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
    "nesterov": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: tf.compat.v1.train.AdadeltaOptimizer(1.0),
    "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(0.01, momentum=0.5),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(0.1),
    "proximal_adagrad": lambda: tf.compat.v1.train.ProximalAdagradOptimizer(0.1),
}
ACTIVATIONS = {"relu": tf.nn.relu, "tanh": tf.tanh, "none": tf.identity}


@st.composite
def models(draw):
    return {"widths": draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)),
            "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
            "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
            "embedding": draw(st.booleans()),
            "resource": draw(st.booleans()),
            "replicas": draw(st.integers(1, 4)),
            "seed": draw(st.integers(0, 1000))}


def _build(spec):
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(spec["seed"])
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        if spec["embedding"]:
            ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
            emb = tf.compat.v1.get_variable("emb", [6, 2], use_resource=spec["resource"])
            h = tf.concat([h, tf.nn.embedding_lookup(emb, ids)], axis=1)
        for i, width in enumerate(spec["widths"] + [1]):
            w = tf.compat.v1.get_variable(f"layer{i}/w", [h.shape[1], width], use_resource=spec["resource"])
            b = tf.compat.v1.get_variable(f"layer{i}/b", [width], use_resource=spec["resource"],
                                          initializer=tf.compat.v1.zeros_initializer())
            h = tf.matmul(h, w) + b
            if i < len(spec["widths"]):
                h = ACTIVATIONS[spec["activation"]](h)
        loss = tf.identity(tf.reduce_mean(tf.square(h - y)), name="loss")
        OPTIMIZERS[spec["optimizer"]]().minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
        names = [v.op.name for v in tf.compat.v1.global_variables()]
    return g.as_graph_def(), names


def _batches(spec):
    rng = np.random.default_rng(spec["seed"])
    out = []
    for _ in range(STEPS):
        feed = {"x:0": rng.normal(size=(BATCH, 3)).astype(np.float32),
                "y:0": rng.normal(size=(BATCH, 1)).astype(np.float32)}
        if spec["embedding"]:
            feed["ids:0"] = rng.integers(0, 6, size=BATCH).astype(np.int32)   # repeats across replicas
        out.append(feed)
    return out


def _train(session, batches, names):
    session.run("init")
    losses = [float(session.run(["loss:0", "train_op"], feed)[0]) for feed in batches]
    return losses, dict(zip(names, session.run([f"{n}:0" for n in _reads(session, names)])))


def _reads(session, names):
    """A tensor holding each variable's value: the ref variable itself, or its read."""
    out = []
    for n in names:
        op = session.graph.get_operation_by_name(n)
        out.append(f"{n}/Read/ReadVariableOp" if op.type == "VarHandleOp" else n)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=models())
def test_random_training_graphs_rewrite_to_one_device_numerics_or_a_clear_refusal(spec):
    graph_def, names = _build(spec)
    try:
        result = gr.rewrite(graph_def, devices_per_worker=spec["replicas"], device_type="CPU")
    except GraphRewriteError:
        return                                     # a refusal is allowed; a crash is not
    batches = _batches(spec)
    one = tf.Graph()
    with one.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=one) as s:
        want_losses, want = _train(s, batches, names)
    with gr.Session(result) as s:
        losses, got = _train(s, batches, names)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-6, err_msg=str(spec))
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-6, err_msg=f"{n}: {spec}")


@pytest.fixture(scope="module")
def valid_graph_bytes():
    graph_def, _ = _build({"widths": [3], "activation": "relu", "optimizer": "adam", "embedding": True,
                           "resource": True, "replicas": 2, "seed": 1})
    return graph_def.SerializeToString(deterministic=True)


@st.composite
def mutations(draw, size):
    edits = draw(st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate"]),
                                    st.integers(0, size - 1), st.integers(0, 255)), min_size=1, max_size=4))
    return edits


def _mutate(data, edits):
    data = bytearray(data)
    for kind, pos, value in edits:
        pos = min(pos, max(len(data) - 1, 0))
        if kind == "flip" and data:
            data[pos] ^= value or 1
        elif kind == "insert":
            data.insert(pos, value)
        elif kind == "delete" and data:
            del data[pos]
        elif kind == "truncate":
            del data[pos:]
    return bytes(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_graph_bytes_never_crash_the_cli(valid_graph_bytes, tmp_path, capsys, data):
    edits = data.draw(mutations(len(valid_graph_bytes)))
    src, out = tmp_path / "in.pb", tmp_path / "out.pb"
    if out.exists():
        out.unlink()
    src.write_bytes(_mutate(valid_graph_bytes, edits))
    os.environ.pop("GRAPH_REWRITE_DEBUG", None)
    rc = cli.main([str(src), str(out), "--device-type", "CPU", "--devices-per-worker", "2"])
    err = capsys.readouterr().err
    assert rc in (0, 2), f"exit {rc} for edits {edits}: {err}"
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("graph-rewrite: error: "), err
        assert not out.exists()
    else:
        assert out.exists()
