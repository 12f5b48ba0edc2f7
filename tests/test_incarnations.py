"""Server incarnations (graph_rewriter/incarnations.py, passes/record_incarnations.py).

What is held (docs/reliability.md, "Poisoned servers"):

- A graph whose collectives span compute tasks has an op of its own that reads every
  compute task's number (``graph_rewriter/server_incarnation`` on its host, 0 where the
  variable does not exist) and records them in ``graph_rewriter/collective_peers`` on
  the hosts it runs on (in-graph all, between-graph its own); no init op or step runs it
  (between-graph, a step with collectives shares its step id with the other workers');
  it reads every host's record for its clients, and gr.Session runs the record.
  Graphs without cross-task collectives (one worker; ps) have none of it.
- ``start_server`` gives its server a number before it serves; a plain
  ``tf.distribute.Server`` has none, and a graph on it still initializes and trains (the
  record holds 0s), which shows the fallback branch works.
- Staleness: a record is stale when a peer's number changed; 0 is never stale; a
  client's check reports stale hosts and unreachable tasks, and waits only as long as
  asked. serve's supervisor replaces its server on the watcher's report.
- For real: in-process servers from ``start_server`` give a rewritten in-graph graph's
  init the numbers it records on both hosts; the Watcher of one of them reports a stale
  record once a peer's number is changed (a restart, as far as the record can tell).
  The restart itself, with serve replacing the survivor, is in tests/test_faults.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import incarnations
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.local_cluster import free_port
from graph_rewriter.server import start_server
from graph_rewriter.supervisor import poison_reason
from graph_rewriter.testing import harness, models
from pass_graphs import runs

tf1 = tf.compat.v1
SPEC = {"worker": ["localhost:2222", "localhost:2223", "localhost:2224"], "ps": ["localhost:2225"]}
SCOPE = incarnations.SCOPE


def _nodes(result):
    return {n.name: n for n in result.graph_def.node}


def _writes(nodes):
    return sorted(n for n, node in nodes.items() if node.op == "AssignVariableOp" and n.startswith(SCOPE))


@pytest.mark.parametrize("task, hosts", [(None, [0, 1, 2]), ("worker:1", [1])], ids=["in-graph", "between-graph"])
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_a_graph_with_collectives_across_tasks_records_its_peers_in_every_init_op(task, hosts, strategy):
    ex = models.build("embedding", "adam", seed=1)
    result = gr.rewrite(ex.graph_def, SPEC, task=task, strategy=strategy, device_type="CPU")
    nodes = _nodes(result)
    for k in range(3):
        number = nodes[f"{SCOPE}/worker_{k}/number"]
        assert number.op == "VarHandleOp" and number.attr["shared_name"].s.decode() == incarnations.INCARNATION
        assert number.device == f"/job:worker/replica:0/task:{k}/device:CPU:0"
        live = nodes[f"{SCOPE}/worker_{k}/live"]          # a v1 cond: read if initialized, else 0
        assert live.op == "Merge" and live.device == number.device
        read, default = (nodes[i.split(":")[0]] for i in live.input)
        assert read.op == "ReadVariableOp" and read.input[0] == number.name
        assert default.op == "Const" and default.attr["value"].tensor.int64_val == [0]
        peers = nodes[f"{SCOPE}/worker_{k}/peers"]
        assert peers.attr["shared_name"].s.decode() == incarnations.RECORD
        assert [d.size for d in peers.attr["shape"].shape.dim] == [3]
        assert nodes[f"{SCOPE}/worker_{k}/recorded"].input == [peers.name]
    numbers = nodes[f"{SCOPE}/numbers"]
    assert numbers.op == "Pack" and numbers.input == [f"{SCOPE}/worker_{k}/live" for k in range(3)]
    assert _writes(nodes) == [f"{SCOPE}/worker_{k}/write" for k in hosts]
    for k in hosts:
        assert nodes[f"{SCOPE}/worker_{k}/write"].input[:2] == [f"{SCOPE}/worker_{k}/peers", numbers.name]
    record = nodes[incarnations.RECORD_OP]
    assert record.op == "NoOp" and record.input == [f"^{SCOPE}/worker_{k}/write" for k in hosts]
    # an op of its own: a step with collectives (whose step id every worker shares) must
    # not read another worker's host, so no init op or step runs it
    meta = result.meta_graph.collection_def
    steps = ["init", "train_op", result.saver().saver_def.restore_op_name] + [
        meta[key].node_list.value[0] for key in ("init_op", "local_init_op")]
    for step in steps:
        assert not any(n.startswith(SCOPE) for n in runs(nodes, step)), step
    info = result.metadata["incarnations"]
    assert info["tasks"] == ["worker:0", "worker:1", "worker:2"]
    assert info["record"] == incarnations.RECORD_OP
    assert info["recorded"]["worker:2"] == f"{SCOPE}/worker_2/recorded:0"
    assert info["live"]["worker:0"] == f"{SCOPE}/worker_0/live:0"


@pytest.mark.parametrize("spec, kwargs", [
    ({"worker": ["localhost:1"]}, dict(devices_per_worker=2)),
    (SPEC, dict(strategy="ps")),
    (SPEC, dict(strategy="ps", task="worker:0")),
    (None, dict(devices_per_worker=2)),
], ids=["one-worker", "ps-in-graph", "ps-between-graph", "no-cluster"])
def test_graphs_without_collectives_across_tasks_record_nothing(spec, kwargs):
    ex = models.build("mlp", "sgd", seed=1)
    result = gr.rewrite(ex.graph_def, spec, device_type="CPU", **kwargs)
    assert not any(n.name.startswith(SCOPE) for n in result.graph_def.node)
    assert "incarnations" not in result.metadata
    assert "record_incarnations" not in result.metadata["passes"]


def test_stale_peers_compares_numbers_and_never_counts_zero():
    tasks = ["worker:0", "worker:1", "worker:2"]
    assert incarnations.stale_peers([5, 6, 7], {"worker:0": 5, "worker:1": 6, "worker:2": 7}, tasks) == []
    assert incarnations.stale_peers([5, 6, 7], {"worker:1": 9, "worker:2": 7}, tasks) == [("worker:1", 6, 9)]
    # a server graph_rewriter did not start (0 then or now), a peer not read: not stale
    assert incarnations.stale_peers([5, 0, 7], {"worker:1": 9, "worker:2": 0}, tasks) == []
    assert incarnations.stale_peers(None, {"worker:1": 9}, tasks) == []
    assert incarnations.stale_peers([5, 6], {"worker:1": 9}, tasks) == []    # another cluster's record


class Reads:
    """A client's reads by tensor name: numbers and records by task, or an error; also
    the session ``settle_and_record`` opens (``open``), counting opens and closes."""

    def __init__(self, live, recorded):
        self.live, self.recorded = live, recorded
        self.calls = self.opened = self.closed = 0
        self.recorded_once = False

    def open(self):
        self.opened += 1
        return self

    def close(self):
        self.closed += 1

    def run(self, tensor, options=None):
        return self(tensor)

    def __call__(self, tensor):
        self.calls += 1
        if tensor == incarnations.RECORD_OP:
            self.recorded_once = True
            return None
        task = tensor.split("/")[2].replace("_", ":")
        value = (self.live if tensor.endswith("/live:0") else self.recorded).get(task)
        if isinstance(value, Exception):
            raise value
        if value is None:
            raise tf.errors.FailedPreconditionError(None, None, "Could not find variable")
        return value


INFO = incarnations.incarnation_metadata(parse_cluster(SPEC, None).compute_tasks)


def test_a_client_sees_stale_records_and_unreachable_tasks_and_waits_only_as_long_as_asked():
    live = {"worker:0": 11, "worker:1": 22, "worker:2": 33}
    settled = Reads(live, {"worker:0": [11, 22, 33], "worker:2": [11, 22, 33]})   # worker:1 holds none yet
    assert incarnations.cluster_state(settled, INFO) == ({}, [])
    assert incarnations.settle_and_record(settled.open, INFO, timeout=5) is None
    assert settled.opened == settled.closed == 1 and settled.recorded_once
    stale = Reads(dict(live, **{"worker:1": 23}), {"worker:0": [11, 22, 33]})
    assert incarnations.cluster_state(stale, INFO) == ({"worker:0": [("worker:1", 22, 23)]}, [])
    message = incarnations.settle_and_record(stale.open, INFO, timeout=0.3, sleep=0.05)
    assert "worker:1's server restarted since this server formed collective groups with it" in message
    assert "on worker:0's server" in message and "Restart worker:0's server" in message
    assert stale.calls > 6 and stale.opened == 1     # it read again while it waited, in one session
    assert not stale.recorded_once
    down = tf.errors.UnavailableError(None, None, "connection refused")
    gone = Reads(dict(live, **{"worker:2": down}), {})
    assert incarnations.cluster_state(gone, INFO) == ({}, ["worker:2"])
    assert "worker:2 cannot be reached" in incarnations.settle_and_record(gone.open, INFO, timeout=0.3, sleep=0.05)
    # a server may have been replaced under the session: every poll opens a new one
    assert gone.opened > 2 and gone.opened == gone.closed


def test_serve_replaces_its_server_on_the_watchers_report():
    line = (f"graph-rewrite: worker:0: {incarnations.stale_message('worker:0', [('worker:1', 5, 6)])}")
    assert poison_reason(line).startswith(incarnations.STALE_MARKER)
    assert poison_reason("graph-rewrite: serving worker:0 at grpc://localhost:1") is None


def _in_process_cluster(plain):
    spec = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    if plain:
        config = tf1.ConfigProto(device_count={"CPU": 2})
        config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
        servers = [tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker", task_index=k, config=config)
                   for k in range(2)]
    else:
        servers = [start_server(spec, f"worker:{k}", device_type="CPU", devices_per_worker=2) for k in range(2)]
    return spec, servers


def _number(server, k):
    graph = tf.Graph()
    with graph.as_default(), tf.device(f"/job:worker/replica:0/task:{k}/device:CPU:0"):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=incarnations.INCARNATION)
        read = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64)
    with tf1.Session(server.target, graph=graph) as sess:
        return int(sess.run(read))


@pytest.mark.parametrize("plain", [False, True], ids=["start_server", "plain-tf-servers"])
def test_a_session_records_the_servers_numbers_and_a_graph_trains_on_servers_without_them(plain):
    """In-process servers, an in-graph allreduce rewrite over both: gr.Session records
    the two numbers on both hosts before it runs anything (0s on plain servers, through
    the fallback branch), and a step still equals one device's."""
    ex = models.build("mlp", "adam", seed=3)
    batch = ex.batch(0, size=8)
    losses, values = harness.run_single(ex, steps=1, feeds=[batch])
    spec, servers = _in_process_cluster(plain)
    result = gr.rewrite(ex.graph_def, spec, device_type="CPU", devices_per_worker=2)
    with gr.Session(result, target=servers[0].target) as sess:
        sess.run("init")
        info = result.metadata["incarnations"]
        recorded = [sess.run(info["recorded"][f"worker:{k}"]).tolist() for k in range(2)]
        loss, _ = sess.run([ex.loss, ex.train_op], feed_dict=batch)
        after = {name: sess.run(read) for name, read in ex.variables.items()}
    if plain:
        assert recorded == [[0, 0], [0, 0]]
    else:
        numbers = [_number(servers[0], k) for k in range(2)]
        assert all(numbers) and numbers[0] != numbers[1]
        assert recorded == [numbers, numbers]
    np.testing.assert_allclose(loss, losses[0], rtol=1e-5)
    for name, value in after.items():
        np.testing.assert_allclose(value, values[name], rtol=1e-5, atol=1e-6)


def test_the_watcher_reports_a_record_that_names_a_peers_earlier_number():
    spec, servers = _in_process_cluster(plain=False)
    ex = models.build("mlp", "sgd", seed=3)
    result = gr.rewrite(ex.graph_def, spec, device_type="CPU", devices_per_worker=2)
    with gr.Session(result, target=servers[0].target) as sess:
        sess.run("init")
    reports = []
    watcher = incarnations.Watcher(servers[0], parse_cluster(spec, "worker:0"), reports.append)
    watcher._build()
    assert watcher.check() is None            # the record matches both numbers
    # worker 1 "restarts": its number changes, as a new server's would
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:worker/replica:0/task:1/device:CPU:0"):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=incarnations.INCARNATION)
        bump = tf.raw_ops.AssignAddVariableOp(resource=handle, value=tf.constant(1, tf.int64))
    with tf1.Session(servers[1].target, graph=graph) as sess:
        sess.run(bump)
    message = watcher.check()
    assert message is not None and message.startswith(f"worker:1's server {incarnations.STALE_MARKER}")
    assert "on worker:0's server" in message


def test_a_session_whose_peer_cannot_be_reached_fails_naming_it_having_run_nothing():
    """worker:1's address answers nothing: gr.Session waits up to the step's timeout
    (2 s here) for the cluster to settle, then raises UnavailableError naming worker:1."""
    spec = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    server = start_server(spec, "worker:0", device_type="CPU", devices_per_worker=2)
    ex = models.build("mlp", "sgd", seed=3)
    result = gr.rewrite(ex.graph_def, spec, device_type="CPU", devices_per_worker=2)
    with pytest.raises(tf.errors.UnavailableError, match="worker:1 cannot be reached .waited 2 s"):
        gr.Session(result, target=server.target, config=tf1.ConfigProto(operation_timeout_in_ms=2000))


def test_closed_addresses_names_the_tasks_where_nothing_listens():
    """TensorFlow's master would wait without end for such a task; the probe says so in
    about no time."""
    import socket
    with socket.socket() as listening:
        listening.bind(("localhost", 0))
        listening.listen()
        open_address = f"localhost:{listening.getsockname()[1]}"
        dead_address = f"localhost:{free_port()}"
        assert incarnations.closed_addresses({"worker:0": open_address, "worker:1": dead_address}) == ["worker:1"]
