"""One variable updated by two applications of a layer: a BatchNorm's moving averages.

A GAN's discriminator applied to real and fake images, and a tf_keras functional model
built on its own Input and then called on a tensor, both leave a BatchNorm's moving
averages with two updates in the graph (two state cuts of one variable). Keyed by
variable, the plan packed the second update in place of the first, whose readers were
left without their mean: the rewrite failed its own verification ("running
'allreduce/pack_0/d/bn/moving_mean/mean' runs collective ... but not its copy"), under
every strategy. Each later update now has a name of its own in the plan
("<variable>/update_<k>", what packs and accumulators list) and its own train ops, so
the Keras model's first-call update (which reads the model's Input placeholder) is not
packed with the train op's.

The discriminator's second application waits for the first's updates (a control
dependency, as a script orders the two updates of one moving average). With synchronised
statistics its fused BatchNorm, replaced by ops, left its read of the moving mean (which a
FusedBatchNorm in training mode ignores) unread but with that control input: a root that
ran replica 0's synced update alone, and the rewrite failed its verification. The pass now
removes reads nobody reads.

The Keras model's first-call update is run by nothing (its cut's train_ops is empty:
CutPlan.run_by_nothing). Between-graph ps waited for it all the same: each worker's step
computed its gradient for the accumulator (reading the Input's placeholder: "You must
feed a value for placeholder tensor 'input_1'") and the chief's token waited for its
take. It now keeps its original update there, which nothing runs, and two workers train
on loopback servers what two in-graph replicas train.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing.tf1_scripts import batch_norm_twice, cnn_batches, gan_batches

import test_cluster as tc
import test_rows_meeting
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 3, 16
RTOL, ATOL = 1e-5, 1e-6
KINDS = ("discriminator", "keras_call")
STRATEGIES = ("allreduce", "ps", "hybrid")


def _feeds(kind):
    if kind == "discriminator":
        return gan_batches(STEPS, BATCH)
    return cnn_batches(STEPS, BATCH)


def _run(session, feeds, reads):
    return test_rows_meeting._train(session, feeds, reads)


def test_the_later_update_has_a_name_of_its_own():
    found = analyze(graph_io.load_graph(batch_norm_twice("discriminator")[0]))
    state = [c for c in found.cuts if c.role == "state"]
    assert [c.key for c in state] == ["d/bn/moving_mean", "d/bn/moving_variance",
                                      "d/bn/moving_mean/update_1", "d/bn/moving_variance/update_1"]
    assert [c.variable for c in state] == ["d/bn/moving_mean", "d/bn/moving_variance"] * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", KINDS)
def test_it_rewrites_and_trains(kind, strategy):
    """Every strategy rewrites the graph (verified) and trains it; the plan's JSON keeps
    the names, and a plan given back rewrites to the same bytes."""
    (graph_def, reads), feeds = batch_norm_twice(kind), _feeds(kind)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    keys = [c.key for c in result.plan.cuts if c.role == "state"]
    assert any(k.endswith("/update_1") for k in keys)
    if strategy != "ps":
        assert [k for p in result.plan.packs for k in p.cuts if k.endswith("/update_1")]
    losses, values = _run(gr.Session(result), feeds, reads)
    assert np.all(np.isfinite(losses)) and len(losses) == STEPS
    again = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU",
                       strategy=gr.Plan.from_json(result.plan.to_json()))
    assert again.graph_def.SerializeToString(deterministic=True) == \
        result.graph_def.SerializeToString(deterministic=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", KINDS)
def test_with_synchronised_statistics_it_trains_as_one_device(kind, strategy):
    """With sync_batch_statistics every variable, both moving averages' two updates
    included, equals one device's (the Keras model's first-call BatchNorm, which the
    train op never runs, is not listed)."""
    (graph_def, reads), feeds = batch_norm_twice(kind), _feeds(kind)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy,
                        sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == (
        ["d/bn/FusedBatchNormV3", "d_1/bn/FusedBatchNormV3"] if kind == "discriminator"
        else ["model/bn/FusedBatchNormV3"])
    got, want = _run(gr.Session(result), feeds, reads), test_rows_meeting._one_device(graph_def, feeds, reads)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in reads:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def _reaches(graph_def, op, placeholder):
    """Whether running ``op`` of ``graph_def`` runs ``placeholder`` (data or control)."""
    nodes = {n.name: n for n in graph_def.node}
    seen, todo = set(), [op]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [i.lstrip("^").split(":")[0] for i in nodes[name].input]
    return placeholder in seen


KERAS_SPEC = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}


@pytest.mark.parametrize("task", ["worker:0", "worker:1"])
def test_between_graph_ps_does_not_run_the_update_nothing_runs(task):
    graph_def, _ = batch_norm_twice("keras_call")
    result = gr.rewrite(graph_def, KERAS_SPEC, strategy="ps", device_type="CPU", devices_per_worker=1, task=task)
    unrun = [c.key for c in result.plan.cuts if c.run_by_nothing]
    assert unrun == ["bn/moving_mean", "bn/moving_variance"]
    assert _reaches(graph_def, "bn/AssignMovingAvg/AssignSubVariableOp", "input_1")   # the first call's update reads it
    for op in ("train_op", "init"):
        assert not _reaches(result.graph_def, op, "input_1"), op
    names = {n.name for n in result.graph_def.node}
    assert "graph_rewriter/accumulators/bn/moving_mean/update_1" in names
    assert "graph_rewriter/accumulators/bn/moving_mean" not in names


@pytest.mark.slow
def test_between_graph_ps_trains_the_keras_model_as_two_in_graph_replicas(pool, procs, tmp_path):
    """2 workers x 1 replica on loopback servers against 2 replicas in one graph: the same
    rows per replica, the same accumulators, so the same variables."""
    (graph_def, reads), feeds = batch_norm_twice("keras_call"), _feeds("keras_call")
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "ps", STEPS, reads.values(), feeds)
    in_graph = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy="ps")
    _, want = _run(gr.Session(in_graph), feeds, reads)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
