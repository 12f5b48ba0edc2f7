"""The server configuration (graph_rewriter/server.py, `graph-rewrite serve`).

What is held (docs/deployment.md, "Server configuration"):

- ``server_config`` sets the collective group leader, the CPU device count for CPU
  replicas and the inter-op threads; ``communication="nccl"`` sets
  ``experimental.collective_nccl`` (NCCL for every GPU collective), "auto" and "ring"
  leave it off (TensorFlow's default); nccl for CPU replicas and unknown values are
  refused, by ``server_config``, ``start_server`` and ``graph-rewrite serve``.
- The scoped allocator, which TensorFlow's MultiWorkerMirroredStrategy turns on for
  CollectiveReduce, stays off: the emitted graphs use CollectiveReduceV2, which it does
  not rewrite (docs/deployment.md says why).
- For real (slow): two `graph-rewrite serve --communication ring` processes on loopback
  (ports from free_port(), bounded waits, both ended by their process ids) train an in-graph
  allreduce rewrite like one device.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import server
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.local_cluster import accepts, free_port
from graph_rewriter.testing import harness, models

GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
SPEC = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"], "ps": ["localhost:4"]}
START_TIMEOUT = 120.0     # a server listening
CALL_TIMEOUT = 60.0       # any one session call
STOP_TIMEOUT = 30.0       # a server leaving after SIGTERM


def _config(task="worker:1", **kwargs):
    return server.server_config(parse_cluster(SPEC, task), **kwargs)


def test_default_config_sets_the_leader_devices_and_threads_and_leaves_nccl_and_the_scoped_allocator_off():
    config = _config(device_type="CPU", devices_per_worker=3)
    assert config.experimental.collective_group_leader == "/job:chief/replica:0/task:0"
    assert config.device_count["CPU"] == 3
    assert config.inter_op_parallelism_threads == 3 * 3 + 2       # 3 replicas on each of 3 trainers, + 2
    assert config.experimental.collective_nccl is False
    rewrite_options = config.graph_options.rewrite_options
    assert rewrite_options.scoped_allocator_optimization == rewrite_options.DEFAULT   # not turned on
    assert list(rewrite_options.scoped_allocator_opts.enable_op) == []
    assert list(config.device_filters) == []


@pytest.mark.parametrize("communication, nccl", [("auto", False), ("ring", False), ("nccl", True)])
def test_communication_sets_collective_nccl_only_for_nccl(communication, nccl):
    config = _config(device_type="GPU", devices_per_worker=8, communication=communication)
    assert config.experimental.collective_nccl is nccl
    assert "CPU" not in config.device_count                          # GPU servers keep every CPU
    assert config.experimental.collective_group_leader == "/job:chief/replica:0/task:0"


@pytest.mark.parametrize("kwargs, words", [
    (dict(device_type="CPU", communication="nccl"), ["'nccl'", "GPU", "CPU"]),
    (dict(communication="mpi"), ["'mpi'", "auto, ring, nccl"]),
])
def test_refused_communication_is_a_clear_error(kwargs, words):
    with pytest.raises(gr.GraphRewriteError) as e:
        _config(**kwargs)
    for word in words:
        assert word in str(e.value)


def test_start_server_hands_the_config_to_tensorflow_and_publishes_the_number_before_serving(monkeypatch):
    seen, order = {}, []

    class FakeServer:
        def start(self):
            order.append("start")

    def fake_server(cluster_spec, job_name, task_index, config, start):
        seen.update(job=job_name, index=task_index, config=config, start=start)
        return FakeServer()

    monkeypatch.setattr(server.tf.distribute, "Server", fake_server)
    monkeypatch.setattr(server, "publish", lambda srv, cluster: order.append(("publish", cluster.task)))
    assert isinstance(gr.start_server(SPEC, "ps:0", communication="nccl", devices_per_worker=4), FakeServer)
    # made without serving, given its number, then started (graph_rewriter/incarnations.py)
    assert (seen["job"], seen["index"], seen["start"]) == ("ps", 0, False)
    assert order == [("publish", ("ps", 0)), "start"]
    assert seen["config"].experimental.collective_nccl is True
    assert seen["config"].experimental.collective_group_leader == "/job:chief/replica:0/task:0"
    order.clear()
    gr.start_server(SPEC, "worker:1", start=False)
    assert order == [("publish", ("worker", 1))]
    with pytest.raises(gr.GraphRewriteError, match="nccl"):
        gr.start_server(SPEC, "worker:0", device_type="CPU", communication="nccl")


@pytest.mark.parametrize("flags, words", [
    (["--device-type", "CPU", "--communication", "nccl"], ["'nccl' runs on GPUs"]),
    (["--communication", "mpi"], ["--communication", "mpi"]),
])
def test_serve_refuses_a_bad_communication_with_one_line(flags, words):
    proc = subprocess.run([GRAPH_REWRITE, "serve", "--cluster", json.dumps({"worker": ["localhost:1"]}),
                           "--task", "worker:0", *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("graph-rewrite: error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr


def test_serve_help_lists_the_communication_flag():
    proc = subprocess.run([GRAPH_REWRITE, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--communication auto|ring|nccl" in proc.stdout and "collective_nccl" in proc.stdout


# ----- for real: loopback servers started with the configuration ---------------------

@pytest.fixture
def servers(tmp_path):
    """Starts `graph-rewrite serve` processes; ends every one of them by its id."""
    started = []

    def start(spec, task, *flags):
        log = open(tmp_path / f"{task.replace(':', '_')}.log", "wb")
        proc = subprocess.Popen([GRAPH_REWRITE, "serve", "--cluster", json.dumps(spec), "--task", task, *flags],
                                stdout=log, stderr=log, start_new_session=True,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1"))
        log.close()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_servers_started_with_the_config_train_an_allreduce_rewrite_like_one_device(servers, tmp_path):
    spec = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    procs = [servers(spec, f"worker:{i}", "--device-type", "CPU", "--devices-per-worker", "2",
                     "--communication", "ring") for i in range(2)]
    deadline = time.monotonic() + START_TIMEOUT
    for address, proc in zip(spec["worker"], procs):
        port = int(address.rsplit(":", 1)[1])
        while not accepts(port):
            assert proc.poll() is None, f"the server for {address} exited with status {proc.returncode}"
            assert time.monotonic() < deadline, f"the server for {address} did not listen within {START_TIMEOUT:.0f} s"
            time.sleep(0.2)

    ex = models.build("mlp", "adam", seed=11)
    steps, batch = 3, 8
    ref_losses, ref_values = harness.run_single(ex, steps=steps, batch_size=batch)
    result = gr.rewrite(ex.graph_def, spec, devices_per_worker=2, device_type="CPU", communication="ring")
    reduces = [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"]
    assert reduces and {n.attr["communication_hint"].s for n in reduces} == {b"ring"}
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(CALL_TIMEOUT * 1000))
    with gr.Session(result, target=f"grpc://{spec['worker'][0]}") as sess:
        sess.run(ex.init, options=options)
        losses = [float(sess.run([ex.loss, ex.train_op], feed_dict=ex.batch(s, batch), options=options)[0])
                  for s in range(steps)]
        values = sess.run(dict(ex.variables), options=options)
        copies = harness.read_replica_copies(sess, ex, result.metadata["replica_prefixes"][1:])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert set(values) == set(ref_values)
    for name, value in ref_values.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    assert copies, "no replica copies read"
    for key, value in copies.items():                  # the replicas on worker 1 too
        variable = key.split("/", 1)[1]
        np.testing.assert_allclose(value, values[variable], rtol=1e-6, atol=1e-7, err_msg=key)
    assert all(proc.poll() is None for proc in procs), "a server exited while training"
