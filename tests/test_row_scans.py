"""Running sums along the batch's rows and the index of the hardest row
(tf1_scripts.cox_survival_mlp, hardest_row_mlp).

DeepSurv's Cox partial likelihood sums each row's risk set with a running sum over the
rows sorted by time, ``log(cumsum(exp(risk)))`` or ``tf.math.cumulative_logsumexp(risk)``.
A replica's running sum over its shard misses the rows of the shards before it: with the
batch sorted by the input pipeline, 2 replicas trained 0.82 away from one device in the
loss (1.2 at 4) with no note, since a Cumsum was no op that moves or ranks rows, and
training only goes through its backward (a running sum of the gradient, which reads
none of its values; "linear": only that). A running sum along the rows is now a ranking: the product head
computes it, and what follows it up to the loss, over every replica's rows in one
device's order, and R replicas train as one device. Hard example mining's
``losses[argmax(losses)]`` (5.9 in the loss at 2 replicas, no note) is noted: the index
holds no rows, so neither a head nor a row move computes it.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (cox_survival_batches, cox_survival_mlp, dropout_batches,
                                                hardest_row_mlp)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
SCANS = {"pipeline": "Cumsum", "stable": "CumulativeLogsumexp", "graph": "argsort/TopKV2", "linear": "Cumsum"}
KINDS = ["pipeline", "stable", "graph", "linear", "feature_axis"]


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


def _feeds(kind):
    return cox_survival_batches(STEPS, BATCH, sort=kind != "graph")


@pytest.mark.parametrize("kind", KINDS)
def test_the_analysis_ranks_a_running_sum_along_the_rows(kind):
    found = analyze(graph_io.load_graph(cox_survival_mlp(kind)))
    want = [SCANS[kind]] if kind in SCANS else []
    assert found.moved_rows == found.ranked_rows == want
    assert (found.product_head is not None and found.product_head.head[0] == want[0]) if want else \
        found.product_head is None


def test_the_hardest_row_is_noted_not_computed():
    found = analyze(graph_io.load_graph(hardest_row_mlp()))
    assert found.moved_rows == ["ArgMax"] and found.ranked_rows == [] and found.product_head is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 4)])
def test_the_cox_loss_trains_as_one_device(kind, strategy, replicas):
    graph_def, feeds = cox_survival_mlp(kind), _feeds(kind)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not _notes(result)
    harness.assert_trained_alike(f"{kind} {strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds),
                                 want, RTOL, ATOL)


def test_without_the_head_the_running_sum_is_noted_and_differs():
    """The control: with ``"product_head": {}`` each replica sums its own shard's rows."""
    graph_def, feeds = cox_survival_mlp("pipeline"), _feeds("pipeline")
    want = harness.trained_on_one_device(graph_def, feeds)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.product_head = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    [note] = _notes(result)
    assert "'Cumsum'" in note
    got = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 0.1


@pytest.mark.parametrize("replicas", [2, 4])
def test_the_hardest_row_is_noted_and_the_step_differs(replicas):
    graph_def, feeds = hardest_row_mlp(), dropout_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU")
    [note] = _notes(result)
    assert "'ArgMax'" in note and "rows moved or ranked" in note
    got = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 0.1


@pytest.mark.slow
def test_two_workers_sum_the_risk_sets_as_one_device(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, all-reduce: the head gathers both workers' rows."""
    graph_def, feeds = cox_survival_mlp("pipeline"), _feeds("pipeline")
    _, want = harness.trained_on_one_device(graph_def, feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "allreduce", STEPS, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
