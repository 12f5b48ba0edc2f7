"""A BiLSTM sequence tagger (graph_rewriter.testing.tf1_scripts.sequence_tagger) trains as
one device: tf.compat.v1.nn.bidirectional_dynamic_rnn over the sentences' lengths, the
cross-entropy averaged over the real tokens, tf.clip_by_global_norm and Adam, fed by
placeholders or by a tf.data padded_batch.

What such a script asks of the rewrite at once: each replica's while loops run to its
own longest sentence, not the batch's (dynamic_rnn copies a finished sentence's state
through, so the outputs agree); the token mean divides by the global batch's token
count, not a replica's (the normalizers pass); the global norm is of the averaged
gradients, so clipping fires as on one device; with padded_batch the time dimension
is dynamic as well as the batch. Both v1 control flow (Enter/Exit frames, made per
replica) and v2 (While ops calling functions) are covered.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import sequence_tagger, sequence_tagger_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
# Adam's normalised steps magnify the rounding of an averaged gradient where it is
# tiny; seen at most 3e-6 on a variable (python -c in the closing note)
RTOL, ATOL = 1e-4, 1e-5
VARIABLES = ["embedding", "tags/kernel", "tags/bias"] + [
    f"bidirectional_rnn/{d}/{d}/{v}" for d in ("fw", "bw") for v in ("kernel", "bias")]



def _feeds(source):
    return sequence_tagger_batches(STEPS, BATCH) if source == "placeholder" else [None] * STEPS


def _one_device(graph_def, feeds):
    """([(loss, grad_norm)] per step, {variable: value}) on one device."""
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        steps = [sess.run(["loss:0", "grad_norm:0", "train_op"], feed)[:2] for feed in feeds]
        return steps, sess.run(harness.resource_reads(graph_def))


def _rewritten(result, graph_def, feeds):
    with gr.Session(result) as sess:
        sess.run("init")
        steps = [sess.run(["loss:0", "grad_norm:0", "train_op"], feed)[:2] for feed in feeds]
        return steps, sess.run(harness.resource_reads(graph_def))


_REFERENCES = {}


def _reference(source, control_flow):
    key = (source, control_flow)
    if key not in _REFERENCES:
        graph_def = sequence_tagger(source, control_flow, batch=BATCH)
        _REFERENCES[key] = graph_def, _one_device(graph_def, _feeds(source))
    return _REFERENCES[key]


@pytest.mark.parametrize("source", ["placeholder", "dataset"])
def test_the_reference_trains_and_exercises_what_it_is_for(source):
    """Clipping fires (the norm is above 0.1) on every step; every variable moved; the
    sentences have different lengths, so the loops stop at different steps per replica
    and padding must be masked; the reference is deterministic."""
    graph_def, (steps, values) = _reference(source, "v1")
    norms = [norm for _, norm in steps]
    assert min(norms) > 0.1, norms
    again = _one_device(graph_def, _feeds(source))
    np.testing.assert_allclose(again[0], steps, rtol=1e-6)
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        initial = sess.run({v: f"{v}/Read/ReadVariableOp:0" for v in VARIABLES})
    for v in VARIABLES:
        assert np.abs(values[v] - initial[v]).max() > 1e-3, f"{v} did not move"
    if source == "placeholder":
        for feed in _feeds(source):
            halves = np.split(feed["lengths:0"], 4)
            assert len({h.max() for h in halves}) > 1, "every quarter's longest sentence is as long"


@pytest.mark.parametrize("source,control_flow,strategy,replicas", [
    ("placeholder", "v1", "allreduce", 2),
    ("placeholder", "v2", "allreduce", 4),
    ("placeholder", "v1", "ps", 4),
    ("placeholder", "v2", "hybrid", 2),
    ("dataset", "v1", "allreduce", 4),
    ("dataset", "v2", "ps", 2),
    ("dataset", "v1", "hybrid", 2),
])
def test_trains_as_one_device(source, control_flow, strategy, replicas):
    """Losses, global norms and every variable (Adam's slots too) after STEPS steps."""
    graph_def, want = _reference(source, control_flow)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    got = _rewritten(result, graph_def, _feeds(source))
    harness.assert_trained_alike(f"{source}, {control_flow}, {strategy}, {replicas} replicas", got, want, RTOL, ATOL,
                                 first="losses and norms")


def test_a_replica_mean_of_token_means_would_be_caught():
    """The control: the mean over 4 quarters of each quarter's own token mean (what
    averaging replicas' losses without the normalizers pass gives) differs from the
    batch's token mean by more than the tolerance, so the test above can fail."""
    graph_def, _ = _reference("placeholder", "v1")
    feed = _feeds("placeholder")[0]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        whole = sess.run("loss:0", feed)
        quarters = [sess.run("loss:0", {k: v[q * 2:(q + 1) * 2] for k, v in feed.items()}) for q in range(4)]
    assert abs(np.mean(quarters) - whole) > 10 * (RTOL * abs(whole) + ATOL), (np.mean(quarters), whole)


def test_the_token_count_is_found_whichever_division_by_it_comes_first():
    """The regression: with v2 while loops, the backward pass's division of the loss's
    gradient by the token count comes before the forward division in the graph's
    order, and the analysis looked at the first division by a sum only, found no
    trainable variable in its dividend, and never synchronised the count: every v2 case
    above trained on the mean of the replicas' token means, silently (0.05 in the loss
    at 4 replicas). Both control flows find it now."""
    from graph_rewriter import graph_io
    from graph_rewriter.analysis import analyze, in_gradients_scope, topological_order
    for control_flow in ("v1", "v2"):
        graph_def, _ = _reference("placeholder", control_flow)
        graph = graph_io.load_graph(graph_def)
        a = analyze(graph)
        assert [t.name for t in a.normalizers] == ["Sum_1:0"], control_flow
        divisions = [n.name for n in topological_order(graph) if n.op == "RealDiv" and n.inputs[1].name == "Sum_1:0"]
        assert "truediv" in divisions and len(divisions) > 1, divisions
        if control_flow == "v2":   # the order the regression needs
            assert in_gradients_scope(divisions[0]), divisions


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_between_graph_on_servers(strategy, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch: the variables equal one device's after STEPS steps."""
    graph_def, (_, want) = _reference("placeholder", "v1")
    reads = harness.resource_reads(graph_def)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, reads.values(),
                              _feeds("placeholder"), dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


@pytest.mark.parametrize("source,control_flow", [("placeholder", "v1"), ("placeholder", "v2"), ("dataset", "v2")])
def test_the_longest_sentence_is_a_loop_bound_not_a_batch_statistic(source, control_flow):
    """dynamic_rnn runs its loop to the batch's longest sentence (a Max over the lengths,
    into the loop's condition only): the plan notes that each replica's loops run to
    its own rows' bound, not that the step differs from one device's (which the
    equivalence above shows it does not)."""
    from graph_rewriter import graph_io
    from graph_rewriter.analysis import analyze
    from graph_rewriter.planner import LOOP_BOUNDS_START, ROWS_MEET_START
    graph_def = sequence_tagger(source, control_flow, batch=BATCH)
    a = analyze(graph_io.load_graph(graph_def))
    assert a.loop_bounds == ["bidirectional_rnn/fw/fw/Max", "bidirectional_rnn/bw/bw/Max"]
    assert a.batch_statistics == []
    notes = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan.notes or []
    assert [n for n in notes if n.startswith(LOOP_BOUNDS_START)] and not [
        n for n in notes if n.startswith(ROWS_MEET_START)], notes
    # nothing to synchronise, and nothing refused (it was: "a Max over the rows ... cannot
    # be synchronised"), so a CNN with BatchNorm under a dynamic_rnn can sync its statistics
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics is None


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("use", ["body", "loss"])
def test_a_maximum_over_the_rows_used_otherwise_stays_a_batch_statistic(control_flow, use):
    """The control: the same Max over the lengths, but read inside the loop's body
    (each step scaled by it) or by the loss as a value, changes what a step computes:
    it stays a statistic over the batch's rows, with the note that the step differs."""
    from graph_rewriter import graph_io
    from graph_rewriter.analysis import analyze
    from graph_rewriter.testing.models import ControlFlow
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        w = tf1.get_variable("w", [3, 3])
        longest = tf.reduce_max(lengths, name="longest")
        if use == "body":
            _, h = tf1.while_loop(lambda i, h: i < longest,
                                  lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w)) / tf.cast(longest, tf.float32)),
                                  [tf.constant(0), x])
            loss = tf.reduce_mean(tf.square(h), name="loss")
        else:
            _, h = tf1.while_loop(lambda i, h: i < longest, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                                  [tf.constant(0), x])
            loss = tf.reduce_mean(tf.square(h) * tf.cast(longest, tf.float32), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    a = analyze(graph_io.load_graph(g.as_graph_def()))
    assert a.loop_bounds == [] and a.batch_statistics == ["longest"], (a.loop_bounds, a.batch_statistics)
