"""The rewritten graph under the TF1 tools a training script already uses.

A rewritten MetaGraphDef is imported with ``tf.compat.v1.train.import_meta_graph`` and
trained by ``tf.compat.v1.train.MonitoredTrainingSession`` with the default Scaffold
and the standard hooks (StopAtStepHook, CheckpointSaverHook, SummarySaverHook,
LoggingTensorHook, NanTensorHook, StepCounterHook); then the client stops and a new
one resumes from the checkpoint. The variables at the end equal one device's after
the same steps on the same global batches.

In-graph (one client, in this process) for allreduce and ps; between-graph (a client
process per worker on real loopback servers, the chief alone checkpointing, the
clients killed mid-run and restarted) in the slow suite.
"""

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.local_cluster import LocalCluster
from graph_rewriter.testing import models

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6
CLIENT_TIMEOUT = 240


def script_graph(embedding=False):
    """A TF1 script's graph: tf.compat.v1.losses (the LOSSES collection), a scalar
    summary, global_step, Adam, an init op and a Saver; exported as a MetaGraphDef.
    ``embedding``: the features also look up rows of a table by "ids" (a sparse
    gradient)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        if embedding:
            ids = tf1.placeholder(tf.int32, [None], name="ids")
            table = tf1.get_variable("table", [EMBEDDING_ROWS, 2], use_resource=True)
            x = tf.concat([x[:, :4], tf.nn.embedding_lookup(table, ids)], axis=1)
        w1 = tf1.get_variable("fc1/kernel", [6, 8], use_resource=True)
        b1 = tf1.get_variable("fc1/bias", [8], initializer=tf1.zeros_initializer(), use_resource=True)
        w2 = tf1.get_variable("fc2/kernel", [8, 1], use_resource=True)
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        loss = tf.identity(tf1.losses.mean_squared_error(y, tf.matmul(h, w2)), name="loss")
        tf1.summary.scalar("loss", loss)
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(0.05).minimize(loss, global_step=step, name="train_op")
        tf1.add_to_collection(tf1.GraphKeys.TRAIN_OP, train)
        tf1.global_variables_initializer()
        saver = tf1.train.Saver()
        return saver.export_meta_graph()


EMBEDDING_ROWS = 10


def batch(step, rows=8):
    rng = np.random.RandomState(100 + step)
    return {"x:0": rng.randn(rows, 6).astype(np.float32), "y:0": rng.randn(rows, 1).astype(np.float32),
            "ids:0": rng.randint(0, EMBEDDING_ROWS, size=rows).astype(np.int32)}


def feeds_of(meta):
    """The batch function for a graph: without the ids when it has no embedding."""
    names = {n.name for n in meta.graph_def.node}
    return lambda step, rows=8: {k: v for k, v in batch(step, rows).items() if k.split(":")[0] in names}


def one_device(meta, steps, feeds=batch):
    """(the variables after ``steps`` steps, the loss of each step)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta)
        with tf1.Session() as sess:
            sess.run("init")
            losses = [sess.run(["loss:0", "train_op"], feeds(s))[0] for s in range(steps)]
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}, losses


def monitored_run(meta_path, checkpoint_dir, last_step, config, master="", feeds=batch):
    """Trains to ``last_step`` with MonitoredTrainingSession and every standard hook;
    returns (the global steps it ran, the variables at the end)."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta_path)
        loss = graph.get_tensor_by_name("loss:0")
        step = tf1.train.get_global_step()
        hooks = [tf1.train.StopAtStepHook(last_step=last_step), tf1.train.NanTensorHook(loss),
                 tf1.train.LoggingTensorHook({"loss": loss}, every_n_iter=1),
                 tf1.train.StepCounterHook(every_n_steps=1, output_dir=checkpoint_dir)]
        ran = []
        with tf1.train.MonitoredTrainingSession(master=master, checkpoint_dir=checkpoint_dir, hooks=hooks,
                                                config=config,
                                                save_checkpoint_steps=1, save_summaries_steps=1) as sess:
            while not sess.should_stop():
                at = int(sess.run_step_fn(lambda step_context: step_context.session.run(step)))
                sess.run("train_op", feeds(at))
                ran.append(at)
            values = sess.run_step_fn(
                lambda step_context: step_context.session.run({v.op.name: v for v in tf1.global_variables()}))
    return ran, values


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_in_graph_monitored_training_session_with_hooks_restarts_from_its_checkpoint(strategy, tmp_path):
    meta = script_graph()
    result = gr.rewrite(meta, strategy=strategy, devices_per_worker=2, device_type="CPU")
    path = result.save(str(tmp_path / "rewritten.meta"))
    assert result.should_checkpoint and result.should_save_summary   # the one client
    config = result.session_config()
    ckpt = str(tmp_path / "ckpt")
    feeds = feeds_of(meta)
    first, _ = monitored_run(path, ckpt, 2, config, feeds=feeds)
    assert first == [0, 1]
    assert tf.train.latest_checkpoint(ckpt).endswith("model.ckpt-2")
    second, values = monitored_run(path, ckpt, 4, config, feeds=feeds)
    assert second == [2, 3], "the second client did not resume from the checkpoint"
    want, losses = one_device(meta, 4, feeds_of(meta))
    assert sorted(values) == sorted(want)   # the original variables, by their original names
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt))
    assert set(reader.get_variable_to_shape_map()) == set(want)
    # the SummarySaverHook wrote the loss summary at every step: the mean over the
    # replicas, which is one device's loss (a mean over equal halves of the batch)
    summaries = {e.step: v.simple_value for f in glob.glob(os.path.join(ckpt, "events.out.tfevents.*"))
                 for e in tf1.train.summary_iterator(f) for v in e.summary.value if v.tag == "loss_1"}
    assert sorted(summaries) == [1, 2, 3, 4], summaries
    np.testing.assert_allclose([summaries[s + 1] for s in range(4)], losses, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_in_graph_monitored_training_on_loopback_servers_restarts_from_its_checkpoint(strategy, tmp_path):
    """One client drives two worker servers (and a ps) on loopback; the servers outlive
    the first client, the second resumes from the checkpoint."""
    meta = script_graph(embedding=strategy == "hybrid")
    feeds = feeds_of(meta)
    ckpt = str(tmp_path / "ckpt")
    with LocalCluster(workers=2, ps=1, device_type="CPU", devices_per_worker=1) as cluster:
        result = gr.rewrite(meta, cluster.spec, strategy=strategy, device_type="CPU")
        path = result.save(str(tmp_path / "rewritten.meta"))
        config = result.session_config()
        first, _ = monitored_run(path, ckpt, 2, config, cluster.target("worker", 0), feeds)
        second, values = monitored_run(path, ckpt, 4, config, cluster.target("worker", 0), feeds)
    assert (first, second) == ([0, 1], [2, 3])
    want, _ = one_device(meta, 4, feeds)
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_graph_def_input_yields_a_meta_graph_with_its_collections(tmp_path):
    """A .pb has no collections: the .meta output gets what the analysis infers."""
    example = models.build("mlp", "adam")
    result = gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU")
    from tensorflow.core.protobuf import meta_graph_pb2
    mg = meta_graph_pb2.MetaGraphDef.FromString(open(result.save(str(tmp_path / "out.meta")), "rb").read())
    for key in ("variables", "trainable_variables", "global_step", "savers", "init_op", "local_init_op",
                "ready_op", "ready_for_local_init_op"):
        assert key in mg.collection_def, key
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(mg)
        names = sorted(v.op.name for v in tf1.global_variables())
        assert names == sorted(example.variables)
        assert sorted(v.op.name for v in tf1.trainable_variables()) == sorted(
            n for n in example.variables if "Adam" not in n and n not in ("global_step", "beta1_power", "beta2_power"))
        assert tf1.train.get_global_step().op.name == "global_step"
        with tf1.Session(config=result.session_config()) as sess:
            report = graph.get_tensor_by_name(mg.collection_def["ready_op"].node_list.value[0])
            assert sorted(sess.run(report).astype(str)) == names   # all uninitialized
            sess.run(mg.collection_def["init_op"].node_list.value[0])
            sess.run(mg.collection_def["local_init_op"].node_list.value[0])
            assert list(sess.run(report)) == []


# ----- between-graph ---------------------------------------------------------------------

def _write_batches(tmp_path, feeds, steps, rows):
    """Each of two workers' halves of every global batch (2 * rows rows), as
    mts_worker reads them: feeds<w>.npz, arrays "<feed>__<step>"."""
    for w in range(2):
        np.savez(tmp_path / f"feeds{w}.npz",
                 **{f"{name}__{s}": value[w * rows:(w + 1) * rows]
                    for s in range(steps) for name, value in feeds(s, 2 * rows).items()})


def _assert_clients_equal_one_device(meta, feeds, outs, steps, rows, ran):
    """Both clients ran the steps ``ran`` and end with one device's fc1/kernel after
    ``steps`` global batches."""
    runs = [json.load(open(o)) for o in outs]
    assert [r["steps"] for r in runs] == [ran, ran]
    want, _ = one_device(meta, steps, lambda s: feeds(s, 2 * rows))
    for r in runs:
        np.testing.assert_allclose(r["values"]["fc1/kernel/Read/ReadVariableOp:0"], want["fc1/kernel"],
                                   rtol=RTOL, atol=ATOL)


def _client(meta, target, chief, ckpt, last_step, feeds, out, stop_after=0):
    cmd = [sys.executable, "-m", "graph_rewriter.testing.mts_worker", "--graph", meta, "--target", target,
           "--last-step", str(last_step), "--batches", feeds, "--out", out, "--timeout", "60",
           "--read", "fc1/kernel/Read/ReadVariableOp:0"]
    if chief:
        cmd += ["--chief", "--checkpoint-dir", ckpt]
    if stop_after:
        cmd += ["--stop-after", str(stop_after)]
    return cmd


def _start(launcher, cmd, log):
    with open(log, "a") as out:
        return launcher.popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def _run_clients(launcher, cmds, logs):
    procs = [_start(launcher, c, log) for c, log in zip(cmds, logs)]
    try:
        return [p.wait(timeout=CLIENT_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, 9)
                p.wait(timeout=30)


def _tail(path):
    with open(path) as f:
        return "".join(f.readlines()[-30:])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_between_graph_monitored_training_killed_and_restarted_equals_one_device(strategy, tmp_path, launcher):
    """Two workers (and a ps), each its own MonitoredTrainingSession client; the chief
    checkpoints at every step. Both clients are killed after 2 steps (os._exit, the
    servers live on), then restarted: the chief restores, every worker takes the
    restored variables (the local init op's broadcast), and 4 steps end where one device
    ends after the 4 global batches."""
    meta = script_graph(embedding=strategy == "hybrid")
    feeds = feeds_of(meta)
    steps = 4
    rows = 8
    _write_batches(tmp_path, feeds, steps, rows)
    ckpt = str(tmp_path / "ckpt")
    logs = [str(tmp_path / f"client{w}.log") for w in range(2)]
    with LocalCluster(workers=2, ps=1, device_type="CPU", devices_per_worker=1) as cluster:
        metas = []
        for w in range(2):
            result = gr.rewrite(meta, cluster.spec, task=f"worker:{w}", strategy=strategy, device_type="CPU")
            metas.append(result.save(str(tmp_path / f"worker{w}.meta")))
            assert result.is_chief == result.should_checkpoint == result.should_save_summary == (w == 0)
            if strategy == "hybrid":
                # the graph's own restore ends with a workers' barrier; a client's restores alone
                restore = result.metadata["saver"]["restore_op_name"]
                assert restore.startswith("graph_rewriter/collections/restore"), restore
        outs = [str(tmp_path / f"out{w}.json") for w in range(2)]

        def cmds(stop_after=0):
            return [_client(metas[w], cluster.target("worker", w), w == 0, ckpt, steps,
                            str(tmp_path / f"feeds{w}.npz"), outs[w], stop_after) for w in range(2)]

        codes = _run_clients(launcher, cmds(stop_after=2), logs)
        assert codes == [17, 17], (codes, _tail(logs[0]), _tail(logs[1]))   # killed after two steps
        assert tf.train.latest_checkpoint(ckpt).endswith("model.ckpt-2"), _tail(logs[0])
        codes = _run_clients(launcher, cmds(), logs)
        assert codes == [0, 0], (codes, _tail(logs[0]), _tail(logs[1]))
    runs = [json.load(open(o)) for o in outs]
    assert [r["steps"] for r in runs] == [[2, 3], [2, 3]]
    want, _ = one_device(meta, steps, lambda s: feeds(s, 2 * rows))
    if strategy == "hybrid":
        assert any(v.placement == "ps" for v in result.plan.variables), "the table is not on the ps"
    for r in runs:
        np.testing.assert_allclose(r["values"]["fc1/kernel/Read/ReadVariableOp:0"], want["fc1/kernel"], rtol=RTOL, atol=ATOL)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(ckpt))
    np.testing.assert_allclose(reader.get_tensor("fc1/kernel"), want["fc1/kernel"], rtol=RTOL, atol=ATOL)
    assert reader.get_tensor("global_step") == steps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_monitored_client_started_alone_waits_for_its_peer_and_leaves_the_servers_usable(tmp_path, launcher):
    """``gr.HeartbeatHook(master=target)`` beats and waits for every peer's client before
    MonitoredTrainingSession creates its session (which runs the init ops and their
    collectives): worker 0's client started alone fails after the graph's timeout (8 s)
    naming worker 1, with nothing run; then both clients, on the same servers, train
    like one device."""
    meta = script_graph()
    feeds = feeds_of(meta)
    steps, rows = 2, 8
    _write_batches(tmp_path, feeds, steps, rows)
    ckpt = str(tmp_path / "ckpt")
    outs = [str(tmp_path / f"out{w}.json") for w in range(2)]
    with LocalCluster(workers=2, device_type="CPU", devices_per_worker=1) as cluster:
        metas = [gr.rewrite(meta, cluster.spec, task=f"worker:{w}", device_type="CPU", timeout_seconds=8)
                 .save(str(tmp_path / f"worker{w}.meta")) for w in range(2)]
        cmds = [_client(metas[w], cluster.target("worker", w), w == 0, ckpt, steps,
                        str(tmp_path / f"feeds{w}.npz"), outs[w]) for w in range(2)]
        lone_log = str(tmp_path / "lone.log")
        started = time.monotonic()
        assert _run_clients(launcher, cmds[:1], [lone_log]) != [0]
        took = time.monotonic() - started
        assert "the session was not created: no heartbeat within 8 s from worker:1" in _tail(lone_log), \
            _tail(lone_log)
        assert took < 60, took   # the wait (8 s) and the client's start, not the 60 s step timeout
        assert not os.path.exists(outs[0])
        logs = [str(tmp_path / f"client{w}.log") for w in range(2)]
        codes = _run_clients(launcher, cmds, logs)
        assert codes == [0, 0], (codes, _tail(logs[0]), _tail(logs[1]))
    _assert_clients_equal_one_device(meta, feeds, outs, steps, rows, ran=[0, 1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ps_worker_restarted_before_its_chief_waits_for_the_chiefs_reset(tmp_path, launcher):
    """Parameter servers that kept running: after both clients were killed, worker 1's
    client is started again 5 s before the chief's. Its session is ready at once (the ps
    variables are still initialized), but the chief's restore empties the accumulators:
    a gradient pushed before it would be drained, and the chief's first take would wait
    for ever. ``HeartbeatHook(master=...)`` makes worker 1 wait until the chief's client
    of this run has reset the parameter servers' state (the run id the chief drew, copied
    by its restore), so both train on and end like one device."""
    meta = script_graph()
    feeds = feeds_of(meta)
    steps, rows = 4, 8
    _write_batches(tmp_path, feeds, steps, rows)
    ckpt = str(tmp_path / "ckpt")
    outs = [str(tmp_path / f"out{w}.json") for w in range(2)]
    logs = [str(tmp_path / f"client{w}.log") for w in range(2)]
    with LocalCluster(workers=2, ps=1, device_type="CPU", devices_per_worker=1) as cluster:
        metas = [gr.rewrite(meta, cluster.spec, task=f"worker:{w}", strategy="ps", device_type="CPU")
                 .save(str(tmp_path / f"worker{w}.meta")) for w in range(2)]

        def cmd(w, stop_after=0):
            return _client(metas[w], cluster.target("worker", w), w == 0, ckpt, steps,
                           str(tmp_path / f"feeds{w}.npz"), outs[w], stop_after)

        assert _run_clients(launcher, [cmd(0, 2), cmd(1, 2)], logs) == [17, 17]
        procs = [_start(launcher, cmd(1), logs[1])]
        try:
            time.sleep(5.0)
            assert procs[0].poll() is None, _tail(logs[1])   # waiting for the chief, not failed
            procs.insert(0, _start(launcher, cmd(0), logs[0]))
            codes = [p.wait(timeout=CLIENT_TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, 9)
                    p.wait(timeout=30)
        assert codes == [0, 0], (codes, _tail(logs[0]), _tail(logs[1]))
    _assert_clients_equal_one_device(meta, feeds, outs, steps, rows, ran=[2, 3])
