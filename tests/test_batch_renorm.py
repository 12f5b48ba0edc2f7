"""Batch renormalization (Ioffe, 2017): ``tf.compat.v1.layers.batch_normalization(renorm=True)``
(tf1_scripts.batch_norm_cnn's RENORMS kinds).

The layer moves two non-trainable averages towards the one batch mean (renorm_mean and
moving_mean) and two towards its deviation (renorm_stddev and moving_stddev; the
moving_variance is assigned from moving_stddev's new value). The analysis found one
statistic updating two variables, took it for an optimizer written in plain ops (the
renorm average as the "variable", moving_mean as its "slot"), and refused every rewrite
with "the gradient of variable 'bn1/beta' ... is computed from the gradient of variable
'bn1/renorm_mean'", naming a different trainable variable from run to run. A cut of
several variables from a value the backward pass does not compute is now the state of
each. Behind a v2 cond on a ``training`` placeholder, the update of bn1's averages was
then more than 256 ops from the statistic in the depth-first search that finds it, the
average was computed for nothing, and the verifier refused the graph (between-graph,
one replica per worker, nothing refused it: each worker moved the averages from its own
rows, under a note saying they were averaged). The search now goes nearest first, and a
statistic whose update it cannot find is refused by name.

Without sync_batch_statistics the statistics are noted and the step differs; with it R
replicas train as one device, every average, slot and weight included.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze, statistic_update_readers
from graph_rewriter.testing.tf1_scripts import RENORMS, batch_norm_cnn, cnn_batches

import test_cluster as tc
import test_rows_meeting
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)
from test_sync_batch_statistics import _assert_one_device, _gaps, _notes, _rewrite

tf1 = tf.compat.v1
STEPS, BATCH = 3, 16
AVERAGES = ["moving_mean", "moving_stddev", "moving_variance", "renorm_mean", "renorm_stddev"]
STATISTICS = [f"{bn}/moments/{s}" for bn in ("bn1", "bn2") for s in ("mean", "variance")]


def _train(result, feeds, reads):
    return test_rows_meeting._train(gr.Session(result), feeds, reads)


def _one_device(graph_def, feeds, reads):
    return test_rows_meeting._one_device(graph_def, feeds, reads)


@pytest.mark.parametrize("kind", RENORMS)
def test_the_averages_are_state_and_every_update_is_found(kind):
    found = analyze(graph_io.load_graph(batch_norm_cnn(kind)[0]))
    roles = {name: v.role for name, v in found.variables.items()}
    for bn in ("bn1", "bn2"):
        assert {roles[f"{bn}/{a}"] for a in AVERAGES if a != "moving_variance"} == {"state"}
        # written from moving_stddev's new value: in the same v2 cond's call, or after it
        assert roles[f"{bn}/moving_variance"] == ("state" if kind == "renorm_cond_v2" else "other")
        assert roles[f"{bn}/gamma"] == roles[f"{bn}/beta"] == "trainable"
    states = [c for c in found.cuts if c.role == "state"]
    assert sorted(c.variable for c in states) == ["bn1/renorm_mean", "bn1/renorm_stddev",
                                                  "bn2/renorm_mean", "bn2/renorm_stddev"]
    assert all("moving_" in v for c in states for v in c.variables if v != c.variable)
    assert all(statistic_update_readers(c.values, c.variables) for c in states)
    assert found.batch_statistics == STATISTICS and found.statistics_obstacles == {}


@pytest.mark.parametrize("kind", RENORMS)
def test_synced_renormalization_trains_as_one_device(kind):
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == STATISTICS and not _notes(result)
    _assert_one_device(_train(result, feeds, reads), _one_device(graph_def, feeds, reads))


@pytest.mark.parametrize("kind", ["renorm", "renorm_cond_v2"])
@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 4, {}), ("ps", 2, {}), ("ps", 4, {}), ("hybrid", 2, {}),
    ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}), ("allreduce", 4, {"materialize_replicas": True})],
    ids=["allreduce-4", "ps", "ps-4", "hybrid", "reduce_to_one", "allreduce-4-built"])
def test_every_strategy_trains_as_one_device(kind, strategy, replicas, options):
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, replicas, strategy=strategy, sync_batch_statistics=True, **options)
    _assert_one_device(_train(result, feeds, reads), _one_device(graph_def, feeds, reads))


@pytest.mark.parametrize("kind", RENORMS)
def test_without_the_option_the_step_differs_and_the_note_says_so(kind):
    """The control: each replica renormalises its shard, named in the note."""
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, 4)
    [note] = _notes(result)
    assert all(f"'{s}'" in note for s in STATISTICS) and "sync_batch_statistics" in note
    loss_gap, gaps = _gaps(_train(result, feeds, reads), _one_device(graph_def, feeds, reads))
    assert loss_gap > 1e-3 and max(gaps.values()) > 1e-2


@pytest.mark.parametrize("kind", RENORMS)
def test_between_graph_parameter_servers_refuse_it_by_name(kind):
    """The deviation the renorm average moves towards is also the one the correction r
    divides, so the forward pass reads the replicas' average; a parameter server gives
    that average to the chief alone, and bn2's statistic is computed from it."""
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    with pytest.raises(gr.GraphRewriteError, match=r"the update of variable 'bn2/renorm_mean' .* is computed from "
                                                   r"the average of the update of 'bn1/renorm_(mean|stddev)'"):
        gr.rewrite(batch_norm_cnn(kind)[0], cluster, strategy="ps", devices_per_worker=1, device_type="CPU",
                   task=("worker", 1))


def _far_update():
    """A moving average of the batch's mean features updated 300 ops from the mean (a
    chain of scalings), the forward pass centring the rows by the same mean."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", [4, 1], initializer=tf1.glorot_uniform_initializer(seed=2))
        avg = tf1.get_variable("avg", [4], trainable=False, initializer=tf1.zeros_initializer())
        mean = tf.reduce_mean(x, 0, name="mean")
        value = mean
        for _ in range(300):
            value = value * 1.0001
        update = tf1.assign_sub(avg, 0.1 * (avg - value))
        loss = tf.reduce_mean(tf.square(tf.matmul(x - mean, w) - y), name="loss")
        with tf.control_dependencies([update]):
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    return g.as_graph_def()


@pytest.mark.parametrize("between_graph", [False, True], ids=["in-graph", "between-graph"])
def test_a_statistic_whose_update_is_out_of_reach_is_refused_by_name(between_graph):
    """Before, in one graph the verifier refused it as an internal error; between-graph
    with one replica per worker it was emitted, each worker moving the average from its
    own rows."""
    cluster = {"worker": ["localhost:1", "localhost:2"]} if between_graph else None
    with pytest.raises(gr.GraphRewriteError, match=r"cannot find how the statistic 'mean:0' reaches the update "
                                                   r"of variable 'avg'.*ExponentialMovingAverage"):
        gr.rewrite(_far_update(), cluster, devices_per_worker=1 if between_graph else 2, device_type="CPU")


@pytest.mark.slow
def test_two_workers_renormalize_as_one_device(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, all-reduce, synced statistics."""
    (graph_def, _), feeds = batch_norm_cnn("renorm_cond_v2"), cnn_batches(STEPS, BATCH)
    _, want = test_rows_meeting._one_device(graph_def, feeds, _resource_reads(graph_def))
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "allreduce", STEPS, feeds,
                                   options={"sync_batch_statistics": True})
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _resource_reads(graph_def):
    from graph_rewriter.testing import harness
    return harness.resource_reads(graph_def)
