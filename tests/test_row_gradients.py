"""Gradients with respect to the batch's rows that leave the backward pass
(graph_rewriter.testing.tf1_scripts: kfac_mlp, adversarial_mlp, and
differentiated_gradient_mlp's input penalties).

A replica's loss is the mean over its own N / R rows, so the gradient of a mean with
respect to a row (an input's, a pre-activation's) is R times one device's on every
replica; the averaged weight gradients make up for it, nothing makes up for a per-row
gradient the step uses by its scale. K-FAC's output-gradient factor, the loss's
gradients with respect to a layer's pre-activations times a batch size, is one
device's when that size is the replica's count of rows (``tf.shape(x)[0]``, as
tensorflow/kfac normalises) or when the gradients are those of a sum (its sampled
Fisher), and R times one device's times a constant batch size: before, silently (1.7
in the factor at 2 replicas). So was a gradient penalty on
``tf.gradients(tf.reduce_mean(D(x)), x)`` (0.012 in the loss), and an adversarial
perturbation divided by its norm over the batch. The plan now notes them
(analysis._find_row_gradients); FGSM's sign and a perturbation divided by its own
norm per row (tf.nn.l2_normalize) do not see the scale and train as one device.

K-FAC appends a homogeneous coordinate to each layer's input, ``tf.concat([a,
ones], -1)``. The row walk did not pass a concatenation, so ``a^T a / 8.0`` was no sum
over the rows and was averaged: 1/R of one device's factor. A concatenation along an
axis other than the rows' keeps them.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (ADVERSARIAL_KINDS, ADVERSARIAL_NOTED_KINDS, KFAC_NORMALIZERS,
                                               KFAC_NOTED_NORMALIZERS, SCALED_ROW_GRADIENT_KINDS, adversarial_mlp,
                                               differentiated_gradient_mlp, dropout_batches, kfac_mlp)

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
NOTED = "a gradient with respect to the batch's rows that leaves the backward pass"
RUNS = [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)]
ONE_DEVICE = [(kfac_mlp, k) for k in KFAC_NORMALIZERS] + [(adversarial_mlp, k) for k in ADVERSARIAL_KINDS]
NOTED_STEPS = ([(kfac_mlp, k) for k in KFAC_NOTED_NORMALIZERS] + [(adversarial_mlp, k) for k in ADVERSARIAL_NOTED_KINDS]
               + [(differentiated_gradient_mlp, k) for k in SCALED_ROW_GRADIENT_KINDS])


def _ids(cases):
    return [f"{build.__name__}-{kind}" for build, kind in cases]


def _rows_meet(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("strategy, replicas", RUNS, ids=[f"{s}-{r}" for s, r in RUNS])
@pytest.mark.parametrize("build, kind", ONE_DEVICE, ids=_ids(ONE_DEVICE))
def test_row_gradients_whose_scale_the_step_does_not_see_train_as_one_device(build, kind, strategy, replicas):
    graph_def, feeds = build(kind), dropout_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not _rows_meet(result), _rows_meet(result)
    got = harness.trained_rewritten(result, graph_def, feeds)
    harness.assert_trained_alike(f"{kind} {strategy} {replicas}", got, want, RTOL, ATOL)


@pytest.mark.parametrize("build, kind", NOTED_STEPS, ids=_ids(NOTED_STEPS))
def test_a_row_gradient_the_step_uses_by_its_scale_is_noted(build, kind):
    graph_def, feeds = build(kind), dropout_batches(STEPS, BATCH)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    [note] = [n for n in _rows_meet(result) if NOTED in n]
    assert "gradients/" in note and "2 times one device's" in note
    want = harness.trained_on_one_device(graph_def, feeds)
    got = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 1e-4   # (the note is due)
    assert not _rows_meet(gr.rewrite(graph_def, devices_per_worker=1, device_type="CPU"))


def test_kfac_input_factors_over_a_homogeneous_coordinate_are_sums_over_the_rows():
    """``a^T a`` with a = concat([h, ones], -1) contracts the rows: divided by a
    constant it is summed over the replicas, one device's sum; divided by the
    replica's count the cut is the quotient, a mean, averaged."""
    constant = {c.variable: c for c in gr.rewrite(kfac_mlp("constant"), devices_per_worker=2,
                                                  device_type="CPU").plan.cuts}
    counted = {c.variable: c for c in gr.rewrite(kfac_mlp("count"), devices_per_worker=2,
                                                 device_type="CPU").plan.cuts}
    for layer in ("layer1", "layer2"):
        cut = constant[f"{layer}/input_factor"]
        assert cut.combine == "sum" and cut.values.startswith("MatMul"), (cut.values, cut.combine)
        cut = counted[f"{layer}/input_factor"]
        assert cut.combine is None and cut.values.startswith("truediv"), (cut.values, cut.combine)


def test_a_concatenation_keeps_the_rows_along_a_feature_axis_only():
    """Along axis 1 or -1 of a rank-2 value each output row is one row of every input;
    along axis 0 (nce_loss's labels then sampled ids) the rows are moved, and
    tf.nn.nce_loss' slice of the labels' rows is no slice of the batch's by position."""
    import tensorflow as tf
    from graph_rewriter import analysis, graph_io
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        for name, axis in (("rows", 0), ("features", 1), ("last", -1)):
            tf.concat([x, tf.ones_like(x[:, :1]) if axis else x], axis, name=name)
    item = graph_io.load_graph(g.as_graph_def())
    assert [analysis._concats_features(item.node(n)) for n in ("rows", "features", "last")] == [False, True, True]
