"""Quantization-aware training's moving ranges (graph_rewriter.testing.tf1_scripts.
quantized_mlp), as tf.contrib.quantize's create_training_graph builds them: each step
takes the batch's minimum and maximum of a layer's activations, moves a non-trainable
range towards them, and fake-quantises the activations to the updated range.

A replica's minimum and maximum are its shard's, and the rewrite averaged the replicas'
moves of the range: the average of their maxima is not the batch's maximum. With ref
variables the fake quantisation reads the assign's output, so the gradients read the
Max and the analysis listed it as a batch statistic (noted). With resource variables
(Keras', and tf.compat.v1's under TF2 behaviour) it reads the variable after the
update, through a control edge alone: the Max reached no gradient's value, was not
listed, and the ranges and the step differed from one device's with no note (0.015 in
the loss and 0.12 in act/max after five steps at 2 replicas). A Max or Min over the
rows that a state update stores is now a batch statistic: noted by default, and with
sync_batch_statistics the replicas take every replica's extreme, one device's.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, quantized_mlp

STEPS, BATCH = 5, 8
RTOL, ATOL = 1e-5, 1e-6
EXTREMES = ["act/Min_1", "act/Max_1"]
RANGES = ["act/min", "act/max"]
STORED = "statistics over the batch's rows that a state update stores"
USED = "statistics over the batch's rows that training uses"
FORMS = {"resource": {}, "ref": {"resource": False}, "per_channel": {"per_channel": True},
         "delay": {"delay": True}}


def _run(sess, graph_def, feeds):
    """([loss per step], {variable: value}): ref variables' ranges (which have no
    resource reads) fetched by their variables' tensors."""
    sess.run("init")
    losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
    reads = harness.resource_reads(graph_def)
    return losses, sess.run({**{name: f"{name}:0" for name in RANGES}, **reads})


def _one_device(graph_def, feeds):
    with harness.one_device_session(graph_def) as sess:
        return _run(sess, graph_def, feeds)


def _rewritten(graph_def, feeds, **options):
    result = gr.rewrite(graph_def, device_type="CPU", **options)
    with gr.Session(result) as sess:
        return result, _run(sess, graph_def, feeds)


def _notes(result, text):
    return [n for n in result.plan.notes or [] if text in n]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_analysis_lists_the_stored_extremes(form):
    """Resource variables: only the update stores them (the gradients read the range
    through a control edge); ref variables: the gradients read the assign's output."""
    found = analyze(graph_io.load_graph(quantized_mlp(**FORMS[form])))
    assert found.batch_statistics == EXTREMES
    assert found.stored_statistics == ([] if form == "ref" else EXTREMES)
    assert sorted(c.variable for c in found.cuts if c.role == "state") == ["act/max", "act/min"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_by_default_the_ranges_are_noted_and_differ(form):
    """Not silent, and the control: the tests below could fail."""
    graph_def = quantized_mlp(**FORMS[form])
    feeds = dropout_batches(STEPS, BATCH)
    _, want = _one_device(graph_def, feeds)
    result, (_, got) = _rewritten(graph_def, feeds, devices_per_worker=2)
    text = USED if form == "ref" else STORED
    assert len(_notes(result, text)) == 1 and "'act/Min_1', 'act/Max_1'" in _notes(result, text)[0]
    assert np.max(np.abs(got["act/max"] - want["act/max"])) > 1e-2


@pytest.mark.parametrize("form", sorted(FORMS))
def test_synced_extremes_train_as_one_device(form):
    graph_def = quantized_mlp(**FORMS[form])
    feeds = dropout_batches(STEPS, BATCH)
    want = _one_device(graph_def, feeds)
    result, got = _rewritten(graph_def, feeds, devices_per_worker=2, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == EXTREMES and not result.plan.notes
    harness.assert_trained_alike(form, got, want, RTOL, ATOL)


@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 4, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("ps", 2, {}), ("ps", 4, {}), ("hybrid", 2, {})],
    ids=["allreduce4", "reduce_to_one", "ps2", "ps4", "hybrid2"])
def test_other_strategies_sync_the_extremes_as_one_device(strategy, replicas, options):
    graph_def = quantized_mlp()
    feeds = dropout_batches(STEPS, BATCH)
    want = _one_device(graph_def, feeds)
    _, got = _rewritten(graph_def, feeds, devices_per_worker=replicas, strategy=strategy,
                        sync_batch_statistics=True, **options)
    harness.assert_trained_alike(f"{strategy} {replicas}", got, want, RTOL, ATOL)


def test_the_weights_own_range_is_not_a_batch_statistic():
    """The weights' min and max (the "Min" and "Max" of w1) are the same on every
    replica: not listed."""
    found = analyze(graph_io.load_graph(quantized_mlp()))
    assert "Min" not in found.batch_statistics and "Max" not in found.batch_statistics
