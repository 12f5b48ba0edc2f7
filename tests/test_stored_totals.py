"""Sums over the batch's rows that a step stores, in forms other than tf.reduce_sum.

A non-trainable variable a step adds a sum of the batch's rows to is summed over the
replicas ("combine": "sum"), so R replicas store what one device stores
(docs/semantics.md, "Sums and counts are summed"). Only tf.reduce_sum, tf.size and
tf.shape counted as sums: a matrix product contracting the rows, the rows summed by
their ids, a bincount and a confusion matrix were averaged, so the stored totals were
1/R of one device's with no note: 5.1 from one device in a total of three steps at 2
replicas, and tf.compat.v1.metrics.mean_iou's running confusion matrix 2 (half its
counts). VQ-VAE's codebook, which sonnet's VectorQuantizerEMA learns from the moving
averages of the codes' counts and the rows summed per code (their ratio), then trained
2.2 from one device in the loss at 2 replicas (with or without sync_batch_statistics).
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (
    STORED_TOTALS, labelled_batches, stored_totals_classifier, vq_batches, vq_vae_ema)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 3, 8
STORE = {"mean_iou": "mean_iou/total_confusion_matrix"}
STRATEGIES = [("allreduce", 2, {}), ("allreduce", 4, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
              ("ps", 2, {}), ("ps", 4, {}), ("hybrid", 2, {})]
IDS = ["allreduce2", "allreduce4", "reduce_to_one", "ps2", "ps4", "hybrid2"]


def _state_cuts(graph_def):
    return {c.variable: c for c in analyze(graph_io.load_graph(graph_def)).cuts if c.role == "state"}


@pytest.mark.parametrize("total", STORED_TOTALS)
def test_the_stored_total_is_summed_over_the_replicas(total):
    cuts = _state_cuts(stored_totals_classifier(total))
    assert cuts[STORE.get(total, "total")].combine == "sum"


def test_an_outer_product_of_means_is_averaged_not_summed():
    """A product contracting the first axis of two means over the rows ([1, 4] each) is
    no sum over the rows: it is averaged, noted as a statistic over the rows, and with
    sync_batch_statistics (the means one device's on every replica) R replicas store
    one device's product."""
    graph_def, feeds = stored_totals_classifier("mean_outer"), labelled_batches(STEPS, BATCH)
    assert _state_cuts(graph_def)["total"].combine is None
    assert [n for n in gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan.notes
            if "meet other rows" in n]
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=True)
    harness.assert_trained_alike("mean_outer", harness.trained_rewritten(result, graph_def, feeds), want,
                                 rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy, replicas, options", STRATEGIES, ids=IDS)
def test_a_moving_mean_broadcast_into_its_variable_travels_in_its_own_shape(strategy, replicas, options):
    """``total.assign(0.9 * total + 0.1 * tf.reduce_mean(x, 0))`` with ``total`` [1, 4]:
    the update's value is the [4] mean, which the cut's plan now carries (shape
    inference, where its rank is not the variable's). Before, it travelled as [1, 4]: a
    parameter server's accumulator refused it at run time ("Shape mismatch: expected
    [1,4], got [4]"), and under allreduce it was reshaped, right only because the sizes
    agree."""
    graph_def, feeds = stored_totals_classifier("broadcast_mean"), labelled_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **options)
    assert result.plan.cut("total").shape == [4]
    harness.assert_trained_alike(strategy, harness.trained_rewritten(result, graph_def, feeds), want,
                                 rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero_debias, stores", [
    (False, ("vq/ema_cluster_size", "vq/ema_dw")),
    (True, ("vq/ema_cluster_size/biased", "vq/ema_dw/biased"))], ids=["biased", "zero_debias"])
def test_the_vq_vae_codebooks_sums_are_summed(zero_debias, stores):
    """Both moving averages move towards sums over the rows: the codes' counts and the
    rows summed per code, a product contracting the rows (with zero_debias, the update
    stores them in the biased averages; the debiased ones are computed from those)."""
    cuts = _state_cuts(vq_vae_ema(zero_debias))
    assert {name: c.combine for name, c in cuts.items()} == dict.fromkeys(stores, "sum")


@pytest.mark.parametrize("total", STORED_TOTALS)
@pytest.mark.parametrize("strategy, replicas, options", STRATEGIES, ids=IDS)
def test_replicas_store_one_devices_total(total, strategy, replicas, options):
    """Nothing is noted either: a transpose of a sum is stored linearly."""
    graph_def, feeds = stored_totals_classifier(total), labelled_batches(STEPS, BATCH)
    want_losses, want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **options)
    assert not [n for n in result.plan.notes or [] if "meet other rows" in n], result.plan.notes
    losses, got = harness.trained_rewritten(result, graph_def, feeds)
    store = STORE.get(total, "total")
    assert np.max(want[store]) >= 2   # (counted rows: averaged, 1/R of these would fail)
    harness.assert_trained_alike(total, (losses, got), (want_losses, want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_debias", [True, False], ids=["zero_debias", "biased"])
@pytest.mark.parametrize("strategy, replicas, options", STRATEGIES, ids=IDS)
def test_a_vq_vae_codebook_learns_as_on_one_device(zero_debias, strategy, replicas, options):
    """The codebook is the ratio of the two moving averages: one device's only if both
    sums are summed. Nothing is noted: the sums are stored linearly, and what divides
    them reads the stored, summed, averages."""
    graph_def, feeds = vq_vae_ema(zero_debias), vq_batches(4, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **options)
    assert not [n for n in result.plan.notes or [] if "meet other rows" in n], result.plan.notes
    got = harness.trained_rewritten(result, graph_def, feeds)
    harness.assert_trained_alike("vq_vae", got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_workers_learn_the_codebook_as_one_device(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica: the sums travel as a sum between the workers."""
    graph_def, feeds = vq_vae_ema(), vq_batches(STEPS, BATCH)
    _, want = harness.trained_on_one_device(graph_def, feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "allreduce", STEPS, feeds)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
