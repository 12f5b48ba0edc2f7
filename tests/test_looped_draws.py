"""Seeded random ops in a while loop over the batch's rows (graph_rewriter.testing.
tf1_scripts.augmented_mlp): TF1 scripts augment images in the graph with ``tf.map_fn``,
a random flip or crop per image, whose loop runs one step per row and draws at every
step from its kernel's state.

A replica's loop runs over its own n rows, so its kernel draws what one device draws
for the batch's first n rows: every replica's augmentations coincide, none is one
device's, and nothing said so (0.65 from one device in the loss after three steps at 2
replicas, per-row noise, v1 loops; every form and loop version alike). Now every
replica runs the loop over every replica's rows, gathered, and keeps its own rows of its
results (graph_rewriter/row_moves.py), so R replicas train as one device; where the
loop reads a variable (noise on a hidden layer), the plan says so.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import LOOPED_AUGMENTATIONS, augmented_mlp, dropout_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
LOOP = {"v1": "map/while/LoopCond", "v2": "map/while"}
STACK = {"v1": "map/TensorArrayStack/TensorArrayGatherV3", "v2": "map/TensorArrayV2Stack/TensorListStack"}
NOTE = "seeded random ops draw in while loops over the batch's rows"


_one_device = harness.trained_on_one_device
_trained = harness.trained_rewritten


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(NOTE)]


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("kind", LOOPED_AUGMENTATIONS)
def test_the_analysis_finds_the_loop_and_its_stack(kind, control_flow):
    """The loop (a v1 frame by its LoopCond, a v2 While) and tf.map_fn's stack of its
    results, which every replica computes over every replica's rows: the rows it reads
    (x, through the reshape to images) are gathered for the loop's readers of them."""
    found = analyze(graph_io.load_graph(augmented_mlp(kind, control_flow)))
    assert found.looped_draws == {LOOP[control_flow]: [STACK[control_flow]]}
    assert found.row_moves.moves == [STACK[control_flow]]
    assert [t for t, _ in found.row_moves.gathered] == ["Reshape:0"]
    assert found.row_moves.copied_ops == [] and found.moved_rows == [] and found.batch_draws == []


def test_unseeded_draws_and_loops_reading_variables_are_not_taken():
    """Unseeded: each kernel draws from a seed of its own, on every replica already
    (nothing found). Noise on the hidden layer: the loop's rows come from w1, whose
    gradient would have to go back through the gather, so it is left to the note."""
    assert analyze(graph_io.load_graph(augmented_mlp("noise", seeded=False))).looped_draws == {}
    found = analyze(graph_io.load_graph(augmented_mlp("hidden_noise", "v1")))
    assert found.looped_draws == {LOOP["v1"]: []} and found.row_moves is None
    assert "computed from the variable 'w1'" in found.row_move_obstacles[LOOP["v1"]]


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_a_loop_a_bound_over_the_rows_bounds_is_none(control_flow):
    """A loop run to a Max over the rows, drawing noise per unit at every step: its steps
    are not the rows, and the loop_bounds pass runs every replica's loop to one device's
    count of steps, so its draws are one device's already (no note, trained alike)."""
    feeds = dropout_batches(STEPS, BATCH)
    graph_def = augmented_mlp("bounded_noise", control_flow)
    found = analyze(graph_io.load_graph(graph_def))
    assert found.looped_draws == {} and found.drawing_loop_bounds
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not _notes(result) and result.plan.loop_bounds
    harness.assert_trained_alike(control_flow, _trained(result, graph_def, feeds), _one_device(graph_def, feeds),
                                 RTOL, ATOL)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("kind", LOOPED_AUGMENTATIONS)
def test_two_replicas_augment_as_one_device(kind, control_flow):
    feeds = dropout_batches(STEPS, BATCH)
    graph_def = augmented_mlp(kind, control_flow)
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert result.plan.row_moves["moves"] == [STACK[control_flow]] and not _notes(result)
    harness.assert_trained_alike(f"{kind}, {control_flow}", _trained(result, graph_def, feeds), want, RTOL, ATOL)


@pytest.mark.parametrize("kind, control_flow, strategy, replicas", [
    ("crop", "v1", "allreduce", 4), ("noise", "v2", "allreduce", 4), ("coin", "v1", "ps", 2),
    ("flip", "v2", "ps", 2), ("noise", "v1", "hybrid", 2)])
def test_more_replicas_and_strategies_augment_as_one_device(kind, control_flow, strategy, replicas):
    feeds = dropout_batches(STEPS, BATCH)
    graph_def = augmented_mlp(kind, control_flow)
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    harness.assert_trained_alike(f"{kind}, {control_flow}, {strategy} {replicas}",
                                 _trained(result, graph_def, feeds), want, RTOL, ATOL)


def test_a_fetch_of_the_augmented_batch_is_one_devices():
    """The stack's replica rows take its name, so Session's merge of the augmented batch
    (the replicas' rows concatenated) is one device's, draw for draw."""
    graph_def = augmented_mlp("noise", "v1")
    feed = dropout_batches(1, BATCH)[0]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = sess.run("augmented:0", feed)
    with gr.Session(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")) as sess:
        sess.run("init")
        got = sess.run("augmented:0", feed)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert np.max(np.abs(want - feed["x:0"])) > 0.1   # (the noise was drawn)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_each_replicas_own_loop_would_be_caught(control_flow):
    """The control: a given plan with ``"row_moves": {}`` leaves each replica's loop over
    its own rows; the note names the loop, and the step differs, so the tests above can
    fail."""
    feeds = dropout_batches(STEPS, BATCH)
    graph_def = augmented_mlp("noise", control_flow)
    want_losses, _ = _one_device(graph_def, feeds)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.row_moves = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    [note] = _notes(result)
    assert f"'{LOOP[control_flow]}'" in note
    losses, _ = _trained(result, graph_def, feeds)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 1e-2, (losses, want_losses)


@pytest.mark.parametrize("kind, options", [("hidden_noise", {}), ("noise", {"accumulation_steps": 2})],
                         ids=["reads_a_variable", "micro_batches"])
def test_loops_left_to_the_replicas_are_noted(kind, options):
    """Not silent where the loop cannot run over every replica's rows: rows computed
    from a variable, or micro-batches (each would run over its micro-batch's rows)."""
    result = gr.rewrite(augmented_mlp(kind, "v2"), devices_per_worker=2, device_type="CPU", **options)
    [note] = _notes(result)
    assert "'map/while'" in note and result.plan.row_moves is None


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_a_static_batchs_loop_is_noted(control_flow):
    """With a static batch TensorFlow folds tf.map_fn's count of rows into a constant,
    and each replica takes a batch of its own: the loop is not run over every replica's
    rows (its count would have to be R times the constant), so the replicas' draws
    coincide, and the plan says so."""
    graph_def = augmented_mlp("noise", control_flow, batch=BATCH)
    found = analyze(graph_io.load_graph(graph_def))
    assert found.looped_draws == {LOOP[control_flow]: []}
    assert "the static batch" in found.row_move_obstacles[LOOP[control_flow]]
    [note] = _notes(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU"))
    assert f"'{LOOP[control_flow]}'" in note


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_augment_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half: the
    gather spans the workers, and each worker's loop draws one device's numbers for its
    rows."""
    feeds = dropout_batches(STEPS, BATCH)
    graph_def = augmented_mlp("crop", "v1")
    _, want = _one_device(graph_def, feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "allreduce", STEPS, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
