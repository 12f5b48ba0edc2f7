"""Heartbeats and serve's supervisor, without a cluster (the real ones: tests/test_faults.py).

What is held (docs/reliability.md, "Dead peers" and "Poisoned servers"):

- The heartbeat pass gives a between-graph graph one float64 heartbeat per compute task
  on that task's host CPU, an op that sets this task's to its clock, one that marks it
  left (-1), and reads of every other task's; in-graph graphs and
  ``heartbeat_seconds=0`` have none. The metadata names them for graph_rewriter.health.
- ``Heartbeat.check`` judges a peer only once it has been seen to beat (a value left by
  an earlier run is no sign of life), only while this client is in a step, never a peer
  that left cleanly; ``wait_for_peers`` returns the peers never seen beating.
- serve's supervisor recognizes TensorFlow's reports of a poisoned collective state in
  the log lines TensorFlow 2.21 writes, and nothing else.
"""

import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import health
from graph_rewriter.supervisor import _tf_log_level, poison_reason
from graph_rewriter.testing import models
from pass_graphs import runs

SPEC = {"worker": ["localhost:2222", "localhost:2223", "localhost:2224"], "ps": ["localhost:2225"]}


def _by_name(graph_def):
    return {n.name: n for n in graph_def.node}


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_between_graph_graphs_carry_a_heartbeat_per_compute_task(strategy):
    ex = models.build("mlp", "sgd", seed=1)
    result = gr.rewrite(ex.graph_def, SPEC, task="worker:1", strategy=strategy, device_type="CPU")
    nodes = _by_name(result.graph_def)
    for k in range(3):
        var = nodes[f"graph_rewriter/heartbeat/worker_{k}"]
        assert var.op == "VarHandleOp" and var.device.endswith(f"/task:{k}/device:CPU:0")
        assert var.attr["shared_name"].s.decode() == var.name
    beat = nodes["graph_rewriter/heartbeat/beat"]
    assert beat.op == "AssignVariableOp" and beat.input[0] == "graph_rewriter/heartbeat/worker_1"
    assert nodes[beat.input[1]].op == "Timestamp" and beat.device.endswith("/task:1/device:CPU:0")
    assert nodes["graph_rewriter/heartbeat/leave"].input[0] == "graph_rewriter/heartbeat/worker_1"
    info = result.metadata["heartbeat"]
    assert info["seconds"] == 5.0
    assert info["peers"] == {"worker:0": "graph_rewriter/heartbeat/worker_0/read:0",
                             "worker:2": "graph_rewriter/heartbeat/worker_2/read:0"}
    assert "graph_rewriter/heartbeat/worker_1/read" not in nodes
    # not a model variable: the Saver and the initializers leave it alone
    saved = [n for n in result.graph_def.node if n.op == "SaveV2"]
    assert saved and all("heartbeat" not in inp for n in saved for inp in n.input)


@pytest.mark.parametrize("kwargs", [dict(), dict(task="worker:0", heartbeat_seconds=0)],
                         ids=["in-graph", "heartbeat_seconds=0"])
def test_no_heartbeat_in_graph_or_when_turned_off(kwargs):
    ex = models.build("mlp", "sgd", seed=1)
    result = gr.rewrite(ex.graph_def, SPEC, strategy="allreduce", device_type="CPU", **kwargs)
    assert not any("heartbeat" in n.name for n in result.graph_def.node)
    assert "heartbeat" not in result.metadata


@pytest.mark.parametrize("value", [0.5, -1, "5", True])
def test_heartbeat_seconds_must_be_zero_or_at_least_one(value):
    ex = models.build("mlp", "sgd", seed=1)
    with pytest.raises(gr.GraphRewriteError, match="heartbeat_seconds"):
        gr.rewrite(ex.graph_def, SPEC, task="worker:0", heartbeat_seconds=value, device_type="CPU")


class Peers:
    """What the peers' heartbeat reads return, step by step (None: unreadable)."""

    def __init__(self, **values):
        self.values = values

    def run(self, fetch, options):
        if fetch.endswith("/beat") or fetch.endswith("/leave"):
            return None
        task = fetch.split("/")[2].replace("_", ":")
        value = self.values.get(task)
        if value is None:
            raise RuntimeError("uninitialized")
        return value


INFO = {"seconds": 5.0, "beat": "graph_rewriter/heartbeat/beat", "leave": "graph_rewriter/heartbeat/leave",
        "peers": {"worker:1": "graph_rewriter/heartbeat/worker_1/read:0"}}


def test_a_peer_is_judged_only_after_it_was_seen_beating_and_only_during_a_step():
    peers = Peers(**{"worker:1": 100.0})
    hb = health.Heartbeat(peers.run, INFO, on_gone=None)
    hb.step_started()
    assert hb.check(now=0.0) is None            # a value from before: no sign of life
    assert hb.check(now=60.0) is None           # still never seen to change: the deadline's job
    peers.values["worker:1"] = 101.0
    assert hb.check(now=61.0) is None           # alive at 61
    assert hb.check(now=65.5) is None           # 4.5 s < 5 s
    message = hb.check(now=66.5)
    assert "worker:1 is gone" in message and "5.5 s" in message and "heartbeat_seconds=5" in message
    hb.step_ended()
    assert hb.check(now=90.0) is None           # not waiting in a step: nothing to end


def test_a_peer_that_left_cleanly_or_keeps_beating_is_never_judged():
    peers = Peers(**{"worker:1": 1.0})
    hb = health.Heartbeat(peers.run, INFO, on_gone=None)
    hb.step_started()
    hb.check(now=0.0)
    for t in range(1, 30):
        peers.values["worker:1"] = 1.0 + t
        assert hb.check(now=float(t)) is None
    peers.values["worker:1"] = health.LEFT
    hb.check(now=30.0)
    assert hb.check(now=100.0) is None


def test_wait_for_peers_returns_the_peers_never_seen_beating():
    info = dict(INFO, seconds=1.0, peers={"worker:1": "graph_rewriter/heartbeat/worker_1/read:0",
                                          "worker:2": "graph_rewriter/heartbeat/worker_2/read:0"})
    clock = {"worker:1": 0.0}

    def run(fetch, options):
        if "worker_1" in fetch:
            clock["worker:1"] += 1.0     # beats on every read
            return clock["worker:1"]
        if "worker_2" in fetch:
            raise RuntimeError("uninitialized: never started")
        return None

    hb = health.Heartbeat(run, info, on_gone=None)
    assert hb.wait_for_peers(timeout=0.5) == ["worker:2"]


LINES = [
    ("E0000 00:00:1795555035.662390   17993 base_collective_executor.cc:252] "
     "BaseCollectiveExecutor::StartAbort CANCELLED: group is cancelled", "group is cancelled"),
    ("E0000 00:00:1795555035.663608   17945 worker.cc:436] Bad status from CompleteGroupDistributed: "
     "FAILED_PRECONDITION: Device /job:worker/replica:0/task:1/device:CPU:0 current incarnation "
     "doesn't match with one in the group.", "incarnation"),
]


@pytest.mark.parametrize("line, why", LINES, ids=["executor-aborted", "leader-refused-a-member"])
def test_the_supervisor_recognizes_tensorflows_report_of_a_poisoned_server(line, why):
    reason = poison_reason(line)
    assert reason is not None and why in reason
    assert _tf_log_level(line) == 2


@pytest.mark.parametrize("line", [
    "W0000 00:00:1795555031.629533   17992 local_rendezvous.cc:412] Local rendezvous is aborting "
    "with status: ABORTED: Cleanup 127266163977112730",
    "I0000 00:00:1795555034.640508   17947 worker.cc:216] Cancellation requested for RunGraph.",
    "graph-rewrite: serving worker:0 at grpc://localhost:1 (process 3; Ctrl-C to stop)",
])
def test_the_supervisor_leaves_a_server_alone_for_other_lines(line):
    assert poison_reason(line) is None


def test_a_between_graph_ps_graph_names_its_reset_handshake_in_the_metadata():
    ex = models.build("mlp", "sgd", seed=1)
    chief = gr.rewrite(ex.graph_def, SPEC, task="worker:0", strategy="ps", device_type="CPU")
    worker = gr.rewrite(ex.graph_def, SPEC, task="worker:1", strategy="ps", device_type="CPU")
    info = chief.metadata["ps_reset"]
    assert info["draw"] == "graph_rewriter/run_id/draw" and info["declare"] == "graph_rewriter/reset_done/declare"
    # the ops a client runs by name that reset the shared state: the init op and the restores
    assert "init" in info["resets"] and chief.saver().saver_def.restore_op_name in info["resets"]
    assert worker.metadata["ps_reset"] == {"run_id": "graph_rewriter/run_id/value:0",
                                           "reset_done": "graph_rewriter/reset_done/value:0"}
    for kwargs in (dict(strategy="allreduce", task="worker:1"), dict(strategy="ps")):
        assert "ps_reset" not in gr.rewrite(ex.graph_def, SPEC, device_type="CPU", **kwargs).metadata


def test_a_worker_waits_for_the_chiefs_reset_of_this_run_only():
    from graph_rewriter.session import wait_for_chief_reset
    md = {"task": ["worker", 1], "ps_reset": {"run_id": "id:0", "reset_done": "done:0"}}
    values = {"id:0": 0, "done:0": 5}
    reads = []

    def run(tensor):
        reads.append(tensor)
        if tensor == "done:0" and len(reads) > 4:
            values["done:0"] = values["id:0"]    # the chief's restore copied this run's id
        return values[tensor]

    wait_for_chief_reset(run, md, limit=5)        # no run id drawn: nothing to wait for
    assert reads == ["id:0"]
    values["id:0"] = 42
    reads.clear()
    wait_for_chief_reset(run, md, limit=5)
    assert reads.count("done:0") == 3 and values["done:0"] == 42
    values["done:0"] = 7                          # an earlier run's id: never this run's reset
    with pytest.raises(tf.errors.DeadlineExceededError, match="chief's client has not initialized or restored"):
        wait_for_chief_reset(lambda t: values[t], md, limit=0.3)


def test_the_chiefs_reset_copy_never_waits_for_another_worker():
    """Hybrid between-graph: the chief's init op also broadcasts the mirrored variables'
    initial values, which completes only once the other workers' init ops receive them;
    the other workers run theirs only after they have seen the run id copied. So the copy
    waits for no collective (it would wait for ever), but for the ps variables' initial
    values and restores, and the accumulators' and queues' resets."""
    ex = models.build("embedding", "adagrad", seed=1)
    chief = gr.rewrite(ex.graph_def, SPEC, task="worker:0", strategy="hybrid", device_type="CPU",
                       devices_per_worker=2)
    nodes = _by_name(chief.graph_def)
    sets = [n for n in nodes if n.startswith("graph_rewriter/reset_done/set")]
    assert len(sets) == 2     # the init op's and the restore op's
    for name in sets:
        before = runs(nodes, name)
        assert not [n for n in before if "Collective" in nodes[n].op], name
        assert any(n.startswith("graph_rewriter/accumulators/") for n in before), name
    assert "embedding/Assign" in [i.lstrip("^") for i in nodes[sets[0]].input]   # the ps variable's initializer
