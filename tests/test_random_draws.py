"""Random draws of the batch's rows: dropout, noise on activations.

A seeded ``tf.nn.dropout`` draws ``random_uniform(tf.shape(x), seed)``. Every replica's
clone keeps the seeds, so before the random_draws pass replica k drew, for its rows,
the mask one device draws for the batch's first rows: every replica the same mask, and
not one device's (the losses of 2 replicas and of one device were 0.38 apart after
three steps of the dropout MLP below). Now each replica draws the R replicas' rows and
keeps its own: R replicas compute what one device computes on their R batches, dropout
included (docs/semantics.md, "Random ops").
"""

import fnmatch

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, dropout_mlp, transformer_block
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
from test_normalizers import assert_transformer_trains_as_one_device
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
READS = {"w1": "w1/Read/ReadVariableOp:0", "w2": "w2/Read/ReadVariableOp:0"}
DROPOUT = "dropout/random_uniform/RandomUniform"
# kind -> the draws the analysis finds (a draw in a v2 cond's branch is "call:function:node",
# the function's name made unique by TensorFlow: matched up to its number)
DRAWS = {"dropout": [DROPOUT], "keep_prob": [DROPOUT], "per_row": [DROPOUT],
         "noise": ["random_normal/RandomStandardNormal"],
         "beta_per_row": ["Beta/sample/random_gamma/RandomGamma", "Beta/sample/random_gamma_1/RandomGamma"],
         "normal_sample": ["Normal/sample/random_normal/RandomStandardNormal"],
         "normal_learned_scale": ["Normal/sample/random_normal/RandomStandardNormal"],
         "stateless": ["stateless_random_uniform/StatelessRandomUniformV2"],
         "cond-v1": ["cond/" + DROPOUT], "cond-v2": ["cond:cond_true_*_rewritten:" + DROPOUT],
         "in_loop-v1": ["while/" + DROPOUT], "in_loop-v2": ["while:while_body_*_rewritten:" + DROPOUT],
         "cond_in_loop": ["while/cond:while_cond_true_*_rewritten:" + DROPOUT],
         "unseeded": [], "per_unit": [], "none": []}
FOUND = [k for k, v in DRAWS.items() if v]


def _build(kind, **kw):
    kind, _, control_flow = kind.partition("-")
    return dropout_mlp(kind, control_flow=control_flow or None, **kw)


def _matches(found, expected):
    return len(found) == len(expected) and all(fnmatch.fnmatchcase(f, e) for f, e in zip(found, expected))


def _train(session, feeds):
    with session as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return losses, sess.run(READS)


def _one_device(graph_def, feeds):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds)


def _assert_same(got, want, what):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL, err_msg=f"{what}: losses")
    for name in READS:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("kind", sorted(DRAWS))
def test_the_analysis_finds_the_seeded_draws_of_the_batchs_rows(kind):
    """Found: dropout (rate or keep_prob), one mask value per row, Gaussian noise and a
    stateless draw of the activations' shape, dropout behind a training flag's cond and
    in a while loop's body (v1 and v2 control flow), and in a v2 cond in a v1 loop. Not: an unseeded draw (each kernel
    seeds itself: the replicas differ already), noise per unit shared by the rows (one
    device's draw on every replica is right), and the variables' initializers."""
    found = analyze(graph_io.load_graph(_build(kind))).batch_draws
    assert _matches(found, DRAWS[kind]), found


def test_a_static_batchs_constant_shape_counts():
    """TensorFlow folds tf.shape(x) of a static [8, 16] into a constant."""
    graph = graph_io.load_graph(dropout_mlp("dropout", batch=BATCH))
    draw = graph.node("dropout/random_uniform/RandomUniform")
    assert draw.inputs[0].node.op == "Const"
    assert analyze(graph).batch_draws == [draw.name]


def test_a_sample_whose_first_axis_is_not_the_rows_is_no_draw_per_row():
    """A distribution whose batch shape broadcasts a row vector of the batch, [rows],
    with a [3, 1] scale: it draws [1, 3, rows], whose rows are its last axis, so it is
    no draw the pass could give each replica's rows of (the longer shape's first entry,
    3, leads)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 1])
        h = tf.reshape(tf.matmul(x, w), [-1])
        z = tf1.distributions.Normal(loc=h, scale=tf.ones([3, 1])).sample(seed=4)
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(z)), name="train_op")
    assert analyze(graph_io.load_graph(g.as_graph_def())).batch_draws == []


def test_the_clones_draws_differ_from_one_devices():
    """The control: with the draws left to the clones (a plan's empty random_draws), 2
    replicas do not train as one device; so the equivalence below depends on the pass."""
    graph_def, feeds = dropout_mlp("dropout"), dropout_batches(STEPS, 2 * BATCH)
    want = _one_device(graph_def, feeds)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    assert plan.random_draws == DRAWS["dropout"]
    plan.random_draws = []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    assert result.metadata["plan"]["random_draws"] == []
    got = _train(gr.Session(result), feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 1e-2


@pytest.mark.parametrize("kind", FOUND)
@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_two_replicas_train_as_one_device(kind, strategy):
    graph_def, feeds = _build(kind), dropout_batches(STEPS, 2 * BATCH)
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    assert _matches(result.metadata["plan"]["random_draws"], DRAWS[kind])
    _assert_same(_train(gr.Session(result), feeds), want, f"{kind} {strategy}")


@pytest.mark.parametrize("kind", ["per_row", "cond-v2", "in_loop-v1", "in_loop-v2", "cond_in_loop"])
def test_four_replicas_template_built_train_as_one_device(kind):
    """With 3 or more replicas only replica 1 is built and stands for the rest: each
    reads its own output of the ranks' Unpack in the export."""
    graph_def, feeds = _build(kind), dropout_batches(STEPS, 4 * BATCH)
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU")
    _assert_same(_train(gr.Session(result), feeds), want, "4 replicas")


@pytest.mark.parametrize("kind", ["dropout", "cond-v1", "cond-v2", "in_loop-v1", "in_loop-v2"])
def test_static_batches_train_as_one_device_built_for_the_global_batch(kind):
    """Each replica takes a batch of its own of 8 rows (global batch 16): one device's
    graph built for 16 rows draws its mask for all 16. TensorFlow folds the mask's
    shape into a constant, in a v2 function's body too."""
    feeds = dropout_batches(STEPS, 2 * BATCH)
    want = _one_device(_build(kind, batch=2 * BATCH), feeds)
    result = gr.rewrite(_build(kind, batch=BATCH), devices_per_worker=2, device_type="CPU")
    assert len(result.metadata["plan"]["random_draws"]) == 1
    _assert_same(_train(gr.Session(result), feeds), want, "static batch")


def test_draws_left_alone_keep_the_graph_as_it_was():
    """An unseeded dropout is cloned as before: no plan entry, no ops added."""
    result = gr.rewrite(dropout_mlp("unseeded"), devices_per_worker=2, device_type="CPU")
    assert "random_draws" not in result.metadata["plan"]
    assert not [n.name for n in result.graph_def.node if "random_draws" in n.name or "replica_rows" in n.name]


def test_gpu_replicas_draw_on_their_own_gpus():
    result = gr.rewrite(dropout_mlp("dropout"), PS2_WORKERS2, devices_per_worker=2, device_type="GPU")
    devices = {n.name: n.device for n in result.graph_def.node}
    rows = [name for name in devices if name.endswith(DROPOUT)]
    assert len(rows) == 4
    for name in rows:
        draw = f"{name}/every_replica"
        assert devices[draw] == devices[name] and "GPU" in devices[name], (name, devices[name])
    ranks = [n for n in result.graph_def.node if n.name == "graph_rewriter/random_draws/rank"]
    assert len(ranks) == 1 and ranks[0].attr["num"].i == 4 and "CPU" in ranks[0].device


def test_between_graph_each_worker_takes_its_group_ranks():
    """Worker 1 of 2 (2 GPUs each) holds group replicas 2 and 3: its ranks are [2, 3]
    and its draws are of 4 replicas' rows."""
    from graph_rewriter import dtypes
    result = gr.rewrite(dropout_mlp("dropout"), PS2_WORKERS2, devices_per_worker=2, device_type="GPU",
                        task="worker:1")
    nodes = {n.name: n for n in result.graph_def.node}
    assert dtypes.int_values(nodes["graph_rewriter/random_draws/ranks"].attr["value"].tensor) == [2, 3]
    assert dtypes.int_values(nodes["dropout/random_uniform/RandomUniform/replica_rows/replicas"]
                             .attr["value"].tensor) == [4]


def test_inspect_lists_the_draws():
    from graph_rewriter.inspect_report import format_report, report
    text = format_report(report(gr.rewrite(dropout_mlp("noise"), devices_per_worker=2, device_type="CPU")))
    assert ("random draws of the batch's rows (each replica draws every replica's rows and keeps its own): "
            "random_normal/RandomStandardNormal") in text


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_a_transformer_block_with_dropout_trains_as_one_device(strategy):
    """tf1_scripts.transformer_block with dropout 0.1 on the embeddings (one mask per
    sequence), the attention probabilities and the attention's output: 2 replicas equal
    one device, loss and every variable, over 4 steps."""
    result = assert_transformer_trains_as_one_device(*transformer_block(dropout=0.1), strategy)
    assert len(result.metadata["plan"]["random_draws"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy, kind", [("allreduce", "dropout"), ("ps", "dropout"), ("allreduce", "cond-v2"),
                                            ("ps", "in_loop-v1")])
def test_two_workers_train_as_one_device_on_loopback_servers(strategy, kind, pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half of every
    batch: worker k keeps rows k*8 .. k*8+7 of its draw of 16 (in the graph, in a v2
    cond's branch copies, in a v1 loop's frame)."""
    feeds = dropout_batches(STEPS, 2 * BATCH)
    graph_def = _build(kind)
    _, want = _one_device(graph_def, feeds)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, READS.values(), feeds)
    for name, tensor in READS.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


@pytest.mark.parametrize("kind", ["cond-v1", "cond-v2"])
def test_the_branch_without_dropout_still_runs_as_one_device(kind):
    """With the training flag False the cond takes the branch without a draw (v2: the
    copy of the else branch takes the rank and ignores it)."""
    graph_def, feeds = _build(kind), dropout_batches(STEPS, 2 * BATCH)
    off = [dict(feed, **{"training:0": False}) for feed in feeds]
    want = _one_device(graph_def, off)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    _assert_same(_train(gr.Session(result), off), want, f"{kind}, training False")


def test_v2_branches_are_copied_for_the_replicas_calls():
    """Every replica's If calls the copies with its rank last; the originals stay for
    any other caller, and the gradient's If is untouched."""
    result = gr.rewrite(_build("cond-v2"), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    functions = {f.signature.name: f for f in result.graph_def.library.function}
    for call in ("cond", "replica_1/cond"):
        node = nodes[call]
        then, other = node.attr["then_branch"].func.name, node.attr["else_branch"].func.name
        assert then.endswith("_rewritten_replica_rows") and other.endswith("_rewritten_replica_rows")
        assert node.input[-1] == "graph_rewriter/random_draws/rank" + (":1" if call.startswith("replica_1") else "")
        assert len(node.attr["Tin"].list.type) == 2
        for name in (then, other):
            assert functions[name].signature.input_arg[-1].name == "graph_rewriter_replica_rank"
            assert name[:-len("_replica_rows")] in functions
    grad = nodes["gradients/cond_grad/StatelessIf"]
    assert not grad.attr["then_branch"].func.name.endswith("_replica_rows")


def test_a_v2_loops_body_copy_returns_the_rank_unchanged():
    """The rank is one more loop variable, a loop constant: the body's copy returns its
    argument, the While gains an input, a type and a scalar output shape."""
    result = gr.rewrite(_build("in_loop-v2"), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    functions = {f.signature.name: f for f in result.graph_def.library.function}
    loop = nodes["replica_1/while"]
    body = functions[loop.attr["body"].func.name]
    cond = functions[loop.attr["cond"].func.name]
    assert body.signature.name.endswith("_replica_rows") and cond.signature.name.endswith("_replica_rows")
    assert body.ret["graph_rewriter_replica_rank"] == "graph_rewriter_replica_rank"
    assert cond.signature.input_arg[-1].name == "graph_rewriter_replica_rank"
    assert loop.input[-1] == "graph_rewriter/random_draws/rank:1"
    assert len(loop.attr["T"].list.type) == len(loop.attr["output_shapes"].list.shape) == len(
        [i for i in loop.input if not i.startswith("^")])
    assert not nodes["gradients/while_grad/while_grad"].attr["body"].func.name.endswith("_replica_rows")


def test_a_v1_loops_draw_takes_the_rank_through_its_frame():
    result = gr.rewrite(_build("in_loop-v1"), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    enter = nodes[f"replica_1/while/{DROPOUT}/replica_rows/rank/enter_0"]
    assert enter.op == "Enter" and enter.attr["is_constant"].b
    assert enter.attr["frame_name"].s == nodes["replica_1/while/Enter"].attr["frame_name"].s
    assert enter.input == ["graph_rewriter/random_draws/rank:1"]
    replicas = nodes[f"replica_1/while/{DROPOUT}/replica_rows/replicas"]
    assert replicas.input == [f"^replica_1/while/{DROPOUT.rsplit('/', 2)[0]}/Shape"]


@pytest.mark.parametrize("kind", ["dropout", "cond-v2", "in_loop-v1", "in_loop-v2", "cond_in_loop"])
def test_the_template_export_equals_every_replica_built(kind):
    graph_def = _build(kind)

    def exported(**kw):
        result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU", **kw)
        return (harness.canonical_nodes(result.graph_def),
                sorted(f.SerializeToString(deterministic=True) for f in result.graph_def.library.function))
    assert exported() == exported(materialize_replicas=True)


def test_a_plan_naming_an_unknown_draw_is_refused():
    graph_def = dropout_mlp("dropout")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.random_draws = ["dense/dropout/RandomUniform"]
    with pytest.raises(gr.GraphRewriteError, match="random_draws names 'dense/dropout/RandomUniform'.*found: "
                                                   "dropout/random_uniform/RandomUniform"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


def test_a_plan_read_back_from_json_keeps_its_choice(tmp_path):
    graph_def = dropout_mlp("dropout")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.random_draws = []
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=str(path))
    assert result.metadata["plan"]["random_draws"] == []
    assert not [n for n in result.graph_def.node if "replica_rows" in n.name]


@pytest.mark.parametrize("training", ["learning_phase", "explicit"])
def test_keras_dropout_trains_as_one_device(training):
    """tf_keras' Dropout layer in a TF1 graph: with training=True it draws in the graph;
    driven by the Keras learning phase (fed True) it draws in a v2 cond's branch."""
    from graph_rewriter.testing.models import import_tf_keras
    keras = import_tf_keras("the Keras dropout test")
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        h = keras.layers.Dense(16, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(x)
        h = keras.layers.Dropout(0.5)(h, **({"training": True} if training == "explicit" else {}))
        out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))(h)
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
        phase = keras.backend.learning_phase().name
        weights = {"w1": tf1.global_variables()[0], "w2": tf1.global_variables()[2]}
        reads = {name: v.op.name + "/Read/ReadVariableOp:0" if v.op.type == "VarHandleOp" else v.name
                 for name, v in weights.items()}
    feeds = [dict(feed, **({phase: True} if training == "learning_phase" else {}))
             for feed in dropout_batches(STEPS, 2 * BATCH)]

    def train(session):
        with session as sess:
            sess.run("init")
            return [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds], sess.run(reads)

    want = train(tf1.Session(graph=graph))
    result = gr.rewrite(graph.as_graph_def(), devices_per_worker=2, device_type="CPU")
    draws = result.metadata["plan"]["random_draws"]
    assert len(draws) == 1 and (":" in draws[0]) == (training == "learning_phase"), draws
    got = train(gr.Session(result))
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in reads:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_draw_fetched_by_name_is_one_devices(replicas):
    """The replica's rows take the draw's name (the op itself becomes
    <name>/every_replica), so Session's merge of the fetch (the replicas' rows, concatenated)
    is the draw one device makes for the whole batch."""
    graph_def, feed = dropout_mlp("dropout"), dropout_batches(1, replicas * BATCH)[0]
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        want = sess.run(DROPOUT + ":0", feed)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU")
    assert result.graph_def.node[[n.name for n in result.graph_def.node].index(DROPOUT)].op == "StridedSlice"
    with gr.Session(result) as sess:
        sess.run("init")
        got = sess.run(DROPOUT + ":0", feed)
    assert got.shape == want.shape == (replicas * BATCH, 16)
    np.testing.assert_array_equal(got, want)


def test_a_shape_whose_first_entry_is_not_the_rows_does_not_count():
    """A reversed shape starts with the units, not the rows."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        tf.identity(x * tf.transpose(tf1.random_uniform(tf.reverse(tf.shape(x), [0]))), name="reversed")
        tf.identity(x * tf1.random_uniform(tf.shape(x)), name="rows")
    found = analyze(graph_io.load_graph(graph.as_graph_def())).batch_draws
    assert found == ["random_uniform_1/RandomUniform"], found
