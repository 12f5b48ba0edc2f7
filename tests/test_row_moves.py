"""Rows moved within the batch train as one device: every replica moves every replica's
rows and keeps its own (graph_rewriter/row_moves.py, passes/row_moves.py).

Mixup mixes each row of the batch with another row: ``lam * x + (1 - lam) *
tf.reverse(x, [0])``, ``x[::-1]``, ``tf.roll(x, 1, 0)`` or a gather of a seeded
``tf.random.shuffle(tf.range(n))``, with lam fixed, drawn once per batch from Beta(0.2,
0.2) as the paper draws it, or once per row. Before, each replica mixed its own shard's
rows among themselves and the plan said so in a note (the control below gives the note
and the difference back). Now each replica gathers the rows, moves the whole batch (the
shuffle's copy draws one device's permutation, from the whole batch's count of rows) and
keeps its own rows of it, so the mixed batch is one device's. Rows moved after a variable
(manifold mixup's hidden features) would need their gradients back on other replicas:
those keep the note, and the log says why.

A seeded ``tf.random.categorical(logits, 1, seed)`` (REINFORCE's actions) takes the same
path: its kernel draws row b from its seeds skipped ahead by b, so each replica drew for
its rows what one device draws for the batch's first rows, with no note (0.17 from one
device in the loss after four steps at 2 replicas, the baseline synced: the control
below); now every replica
draws from every replica's logits and keeps its own rows' actions.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io, inspect_report
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, policy_gradient, rows_meeting_mlp

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 4, 16
RTOL, ATOL = 1e-5, 1e-6
MIXUPS = ("mixup", "mixup_sliced", "mixup_shuffled", "roll", "mixup_beta", "mixup_per_row")

_REFERENCES = {}


def _graph(kind):
    kind, _, policy = kind.partition(":")
    return policy_gradient(policy) if kind == "policy" else rows_meeting_mlp(kind)


def _reference(kind):
    if kind not in _REFERENCES:
        graph_def = _graph(kind)
        with harness.one_device_session(graph_def) as sess:
            _REFERENCES[kind] = graph_def, harness.train_and_read(sess, graph_def, _batches())
    return _REFERENCES[kind]


def _batches(steps=STEPS):
    return dropout_batches(steps, BATCH)


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("kind, gathered, count_leaves", [
    ("mixup", ["x:0", "y:0"], []),
    ("mixup_sliced", ["x:0", "y:0"], []),
    ("roll", ["x:0", "y:0"], []),
    ("mixup_shuffled", ["x:0", "y:0"], ["Shape"]),
    ("mixup_beta", ["x:0", "y:0"], ["Shape"]),
])
def test_the_analysis_finds_the_moves(kind, gathered, count_leaves):
    """Both moves (of the images and of their labels), the rows they read, and, for the
    shuffled order, the ops computing it again from R times the replica's count (one
    order for both moves: the indices are copied once)."""
    found = analyze(graph_io.load_graph(rows_meeting_mlp(kind)))
    moves = found.row_moves
    assert [n.rsplit("/", 1)[0] for n in moves.moves] == ["mixed_x", "mixed_y"]
    assert [t for t, _ in moves.gathered] == gathered
    assert moves.count_leaves == count_leaves
    if count_leaves:
        assert any(n.endswith("RandomShuffle") for n in moves.copied_ops)
        [(order, readers)] = moves.copied
        assert [r for r, _ in readers] == ["mixed_x", "mixed_y"]
    assert not found.row_move_obstacles


@pytest.mark.parametrize("kind", MIXUPS)
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_trains_as_one_device(kind, strategy, replicas):
    """Losses at every step and every variable, with no note (4 replicas: built from
    the template replica)."""
    graph_def, want = _reference(kind)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not _notes(result)
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, _batches())
    harness.assert_trained_alike(f"{kind}, {strategy}, {replicas} replicas", got, want, RTOL, ATOL)


@pytest.mark.parametrize("kind", ["mixup", "mixup_shuffled", "mixup_beta"])
def test_each_replicas_own_moves_would_be_caught(kind):
    """The control: a given plan with ``"row_moves": {}`` leaves each replica moving its
    own rows; the note comes back and the losses differ, so the test above can fail."""
    graph_def, want = _reference(kind)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.row_moves = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    [note] = _notes(result)
    assert "'mixed_x'" in note
    with gr.Session(result) as sess:
        losses, _ = harness.train_and_read(sess, graph_def, _batches())
    assert max(abs(a - b) for a, b in zip(losses, want[0])) > 1e-3, (losses, want[0])


POLICIES = ("policy:categorical", "policy:stateless")


@pytest.mark.parametrize("kind, sample", [("policy:categorical", "categorical/Multinomial"),
                                          ("policy:stateless", "stateless_categorical/StatelessMultinomial"),
                                          ("policy:unseeded", None)])
def test_the_analysis_finds_seeded_samples_of_rows(kind, sample):
    """A seeded draw of actions per row from the policy's logits is found and drawn over
    every replica's logits (computed from variables: a draw has no gradient); an
    unseeded one draws from a seed of its own on every replica already: left alone."""
    found = analyze(graph_io.load_graph(_graph(kind)))
    assert found.sampled_rows == ([sample] if sample else [])
    assert (found.row_moves.moves if found.row_moves else []) == found.sampled_rows
    assert found.row_moves is None or [t for t, _ in found.row_moves.gathered] == ["MatMul_1:0"]


@pytest.mark.parametrize("kind", POLICIES)
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("hybrid", 2)])
def test_sampled_actions_train_as_one_device(kind, strategy, replicas):
    """REINFORCE with the batch's mean reward as its baseline (a batch statistic, synced):
    losses and every variable (Adam's slots among them) as one device's, no note."""
    graph_def, want = _reference(kind)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy,
                        sync_batch_statistics=True)
    assert not _notes(result)
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, _batches())
    harness.assert_trained_alike(f"{kind}, {strategy}, {replicas} replicas", got, want, RTOL, ATOL)


@pytest.mark.parametrize("kind", POLICIES)
def test_each_replicas_own_samples_would_be_caught(kind):
    """The control: with ``"row_moves": {}`` each replica draws for its rows what one
    device draws for the first rows; the note says so, and the actions and the losses
    differ from one device's."""
    graph_def, want = _reference(kind)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=True).plan
    plan.row_moves = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    [note] = _notes(result)
    assert "seeded draws of samples per row" in note and "categorical" in note
    with gr.Session(result) as sess:
        losses, _ = harness.train_and_read(sess, graph_def, _batches())
    assert max(abs(a - b) for a, b in zip(losses, want[0])) > 1e-3, (losses, want[0])


def test_sampled_actions_are_fetched_as_one_devices():
    graph_def = _graph("policy:categorical")
    feed = _batches(1)[0]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = sess.run("actions:0", feed)
    result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU", sync_batch_statistics=True)
    with gr.Session(result) as sess:
        sess.run("init")
        got = sess.run("actions:0", feed)
    np.testing.assert_array_equal(got, want)


def test_the_moved_batch_is_fetched_as_one_devices():
    """The move keeps its name on the replica's rows: fetched, the mixed batch is one
    device's, the replicas' rows concatenated."""
    graph_def = rows_meeting_mlp("mixup_shuffled")
    feed = _batches(1)[0]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = sess.run("mixed_x:0", feed)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as sess:
        sess.run("init")
        got = sess.run("mixed_x:0", feed)
    np.testing.assert_array_equal(got, want)


def test_the_graph_gathers_per_replica_and_inspect_says_so():
    """Each replica gathers the images, then the labels, with instance keys of their own;
    the whole batch's move is ``<name>/every_replica``; the plan lists the moves and
    `graph-rewrite inspect` prints them."""
    result = gr.rewrite(rows_meeting_mlp("mixup"), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    gathers = [n for n in result.graph_def.node if n.op == "CollectiveGatherV2"]
    assert len(gathers) == 4
    for prefix in ("", "replica_1/"):
        assert nodes[prefix + "mixed_x/every_replica"].op == "ReverseV2"
        assert nodes[prefix + "mixed_x"].op == "StridedSlice"
    keys = [(n.name.startswith("replica_1/"), nodes[n.input[3].split(":")[0]].attr["value"].tensor.int_val[0])
            for n in result.graph_def.node if n.op.startswith("Collective")]
    assert len(set(keys)) == len(keys)
    assert result.metadata["plan"]["row_moves"]["moves"] == ["mixed_x", "mixed_y"]
    text = inspect_report.format_report(inspect_report.report(result))
    assert "rows moved within the batch over every replica's rows" in text and "mixed_x" in text


def test_rows_moved_after_a_variable_keep_the_note():
    """Manifold mixup moves hidden features, whose gradients would have to go back to
    other replicas: the note names that move, the log says why; the labels' move, from
    the batch alone, is computed over every replica's rows."""
    lines = []
    result = gr.rewrite(rows_meeting_mlp("mixup_hidden"), devices_per_worker=2, device_type="CPU",
                        log=lines.append)
    assert result.plan.row_moves["moves"] == ["mixed_y"]
    [note] = _notes(result)
    assert "'mixed_h'" in note and "'mixed_y'" not in note
    assert any("'mixed_h'" in line and "variable 'w1'" in line for line in lines), lines


def test_micro_batches_keep_the_note():
    """Under micro-batches each would mix its micro-batch's rows: the note stays."""
    result = gr.rewrite(rows_meeting_mlp("mixup"), devices_per_worker=2, device_type="CPU", accumulation_steps=2)
    assert result.plan.row_moves is None
    [note] = _notes(result)
    assert "'mixed_x'" in note and "'mixed_y'" in note


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["mixup_shuffled", "mixup_per_row"])
def test_between_graph_on_servers(kind, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch: the rows are gathered across the workers' processes, each
    worker keeps its replicas' rows of the moved batch (ranks 2 and 3 on worker 1), and
    the variables equal one device's after STEPS steps."""
    graph_def, (_, want) = _reference(kind)
    reads = harness.resource_reads(graph_def)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(), _batches(),
                              dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
