"""Losses summed over the batch's rows: ``tf.reduce_sum`` of squared errors,
``tf.nn.l2_loss``, a ``tf.compat.v1.losses`` loss with ``reduction=SUM``.

One device's gradient of such a loss over the R replicas' batches is the sum of the
replicas' gradients; averaging them (every strategy does) divided it by R. Without the
loss_sums pass (the control below), two CPU replicas train the ``reduce_sum`` MLP 0.081
away from one device in the weights after three SGD steps, and report half its loss.
Now each replica's sum, and the gradient into it, counts
R times: R replicas compute what one device computes on their R batches
(docs/semantics.md, "Gradients").
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing.tf1_scripts import MEAN_LOSSES, SUMMED_LOSSES, dropout_batches, summed_loss_mlp
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 3, 8
RTOL, ATOL = 2e-5, 1e-5
READS = {"w1": "w1/Read/ReadVariableOp:0", "w2": "w2/Read/ReadVariableOp:0"}
# kind -> the sum the analysis lists, with a dynamic batch
FOUND = {"sum": ["Sum"], "l2_loss": ["L2Loss"], "losses_sum": ["mean_squared_error/Sum"], "xent_sum": ["Sum"],
         "sum_plus_decay": ["Sum"], "loss_scaled": ["Sum"], "learned_weight": ["Sum"], "counted": ["Sum"],
         "sum_over_batch": ["Sum"], "sum_of_row_sums": ["total"]}


def _reads(kind):
    reads = dict(READS)
    if kind == "learned_weight":
        reads["c"] = "c/Read/ReadVariableOp:0"
    if kind == "counted":
        reads["loss_total"] = "loss_total/Read/ReadVariableOp:0"
    return reads


def _train(session, feeds, reads):
    with session as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return losses, sess.run(reads)


def _one_device(graph_def, feeds, reads):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds, reads)


def _assert_same(got, want, what):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL, err_msg=f"{what}: losses")
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=f"{what}: {name}")


def _assert_trains_as_one_device(kind, replicas=2, optimizer="sgd", **options):
    graph_def, feeds, reads = summed_loss_mlp(kind, optimizer=optimizer), dropout_batches(STEPS, 2 * BATCH), _reads(kind)
    want = _one_device(graph_def, feeds, reads)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", **options)
    assert result.plan.loss_sums == FOUND.get(kind)
    _assert_same(_train(gr.Session(result), feeds, reads), want, f"{kind}, {replicas} replicas, {options}")
    return result


@pytest.mark.parametrize("kind", SUMMED_LOSSES + MEAN_LOSSES)
def test_the_analysis_finds_the_losses_summed_over_the_rows(kind):
    """Listed: a sum of squared errors, an l2_loss, tf.compat.v1.losses with SUM, a summed
    cross entropy, a sum plus weight decay, a loss-scaled sum, a sum with a trainable
    weight, a sum also counted in a statistic, a sum divided by a constant (16.0) that
    is no count of a dynamic batch's rows, a sum of per-row sums (its rank read through
    the inner reduction). Not: a mean, a sum divided by tf.shape(x)[0], the mean
    of per-example sums, Keras' and tf.compat.v1.losses' default reductions."""
    assert analyze(graph_io.load_graph(summed_loss_mlp(kind))).loss_sums == FOUND.get(kind, [])


@pytest.mark.parametrize("kind, found", [("sum", ["Sum"]), ("l2_loss", ["L2Loss"]), ("sum_plus_decay", ["Sum"]),
                                         ("losses_sum", ["mean_squared_error/Sum"]), ("sum_over_batch", []),
                                         ("losses_default", []), ("keras_mse", []), ("mean", [])])
def test_with_static_batches_a_division_by_the_batch_size_is_a_mean(kind, found):
    """With a static batch B, ``reduce_sum(x) / B`` is a mean (a model built for R x B
    divides by R x B), as is tf.compat.v1.losses' count of present weights (a Sum of
    ones of the batch's static shape) and Keras' (a constant size)."""
    assert analyze(graph_io.load_graph(summed_loss_mlp(kind, batch=BATCH))).loss_sums == found


@pytest.mark.parametrize("kind", SUMMED_LOSSES)
def test_two_replicas_train_as_one_device(kind):
    """Loss every step and every variable (the learned weight; the statistic adding the
    sum up: summed across the replicas, from the replicas' own sums) equal one device's
    on the same 16-row batches, under allreduce."""
    _assert_trains_as_one_device(kind)


@pytest.mark.parametrize("kind", ["sum", "sum_plus_decay", "learned_weight", "counted", "loss_scaled"])
@pytest.mark.parametrize("strategy", ["ps", "hybrid"])
def test_two_replicas_train_as_one_device_under_ps_and_hybrid(strategy, kind):
    _assert_trains_as_one_device(kind, strategy=strategy)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_optimizers_with_state_see_one_devices_gradient(strategy, optimizer):
    """Momentum and Adam written by hand (assign ops) amplify a gradient off by R in
    their slots; they match one device too."""
    _assert_trains_as_one_device("sum_plus_decay", optimizer=optimizer, strategy=strategy)


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_four_replicas_train_as_one_device(strategy):
    """Four replicas (a template replica under allreduce): the factor is 4."""
    result = _assert_trains_as_one_device("sum_plus_decay", replicas=4, strategy=strategy)
    factors = [n for n in result.graph_def.node if n.name.endswith("/factor")]
    assert factors and {n.attr["value"].tensor.float_val[0] for n in factors} == {4.0}


def test_micro_batches_count_every_runs_rows():
    """accumulation_steps=2 on 2 replicas: two runs, each fed half of a batch, end where
    one device's step on the whole batch ends (the gradient counts R x k = 4 times)."""
    graph_def, reads = summed_loss_mlp("sum_plus_decay"), _reads("sum_plus_decay")
    feeds = dropout_batches(STEPS, 4 * BATCH)
    _, want = _one_device(graph_def, feeds, reads)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", accumulation_steps=2)
    assert result.plan.loss_sums == ["Sum"]
    with gr.Session(result) as sess:
        sess.run("init")
        for feed in feeds:
            for half in range(2):
                sess.run("train_op", {k: v[half * 2 * BATCH:(half + 1) * 2 * BATCH] for k, v in feed.items()})
        got = sess.run(reads)
    for name in reads:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("kind", ["sum", "l2_loss", "sum_plus_decay", "sum_over_batch"])
def test_static_batches_train_as_one_device_built_for_the_global_batch(kind):
    """A batch-8 graph on 2 replicas fed 16 rows equals the same script built for 16:
    its sums over 16 rows, and ``reduce_sum(x) / 16`` (a mean, left averaged)."""
    feeds, reads = dropout_batches(STEPS, 2 * BATCH), _reads(kind)
    want = _one_device(summed_loss_mlp(kind, batch=2 * BATCH), feeds, reads)
    result = gr.rewrite(summed_loss_mlp(kind, batch=BATCH), devices_per_worker=2, device_type="CPU")
    _assert_same(_train(gr.Session(result), feeds, reads), want, f"static {kind}")


def test_the_loss_fetched_by_name_is_one_devices_in_any_session():
    """The sum's scaled value takes the sum's name, so Session's mean over the replicas
    of ``Sum:0`` and of ``loss:0``, and a plain session's ``loss:0`` (merged in the graph,
    ``outputs``), are one device's sum over the batch."""
    graph_def, feeds = summed_loss_mlp("sum_plus_decay"), dropout_batches(1, 2 * BATCH)
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        want = sess.run(["loss:0", "Sum:0"], feeds[0])
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", outputs=["loss:0"])
    with gr.Session(result) as sess:
        sess.run("init")
        np.testing.assert_allclose(sess.run(["loss:0", "Sum:0"], feeds[0]), want, rtol=RTOL)
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(result.graph_def, name="")
    with tf1.Session(graph=graph, config=result.session_config()) as sess:
        sess.run("init")
        rows = {"x:0": feeds[0]["x:0"], "y:0": feeds[0]["y:0"]}
        np.testing.assert_allclose(sess.run("loss:0", rows), want[0], rtol=RTOL)


def test_without_the_pass_two_replicas_are_off_by_the_replica_count(tmp_path):
    """The control: a given plan's ``"loss_sums": []`` (here read back from JSON) keeps
    the average, and the training differs from one device's."""
    graph_def, feeds, reads = summed_loss_mlp("sum"), dropout_batches(STEPS, 2 * BATCH), _reads("sum")
    want = _one_device(graph_def, feeds, reads)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    assert plan.loss_sums == ["Sum"]
    plan.loss_sums = []
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=str(path))
    assert result.metadata["plan"]["loss_sums"] == []
    assert not [n for n in result.graph_def.node if n.name.endswith("/factor")]
    got = _train(gr.Session(result), feeds, reads)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 1e-1


def test_a_given_plan_names_only_sums_the_graph_has():
    graph_def = summed_loss_mlp("sum")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.loss_sums = ["Square"]
    with pytest.raises(gr.GraphRewriteError, match="loss_sums names 'Square'.*found: Sum"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


def test_gpu_replicas_scale_on_their_own_gpus_and_the_sum_keeps_its_name():
    """Structure: every replica's scaled sum is a Mul named as the sum was, reading the
    renamed sum on the replica's GPU; the gradient's entry reads the gradient times R."""
    result = gr.rewrite(summed_loss_mlp("sum"), devices_per_worker=2)
    nodes = {n.name: n for n in result.graph_def.node}
    for prefix, gpu in (("", "GPU:0"), ("replica_1/", "GPU:1")):
        scaled = nodes[f"{prefix}Sum"]
        assert scaled.op == "Mul" and scaled.input[0] == f"{prefix}Sum/replica_rows"
        assert nodes[f"{prefix}Sum/replica_rows"].op == "Sum"
        assert scaled.device.endswith(gpu) and nodes[scaled.input[1]].attr["value"].tensor.float_val == [2.0]
        entry = nodes[f"{prefix}gradients/Sum_grad/Reshape"]
        assert nodes[entry.input[0]].op == "Mul" and nodes[entry.input[0]].device.endswith(gpu)
    assert result.plan.loss_sums == ["Sum"]


def test_inspect_lists_the_loss_sums(tmp_path, capsys):
    path = gr.rewrite(summed_loss_mlp("l2_loss"), devices_per_worker=2, device_type="CPU").save(
        str(tmp_path / "sum.pb"))
    from graph_rewriter.cli import main
    assert main(["inspect", path]) == 0
    assert "losses summed over the batch's rows (each replica's sum and its gradient count 2 times): L2Loss" \
        in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["mean", "keras_mse", "losses_default", "sum_over_rows", "mean_of_row_sums"])
def test_mean_losses_are_left_alone_and_train_as_one_device(kind):
    _assert_trains_as_one_device(kind)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_two_workers_train_as_one_device_on_loopback_servers(strategy, pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica, each its own client fed its half of every
    batch: the factor is the global replica count, 2."""
    feeds, graph_def = dropout_batches(STEPS, 2 * BATCH), summed_loss_mlp("sum_plus_decay")
    _, want = _one_device(graph_def, feeds, READS)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, READS.values(), feeds)
    for name, tensor in READS.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")


def test_between_graph_ps_scales_by_the_global_replica_count():
    """Worker 1 of 2 workers x 2 replicas under ps: its graph holds 2 replicas, and its
    factor is the 4 replicas whose gradients the accumulators average."""
    result = gr.rewrite(summed_loss_mlp("sum"), PS2_WORKERS2, strategy="ps", devices_per_worker=2,
                        device_type="CPU", task="worker:1")
    factors = [n for n in result.graph_def.node if n.name.endswith("/factor")]
    assert factors and {n.attr["value"].tensor.float_val[0] for n in factors} == {4.0}


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_the_template_export_equals_every_replica_built(strategy):
    """Four replicas from a template replica: the export writes every replica's scaled
    sum and gradient entry as building every replica does."""
    from test_template_replicas import _assert_same_graph, _rewrite_both, _used_template
    built, template, lines, _ = _rewrite_both(summed_loss_mlp("counted"), devices_per_worker=4, device_type="CPU",
                                              strategy=strategy)
    assert _used_template(lines)
    _assert_same_graph(built, template)
    assert built["replica_3/Sum"].op == "Mul" and built["replica_3/Sum"].input[0] == "replica_3/Sum/replica_rows"


def test_a_plan_that_leaves_a_counted_sum_unscaled_must_sum_its_statistic():
    """A statistic adding a loss sum up is averaged because every replica's sum counts R
    times; a given plan that leaves the sum unscaled but the statistic averaged would
    count 1/R of it, and is refused, naming both."""
    graph_def = summed_loss_mlp("counted")
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    assert plan.cut("loss_total").combine is None
    plan.loss_sums = []
    with pytest.raises(gr.GraphRewriteError, match="leaves the loss sum 'Sum' unscaled.*'loss_total'"):
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
