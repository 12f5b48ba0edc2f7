"""Inputs taken per replica: static batches, and batch_split="per_replica".

An input with a static first dimension B (a tf.data pipeline batched with
drop_remainder=True, a placeholder [B, F]) cannot be split: TensorFlow folded B into
constants while building the graph (tf.shape(x)[0], the gradient of a mean). So each of R
replicas takes a batch of its own of B rows: the shared iterator is drawn once per
replica, replica 0 first; the placeholder keeps its name and takes R*B rows, the R
replicas' batches concatenated in replica order. ``batch_split="per_replica"`` asks for
the same with a dynamic first dimension.

The oracle: the same model built single-device with a static batch of R*B (a pipeline
batched by R*B over the same data, a placeholder [R*B, F]), run on the R batches
concatenated in replica order, gives the losses and every variable (weights, optimizer
slots, the step counter) of the R-replica graph built from the batch-B model. That holds
for a mean loss and for a loss divided by tf.shape(x)[0]: the mean of R equal
per-replica means is the mean over the R*B rows.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import graph_rewriter as gr
from graph_rewriter.testing import harness, models

tf1 = tf.compat.v1

B = 4                 # the per-replica (static) batch
FEATURES, HIDDEN = 5, 6
STEPS = 3
ROWS = 4 * B * STEPS  # enough rows for STEPS steps of the largest global batch (no repeat needed)
RTOL, ATOL = 1e-4, 1e-6
GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
ERROR_PREFIX = "graph-rewrite: error: "


# ----- the models -----------------------------------------------------------------------------

def _data(seed=11):
    rng = np.random.default_rng([seed, 5])
    xs = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    ys = (np.sin(xs.sum(axis=1))[:, None] + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)
    return xs, ys


def build(batch, source="placeholder", loss="mean", optimizer="adam", seed=0, rows=ROWS):
    """A seeded two-layer MLP whose batch is ``batch`` rows (None: dynamic).

    source: "placeholder" (x [batch, FEATURES], y [batch, 1]); "one_shot" or
    "initializable": a tf.data iterator over _data(), batched by ``batch`` with
    drop_remainder=True (without it when ``batch`` is None: the dynamic-batch pipeline,
    batched by B). loss: "mean" (reduce_mean) or "shape" (a sum divided by
    tf.shape(x)[0], which TensorFlow folds into a constant when the batch is static).
    rows: how many rows of _data() the pipeline reads."""
    graph = tf.Graph()
    extra_init = []
    with graph.as_default():
        tf1.set_random_seed(seed)
        if source == "placeholder":
            x = tf1.placeholder(tf.float32, [batch, FEATURES], name="x")
            y = tf1.placeholder(tf.float32, [batch, 1], name="y")
        else:
            xs, ys = _data()
            ds = tf.data.Dataset.from_tensor_slices((xs[:rows], ys[:rows]))
            ds = ds.batch(batch, drop_remainder=True) if batch else ds.batch(B)
            if source == "one_shot":
                iterator = tf1.data.make_one_shot_iterator(ds)
            else:
                iterator = tf1.data.make_initializable_iterator(ds)
                extra_init.append(iterator.initializer)
            x, y = iterator.get_next()
        with tf1.variable_scope("", use_resource=True):
            w1 = tf1.get_variable("hidden/kernel", [FEATURES, HIDDEN],
                                  initializer=tf1.glorot_uniform_initializer(seed=seed * 10 + 1))
            b1 = tf1.get_variable("hidden/bias", [HIDDEN],
                                  initializer=tf1.random_uniform_initializer(-0.1, 0.1, seed=seed * 10 + 2))
            w2 = tf1.get_variable("output/kernel", [HIDDEN, 1],
                                  initializer=tf1.glorot_uniform_initializer(seed=seed * 10 + 3))
        pred = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)
        if loss == "mean":
            value = tf.reduce_mean(tf.square(pred - y))
        else:
            value = tf.reduce_sum(tf.square(pred - y)) / tf.cast(tf.shape(x)[0], tf.float32)
        value = tf.identity(value, name="loss")
        tf.identity(pred, name="pred")
        step = tf1.train.get_or_create_global_step()
        opt = (tf1.train.AdamOptimizer(0.05) if optimizer == "adam"
               else tf1.train.GradientDescentOptimizer(0.1))
        opt.minimize(value, global_step=step, name="train_op")
        variables = tf1.global_variables()
        init = tf1.variables_initializer(variables, name="init_variables")
        tf.group(init, *extra_init, name="init")
        tf1.train.Saver(var_list=variables)
        reads = {v.op.name: models._read_tensor_name(v) for v in variables}
    return models.Example(
        graph_def=graph.as_graph_def(), model="static_mlp", optimizer=optimizer, resource=True,
        feeds=["x:0", "y:0"] if source == "placeholder" else [], variables=reads,
        step_counter=reads[step.op.name])


def _feeds(rows, source="placeholder"):
    """Step t's feed of ``rows`` rows: the rows R replicas of B take at step t, in
    replica order (rows t*rows .. (t+1)*rows - 1 of _data()). Iterators feed nothing:
    they read the same rows in the same order from their pipeline."""
    if source != "placeholder":
        return lambda t: {}
    xs, ys = _data()
    return lambda t: {"x:0": xs[t * rows:(t + 1) * rows], "y:0": ys[t * rows:(t + 1) * rows]}


def _reference(replicas, source, loss, optimizer="adam", dynamic=False):
    """(losses, values) of one device on the global batch: R*B rows per step."""
    ref = build(None if dynamic else replicas * B, source, loss, optimizer)
    return harness.run_single(ref, steps=STEPS, feeds=_feeds(replicas * B, source))


def _assert_equivalent(result, ex, replicas, source, loss, optimizer="adam", dynamic=False):
    want_losses, want = _reference(replicas, source, loss, optimizer, dynamic)
    _, initial = harness.run_single(ex, steps=0, feeds=_feeds(B, source))
    moved = [n for n in want if not np.array_equal(want[n], initial[n])]
    assert len(moved) >= 3, f"the reference barely trained: only {moved} moved"
    got_losses, got = harness.run_rewritten(result, ex, steps=STEPS, feeds=_feeds(replicas * B, source),
                                             replica_copies=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=RTOL, atol=ATOL,
                               err_msg=f"losses of {replicas} replicas of batch {B} vs one device on {replicas * B}")
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=f"variable '{name}'")
    assert int(got[next(n for n, t in ex.variables.items() if t == ex.step_counter)]) == STEPS
    for prefix in result.metadata["replica_prefixes"][1:]:
        for name in want:
            if prefix + name in got:
                np.testing.assert_allclose(got[prefix + name], got[name], rtol=RTOL, atol=ATOL,
                                           err_msg=f"replica copy '{prefix + name}'")


def _rewrite(ex, replicas, strategy="allreduce", **kw):
    return gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **kw)


# ----- numeric equivalence ----------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("source, loss", [("one_shot", "mean"), ("initializable", "shape")])
def test_static_iterator_draws_one_batch_per_replica(source, loss, replicas, strategy):
    """(a) .batch(B, drop_remainder=True): replica k trains on the k-th batch drawn in the
    step, so step t covers the rows the reference's .batch(R*B) gives at step t."""
    ex = build(B, source, loss)
    result = _rewrite(ex, replicas, strategy)
    _assert_equivalent(result, ex, replicas, source, loss)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("loss", ["mean", "shape"])
def test_static_placeholder_takes_the_replicas_batches_concatenated(loss, replicas, strategy):
    """(b) x [B, F]: the rewritten x takes R*B rows, replica k gets rows k*B..(k+1)*B-1."""
    ex = build(B, "placeholder", loss)
    result = _rewrite(ex, replicas, strategy)
    _assert_equivalent(result, ex, replicas, "placeholder", loss)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_per_replica_on_a_dynamic_placeholder(replicas, strategy):
    """(c) batch_split="per_replica" on x [None, F]: the feed holds R per-replica batches
    of B; the reference is the same dynamic model fed the R*B rows."""
    ex = build(None, "placeholder", "shape")
    result = _rewrite(ex, replicas, strategy, batch_split="per_replica")
    assert [i["mode"] for i in result.metadata["inputs"]] == ["per_replica", "per_replica"]
    _assert_equivalent(result, ex, replicas, "placeholder", "shape", dynamic=True)


@pytest.mark.parametrize("replicas", [2, 4])
def test_per_replica_on_a_dynamic_iterator_draws_once_per_replica(replicas):
    """batch_split="per_replica" on a pipeline batched by B without drop_remainder: each
    replica draws its own batch of B (the global batch is R*B) instead of splitting one."""
    ex = build(None, "initializable", "mean")
    result = _rewrite(ex, replicas, batch_split="per_replica")
    _assert_equivalent(result, ex, replicas, "initializable", "mean")


def test_per_replica_draws_of_unequal_size_fail_the_step():
    """A dynamic pipeline's last, smaller batch would give one replica fewer rows than the
    others (the mean of replica means then weights rows unequally): the step fails with
    a message saying so instead of training on it."""
    ex = build(None, "initializable", rows=3 * B + 2)   # batches of B, B, B, 2
    result = _rewrite(ex, 2, batch_split="per_replica")
    with gr.Session(result) as sess:
        sess.run("init")
        sess.run("train_op")                            # batches 0 and 1: B rows each
        with pytest.raises(tf.errors.InvalidArgumentError, match="differ in rows.*drop_remainder=True"):
            sess.run("train_op")                        # batches 2 and 3: B and 2 rows


# ----- structure: the graph, the metadata, inspect and -v -------------------------------------

def _graph(result):
    return {n.name: n for n in graph_pb2.GraphDef.FromString(result.serialized()).node}


def test_static_placeholder_keeps_its_name_and_takes_r_times_the_rows():
    ex = build(B, "placeholder")
    result = _rewrite(ex, 2)
    nodes = _graph(result)
    assert [d.size for d in nodes["x"].attr["shape"].shape.dim] == [2 * B, FEATURES]
    assert [d.size for d in nodes["y"].attr["shape"].shape.dim] == [2 * B, 1]
    assert nodes["x/split_for_replicas"].op == "Split"
    assert nodes["x/split_for_replicas"].attr["num_split"].i == 2
    assert result.metadata["inputs"] == [
        {"name": "x:0", "kind": "placeholder", "mode": "per_replica", "static_batch": B, "global_batch": 2 * B},
        {"name": "y:0", "kind": "placeholder", "mode": "per_replica", "static_batch": B, "global_batch": 2 * B}]
    assert result.metadata["plan"]["inputs"] == result.metadata["inputs"]
    assert result.plan.batch_inputs == ["x:0", "y:0"]


@pytest.mark.parametrize("config", [
    dict(devices_per_worker=4, device_type="CPU"),
    dict(devices_per_worker=11, device_type="GPU"),
    dict(cluster_spec={"worker": ["localhost:2220", "localhost:2221"]}, devices_per_worker=3, device_type="CPU"),
])
@pytest.mark.parametrize("source", ["one_shot", "placeholder", "dynamic_iterator"])
def test_template_replicas_read_their_own_draw_or_rows(source, config):
    """With 3+ replicas only replica 1 is built; the export must write, for replica k, a
    reader of the k-th draw (or the k-th rows): the same graph as building every replica."""
    from test_template_replicas import TEMPLATE_NOTE, _assert_same_graph, _nodes
    if source == "dynamic_iterator":
        ex, source = build(None, "initializable"), "one_shot"
        config = dict(config, batch_split="per_replica")
    else:
        ex = build(B, source)
    lines = []
    built = _nodes(gr.rewrite(ex.graph_def, materialize_replicas=True, **config))
    template = _nodes(gr.rewrite(ex.graph_def, log=lines.append, **config))
    assert any(TEMPLATE_NOTE in line for line in lines), lines
    _assert_same_graph(built, template)
    replicas = sum(1 for name in template if name.endswith("/loss")) + 1
    for k in range(1, replicas):
        inputs = list(template[f"replica_{k}/MatMul"].input)
        if source == "placeholder":
            assert f"x/split_for_replicas:{k}" in inputs, inputs
        else:
            assert f"IteratorGetNext/per_replica_0:{k}" in inputs, inputs


def test_iterator_draws_are_chained_in_replica_order():
    ex = build(B, "one_shot")
    result = _rewrite(ex, 4)
    nodes = _graph(result)
    draws = ["IteratorGetNext"] + [f"IteratorGetNext/draw_{k}" for k in range(1, 4)]
    for k in range(1, 4):
        d = nodes[draws[k]]
        assert d.op == "IteratorGetNext"
        assert list(d.input) == ["OneShotIterator", f"^{draws[k - 1]}"]
    for i in range(2):
        per = nodes[f"IteratorGetNext/per_replica_{i}"]
        assert per.op == "IdentityN"
        assert list(per.input) == [f"{d}:{i}" if i else d for d in draws]
    assert nodes["MatMul"].input[0] == "IteratorGetNext/per_replica_0"
    assert all(i["mode"] == "per_replica" and i["kind"] == "iterator" and i["static_batch"] == B
               and i["global_batch"] == 4 * B for i in result.metadata["inputs"])


def test_between_graph_workers_shard_before_batching_and_draw_per_replica():
    """Each worker's graph reads its own shard (a ShardDataset before the BatchDataset
    with drop_remainder) and each of its replicas draws its own batch of that shard."""
    ex = build(B, "initializable")
    cluster = {"worker": ["localhost:2220", "localhost:2221"]}
    result = gr.rewrite(ex.graph_def, cluster, task="worker:1", devices_per_worker=2, device_type="CPU")
    nodes = _graph(result)
    batch = next(n for n in nodes.values() if n.op == "BatchDatasetV2")
    assert nodes[batch.input[0]].op == "ShardDataset"
    assert "IteratorGetNext/draw_1" in nodes
    assert [i["global_batch"] for i in result.metadata["inputs"]] == [4 * B, 4 * B]   # 2 workers x 2


def test_a_plan_with_per_replica_inputs_round_trips_through_json():
    """`graph-rewrite plan` prints the inputs; --plan applies the plan (the modes are
    derived again from the graph and the options, as the fingerprint is)."""
    ex = build(B, "one_shot")
    result = _rewrite(ex, 2)
    plan = gr.Plan.from_json(result.plan.to_json())
    assert [(i.name, i.mode, i.static_batch, i.global_batch) for i in plan.inputs] == [
        ("IteratorGetNext:0", "per_replica", B, 2 * B), ("IteratorGetNext:1", "per_replica", B, 2 * B)]
    again = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    assert again.serialized() == result.serialized()


def test_dynamic_inputs_keep_todays_graph():
    """The default path: split inputs add nothing to the plan or the metadata; and
    per_replica on a dynamic placeholder builds the very same graph (the feed is what
    differs: R batches), its metadata aside."""
    ex = models.build("mlp", "sgd")
    default = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    assert "inputs" not in default.metadata and "inputs" not in default.metadata["plan"]
    assert default.serialized() == gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU",
                                              batch_split="global").serialized()
    per = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU", batch_split="per_replica")
    a, b = _graph(default), _graph(per)
    meta = "graph_rewriter/metadata"
    assert sorted(a) == sorted(b)
    assert all(a[n] == b[n] for n in a if n != meta)
    assert [i["mode"] for i in per.metadata["inputs"]] == ["per_replica", "per_replica"]


def _run_cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "GRAPH_REWRITE_DEBUG")}
    return subprocess.run([GRAPH_REWRITE, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.fixture(scope="module")
def static_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("static_batch")
    src = folder / "static.pb"
    src.write_bytes(build(B, "placeholder").graph_def.SerializeToString())
    return folder, src


def test_verbose_and_inspect_say_how_each_input_reaches_the_replicas(static_files):
    folder, src = static_files
    out = folder / "out.pb"
    proc = _run_cli(src, out, "--device-type", "CPU", "--devices-per-worker", "2", "-v")
    assert proc.returncode == 0, proc.stderr
    assert (f"plan: input x:0: per_replica, fed as the replicas' batches concatenated in replica "
            f"order (static batch {B}, global batch {2 * B} = 2 x {B})") in proc.stderr
    assert f"per replica: x:0 ({B} rows each, global batch {2 * B})" in proc.stderr
    text = _run_cli("inspect", out)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "batch inputs (2): split divides the batch across replicas, per_replica gives each replica its own batch" in lines
    assert f"  x:0  placeholder per_replica  static batch {B}, global batch {2 * B}" in lines
    assert f"  y:0  placeholder per_replica  static batch {B}, global batch {2 * B}" in lines
    report = json.loads(_run_cli("inspect", out, "--json").stdout)
    assert report["inputs"][0] == {"name": "x:0", "kind": "placeholder", "mode": "per_replica",
                                   "static_batch": B, "global_batch": 2 * B}


def test_inspect_lists_split_inputs_as_before(tmp_path):
    path = tmp_path / "mlp.pb"
    gr.rewrite(models.build("mlp", "sgd").graph_def, devices_per_worker=2, device_type="CPU").save(str(path))
    from graph_rewriter.inspect_report import format_report, report
    rep = report(gr.load(str(path)))
    assert "batch inputs split across replicas: x:0, y:0" in format_report(rep).splitlines()
    assert [(i["name"], i["mode"], i["static_batch"], i["global_batch"]) for i in rep["inputs"]] == [
        ("x:0", "split", None, None), ("y:0", "split", None, None)]


def test_cli_batch_split_per_replica_reaches_the_rewrite(static_files, tmp_path):
    src = tmp_path / "mlp.pb"
    src.write_bytes(models.build("mlp", "sgd").graph_def.SerializeToString())
    out = tmp_path / "out.pb"
    proc = _run_cli(src, out, "--device-type", "CPU", "--devices-per-worker", "2", "--batch-split", "per_replica")
    assert proc.returncode == 0, proc.stderr
    assert [i["mode"] for i in gr.load(str(out)).metadata["inputs"]] == ["per_replica", "per_replica"]


# ----- bad input -------------------------------------------------------------------------------

def test_bad_batch_split_flag_exits_2_naming_the_flag_and_writes_nothing(static_files, tmp_path):
    _, src = static_files
    out = tmp_path / "never.pb"
    proc = _run_cli(src, out, "--device-type", "CPU", "--devices-per-worker", "2", "--batch-split", "local")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), proc.stderr
    for word in ("--batch-split", "'local'", "global", "per_replica"):
        assert word in lines[0], lines[0]
    assert not out.exists()
    assert not list(tmp_path.glob(".graph-rewrite-*"))


def test_bad_batch_split_keyword_names_the_valid_values():
    with pytest.raises(gr.GraphRewriteError, match="batch_split 'local'.*global, per_replica"):
        gr.rewrite(build(B).graph_def, devices_per_worker=2, device_type="CPU", batch_split="local")


def test_session_rejects_a_wrong_row_count_for_a_static_placeholder():
    ex = build(B, "placeholder")
    result = _rewrite(ex, 2)
    xs, ys = _data()
    with gr.Session(result) as sess:
        sess.run("init")
        for rows in (B, 3 * B):
            with pytest.raises(gr.GraphRewriteError,
                               match=rf"input 'x:0' gets {rows} row\(s\), but takes {2 * B} rows.*"
                                     rf"static batch of {B} for each of 2 replica"):
                sess.run("train_op", {"x:0": xs[:rows], "y:0": ys[:2 * B]})
        loss = sess.run("loss:0", {"x:0": xs[:2 * B], "y:0": ys[:2 * B]})
        assert np.isfinite(loss)
        # a fetched per-example tensor is every replica's rows, concatenated
        assert sess.run("pred:0", {"x:0": xs[:2 * B], "y:0": ys[:2 * B]}).shape == (2 * B, 1)


def test_session_rejects_uneven_per_replica_batches():
    ex = build(None, "placeholder")
    result = _rewrite(ex, 2, batch_split="per_replica")
    xs, ys = _data()
    with gr.Session(result) as sess:
        sess.run("init")
        with pytest.raises(gr.GraphRewriteError, match="input 'x:0' gets 7 rows, which are not 2 equal per-replica"):
            sess.run("train_op", {"x:0": xs[:7], "y:0": ys[:7]})


def test_a_graph_without_any_input_is_still_refused():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones((B, FEATURES), np.float32))
        w = tf1.get_variable("w", [FEATURES, 1], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    with pytest.raises(gr.GraphRewriteError, match="no batch input"):
        gr.rewrite(graph.as_graph_def(), devices_per_worker=2, device_type="CPU")
