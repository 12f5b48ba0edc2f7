"""Rows taken by position whose values no gradient reads, only differentiated through.

DP-SGD (tensorflow_privacy's DPGradientDescentOptimizer, not vectorised) groups the
per-example losses into microbatches by position, ``tf.reshape(losses, [M, -1])``,
differentiates each microbatch's mean loss alone, clips its gradient and sums them. A
loss on the first rows' losses, ``reduce_mean(losses[:4])``, or on the halves' by
``tf.split``, is alike. The backward of a reshape, a slice or a split reads only the
op's shape, so the op was no ancestor of any gradient's value, and the analysis, which
looked for those, missed it: each replica grouped or took its own shard's rows, and
the step differed from one device's with no note (0.015 in the loss after four steps
of DP-SGD at 2 replicas, 1.35 with the first rows' mean, 0.40 with the halves). Such
an op now counts where the gradients go through its backward, and is noted. It does
not start a product head: the head hands each replica the gradient of its own rows'
share, and DP-SGD clips each microbatch's whole gradient (tried: 0.017 from one device
with no note).
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dp_sgd_mlp, dropout_batches, positioned_loss_mlp

STEPS, BATCH = 4, 16   # (4 replicas x 4 rows: each reshapes its own into 4 microbatches)
POSITIONED = "rows taken by their position in the batch"
# the graphs and the op that takes rows by position
MODELS = {
    "dp_sgd": (lambda: dp_sgd_mlp("unrolled"), "Reshape"),
    "dp_sgd_noised": (lambda: dp_sgd_mlp("unrolled", noise=1.0), "Reshape"),
    "dp_sgd_while": (lambda: dp_sgd_mlp("while"), "Reshape"),
    "first": (lambda: positioned_loss_mlp("first"), "strided_slice"),
    "halves": (lambda: positioned_loss_mlp("halves"), "split"),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_differentiated_op_is_found_and_starts_no_head(model):
    build, op = MODELS[model]
    found = analyze(graph_io.load_graph(build()))
    assert found.positioned_rows == [op]
    assert found.product_head is None


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("ps", 2), ("allreduce", 4)])
def test_each_replicas_positions_are_noted_and_differ(model, strategy, replicas):
    """The note names the op, and the step does differ (the note is no false alarm)."""
    build, op = MODELS[model]
    graph_def, feeds = build(), dropout_batches(STEPS, BATCH)
    want_losses, want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    notes = [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START) and POSITIONED in n]
    assert len(notes) == 1 and f"'{op}'" in notes[0], result.plan.notes
    _, got = harness.trained_rewritten(result, graph_def, feeds)
    assert max(float(np.max(np.abs(got[name] - want[name]))) for name in want) > 1e-3


def test_the_batchs_own_mean_loss_is_not_positioned():
    """The control on the other side: the same network's mean loss over every row, whose
    backward goes through no positional op, is found nothing, and trains as one device."""
    graph_def, feeds = positioned_loss_mlp("mean"), dropout_batches(STEPS, BATCH)
    assert analyze(graph_io.load_graph(graph_def)).positioned_rows == []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not result.plan.notes
    harness.assert_trained_alike("mean", harness.trained_rewritten(result, graph_def, feeds),
                                 harness.trained_on_one_device(graph_def, feeds), 1e-5, 1e-6)
