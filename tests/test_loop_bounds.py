"""While loops that draw random numbers at every step run to the batch's bound on every
replica (passes/loop_bounds.py), so a dropout inside dynamic_rnn draws what one device draws.

The BiLSTM tagger (tf1_scripts.sequence_tagger) with a seeded dropout on every step's
input, as a DropoutWrapper gives: dynamic_rnn runs its loop to the batch's longest
sentence, and each replica's Max sees its own rows. Each replica draws every replica's
rows (passes/random_draws.py), so the masks of the steps it runs are one device's; but
a stateful random op's state advances once per step run, so a replica that ran fewer
steps draws differently from the next run on. The plan's loop_bounds makes every replica
read the replicas' maximum. Its loops run one step at a time (parallel_iterations=1):
otherwise one device is not deterministic either (steps running at once take their
draws in any order).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import GraphRewriteError, graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import LOOP_BOUNDS_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.models import ControlFlow
from graph_rewriter.testing.tf1_scripts import sequence_tagger, sequence_tagger_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH, RATE = 3, 8, 0.3
RTOL, ATOL = 1e-4, 1e-5   # as test_sequence_tagger: Adam magnifies an averaged gradient's rounding
BOUNDS = ["bidirectional_rnn/fw/fw/Max", "bidirectional_rnn/bw/bw/Max"]



def _feeds(source):
    return sequence_tagger_batches(STEPS, BATCH) if source == "placeholder" else [None] * STEPS



_REFERENCES = {}


def _reference(source, control_flow):
    key = (source, control_flow)
    if key not in _REFERENCES:
        graph_def = sequence_tagger(source, control_flow, batch=BATCH, dropout=RATE)
        with harness.one_device_session(graph_def) as sess:
            _REFERENCES[key] = graph_def, harness.train_and_read(sess, graph_def, _feeds(source))
    return _REFERENCES[key]


def _rewritten(graph_def, source, **options):
    result = gr.rewrite(graph_def, device_type="CPU", **options)
    with gr.Session(result) as sess:
        return result, harness.train_and_read(sess, graph_def, _feeds(source))


def _differences(got, want):
    """(largest loss difference, largest variable difference)."""
    return (float(np.max(np.abs(np.array(got[0]) - want[0]))),
            max(float(np.max(np.abs(got[1][k] - want[1][k]))) for k in want[1]))


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_the_reference_is_deterministic_and_its_loops_stop_at_different_steps(control_flow):
    """What the tests below lean on: one device trains the same twice (so a difference is
    the rewrite's), the dropout fires, and some quarter of every batch has a shorter
    longest sentence than the batch (so a replica's own bound runs fewer steps)."""
    graph_def, (losses, _) = _reference("placeholder", control_flow)
    with harness.one_device_session(graph_def) as sess:
        again, _ = harness.train_and_read(sess, graph_def, _feeds("placeholder"))
    np.testing.assert_array_equal(again, losses)
    plain = sequence_tagger("placeholder", control_flow, batch=BATCH)
    with harness.one_device_session(plain) as sess:
        without, _ = harness.train_and_read(sess, plain, _feeds("placeholder"))
    assert abs(without[0] - losses[0]) > 1e-3, (without, losses)
    for feed in _feeds("placeholder"):
        quarters = np.split(feed["lengths:0"], 4)
        assert min(q.max() for q in quarters) < feed["lengths:0"].max()


@pytest.mark.parametrize("source,control_flow,strategy,replicas", [
    ("placeholder", "v1", "allreduce", 2),
    ("placeholder", "v2", "allreduce", 2),
    ("placeholder", "v1", "allreduce", 4),
    ("placeholder", "v2", "ps", 4),
    ("placeholder", "v1", "hybrid", 2),
    ("dataset", "v2", "allreduce", 2),
])
def test_dropout_in_the_loops_trains_as_one_device(source, control_flow, strategy, replicas):
    """Losses at every step and every variable (Adam's slots too) after STEPS steps."""
    graph_def, want = _reference(source, control_flow)
    result, got = _rewritten(graph_def, source, devices_per_worker=replicas, strategy=strategy)
    assert result.plan.loop_bounds == BOUNDS
    loss, variables = _differences(got, want)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)
    assert loss < 1e-5 and variables < 1e-4


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_each_replicas_own_bound_would_be_caught(control_flow):
    """The control: a given plan with ``"loop_bounds": []`` leaves each replica's loops at
    its own longest sentence. The first step is still one device's (every mask drawn is
    one device's), the next ones are not: the test above can fail."""
    graph_def, want = _reference("placeholder", control_flow)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.loop_bounds = []
    result, got = _rewritten(graph_def, "placeholder", devices_per_worker=2, strategy=plan)
    assert result.plan.loop_bounds == []
    assert [n for n in result.plan.notes if n.startswith(LOOP_BOUNDS_START)]
    assert abs(got[0][0] - want[0][0]) < 1e-5
    loss, variables = _differences(got, want)
    assert loss > 1e-3 and variables > 1e-2, (loss, variables)


def test_the_bounds_are_reduced_by_maximum_in_one_chain():
    """Per replica, each bound's readers read a CollectiveReduveV2 with merge_op Max of it
    (as float64, cast back to int32), the second waits for the first, the instance keys
    differ from each other and from the token count's, no note says the loops run to the
    replica's own bound, and `graph-rewrite inspect` lists the bounds."""
    from graph_rewriter import inspect_report
    graph_def, _ = _reference("placeholder", "v1")
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not [n for n in result.plan.notes or [] if n.startswith(LOOP_BOUNDS_START)]
    text = inspect_report.format_report(inspect_report.report(result))
    assert "loop bounds (while loops that draw at every step run to the batch's bound, the replicas' maximum): " \
        + ", ".join(BOUNDS) in text
    nodes = {n.name: n for n in result.graph_def.node}
    reduces = [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"]
    bounds = [n for n in reduces if n.attr["merge_op"].s == b"Max"]
    assert len(bounds) == 4, [n.name for n in bounds]
    keys = {}
    for n in reduces:
        keys.setdefault(n.device, []).append(nodes[n.input[3]].attr["value"].tensor.int_val[0])
    for device, device_keys in keys.items():
        assert len(set(device_keys)) == len(device_keys), (device, device_keys)
    for prefix in ("", "replica_1/"):
        fw, bw = (nodes[f"{prefix}{b}/batch/all_reduce"] for b in BOUNDS)
        assert f"^{fw.name}" in bw.input
        assert nodes[fw.input[0]].op == "Cast" and nodes[fw.input[0]].input[0] == f"{prefix}{BOUNDS[0]}"
        value = nodes[f"{prefix}{BOUNDS[0]}/batch/value"]
        assert value.attr["DstT"].type == tf.int32.as_datatype_enum
        readers = [n for n in result.graph_def.node if f"{prefix}{BOUNDS[0]}" in n.input]
        assert [n.name for n in readers] == [fw.input[0]], [n.name for n in readers]


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_a_loop_without_draws_keeps_each_replicas_bound(control_flow):
    """Without dropout a replica's own bound computes one device's values
    (test_sequence_tagger): nothing is reduced, and the note stays."""
    graph_def = sequence_tagger("placeholder", control_flow, batch=BATCH)
    a = analyze(graph_io.load_graph(graph_def))
    assert a.loop_bounds == BOUNDS and a.drawing_loop_bounds == []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert result.plan.loop_bounds is None and "loop_bounds" not in result.plan.to_dict()
    assert not [n for n in result.graph_def.node if n.op == "CollectiveReduceV2" and n.attr["merge_op"].s == b"Max"]


def _small_loop(control_flow, draw, inside=False):
    """A while loop to the batch's longest length whose body adds ``draw`` noise
    ("stateful": tf.random.uniform with a seed; "stateless": tf.random.stateless_uniform;
    "unseeded": tf.random.uniform without seeds) to its state. ``inside``: the longest
    length is computed in the loop's condition, at every step."""
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        w = tf1.get_variable("w", [3, 3])

        def body(i, h):
            if draw == "stateful":
                noise = tf1.random_uniform(tf.shape(h), seed=7)
            elif draw == "stateless":
                noise = tf.random.stateless_uniform(tf.shape(h), seed=[1, 2])
            else:
                noise = tf1.random_uniform(tf.shape(h))
            return i + 1, tf.tanh(tf.matmul(h, w)) + 0.1 * noise

        if inside:
            _, h = tf1.while_loop(lambda i, h: i < tf.reduce_max(lengths, name="longest"), body,
                                  [tf.constant(0), x])
        else:
            longest = tf.reduce_max(lengths, name="longest")
            _, h = tf1.while_loop(lambda i, h: i < longest, body, [tf.constant(0), x])
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    return g.as_graph_def()


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("draw,drawing", [("stateful", True), ("stateless", False), ("unseeded", False)])
def test_which_draws_make_a_bound_drawing(control_flow, draw, drawing):
    """A seeded stateful draw in the bounded loop makes the bound drawing; a stateless one
    (its numbers come from its seed input, whatever ran before) or an unseeded one (a
    random seed per kernel: no run is reproducible) does not."""
    a = analyze(graph_io.load_graph(_small_loop(control_flow, draw)))
    assert a.loop_bounds == ["longest"]
    assert a.drawing_loop_bounds == (["longest"] if drawing else [])


def test_a_bound_computed_in_a_loop_stays_the_replicas():
    """A Max computed in a v1 loop's condition runs at every step, in the loop's frame:
    it is a loop bound (the note), but not one the replicas reduce (its all-reduce would
    run in the frame), and a given plan may not name it."""
    graph_def = _small_loop("v1", "stateful", inside=True)
    a = analyze(graph_io.load_graph(graph_def))
    assert a.loop_bounds == ["while/longest"] and a.outer_loop_bounds == a.drawing_loop_bounds == []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert result.plan.loop_bounds is None
    assert [n for n in result.plan.notes if n.startswith(LOOP_BOUNDS_START)]
    plan = result.plan   # (a new Plan each time it is read)
    plan.loop_bounds = ["while/longest"]
    with pytest.raises(GraphRewriteError, match="loop_bounds names 'while/longest'"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


def test_a_given_plan_names_only_loop_bounds():
    graph_def, _ = _reference("placeholder", "v1")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.loop_bounds = ["Sum_1"]
    with pytest.raises(GraphRewriteError, match="loop_bounds names 'Sum_1'"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


_DECODERS = {}


def _decoder(control_flow):
    """(GraphDef, (losses, variables)) of the scheduled-sampling decoder on one device."""
    from graph_rewriter.testing.tf1_scripts import scheduled_sampling_batches, scheduled_sampling_decoder
    if control_flow not in _DECODERS:
        graph_def = scheduled_sampling_decoder(control_flow)
        with harness.one_device_session(graph_def) as sess:
            _DECODERS[control_flow] = graph_def, harness.train_and_read(
                sess, graph_def, scheduled_sampling_batches(STEPS, BATCH))
    return _DECODERS[control_flow]


@pytest.mark.parametrize("control_flow,strategy,replicas", [
    ("v1", "allreduce", 2), ("v2", "allreduce", 2), ("v1", "ps", 4), ("v2", "allreduce", 4)])
def test_a_scheduled_sampling_decoder_trains_as_one_device(control_flow, strategy, replicas):
    """A decoder whose while_loop runs to maximum_iterations=tf.reduce_max(lengths) and
    draws a coin per row at every step. Two things it needed: the bound as a v2 While's
    maximum_iterations, which the backward pass also reads (its accumulators' capacity,
    its own loop's bound), is a loop bound (it was a batch statistic: 0.034 in the loss
    by the third step); and with v1 loops the token count is a normalizer although the
    loss's only trainable ancestors are in the loop's body, behind its back edges (it
    was not: every replica divided by its own count, 0.002 in the first loss)."""
    from graph_rewriter.testing.tf1_scripts import scheduled_sampling_batches
    graph_def, want = _decoder(control_flow)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert result.plan.loop_bounds == ["Max"] and result.plan.normalizers == ["Sum_1:0"]
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, scheduled_sampling_batches(STEPS, BATCH))
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_the_decoders_reference_is_deterministic_and_its_bounds_differ():
    """One device trains the same twice (a difference is the rewrite's), and the
    quarters of a batch have different longest targets (the replicas' own bounds
    differ)."""
    from graph_rewriter.testing.tf1_scripts import scheduled_sampling_batches
    graph_def, (losses, _) = _decoder("v2")
    with harness.one_device_session(graph_def) as sess:
        again, _ = harness.train_and_read(sess, graph_def, scheduled_sampling_batches(STEPS, BATCH))
    np.testing.assert_array_equal(again, losses)
    for feed in scheduled_sampling_batches(STEPS, BATCH):
        assert len({q.max() for q in np.split(feed["lengths:0"], 4)}) > 1, feed["lengths:0"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,control_flow", [("allreduce", "v1"), ("ps", "v2")])
def test_between_graph_on_servers(strategy, control_flow, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch: the bound is reduced across the workers' processes, and the
    variables equal one device's after STEPS steps."""
    graph_def, (_, want) = _reference("placeholder", control_flow)
    reads = harness.resource_reads(graph_def)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, reads.values(),
                              _feeds("placeholder"), dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")
