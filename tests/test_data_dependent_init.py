"""Weight normalization's data-dependent initialisation (graph_rewriter.testing.
tf1_scripts.weight_norm_mlp), as OpenAI's weight-normalization, PixelCNN++ and
improved-GAN code do it: before training, one run of ``data_init`` on a batch assigns
each layer's gain g = 1 / sqrt(var) and bias b = -mean * g from the moments of its
pre-activations ``x @ normalize(v)``, so the first batch comes out standardised.

Before, the rewrite stopped with an internal error ("the graph has a cycle that is not a
while loop"): b's state update reads g's new scale, which the allreduce pass computes
from the averaged variance, and both states were all-reduced in one pack. Now b's
update is packed after g's (its cut's ``after``), the moments are batch statistics (a
statistic a state stores non-linearly counts as one training uses), noted by default,
and with sync_batch_statistics the init is one device's and so is every step after it.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, weight_norm_mlp

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
MOMENTS = ["moments/mean", "moments/variance"]


def _run(sess, graph_def, feeds):
    """([loss per step], {variable: value}, (g, b) after the init): init, data_init on
    the first batch, then a train step on each of the others."""
    reads = harness.resource_reads(graph_def)
    sess.run("init")
    sess.run("data_init", feeds[0])
    initial = sess.run([reads["g"], reads["b"]])
    losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds[1:]]
    return losses, sess.run(reads), initial


def _one_device(feeds):
    graph_def = weight_norm_mlp()
    with harness.one_device_session(graph_def) as sess:
        return _run(sess, graph_def, feeds)


def _rewritten(feeds, **options):
    graph_def = weight_norm_mlp()
    result = gr.rewrite(graph_def, device_type="CPU", **options)
    with gr.Session(result) as sess:
        return result, _run(sess, graph_def, feeds)


def test_the_analysis_orders_the_states_and_lists_the_moments():
    """g's state cut is the variance (its update reads 1 / sqrt(var + eps)), b's the
    product -mean * scale, which reads g's average on the way to g's update: b comes
    after g. The moments are stored other than linearly: batch statistics."""
    found = analyze(graph_io.load_graph(weight_norm_mlp()))
    states = {c.variable: c for c in found.cuts if c.role == "state"}
    assert sorted(states) == ["b", "g"]
    assert states["b"].after == ["g"] and states["g"].after is None
    assert found.batch_statistics == MOMENTS


def test_the_dependent_state_is_packed_after_the_other():
    result = gr.rewrite(weight_norm_mlp(), devices_per_worker=2, device_type="CPU")
    cuts = {c.key: c for c in result.plan.cuts if c.role == "state"}
    assert cuts["g"].pack < cuts["b"].pack
    assert result.plan.to_dict()["cuts"][[c.key for c in result.plan.cuts].index("b")]["after"] == ["g"]


def test_by_default_the_moments_are_noted_and_the_init_is_the_replicas():
    """Not silent: each replica's moments are its shard's; g, from their averaged
    variance, is not one device's (the control: the tests below can fail)."""
    feeds = dropout_batches(STEPS, BATCH)
    _, _, (want_g, _) = _one_device(feeds)
    result, (_, _, (g, _)) = _rewritten(feeds, devices_per_worker=2)
    assert any("'moments/mean', 'moments/variance'" in note for note in result.plan.notes), result.plan.notes
    assert np.max(np.abs(g - want_g)) > 1e-3


@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 2, {}), ("allreduce", 4, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("ps", 2, {}), ("hybrid", 2, {})], ids=["allreduce2", "allreduce4", "reduce_to_one", "ps2", "hybrid2"])
def test_synced_moments_initialise_and_train_as_one_device(strategy, replicas, options):
    feeds = dropout_batches(STEPS, BATCH)
    want_losses, want, (want_g, want_b) = _one_device(feeds)
    result, (losses, got, (g, b)) = _rewritten(feeds, devices_per_worker=replicas, strategy=strategy,
                                               sync_batch_statistics=True, **options)
    assert result.plan.sync_batch_statistics == MOMENTS
    np.testing.assert_allclose(g, want_g, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(b, want_b, rtol=RTOL, atol=ATOL)
    harness.assert_trained_alike(f"{strategy} {replicas}", (losses, got), (want_losses, want), RTOL, ATOL)


PS_CLUSTER = {"ps": ["p0:2222"], "worker": ["w0:2222", "w1:2222"]}


@pytest.mark.parametrize("task", [("worker", 0), ("worker", 1)])
def test_between_graph_parameter_servers_are_refused_naming_both_updates(task):
    """Between-graph, the gain's average exists on the chief alone, after its take: the
    other workers could not compute the bias from it (before: an internal error in the
    sync_queues pass, "cannot remove node 'Sqrt'")."""
    with pytest.raises(gr.GraphRewriteError, match="the update of variable 'b' .* average of the update of 'g'"):
        gr.rewrite(weight_norm_mlp(), PS_CLUSTER, strategy="ps", task=task, device_type="CPU")


def test_strategy_auto_plans_it():
    """(before: an internal KeyError: the gain's state cut, beside its gradient, has no
    costs of its own)"""
    result = gr.rewrite(weight_norm_mlp(), PS_CLUSTER, devices_per_worker=2, strategy="auto", device_type="CPU")
    assert result.plan.cost["choice"] in ("mixed", "mirrored", "ps")
