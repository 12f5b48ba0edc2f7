"""Counts of the batch's labels per class in the loss (graph_rewriter.testing.tf1_scripts.
class_balanced_classifier): a class-balanced loss weights each row by the inverse of its
label's count in the batch.

One device counts the whole batch's labels; a replica counts its own shard's, so its
weights are not one device's, and nothing in the loss says so: before the analysis
knew these counts, a segment sum and tf.unique_with_counts trained 0.42 from one device
at 2 replicas (0.79 at 4) with no note, and the weighted sum was not found as a loss sum
either (tf.gather's rank was unknown). Now every form is a batch statistic: noted by
default, and with sync_batch_statistics the counts of a fixed number of classes are
summed over the replicas (passes/batch_statistics.py), so R replicas train as one device.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import class_balanced_classifier, center_loss_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
STATISTIC = {"one_hot": "Sum", "segment_sum": "UnsortedSegmentSum", "bincount": "bincount/DenseBincount",
             "bincount_open": "bincount/DenseBincount", "unique": "UniqueWithCounts"}
SYNCED = ("one_hot", "segment_sum", "bincount")
READS = ("w1", "w2")


def _one_device(counts, feeds):
    graph_def = class_balanced_classifier(counts)
    with harness.one_device_session(graph_def) as sess:
        return harness.train_and_read(sess, graph_def, feeds)


def _rewritten(counts, feeds, **options):
    graph_def = class_balanced_classifier(counts)
    result = gr.rewrite(graph_def, device_type="CPU", **options)
    with gr.Session(result) as sess:
        return result, harness.train_and_read(sess, graph_def, feeds)


@pytest.mark.parametrize("counts", sorted(STATISTIC))
def test_the_analysis_lists_the_counts_and_the_weighted_sum(counts):
    """The counts are the batch statistic (not tf.math.bincount's max(labels) + 1 where
    minlength = maxlength fixes the size), and the weighted sum over the rows is a loss
    sum: its rank is read through tf.gather, tf.one_hot and the segment sum."""
    found = analyze(graph_io.load_graph(class_balanced_classifier(counts)))
    expected = [STATISTIC[counts]] if counts != "bincount_open" else ["bincount/Max", STATISTIC[counts]]
    assert found.batch_statistics == expected
    assert len(found.loss_sums) == 1


@pytest.mark.parametrize("counts", sorted(STATISTIC))
def test_by_default_the_plan_notes_the_counts_per_replica(counts):
    """Not silent: the counts stay the replica's (the control below), and the plan says so."""
    result = gr.rewrite(class_balanced_classifier(counts), devices_per_worker=2, device_type="CPU")
    assert any(STATISTIC[counts] in note and "meet other rows" in note for note in result.plan.notes), \
        result.plan.notes


def test_the_replicas_own_counts_are_not_one_devices():
    """The control: without the option, 2 replicas' weights are their shards' (the loss
    and the weights differ from one device's by far more than rounding)."""
    feeds = center_loss_batches(STEPS, BATCH)
    want_losses, want = _one_device("segment_sum", feeds)
    _, (losses, got) = _rewritten("segment_sum", feeds, devices_per_worker=2)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 0.1
    assert max(np.max(np.abs(got[n] - want[n])) for n in READS) > 1e-2


@pytest.mark.parametrize("counts", SYNCED)
@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 2, {}), ("allreduce", 4, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("ps", 2, {}), ("hybrid", 2, {})], ids=["allreduce2", "allreduce4", "reduce_to_one", "ps2", "hybrid2"])
def test_synced_counts_train_as_one_device(counts, strategy, replicas, options):
    feeds = center_loss_batches(STEPS, BATCH)
    want_losses, want = _one_device(counts, feeds)
    result, (losses, got) = _rewritten(counts, feeds, devices_per_worker=replicas, strategy=strategy,
                                       sync_batch_statistics=True, **options)
    assert result.plan.sync_batch_statistics == [STATISTIC[counts]]
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in READS:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{counts}: {name}")


@pytest.mark.parametrize("counts, why", [
    ("unique", "counts the unique values of the replica's rows"),
    ("bincount_open", "'bincount/DenseBincount' cannot be synchronised: its size")])
def test_counts_of_no_fixed_shape_are_refused_under_the_option(counts, why):
    """Their shape depends on the replica's values (a count per unique label; a
    bincount sized by the shard's largest label, a Max with no gradient, which is
    synced, but the bincount's size is not read from it): the replicas' could not be
    summed."""
    with pytest.raises(gr.GraphRewriteError, match="sync_batch_statistics") as error:
        gr.rewrite(class_balanced_classifier(counts), devices_per_worker=2, device_type="CPU",
                   sync_batch_statistics=True)
    assert why in str(error.value)


def test_an_open_bincount_alone_is_refused_for_its_size():
    with pytest.raises(gr.GraphRewriteError, match="its size .* is computed from the batch"):
        gr.rewrite(class_balanced_classifier("bincount_open"), devices_per_worker=2, device_type="CPU",
                   sync_batch_statistics=["bincount/DenseBincount"])


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half."""
    feeds = center_loss_batches(STEPS, BATCH)
    _, want = _one_device("segment_sum", feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, class_balanced_classifier("segment_sum"), "allreduce",
                                   STEPS, feeds, options={"sync_batch_statistics": True})
    for name in READS:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
