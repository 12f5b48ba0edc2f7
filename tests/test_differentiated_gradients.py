"""Gradients the step differentiates again
(graph_rewriter.testing.tf1_scripts.differentiated_gradient_mlp).

A weight's gradient of the batch's mean loss is a sum over the rows; the rewrite
averages it where it reaches the update. When the step computes a loss from it instead
(GradNorm's norms of the tasks' gradients, which train the task weights) or steps
weights by it before an outer loss (MAML's inner step on the whole batch), each replica
uses its own rows' gradient, whose norm or step is not one device's, and no average of
the results makes it so: 0.12 in the loss after four steps at 2 replicas for MAML on the
batch, silently, and GradNorm was silent with ``sync_batch_statistics`` (0.0037 in the
loss, 0.51 in the variables). The plan now notes such gradients (analysis
_find_regradients), with or without the option. Per-row gradients stay one device's:
MAML per task (``tf.map_fn`` over the rows) and a gradient penalty on the inputs. The
penalty taken of ``tf.reduce_sum(D(x))`` used to be counted a loss summed over the
rows and scaled by R, so the penalty was R^2 times one device's (0.022 in the loss at 2
replicas); a sum whose backward pass computes no gradient the rewrite averages is no
loss sum now.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (PER_ROW_GRADIENT_KINDS, REGRADIENT_KINDS, differentiated_gradient_mlp,
                                               dropout_batches, task_batches)

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
NOTED = "a gradient of the batch's loss that the step differentiates again"


def _feeds(kind):
    return task_batches(STEPS, BATCH) if kind == "maml_tasks" else dropout_batches(STEPS, BATCH)


def _rows_meet(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("sync", [False, True], ids=["plain", "sync_batch_statistics"])
@pytest.mark.parametrize("kind", REGRADIENT_KINDS)
def test_a_gradient_differentiated_again_is_noted(kind, sync):
    graph_def, feeds = differentiated_gradient_mlp(kind), _feeds(kind)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=sync)
    [note] = [n for n in _rows_meet(result) if NOTED in n]
    assert ("Conv2D_grad/Conv2DBackpropFilter'" if kind == "gradnorm_conv" else "MatMul_grad/MatMul_1'") in note
    want = harness.trained_on_one_device(graph_def, feeds)
    got = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 1e-4   # (the note is due)
    assert not [n for n in _rows_meet(gr.rewrite(graph_def, devices_per_worker=1, device_type="CPU"))]


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
@pytest.mark.parametrize("kind", PER_ROW_GRADIENT_KINDS)
def test_per_row_gradients_train_as_one_device(kind, strategy, replicas):
    graph_def, feeds = differentiated_gradient_mlp(kind), _feeds(kind)
    want = harness.trained_on_one_device(graph_def, feeds)
    assert want[1]
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not _rows_meet(result)
    got = harness.trained_rewritten(result, graph_def, feeds)
    harness.assert_trained_alike(f"{kind} {strategy} {replicas}", got, want, RTOL, ATOL)


def test_a_sum_taken_only_for_an_input_gradient_is_no_loss_sum():
    """The penalty's ``tf.reduce_sum(D(x))`` is differentiated with respect to x alone:
    its backward pass computes no weight's gradient, so it is not scaled by R."""
    result = gr.rewrite(differentiated_gradient_mlp("input_penalty_sum"), devices_per_worker=2, device_type="CPU")
    assert not result.plan.loss_sums
