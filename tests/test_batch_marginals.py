"""Statistics of the batch's class assignments (graph_rewriter.testing.tf1_scripts.
batch_assignments): SwAV's Sinkhorn-Knopp equipartition, which normalises the transposed
[classes, rows] matrix of the batch's scores over its rows and over its classes, three
times, an information-maximising loss's entropy of the batch's mean prediction, and a
log partition over the batch's rows (tf.reduce_logsumexp, whose Max has no gradient:
synced as the replicas' maximum).

One device normalises over the whole batch's rows; a replica over its own. Before, the
Sinkhorn's sums over axis 1 of the transposed matrix were not found (the strict row walk
stops at the transpose, and the graph did not tell the rank of a value divided by
``tf.shape(q)[1]``): 0.034 from one device in the loss at 2 replicas, 0.091 at 4, no note,
also with sync_batch_statistics. Now the analysis follows the rows through the transpose
and the element-wise steps (row_axes.rows_axis), lists the sums over them, the plan notes
them by default, and the option sums them over the replicas.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import batch_assignments, assignment_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-5, 1e-6
STATISTICS = {"sinkhorn": ["Sum", "Sum_1", "Sum_3", "Sum_5"], "marginal": ["Mean"],
              "logsumexp": ["ReduceLogSumExp/Max", "ReduceLogSumExp/Sum"]}


def _one_device(kind, feeds):
    graph_def = batch_assignments(kind)
    with harness.one_device_session(graph_def) as sess:
        return harness.train_and_read(sess, graph_def, feeds)


@pytest.mark.parametrize("kind", sorted(STATISTICS))
def test_the_analysis_lists_the_sums_over_the_rows_not_over_the_classes(kind):
    """The Sinkhorn's total and its sums over axis 1 (the rows, transposed), not its
    sums over axis 0 (each row's classes)."""
    found = analyze(graph_io.load_graph(batch_assignments(kind)))
    assert found.batch_statistics == STATISTICS[kind]


@pytest.mark.parametrize("kind", sorted(STATISTICS))
def test_by_default_the_plan_notes_them_and_the_step_differs(kind):
    """The control: without the option each replica normalises over its own rows."""
    feeds = assignment_batches(STEPS, BATCH)
    want_losses, _ = _one_device(kind, feeds)
    result = gr.rewrite(batch_assignments(kind), devices_per_worker=2, device_type="CPU")
    assert any(STATISTICS[kind][-1] in note for note in result.plan.notes), result.plan.notes
    with gr.Session(result) as sess:
        losses, _ = harness.train_and_read(sess, batch_assignments(kind), feeds)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 5e-3


@pytest.mark.parametrize("kind", sorted(STATISTICS))
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_synced_they_train_as_one_device(kind, strategy, replicas):
    feeds = assignment_batches(STEPS, BATCH)
    graph_def = batch_assignments(kind)
    want = _one_device(kind, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy,
                        sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == STATISTICS[kind]
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, feeds)
    harness.assert_trained_alike(f"{kind}, {strategy}, {replicas}", got, want, RTOL, ATOL)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half."""
    feeds = assignment_batches(STEPS, BATCH)
    _, want = _one_device("sinkhorn", feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, batch_assignments("sinkhorn"), "allreduce", STEPS, feeds,
                                   options={"sync_batch_statistics": True})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
