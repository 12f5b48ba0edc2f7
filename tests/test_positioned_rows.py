"""Rows taken by their position in the batch, computed over every replica's rows.

A model that takes rows of the batch by their position pairs or groups rows that a
replica's contiguous shard splits apart: the halves of a batch where the input pipeline
put two views of its examples (``tf.split(h, 2, 0)``), a loss on ``h[:n]``, and a
prototypical network's episode, whose support embeddings ``tf.reshape(h, [n_way, -1, d])``
groups class by class, then averages into one prototype per class that every query is
compared with. Before, the first two were noted (0.22 from one device in the loss at 2
replicas) and the prototypes were neither noted nor one device's (0.73 in the loss
after three episodes at 2 replicas: each replica's reshape grouped its own rows, of
other classes). ProGAN's and StyleGAN's minibatch standard deviation groups the rows by
``tf.reshape(h, [tf.minimum(4, tf.shape(h)[0]), -1, d])``: its group count was no
constant, so nothing was found, and 2 replicas trained 0.016 from one device in the
loss with no note. Now such an op starts a head, as an in-batch product does
(graph_rewriter/product_heads.py): every replica gathers the rows it reads, in replica
order (one device's batch), computes the rest of the forward pass from them, and keeps
its own rows' gradients, so R replicas train as one device.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (dropout_batches, minibatch_stddev_mlp, prototypical_network,
                                                prototypical_episodes, rows_meeting_mlp)

RTOL, ATOL = 1e-5, 1e-6
# the graphs, their batches, and the op that takes rows by position
MODELS = {
    "halves": (lambda: rows_meeting_mlp("halves"), lambda: dropout_batches(3, 16), "halves"),
    "first_rows": (lambda: rows_meeting_mlp("first_rows"), lambda: dropout_batches(3, 16), "first/strided_slice_1"),
    "prototypes": (prototypical_network, lambda: prototypical_episodes(3), "prototypes/grouped"),
    "minibatch_stddev": (minibatch_stddev_mlp, lambda: dropout_batches(3, 16), "minibatch_stddev/grouped"),
}


_one_device = harness.trained_on_one_device
_trained = harness.trained_rewritten


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_positioned_op_starts_a_head(model):
    build, _, op = MODELS[model]
    found = analyze(graph_io.load_graph(build()))
    assert found.positioned_rows == [op]
    assert found.product_head is not None and found.product_head.products == [op]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_rows_taken_by_position_train_as_one_device(model, strategy, replicas):
    build, batches, op = MODELS[model]
    graph_def, feeds = build(), batches()
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert op in result.plan.product_head["head"]
    assert not [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    harness.assert_trained_alike(f"{model}, {strategy} {replicas}", _trained(result, graph_def, feeds), want,
                                 RTOL, ATOL)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_replicas_own_positions_would_be_caught(model):
    """The control: with ``"product_head": {}`` each replica takes positions in its own
    shard; the note names the op, and the loss differs, so the tests above can fail."""
    build, batches, op = MODELS[model]
    graph_def, feeds = build(), batches()
    want_losses, _ = _one_device(graph_def, feeds)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.product_head = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    [note] = [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    assert f"'{op}'" in note and "rows taken by their position in the batch" in note
    losses, _ = _trained(result, graph_def, feeds)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 1e-3, (losses, want_losses)


def _gathering(axis, indices="constant"):
    """An MLP whose loss reads the rows (axis 0) or the features (axis 1) a gather takes,
    by constant indices or by indices from the batch's count of rows (every other row).
    Returns the GraphDef."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 4], initializer=tf1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)
        picked = [0, 1] if indices == "constant" else tf.range(0, tf.shape(h)[axis], 2)
        taken = tf.gather(h, picked, axis=axis, name="taken")
        loss = tf.reduce_mean(tf.square(taken), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


@pytest.mark.parametrize("indices", ["constant", "from_the_count"])
def test_rows_a_gather_takes_by_position_are_noted(indices):
    """``tf.gather(h, [0, 1])`` (or every other row, ``tf.range(0, n, 2)``) takes rows by
    their position: before, each replica took its own shard's rows 0 and 1, silently
    (0.26 from one device in the loss after three steps at 2 replicas). The head cannot
    be computed (the gather's gradient is sparse, its indices read by the rows'
    backward), so the plan's notes name the gather; a gather by indices the batch's
    values decide (a top_k) is a ranking, not this."""
    result = gr.rewrite(_gathering(0, indices), devices_per_worker=2, device_type="CPU")
    notes = [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    assert notes and "'taken'" in notes[0], result.plan.notes


def test_features_a_gather_takes_train_as_one_device():
    """The control: a gather along the features (axis 1) takes no rows: no note, and 2
    replicas train as one device."""
    graph_def = _gathering(1)
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(8, 4).astype(np.float32)} for _ in range(3)]
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)], result.plan.notes
    harness.assert_trained_alike("features", harness.trained_rewritten(result, graph_def, feeds),
                                 harness.trained_on_one_device(graph_def, feeds), RTOL, ATOL)
