"""A language model that carries its LSTM state through the feed trains as one device
(graph_rewriter.testing.tf1_scripts.carried_state_lm).

TensorFlow's PTB tutorial and char-rnn build ``initial_state = cell.zero_state(batch,
tf.float32)``, fetch the final state with every step and feed it back by the zero
state's tensors' names. Every replica computes its own zeros, so before
passes/row_defaults.py a value fed by such a name reached replica 0 alone: in a plain
session (the tutorial's Supervisor, MonitoredTrainingSession) the other replicas started
every step from zeros, silently (0.15 in the loss after four steps of PTB at 2
replicas); through graph_rewriter.Session the fed rows did not fit replica 0's, and the
step failed. Now the name holds every replica's rows and each replica reads its own.

Covered: static batches (one batch of B rows per replica) and dynamic ones (split); the
state as rnn_cell's zero_state builds it, as ``tf.zeros``, as placeholders and as
``placeholder_with_default``s; the steps unrolled (PTB) or in a dynamic_rnn (v1 and v2
while loops); allreduce at 2, 3 and 4 replicas, ps, hybrid; graph_rewriter.Session and a
plain tf.compat.v1.Session; two workers on loopback servers, each client carrying its
own replicas' state.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.session import session_config
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (CARRIED_STATES, LM_HIDDEN, LM_STEPS, carried_state_lm,
                                                carried_state_names, carried_state_text)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, B = 4, 4   # B: a replica's rows (its static batch; with dynamic batches, its share)
RTOL, ATOL = 1e-5, 1e-6
INITIAL, FINAL = carried_state_names()


def _feeds(rows, steps=STEPS, state="cell"):
    """Step t's words and next words of ``rows`` streams; the zero state fed at step 0
    only where the state is a placeholder (the other forms default to zeros)."""
    text = carried_state_text(rows, steps)
    feeds = [{"x:0": text[:, t * LM_STEPS:(t + 1) * LM_STEPS], "y:0": text[:, t * LM_STEPS + 1:(t + 1) * LM_STEPS + 1]}
             for t in range(steps)]
    if state == "placeholder":
        feeds[0].update({name: np.zeros((rows, LM_HIDDEN), np.float32) for name in INITIAL})
    return feeds


def _train(sess, graph_def, feeds, carry=True):
    """((losses, global norms), {variable: value}): runs init, then a step per feed,
    feeding each step's final state as the next step's initial state (``carry``)."""
    sess.run("init")
    steps, state = [], None
    for t, feed in enumerate(feeds):
        feed = dict(feed)
        if t and carry:
            feed.update(zip(INITIAL, state))
        loss, norm, state, _ = sess.run(["loss:0", "grad_norm:0", FINAL, "train_op"], feed)
        steps.append((loss, norm))
    return steps, tf1.Session.run(sess, harness.resource_reads(graph_def))


def _plain(result):
    g = tf.Graph()
    with g.as_default():
        tf1.import_graph_def(result.graph_def, name="")
    return tf1.Session(graph=g, config=session_config(result.metadata["session_config"]))


_REFERENCES = {}


def _reference(kind, state, rnn="unrolled", control_flow=None, rows=2 * B):
    """(graph_def, trained) of one device on ``rows`` streams."""
    key = (kind, state, rnn, control_flow, rows)
    if key not in _REFERENCES:
        graph_def = carried_state_lm(None if kind == "dynamic" else rows, state, rnn, control_flow)
        with harness.one_device_session(graph_def) as sess:
            _REFERENCES[key] = graph_def, _train(sess, graph_def, _feeds(rows, state=state))
    return _REFERENCES[key]


def _rewrite(kind, state, replicas, rnn="unrolled", control_flow=None, **options):
    graph_def = carried_state_lm(None if kind == "dynamic" else B, state, rnn, control_flow)
    return graph_def, gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", **options)


def _trained(kind, state, replicas, rnn="unrolled", control_flow=None, plain=False, **options):
    graph_def, result = _rewrite(kind, state, replicas, rnn, control_flow, **options)
    with (_plain(result) if plain else gr.Session(result)) as sess:
        return _train(sess, graph_def, _feeds(replicas * B, state=state))


def test_the_reference_carries_its_state_and_clips():
    """The control for everything below: one device's losses with the state carried
    differ from its losses with every step started from zeros by far more than the
    tolerance (a replica that loses the state is caught), clipping fires on every step
    (norms above 0.25), every variable moves, and the reference is deterministic."""
    graph_def, (steps, values) = _reference("static", "cell")
    with harness.one_device_session(graph_def) as sess:   # (a session's init draws its own values)
        zeros_every_step, _ = _train(sess, graph_def, _feeds(2 * B), carry=False)
    with harness.one_device_session(graph_def) as sess:
        again, _ = _train(sess, graph_def, _feeds(2 * B))
    np.testing.assert_allclose(again, steps, rtol=1e-6)
    losses, norms = np.array(steps).T
    assert np.abs(losses[1:] - np.array(zeros_every_step)[1:, 0]).max() > 1e-2, (losses, zeros_every_step)
    assert norms.min() > 0.25, norms
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        initial = tf1.Session.run(sess, harness.resource_reads(graph_def))
    for name in values:
        if "global_step" not in name:
            assert np.abs(values[name] - initial[name]).max() > 1e-3, f"{name} did not move"


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("state", CARRIED_STATES)
def test_trains_as_one_device_in_a_graph_rewriter_session(kind, state):
    """Two replicas, the steps unrolled: losses, norms and every variable after STEPS
    steps of carried state, fetched and fed through graph_rewriter.Session."""
    _, want = _reference(kind, state)
    got = _trained(kind, state, 2)
    harness.assert_trained_alike(f"{kind} {state}", got, want, RTOL, ATOL, first="losses and norms")


@pytest.mark.parametrize("kind,state,control_flow", [
    ("static", "cell", "v2"), ("static", "with_default", "v2"), ("dynamic", "zeros", "v2"),
    ("dynamic", "placeholder", "v2"), ("static", "cell", "v1"), ("dynamic", "with_default", "v1")])
def test_trains_as_one_device_through_dynamic_rnn(kind, state, control_flow):
    """The state enters a dynamic_rnn's while loop (an Enter, a While's input). A v1
    loop's final state has no static rank once imported, so Session would return replica
    0's rows of it: ``merge`` says to concatenate it (Session's check of the feed says
    so, below)."""
    _, want = _reference(kind, state, "dynamic_rnn", control_flow)
    merge = {name: "concat" for name in FINAL} if control_flow == "v1" else {}
    got = _trained(kind, state, 2, "dynamic_rnn", control_flow, merge=merge)
    harness.assert_trained_alike(f"{kind} {state} {control_flow}", got, want, RTOL, ATOL, first="losses and norms")


@pytest.mark.parametrize("kind,state,replicas,options", [
    ("static", "cell", 4, {}),
    ("dynamic", "cell", 4, {}),
    ("dynamic", "cell", 3, {"materialize_replicas": True}),
    ("dynamic", "with_default", 2, {"strategy": "ps"}),
    ("static", "zeros", 2, {"strategy": "hybrid"}),
])
def test_trains_as_one_device_under_other_plans(kind, state, replicas, options):
    """Template replicas (4: replica 1 stands for 1..3, its split output rendered per
    replica), every replica built, a parameter server, hybrid."""
    _, want = _reference(kind, state, rows=replicas * B)
    got = _trained(kind, state, replicas, **options)
    harness.assert_trained_alike(f"{kind} {state} {replicas} {options}", got, want, RTOL, ATOL,
                                 first="losses and norms")


@pytest.mark.parametrize("kind,state", [("static", "cell"), ("dynamic", "cell"), ("dynamic", "with_default")])
def test_trains_as_one_device_in_a_plain_session_that_fetches_merged_states(kind, state):
    """A plain tf.compat.v1.Session (what the tutorial's Supervisor and a
    MonitoredTrainingSession run), the final state named in ``outputs`` so its name
    gives every replica's rows, as the fed initial state's does."""
    _, want = _reference(kind, state)
    got = _trained(kind, state, 2, plain=True, outputs=["loss:0"] + FINAL)
    harness.assert_trained_alike(f"plain {kind} {state}", got, want, RTOL, ATOL, first="losses and norms")


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_plain_session_feeding_one_replicas_state_fails_instead_of_training_apart(kind):
    """Without ``outputs``, a plain session's fetch of the final state is replica 0's
    rows; fed back, they do not fit the initial state, which holds every replica's: the
    step fails. With the pass switched off (``row_defaults: []``) the same loop runs,
    and trains replica 1 from zeros at every step: the silent difference this pass
    removes (the control: it exceeds the tolerance)."""
    _, want = _reference(kind, "cell")
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        _trained(kind, "cell", 2, plain=True)
    graph_def, result = _rewrite(kind, "cell", 2)
    plan = result.plan.to_dict()
    assert plan["row_defaults"] == [name.rsplit(":", 1)[0] for name in INITIAL]
    plan["row_defaults"] = []
    got = _trained(kind, "cell", 2, plain=True, strategy=gr.Plan.from_dict(plan))
    assert np.abs(np.array(got[0]) - np.array(want[0])).max() > 1e-2


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_the_initial_state_holds_every_replicas_rows_under_its_name(kind):
    """Unfed, the name gives the zeros of every replica's rows, in either session, and
    replica 0's own zeros keep a name of their own (replica_0/...); the plan lists the
    state and the pass says what it did."""
    lines = []
    graph_def, result = _rewrite(kind, "cell", 2, log=lines.append)
    feed = _feeds(2 * B)[0]
    for sess in (gr.Session(result), _plain(result)):
        with sess:
            values = tf1.Session.run(sess, INITIAL + ["replica_0/" + INITIAL[0]], feed)
        assert [v.shape for v in values] == [(2 * B, LM_HIDDEN)] * len(INITIAL) + [(B, LM_HIDDEN)]
        assert not any(np.any(v) for v in values)
    assert result.plan.row_defaults == [name.rsplit(":", 1)[0] for name in INITIAL]
    assert [line for line in lines if line.startswith(f"row_defaults: {INITIAL[0]} holds every replica's rows")]


@pytest.mark.parametrize("kind,rows", [("static", B), ("static", 3 * B), ("dynamic", B), ("dynamic", 3)])
def test_session_names_a_fed_state_without_every_replicas_rows(kind, rows):
    """Fed with other than every replica's rows (replica 0's, or too many, or rows that
    do not match the batch fed with them), Session refuses the run naming the state and
    the rows it takes."""
    _, result = _rewrite(kind, "cell", 2)
    feed = dict(_feeds(2 * B)[0], **{INITIAL[0]: np.zeros((rows, LM_HIDDEN), np.float32)})
    with gr.Session(result) as sess:
        sess.run("init")
        with pytest.raises(GraphRewriteError) as e:
            sess.run("train_op", feed)
    assert f"'{INITIAL[0]}' gets {rows} row(s)" in str(e.value) and f"takes {2 * B} rows" in str(e.value)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_template_replicas_emit_what_built_replicas_emit(kind):
    """The split's output k read by replica k: the template export (replica 1 written
    for 1..3) gives the nodes of every replica built (control inputs are a set:
    tests/test_template_replicas.py)."""
    graph_def = carried_state_lm(None if kind == "dynamic" else B, "cell")
    a, b = (gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU", materialize_replicas=m).graph_def
            for m in (False, True))
    assert harness.canonical_nodes(a) == harness.canonical_nodes(b)


def test_a_given_plan_names_only_states_of_the_graph():
    _, result = _rewrite("dynamic", "cell", 2)
    plan = result.plan.to_dict()
    plan["row_defaults"] = ["lm/softmax_w"]
    with pytest.raises(GraphRewriteError, match="row_defaults names 'lm/softmax_w'"):
        gr.rewrite(carried_state_lm(None, "cell"), devices_per_worker=2, device_type="CPU",
                   strategy=gr.Plan.from_dict(plan))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_values_that_are_not_states_are_left_alone(kind):
    """Not a carried state: a ones_like or zeros_like of a value (a loss's weights, the
    backward pass's fills), a vector with a row per row (rank 1), an integer fill, and
    a fill of the width alone; the LSTM's zero state beside them is one."""
    from graph_rewriter import graph_io
    from graph_rewriter.analysis import analyze
    batch = None if kind == "dynamic" else B
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [batch, 3], name="x")
        rows = tf.shape(x)[0] if batch is None else batch
        w = tf1.get_variable("w", [3 + 3, 3])
        state = tf.zeros(tf.stack([rows, 3]) if batch is None else [rows, 3], name="state")
        h = tf.tanh(tf.matmul(tf.concat([x, state], 1), w))
        weights = tf.ones_like(h) * tf.zeros_like(h)
        per_row = tf.ones(tf.stack([rows]) if batch is None else [rows], name="per_row")
        counts = tf.zeros(tf.stack([rows, 3]) if batch is None else [rows, 3], tf.int32, name="counts")
        width = tf.fill([3], 2.0, name="width")
        loss = tf.reduce_mean(tf.square(h) * (1.0 + weights) * width + tf.expand_dims(per_row, 1)
                              + tf.cast(counts, tf.float32), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    assert analyze(graph_io.load_graph(g.as_graph_def())).row_defaults == ["state"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,state,strategy", [("static", "cell", "allreduce"), ("dynamic", "with_default", "ps")])
def test_between_graph_on_servers(kind, state, strategy, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch's streams and carrying its own replicas' state
    (worker_client --carry): the variables equal one device's on every stream."""
    graph_def, (_, want) = _reference(kind, state, rows=4 * B)
    rewritten = carried_state_lm(None if kind == "dynamic" else B, state)
    reads = harness.resource_reads(rewritten)
    got = tc.two_workers_read(pool, procs, tmp_path, rewritten, strategy, STEPS, reads.values(),
                              _feeds(4 * B, state=state), dpw=2, carry=list(zip(FINAL, INITIAL)),
                              step_ops=[("loss:0", "train_op")])
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{kind} {strategy}: {name}")


@pytest.mark.parametrize("kind,state", [("static", "cell"), ("dynamic", "zeros")])
def test_session_splits_a_fed_state_even_where_the_plan_keeps_it_per_replica(kind, state):
    """graph_rewriter.Session feeds a tensor every replica computes by giving each
    replica's copy its rows of the value, so with ``row_defaults: []`` (no pass) the
    state reaches every replica all the same in it."""
    _, want = _reference(kind, state)
    _, result = _rewrite(kind, state, 2)
    plan = result.plan.to_dict()
    plan["row_defaults"] = []
    got = _trained(kind, state, 2, strategy=gr.Plan.from_dict(plan))
    harness.assert_trained_alike(f"{kind} {state}", got, want, RTOL, ATOL, first="losses and norms")


def test_session_feeds_a_computed_value_to_every_replica():
    """A value the graph computes in every replica and the script overrides by feeding
    it (a learning rate): every replica takes the fed value, so none keeps its own. Fed
    0, no replica's copy of the weights moves; fed 0.1, they move alike."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", initializer=tf.ones([3, 1]), use_resource=False)   # (its ref reads as a value)
        lr = tf.identity(tf.constant(0.5) * 0.2, name="lr")
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0), name="loss")
        tf1.train.GradientDescentOptimizer(lr).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU")
    feed = {"x:0": np.arange(12, dtype=np.float32).reshape(4, 3)}
    with gr.Session(result) as sess:
        sess.run("init")
        sess.run("train_op", dict(feed, **{"lr:0": 0.0}))
        copies = tf1.Session.run(sess, ["w:0", "replica_1/w:0"])
        assert all(np.all(c == 1.0) for c in copies), copies
        sess.run("train_op", dict(feed, **{"lr:0": 0.1}))
        copies = tf1.Session.run(sess, ["w:0", "replica_1/w:0"])
    np.testing.assert_array_equal(copies[0], copies[1])
    assert np.abs(copies[0] - 1.0).max() > 1e-2
