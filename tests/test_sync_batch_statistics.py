"""Synchronised batch statistics: with sync_batch_statistics, R replicas train as one device
through BatchNorm in training mode.

Without the option each replica normalises its shard with the shard's statistics (0.0077
in the loss and 0.16 in a Momentum slot after three steps of 16 images at 2 replicas,
the control below). With it the statistics the analysis lists are all-reduced over
every replica's rows, forward and backward (passes/batch_statistics.py): a fused
BatchNorm is replaced by its ops, a Mean over the rows is synced where it is computed
and where its gradient enters its backward pass. Every variable, the optimizer's slots
and the moving averages included, then equals one device's on the same batch (rtol
1e-5). The CNN is tf1_scripts.batch_norm_cnn, its BatchNorms written five ways.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing.tf1_scripts import (BATCH_NORMS, batch_norm_cnn, cnn_batches, dropout_batches,
                                                rows_meeting_mlp)
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
import test_rows_meeting
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 16
RTOL, ATOL = 1e-5, 1e-6
FUSED = {"layers": ["bn1/FusedBatchNormV3", "bn2/FusedBatchNormV3"],
         "layers_cond": ["bn1/cond/FusedBatchNormV3", "bn2/cond/FusedBatchNormV3"],
         "moments": ["bn1/moments/mean", "bn1/moments/variance", "bn2/moments/mean", "bn2/moments/variance"],
         "fused_average": ["bn1", "bn2"], "nchw": ["bn1", "bn2"]}


def _train(session, feeds, reads):
    return test_rows_meeting._train(session, feeds, reads)


def _one_device(graph_def, feeds, reads):
    return test_rows_meeting._one_device(graph_def, feeds, reads)


def _gaps(got, want):
    """(largest loss difference, {variable: largest difference})."""
    return float(np.max(np.abs(got[0] - want[0]))), {
        name: float(np.max(np.abs(np.asarray(got[1][name], np.float64) - want[1][name]))) for name in want[1]}


def _assert_one_device(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


def _rewrite(graph_def, replicas=2, **options):
    return gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", **options)


@pytest.mark.parametrize("kind", BATCH_NORMS)
def test_the_analysis_lists_every_batch_norm_and_can_sync_it(kind):
    found = analyze(graph_io.load_graph(batch_norm_cnn(kind)[0]))
    assert found.batch_statistics == FUSED[kind] and found.statistics_obstacles == {}


@pytest.mark.parametrize("kind", BATCH_NORMS)
def test_every_batch_norm_trains_as_one_device(kind):
    """Each way of writing BatchNorm: 2 replicas with the option equal one device, and
    the plan lists the statistics and has no note on them."""
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == FUSED[kind] and not _notes(result)
    _assert_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))


@pytest.mark.parametrize("kind", ["layers", "moments"])
@pytest.mark.parametrize("strategy, replicas, options", [
    ("ps", 2, {}), ("hybrid", 2, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("allreduce", 4, {}), ("ps", 4, {}), ("allreduce", 4, {"materialize_replicas": True}),
    ("allreduce", 3, {})],
    ids=["ps", "hybrid", "reduce_to_one", "allreduce-4", "ps-4", "allreduce-4-built", "allreduce-3"])
def test_every_strategy_trains_as_one_device(kind, strategy, replicas, options):
    """ps, hybrid, reduce_to_one, 4 template and 4 built replicas, 3 replicas of 6 images."""
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS, 18 if replicas == 3 else BATCH)
    result = _rewrite(graph_def, replicas, strategy=strategy, sync_batch_statistics=True, **options)
    _assert_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))


def test_without_the_option_the_step_differs_and_the_note_says_so():
    """The control: the same CNN without the option trains away from one device, and the
    note names the BatchNorms and the option."""
    (graph_def, reads), feeds = batch_norm_cnn("layers"), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def)
    assert result.plan.sync_batch_statistics is None
    [note] = _notes(result)
    assert "'bn1/FusedBatchNormV3', 'bn2/FusedBatchNormV3'" in note and "sync_batch_statistics" in note
    loss_gap, gaps = _gaps(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))
    assert loss_gap > 1e-3 and max(gaps.values()) > 1e-2


def test_a_subset_syncs_only_those_and_names_the_rest():
    """Naming one BatchNorm syncs that one: the other stays per replica, in the note,
    and the step still differs from one device's."""
    (graph_def, reads), feeds = batch_norm_cnn("layers"), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, sync_batch_statistics=["bn2/FusedBatchNormV3"])
    assert result.plan.sync_batch_statistics == ["bn2/FusedBatchNormV3"]
    [note] = _notes(result)
    assert "'bn1/FusedBatchNormV3'" in note and "bn2" not in note
    ops = {n.name: n.op for n in result.graph_def.node}
    assert ops["bn1/FusedBatchNormV3"] == "FusedBatchNormV3" and ops["bn2/FusedBatchNormV3"] == "IdentityN"
    loss_gap, _ = _gaps(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))
    assert loss_gap > 1e-4


@pytest.mark.parametrize("kind", ["center_loss", "mean_features", "fused_batch_norm", "cross_correlation",
                                  "covariance", "center_by_hand", "size_count"])
def test_other_statistics_over_the_rows_train_as_one_device(kind):
    """A center loss's mean, a loss on the batch's mean features, a fused BatchNorm of
    rank-2 features reshaped to images, Barlow Twins' cross-correlation and VICReg's
    covariance of the features over the batch (products contracting the rows, divided
    by ``tf.shape(h)[0]``, by ``n - 1`` and by ``tf.size(h) / 16``), a center loss by hand (a Sum over the rows
    divided by their count) (tests/test_rows_meeting.py's MLP)."""
    graph_def, feeds = rows_meeting_mlp(kind), dropout_batches(STEPS, BATCH)
    reads = test_rows_meeting.MLP_READS
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics and not _notes(result)
    _assert_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))


@pytest.mark.parametrize("kind", ["cross_correlation", "center_by_hand"])
@pytest.mark.parametrize("strategy, replicas, options", [
    ("ps", 2, {}), ("hybrid", 2, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
    ("allreduce", 4, {}), ("allreduce", 4, {"materialize_replicas": True})],
    ids=["ps", "hybrid", "reduce_to_one", "allreduce-4", "allreduce-4-built"])
def test_sums_over_the_rows_train_as_one_device_under_every_strategy(kind, strategy, replicas, options):
    graph_def, feeds = rows_meeting_mlp(kind), dropout_batches(STEPS, BATCH)
    reads = test_rows_meeting.MLP_READS
    result = _rewrite(graph_def, replicas, strategy=strategy, sync_batch_statistics=True, **options)
    _assert_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))


def test_a_sum_over_the_rows_is_summed_and_its_count_counts_every_replicas_rows():
    """The center loss by hand, 2 replicas: the Sum keeps its name on a summing
    all-reduce, as does its gradient's entry; where the Sum's value alone is divided by
    ``n = tf.cast(tf.shape(h)[0])`` the quotient and its gradient read n from a copy
    whose Shape's rows are summed over the replicas, and where the replica's own
    distances are divided by n (a mean by hand) they still read the replica's n."""
    result = _rewrite(rows_meeting_mlp("center_by_hand"), sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == ["center"]
    assert result.plan.synced_row_counts == [["truediv", 1, ["Shape"]]]
    assert gr.Plan.from_json(result.plan.to_json()).synced_row_counts == result.plan.synced_row_counts
    nodes = {n.name: n for n in result.graph_def.node}
    for prefix in ("", "replica_1/"):
        center = nodes[f"{prefix}center"]
        assert center.op == "CollectiveReduceV2" and center.attr["final_op"].s == b"Id"
        assert center.input[0] == f"{prefix}center/replica_rows"
        [entry] = [n for name, n in nodes.items() if name.startswith(f"{prefix}gradients/center_grad/")
                   and n.op == "Reshape"]
        assert nodes[entry.input[0]].op == "CollectiveReduceV2"
        whole = nodes[nodes[f"{prefix}truediv"].input[1]]
        assert whole.name.startswith(f"{prefix}truediv/sync/whole_count/") and whole.op == "Cast"
        shape = nodes[nodes[whole.input[0]].input[0]]
        assert shape.op == "ConcatV2" and any(
            nodes[i].op == "Cast" and nodes[nodes[i].input[0]].op == "CollectiveReduceV2" for i in shape.input)
        divisors = {i for name, n in nodes.items() if name.startswith(f"{prefix}gradients/truediv_grad/")
                    for i in n.input if i in (whole.name, f"{prefix}Cast")}
        assert divisors == {whole.name}
        mean_by_hand = nodes[f"{prefix}truediv_1"]
        assert mean_by_hand.input[1] == f"{prefix}Cast"


def _half_precision_batch_norm():
    """A conv, a fused BatchNorm of its output cast to float16 (T half, statistics in
    float), relu, mean over the image, dense 1; SGD 0.1."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        k = tf1.get_variable("k", [3, 3, 2, 4], initializer=tf1.glorot_uniform_initializer(seed=2))
        gamma = tf1.get_variable("gamma", [4], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [4], initializer=tf1.zeros_initializer())
        out, _, _ = tf1.nn.fused_batch_norm(tf.cast(tf.nn.conv2d(x, k, 1, "SAME"), tf.float16), gamma, beta,
                                            is_training=True, name="bn")
        w = tf1.get_variable("w", [4, 1], initializer=tf1.glorot_uniform_initializer(seed=4))
        h = tf.reduce_mean(tf.nn.relu(tf.cast(out, tf.float32)), [1, 2])
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(h, w) - y)), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def(), {n: f"{n}/Read/ReadVariableOp:0" for n in ("k", "gamma", "beta", "w")}


def test_a_half_precision_batch_norm_trains_as_one_device():
    """float16 images, float statistics (without the option: 0.019 in the loss)."""
    (graph_def, reads), feeds = _half_precision_batch_norm(), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == ["bn"]
    got, want = _train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-4)   # a float16 loss
    for name in reads:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_real_resnet_trains_as_one_device_on_the_global_batch():
    """The ResNet of tests/test_real_models.py with its hand-written BatchNorms (twelve
    moments) and a static batch per replica: 2 replicas of 4 images each equal one device
    on 8, moving averages included (without the option: 0.086 in the loss)."""
    import test_real_models as trm
    from graph_rewriter.testing import harness, real_models as rm
    steps = 4
    _, _, _, want_losses, want = trm._resnet_reference(2 * rm.RESNET_BATCH, True, steps=steps)
    ex, feed = rm.build_resnet(batch_size=rm.RESNET_BATCH, batch_norm=True)
    result = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=True)
    assert len(result.plan.sync_batch_statistics) == 12
    losses, values = harness.run_rewritten(result, ex, steps=steps, feeds=feed)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("kind", ["layers_cond", "layers_cond_v2"])
def test_the_cond_still_infers_with_the_moving_statistics(kind):
    """tf.compat.v1.layers.batch_normalization(training=placeholder), in a v1 cond or a v2
    one (lowered): after training with the option, feeding training=False takes the
    inference branch (the synced ops are in the other, dead, branch) and gives one
    device's loss."""
    (graph_def, reads), feeds = batch_norm_cnn(kind), cnn_batches(STEPS + 1, BATCH)

    def run(session):
        with session as sess:
            sess.run("init")
            for feed in feeds[:STEPS]:
                sess.run("train_op", feed)
            return sess.run("loss:0", dict(feeds[STEPS], **{"training:0": False}))

    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    want = run(tf1.Session(graph=graph))
    got = run(gr.Session(_rewrite(graph_def, sync_batch_statistics=True)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_structure_on_gpus():
    """2 workers x 2 GPUs: each replica's fused BatchNorm and its backward are IdentityNs
    taking their names, every new node on the replica's GPU; per BatchNorm five
    all-reduces (the count, the mean, the variance, the backward's two means), the
    forward ones chained in order and the backward ones chained apart."""
    result = gr.rewrite(batch_norm_cnn("layers")[0], PS2_WORKERS2, devices_per_worker=2,
                        sync_batch_statistics=True)
    nodes = {n.name: n for n in result.graph_def.node}
    assert not [n for n in nodes.values() if n.op.startswith("FusedBatchNorm")]
    for prefix, device in (("", "/job:worker/replica:0/task:0/device:GPU:0"),
                           ("replica_3/", "/job:worker/replica:0/task:1/device:GPU:1")):
        for bn in ("bn1", "bn2"):
            forward = nodes[f"{prefix}{bn}/FusedBatchNormV3"]
            backward = nodes[f"{prefix}gradients/{bn}/FusedBatchNormV3_grad/FusedBatchNormGradV3"]
            assert forward.op == backward.op == "IdentityN" and len(forward.input) == len(backward.input) == 3
            assert forward.device == backward.device == device
        mine = [n for name, n in nodes.items() if "/sync/" in name and name.startswith(prefix)
                and (prefix or not name.startswith("replica_"))]
        assert mine and {n.device for n in mine} == {device}
        reduces = [n for n in mine if n.op == "CollectiveReduceV2"]
        assert len(reduces) == 10
        forward = [n for n in reduces if "gradients/" not in n.name]
        backward = [n for n in reduces if "gradients/" in n.name]
        assert len(forward) == 6 and len(backward) == 4
        for chain in (forward, backward):   # each after the one before it
            waits = [[c[1:] for c in n.input if c.startswith("^")] for n in chain]
            assert sorted(len(w) for w in waits) == [0] + [1] * (len(chain) - 1)
            assert all(nodes[w[0]] in chain for w in waits if w)


def test_a_given_plan_keeps_its_choice_and_the_same_graph():
    graph_def = batch_norm_cnn("moments")[0]
    result = _rewrite(graph_def, sync_batch_statistics=True)
    again = _rewrite(graph_def, strategy=gr.Plan.from_json(result.plan.to_json()))
    assert again.plan.sync_batch_statistics == FUSED["moments"]
    assert again.graph_def.SerializeToString(deterministic=True) == \
        result.graph_def.SerializeToString(deterministic=True)


def test_one_replica_needs_nothing():
    result = _rewrite(batch_norm_cnn("layers")[0], 1, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics is None
    assert [n.op for n in result.graph_def.node if n.name == "bn1/FusedBatchNormV3"] == ["FusedBatchNormV3"]


def test_micro_batches_are_noted_and_train():
    """With accumulation_steps 2 the note says the statistics are each micro-batch's, and
    two runs (one update) train."""
    from graph_rewriter.planner import SYNCED_MICRO_BATCHES
    (graph_def, reads), feeds = batch_norm_cnn("layers"), cnn_batches(2, BATCH)
    result = _rewrite(graph_def, sync_batch_statistics=True, accumulation_steps=2)
    start = SYNCED_MICRO_BATCHES.split("{")[0]
    [note] = [n for n in result.plan.notes if n.startswith(start)]
    assert "'bn1/FusedBatchNormV3'" in note and "each micro-batch's" in note
    losses, values = _train(gr.Session(result), feeds, reads)
    assert np.all(np.isfinite(losses)) and int(values["global_step"]) == 1


# ----- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("graph_def, sync, message", [
    (lambda: rows_meeting_mlp("batch_max"), True,
     "the batch statistic 'center' cannot be synchronised: it is a Max over the rows with a gradient"),
    (lambda: rows_meeting_mlp("mixed_count"), True,
     "the batch statistic 'center' cannot be synchronised: 'truediv' meets a count of the batch's rows with a "
     "sum over the replica's rows plus a value of the statistic alone"),
    (lambda: rows_meeting_mlp("reshaped_count"), True,
     "the batch statistic 'center' cannot be synchronised: 'truediv' meets it with a count of the batch's rows "
     "taken by Shape 'Shape' of a tensor whose first axis may not be the rows"),
    (lambda: batch_norm_cnn("layers")[0], ["bn3/FusedBatchNormV3"],
     "sync_batch_statistics names 'bn3/FusedBatchNormV3', which is not a statistic over the batch's rows "
     "that this graph trains with \\(found: bn1/FusedBatchNormV3, bn2/FusedBatchNormV3\\)"),
], ids=["max", "mixed_count", "reshaped_count", "unknown"])
def test_what_cannot_be_synced_is_refused_by_name(graph_def, sync, message):
    with pytest.raises(gr.GraphRewriteError, match=message) as e:
        _rewrite(graph_def(), sync_batch_statistics=sync)
    assert e.value.hint


def _moments_model(gradients_name):
    """x -> MatMul(w) -> normalised by its batch moments -> a summed square; its
    gradient by tf.gradients(..., name=gradients_name), SGD."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 3], initializer=tf1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)
        mean, var = tf.nn.moments(h, [0], name="moments")
        loss = tf.reduce_mean(tf.square((h - mean) / tf.sqrt(var + 1e-3) - 0.5), name="loss")
        grads = tf.gradients(loss, [w], name=gradients_name)
        tf1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, [w]), name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


@pytest.mark.parametrize("gradients_name", ["gradients", "my_grads"])
def test_a_backward_pass_under_another_name_is_synchronised_too(gradients_name):
    """tf.gradients(..., name="my_grads"): its backward pass is found under that scope
    as under the default one (analysis.named_gradient_scopes), so the moments are
    synchronised forward and backward and 2 replicas train as one device. (It was
    refused before: the analysis read backward passes by their "gradients" scope only.)"""
    graph_def = _moments_model(gradients_name)
    rng = np.random.RandomState(3)
    feeds = [{"x:0": rng.randn(8, 4).astype(np.float32)} for _ in range(3)]
    reads = {"w": "w/Read/ReadVariableOp:0"}
    want = _one_device(graph_def, feeds, reads)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == ["moments/mean", "moments/variance"]
    _assert_one_device(_train(gr.Session(result), feeds, reads), want)


def test_a_parameter_server_plan_across_machines_is_refused():
    with pytest.raises(gr.GraphRewriteError, match="meet in no collective group") as e:
        gr.rewrite(batch_norm_cnn("layers")[0], PS2_WORKERS2, task="worker:1", strategy="ps", device_type="CPU",
                   sync_batch_statistics=True)
    assert "strategy allreduce or hybrid" in e.value.hint


@pytest.mark.parametrize("value", [[], [3], "", 1])
def test_a_bad_option_value_is_refused(value):
    with pytest.raises(gr.GraphRewriteError, match="sync_batch_statistics must be True, False or names"):
        _rewrite(batch_norm_cnn("layers")[0], sync_batch_statistics=value)


def test_the_cli_flag_syncs_and_inspect_lists_them(tmp_path, capsys):
    from graph_rewriter.cli import main
    src = tmp_path / "cnn.pb"
    src.write_bytes(batch_norm_cnn("layers")[0].SerializeToString())
    out = tmp_path / "out.pb"
    assert main([str(src), str(out), "--device-type", "CPU", "--devices-per-worker", "2",
                 "--sync-batch-statistics"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("synchronised batch statistics (all-reduced over every replica's rows, forward and backward): "
            "bn1/FusedBatchNormV3, bn2/FusedBatchNormV3") in text
    assert not re.search(ROWS_MEET_START, text)


def test_the_cli_refuses_with_exit_2_and_no_output(tmp_path, capsys):
    from graph_rewriter.cli import main
    src = tmp_path / "mlp.pb"
    src.write_bytes(rows_meeting_mlp("batch_max").SerializeToString())
    out = tmp_path / "out.pb"
    assert main([str(src), str(out), "--device-type", "CPU", "--devices-per-worker", "2",
                 "--sync-batch-statistics"]) == 2
    err = capsys.readouterr().err
    assert "graph-rewrite: error:" in err and "'center' cannot be synchronised" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph allreduce, 2 workers x 1 replica, each its own client fed its half
    of every batch: the fused BatchNorms' statistics all-reduced between the processes."""
    (graph_def, reads), feeds = batch_norm_cnn("layers"), cnn_batches(STEPS, BATCH)
    _, want = _one_device(graph_def, feeds, reads)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(), feeds,
                              options={"sync_batch_statistics": True})
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_sum_the_rows_and_their_count_on_loopback_servers(pool, procs, tmp_path):
    """Barlow Twins' cross-correlation divided by ``tf.shape(h)[0]``, between-graph
    allreduce, 2 workers x 1 replica: the products' sum and the count of rows (a float64
    all-reduce) summed between the processes."""
    graph_def, feeds = rows_meeting_mlp("cross_correlation"), dropout_batches(STEPS, BATCH)
    reads = test_rows_meeting.MLP_READS
    _, want = _one_device(graph_def, feeds, reads)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(), feeds,
                              options={"sync_batch_statistics": True})
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
