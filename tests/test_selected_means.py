"""A mean over the rows a condition on the batch selects: the loss of the labelled rows.

``tf.reduce_mean(tf.boolean_mask(err, labelled))`` divides the selected rows' sum by the
batch's count of them. Each replica selects from its own shard, and dividing by its own
count then averaging the replicas weighs the shards alike, whatever their counts: 0.125
apart in the loss after three steps of 16 rows at 2 replicas (the opt-out control
below). The normalizers pass scales every replica's mean by its count over the replicas'
mean count, forward and where the gradient enters the mean's backward pass, so R
replicas train as one device (docs/semantics.md, "Gradients"). The network is
``rows_meeting_mlp("labelled_rows")``: the rows with ``x[:, 0] > 0`` (about half).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing.tf1_scripts import dropout_batches, masked_sequence_model, rows_meeting_mlp
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
import test_rows_meeting
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 16
RTOL, ATOL = 1e-5, 1e-6
READS = {"w1": "w1/Read/ReadVariableOp:0", "w2": "w2/Read/ReadVariableOp:0"}
MEAN = "loss_of_labelled"


def _train(session, feeds):
    return test_rows_meeting._train(session, feeds, READS)


def _one_device(graph_def, feeds):
    return test_rows_meeting._one_device(graph_def, feeds, READS)


def _assert_one_device(result, graph_def, feeds):
    want, got = _one_device(graph_def, feeds), _train(gr.Session(result), feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in READS:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("kind", ["labelled_rows", "partitioned_rows"])
@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 2, {}), ("ps", 2, {}), ("hybrid", 2, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("allreduce", 4, {}), ("ps", 4, {}), ("allreduce", 4, {"materialize_replicas": True})],
    ids=["allreduce", "ps", "hybrid", "reduce_to_one", "allreduce-4", "ps-4", "allreduce-4-built"])
def test_replicas_train_as_one_device(kind, strategy, replicas, options):
    graph_def, feeds = rows_meeting_mlp(kind), dropout_batches(STEPS, BATCH)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **options)
    assert result.plan.selected_means == [MEAN] and not _notes(result)
    _assert_one_device(result, graph_def, feeds)


def test_a_replica_that_selects_no_row_adds_nothing():
    """Replica 1's half of every batch has no labelled row: its mean is NaN (0/0), its
    share zero, and the step is still one device's (not NaN)."""
    feeds = dropout_batches(STEPS, BATCH)
    for feed in feeds:
        feed["x:0"][BATCH // 2:, 0] = -np.abs(feed["x:0"][BATCH // 2:, 0]) - 0.1
        feed["x:0"][:BATCH // 2, 0] = np.abs(feed["x:0"][:BATCH // 2, 0]) + 0.1
    graph_def = rows_meeting_mlp("labelled_rows")
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    _assert_one_device(result, graph_def, feeds)


def test_the_opt_out_control_differs_and_names_the_mean():
    """A given plan with "selected_means": [] leaves every replica dividing by its own
    count: the step differs from one device's, and the note says so."""
    graph_def, feeds = rows_meeting_mlp("labelled_rows"), dropout_batches(STEPS, BATCH)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.selected_means = []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    assert result.plan.selected_means == []
    [note] = _notes(result)
    assert f"'{MEAN}'" in note and "a mean over the rows a condition on the batch selects" in note
    want, got = _one_device(graph_def, feeds), _train(gr.Session(result), feeds)
    assert np.max(np.abs(got[0] - want[0])) > 0.05


def test_a_given_plan_naming_another_mean_is_refused():
    graph_def = rows_meeting_mlp("labelled_rows")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.selected_means = ["Mean_7"]
    with pytest.raises(gr.GraphRewriteError, match="selected_means names 'Mean_7'.*found: loss_of_labelled"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


def test_structure_on_gpus():
    """Every replica: the mean renamed <name>/replica_rows, a MulNoNan by the factor
    taking the mean's name, the count reduced in the normalizers' group, the gradient
    entry scaled; every new node on its replica's GPU."""
    result = gr.rewrite(rows_meeting_mlp("labelled_rows"), PS2_WORKERS2, devices_per_worker=2)
    nodes = {n.name: n for n in result.graph_def.node}
    for prefix, device in (("", "/job:worker/replica:0/task:0/device:GPU:0"),
                           ("replica_3/", "/job:worker/replica:0/task:1/device:GPU:1")):
        scaled = nodes[prefix + MEAN]
        assert scaled.op == "MulNoNan" and scaled.input[0] == f"{prefix}{MEAN}/replica_rows"
        assert nodes[f"{prefix}{MEAN}/replica_rows"].op == "Mean"
        factor = nodes[scaled.input[1]]
        assert factor.op == "RealDiv" and nodes[factor.input[1].split(":")[0]].op == "CollectiveReduceV2"
        assert {scaled.device, factor.device} == {device}
        entries = [n for n in nodes.values() if n.name.startswith(prefix + "gradients/")
                   and n.op == "Mul" and scaled.input[1] in n.input]
        assert len(entries) == 1 and "loss_of_labelled_grad" in entries[0].name
    # only the scaled value and the Mean's shape-readers read the renamed mean
    readers = {n.op for n in nodes.values() if f"{MEAN}/replica_rows" in n.input}
    assert readers <= {"MulNoNan", "Shape"}


def test_a_parameter_server_plan_across_machines_leaves_it_and_says_so():
    result = gr.rewrite(rows_meeting_mlp("labelled_rows"), PS2_WORKERS2, task="worker:1", strategy="ps",
                        device_type="CPU")
    assert result.plan.selected_means is None
    [note] = _notes(result)
    assert f"'{MEAN}'" in note
    assert not [n for n in result.graph_def.node if n.op == "MulNoNan"]


def test_inspect_lists_the_means():
    from graph_rewriter.inspect_report import format_report, report
    text = format_report(report(gr.rewrite(rows_meeting_mlp("labelled_rows"), devices_per_worker=2,
                                           device_type="CPU")))
    assert f"means over selected rows (each divides by the replicas' mean count of selected rows): {MEAN}" in text


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph allreduce, 2 workers x 1 replica, each its own client fed its half
    of every batch."""
    graph_def, feeds = rows_meeting_mlp("labelled_rows"), dropout_batches(STEPS, BATCH)
    _, want = _one_device(graph_def, feeds)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, READS.values(), feeds)
    for name, tensor in READS.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("graph_def, names", [
    (lambda: rows_meeting_mlp("labelled_rows"), f"'{MEAN}'"),
    (lambda: masked_sequence_model("masked"), "'Sum_1:0'")], ids=["selected_mean", "normalizer"])
def test_micro_batches_divide_by_their_own_counts_and_the_plan_says_so(graph_def, names):
    """With accumulation_steps 2 each micro-batch divides by its own count, and the note
    says so, with 1 replica too; without accumulation there is no such note."""
    from graph_rewriter.planner import MICRO_BATCH_COUNTS_START
    for replicas, k in ((2, 2), (1, 2), (2, 1)):
        result = gr.rewrite(graph_def(), devices_per_worker=replicas, device_type="CPU", accumulation_steps=k)
        notes = [n for n in result.plan.notes or [] if n.startswith(MICRO_BATCH_COUNTS_START)]
        assert len(notes) == (k > 1) and all(names in n and "each micro-batch's count" in n for n in notes)


@pytest.mark.parametrize("kind, differs", [("labelled_rows", True), ("plain", False)])
def test_the_micro_batch_note_is_true(kind, differs):
    """Two runs of 8 rows with accumulation_steps 2 against one step of the 16 rows: the
    mean over selected rows differs (the halves select different counts); the plain
    mean loss, the control, is one device's step."""
    feed = dropout_batches(1, BATCH)[0]
    halves = [{k: v[h * BATCH // 2:(h + 1) * BATCH // 2] for k, v in feed.items()} for h in range(2)]
    graph_def = rows_meeting_mlp(kind)
    want = _one_device(graph_def, [feed])[1]
    got = _train(gr.Session(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", accumulation_steps=2)),
                 halves)[1]
    gap = max(np.max(np.abs(got[n] - want[n])) for n in READS)
    assert gap > 1e-3 if differs else gap < 1e-6, gap
