"""Synchronised batch statistics inside a v2 cond: a BatchNorm behind a training flag.

TensorFlow 2's control flow (what a tf.compat.v1 graph gets unless the script disables
it) builds ``tf.compat.v1.layers.batch_normalization(training=placeholder)`` and tf_keras'
BatchNormalization behind the Keras learning phase as an If op whose branch function
holds the fused BatchNorm, and the backward pass as a second If on the same predicate.
With sync_batch_statistics the rewrite lowers both to Switch and Merge
(passes/lower_conds.py) and synchronises the BatchNorm as in a v1 cond; 2 and 4
replicas then train as one device under every strategy (rtol 1e-5). Without the
option nothing is lowered, and the step differs (the control). The Keras model behind
its learning phase is in tests/test_keras_batch_norm.py, the inference branch after
training in tests/test_sync_batch_statistics.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.cli import main
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing.tf1_scripts import batch_norm_cnn, cnn_batches
from pass_graphs import PS2_WORKERS2

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)
from test_sync_batch_statistics import STEPS, BATCH, RTOL, ATOL, _assert_one_device, _gaps, _one_device, _train

tf1 = tf.compat.v1
KIND = "layers_cond_v2"
LOWERED = ["bn1/cond/then/FusedBatchNormV3", "bn2/cond/then/FusedBatchNormV3"]


def _rewrite(graph_def, replicas=2, **options):
    return gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", **options)


def _functional(graph_def):
    return sorted(n.name for n in graph_def.node if n.op in ("If", "StatelessIf") and "/cond" in n.name
                  and "cond_1" not in n.name)


def test_the_analysis_finds_them_in_the_functions():
    """Before lowering, each statistic is named call:function:node, and is one the plan
    could not sync as it is."""
    found = analyze(graph_io.load_graph(batch_norm_cnn(KIND)[0]))
    assert [n.split(":")[0] for n in found.batch_statistics] == ["bn1/cond", "bn2/cond"]
    assert all(n.endswith(":FusedBatchNormV3") and n in found.statistics_obstacles for n in found.batch_statistics)


@pytest.mark.parametrize("strategy, replicas, options", [
    ("allreduce", 2, {}), ("allreduce", 4, {}), ("ps", 2, {}), ("hybrid", 2, {}),
    ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}), ("allreduce", 4, {"materialize_replicas": True})],
    ids=["allreduce", "allreduce-4", "ps", "hybrid", "reduce_to_one", "allreduce-4-built"])
def test_a_batch_norm_in_a_v2_cond_trains_as_one_device(strategy, replicas, options):
    """Every variable (slots and moving averages included) and the losses equal one
    device's; the plan lists the lowered BatchNorms, has no note on them, and no If of
    theirs is left."""
    (graph_def, reads), feeds = batch_norm_cnn(KIND), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def, replicas, strategy=strategy, sync_batch_statistics=True, **options)
    assert result.plan.sync_batch_statistics == LOWERED
    assert not [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    assert _functional(graph_def) == ["bn1/cond", "bn2/cond", "gradients/bn1/cond_grad/StatelessIf",
                                      "gradients/bn2/cond_grad/StatelessIf"]
    assert _functional(result.graph_def) == []
    _assert_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))


def test_without_the_option_nothing_is_lowered_and_the_step_differs():
    """The control: without the option the Ifs stay, the note names the statistics in
    their functions, and 2 replicas train away from one device."""
    (graph_def, reads), feeds = batch_norm_cnn(KIND), cnn_batches(STEPS, BATCH)
    result = _rewrite(graph_def)
    assert len(_functional(result.graph_def)) == 2 * len(_functional(graph_def))   # per replica
    [note] = [n for n in result.plan.notes if n.startswith(ROWS_MEET_START)]
    assert "'bn1/cond:bn1_cond_true_" in note
    loss_gap, gaps = _gaps(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads))
    assert loss_gap > 1e-3 and max(gaps.values()) > 1e-2


def test_the_lowered_graph_computes_what_the_original_computes():
    """The lowering alone (saver and lower_conds on the one-device graph, no replicas):
    three training steps and then a loss in the inference branch equal the original
    graph's, every variable included, and the Ifs of the BatchNorms are gone."""
    from graph_rewriter.api import _options
    from graph_rewriter.cluster import parse_cluster
    from graph_rewriter.context import RewriteContext
    from graph_rewriter.pass_manager import run_passes
    from graph_rewriter.passes import LowerCondsPass, SaverPass
    (graph_def, reads), feeds = batch_norm_cnn(KIND), cnn_batches(STEPS + 1, BATCH)
    _, options = _options(dict(devices_per_worker=2, sync_batch_statistics=True))
    ctx = RewriteContext(options=options, cluster=parse_cluster(None, None))
    graph = graph_io.load_graph(graph_def)
    run_passes(graph, ctx, SaverPass(), LowerCondsPass())
    lowered = graph_io.to_graph_def(graph, None)
    assert _functional(lowered) == [] and sorted(ctx.lowered_statistics.values()) == LOWERED

    def run(gd):
        g = tf.Graph()
        with g.as_default():
            tf1.import_graph_def(gd, name="")
        with tf1.Session(graph=g) as sess:
            sess.run("init")
            losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds[:STEPS]]
            losses.append(sess.run("loss:0", dict(feeds[STEPS], **{"training:0": False})))
            return np.array(losses), sess.run(reads)

    (got_losses, got), (want_losses, want) = run(lowered), run(graph_def)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_the_option_names_a_statistic_either_way():
    """A name as the analysis gives it (call:function:node, what the note says) or as
    lowered: the same graph as True."""
    graph_def = batch_norm_cnn(KIND)[0]
    everything = _rewrite(graph_def, sync_batch_statistics=True).graph_def.SerializeToString(deterministic=True)
    found = analyze(graph_io.load_graph(graph_def)).batch_statistics
    for names in (found, LOWERED):
        result = _rewrite(graph_def, sync_batch_statistics=names)
        assert result.plan.sync_batch_statistics == LOWERED
        assert result.graph_def.SerializeToString(deterministic=True) == everything
    one = _rewrite(graph_def, sync_batch_statistics=[found[0]])
    assert one.plan.sync_batch_statistics == LOWERED[:1]
    assert [n for n in one.plan.notes if n.startswith(ROWS_MEET_START) and "'bn2/cond/then/FusedBatchNormV3'" in n]


def test_a_given_plan_keeps_the_same_graph():
    graph_def = batch_norm_cnn(KIND)[0]
    result = _rewrite(graph_def, sync_batch_statistics=True)
    again = _rewrite(graph_def, strategy=gr.Plan.from_json(result.plan.to_json()))
    assert again.plan.sync_batch_statistics == LOWERED
    assert again.graph_def.SerializeToString(deterministic=True) == \
        result.graph_def.SerializeToString(deterministic=True)


def test_a_cond_that_cannot_be_lowered_is_refused_by_name():
    """A branch function with a control output is not inlined: the option is refused,
    naming the statistic, its function and the call."""
    graph_def = batch_norm_cnn(KIND)[0]
    call = next(n for n in graph_def.node if n.name == "bn1/cond")
    fn = next(f for f in graph_def.library.function if f.signature.name == call.attr["then_branch"].func.name)
    fn.node_def.add(name="marker", op="NoOp")
    fn.control_ret["marker"] = "marker"
    fn.signature.control_output.append("marker")
    with pytest.raises(gr.GraphRewriteError, match=r"the batch statistic 'bn1/cond:bn1_cond_true_\d+:"
                                                  r"FusedBatchNormV3' cannot be synchronised: it is inside the "
                                                  r"function 'bn1_cond_true_\d+' that 'bn1/cond' calls, which the "
                                                  r"rewrite does not lower"):
        _rewrite(graph_def, sync_batch_statistics=True)


def test_structure_on_gpus():
    """2 workers x 2 GPUs: no If of the BatchNorms is left; each replica's lowered fused
    BatchNorm and its backward are IdentityNs taking their names, the inference
    branch's BatchNorm stays, and the statistics' ops sit on the replica's GPU."""
    result = gr.rewrite(batch_norm_cnn(KIND)[0], PS2_WORKERS2, devices_per_worker=2, sync_batch_statistics=True)
    nodes = {n.name: n for n in result.graph_def.node}
    assert _functional(result.graph_def) == []
    for prefix, device in (("", "/job:worker/replica:0/task:0/device:GPU:0"),
                           ("replica_3/", "/job:worker/replica:0/task:1/device:GPU:1")):
        for bn in ("bn1", "bn2"):
            forward = nodes[f"{prefix}{bn}/cond/then/FusedBatchNormV3"]
            backward = nodes[f"{prefix}gradients/{bn}/cond_grad/StatelessIf/then/grad/FusedBatchNormV3_grad/"
                             "FusedBatchNormGradV3"]
            assert forward.op == backward.op == "IdentityN" and forward.device == backward.device == device
            assert nodes[f"{prefix}{bn}/cond/else/FusedBatchNormV3"].op == "FusedBatchNormV3"
        reduces = [n for name, n in nodes.items() if n.op == "CollectiveReduceV2" and "/sync/" in name
                   and name.startswith(prefix) and (prefix or not name.startswith("replica_"))]
        assert len(reduces) == 10 and {n.device for n in reduces} == {device}


def test_the_cli_flag_lowers_and_inspect_lists_them(tmp_path, capsys):
    src, out = tmp_path / "in.pb", tmp_path / "out.pb"
    src.write_bytes(batch_norm_cnn(KIND)[0].SerializeToString())
    assert main([str(src), str(out), "--device-type", "CPU", "--devices-per-worker", "2",
                 "--sync-batch-statistics", "-v"]) == 0
    err = capsys.readouterr().err
    assert "lower_conds: 2 v2 cond(s) holding batch statistics lowered to Switch and Merge: 'bn1/cond' (and its " \
           "backward 'gradients/bn1/cond_grad/StatelessIf'), 'bn2/cond'" in err
    assert main(["inspect", str(out)]) == 0
    assert "bn1/cond/then/FusedBatchNormV3" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph allreduce, 2 workers x 1 replica, each its own client fed its half
    of every batch: the lowered BatchNorms' statistics all-reduced between the processes."""
    (graph_def, reads), feeds = batch_norm_cnn(KIND), cnn_batches(STEPS, BATCH)
    _, want = _one_device(graph_def, feeds, reads)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(), feeds,
                              options={"sync_batch_statistics": True})
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
