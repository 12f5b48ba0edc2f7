"""Self-paced learning: each step trains on the rows whose loss is below the batch's mean
loss, ``sum(loss_i * keep) / max(sum(keep), 1)`` (tf1_scripts.self_paced_mlp).

The threshold, the batch's mean loss, is a statistic over the rows: noted by default,
synced with sync_batch_statistics. The count of the kept rows divides the loss, but the
normalizers' rule wanted a divisor computed from no trainable variable, and this one
is (through the comparison, which no gradient goes through): it was a statistic, synced
under the option, and each replica divided its own sum by one device's count, so the
replicas' mean gradient was 1/R of one device's, with no note (0.39 in the loss after
four steps at 2 replicas, 0.59 at 4 under ps). A divisor that depends on trainable
variables only through ops no gradient goes through is now a normalizer, and with the
option R replicas train as one device. The normalizers pass also removes the replica's
own clamp of the count once nothing reads it: left in the graph, it read the synced
threshold's collective in one replica only, and the verifier refused the graph.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, self_paced_mlp

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6


def test_the_count_of_kept_rows_is_a_normalizer_and_the_threshold_a_statistic():
    found = analyze(graph_io.load_graph(self_paced_mlp()))
    assert [t.name for t in found.normalizers] == ["Maximum:0"] and found.batch_statistics == ["Mean"]


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("ps", 4),
                                                ("hybrid", 4)])
def test_with_synced_statistics_it_trains_as_one_device(strategy, replicas):
    graph_def, feeds = self_paced_mlp(), dropout_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy,
                        sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == ["Mean"] and result.plan.normalizers == ["Maximum:0"]
    harness.assert_trained_alike(f"{strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds), want,
                                 RTOL, ATOL)


def test_without_the_option_the_threshold_is_noted_and_the_step_differs():
    graph_def, feeds = self_paced_mlp(), dropout_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    [note] = [n for n in result.plan.notes if n.startswith(ROWS_MEET_START)]
    assert "in 'Mean' (statistics over the batch's rows that training uses" in note
    got = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 0.05


def test_the_replicas_own_clamp_of_the_count_is_removed():
    result = gr.rewrite(self_paced_mlp(), devices_per_worker=2, device_type="CPU", sync_batch_statistics=True)
    names = {n.name for n in result.graph_def.node}
    assert "Maximum" not in names and "replica_1/Maximum" not in names
    assert {"Maximum/every_replica", "replica_1/Maximum/every_replica"} <= names
