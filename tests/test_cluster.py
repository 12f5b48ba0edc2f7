"""Multi-process tests on real TensorFlow servers on loopback (all marked slow).

Every server is a ``graph-rewrite serve --no-supervise`` process started by LocalCluster
(ports from free_port()); every between-graph worker is its own client process (``python -m
graph_rewriter.worker_client``, or the small client loop of this file); both are forked
by the suite's launcher (tests/conftest.py, graph_rewriter.testing.fork_server) from a
process that has imported TensorFlow, so none spends 4.5 s importing it; every wait is
bounded (server start, every session call, every process) and every process a test
starts is ended by its id in a fixture's teardown, whatever happens.

What is held (docs/api.md, "Semantics"; DESIGN.md, "Multi-worker"):

- Equivalence on a real cluster: 2 workers x 1-2 CPU replicas, 0-2 ps tasks, strategies
  allreduce, ps and hybrid, dense ("mlp") and sparse ("embedding") models, sgd, adam and
  adagrad, in-graph (one client drives every worker) and between-graph (one client per
  worker, each feeding its own rows of the global batch). After STEPS steps the final
  variables (weights, optimizer slots, step counter) equal the single-device run on the
  concatenated global batches, the loss per step (the mean of the workers' losses)
  equals the single-device loss, the workers agree with each other, every mirrored
  replica copy equals the master's, and the step counter equals STEPS.
- Parameter-server staleness (between-graph, one worker slowed down): a fast worker runs
  ahead of the applied updates by at most ``staleness`` steps, a fast non-chief does run
  ahead when allowed to, both workers finish, and every step is applied once.
- Asynchronous parameter servers: training runs to completion, the step counter counts
  every replica's update, and the model learns.
- A ps job rerun on the same servers trains like the first run.
- ``graph-rewrite serve`` (flags and TF_CONFIG) and ``gr.start_server`` in a subprocess
  listen, have the configured CPU devices, serve a rewritten graph (trained like one
  device), and exit on SIGTERM.

Cost: about 3 minutes on two cores (8 before the fork server: starting a server or a
worker client took ~5 s, now well under one). The equivalence cases share one live cluster per number of ps tasks (ClusterPool:
consecutive cases reuse it; a case that fails while running discards it, since a failed
collective or a blocked step can poison a server). Each case builds its example with its
own seed, so no two graphs run on one cluster have the same fingerprint (shared names and
collective keys derive from it; running one graph twice on the same servers is the
rerun test's subject). The staleness, async and rerun tests get fresh clusters.
"""

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.local_cluster import LocalCluster, accepts, free_port
from graph_rewriter.testing import harness, models

# Slow: part of the full run, left out of the quick one (pytest -m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")

STEPS = 3
BATCH = 8                  # global batch: 2 rows per replica with 2 workers x 2 replicas
RTOL, ATOL = 1e-4, 1e-6
AGREE_RTOL, AGREE_ATOL = 1e-6, 1e-7   # two workers' copies of one computation
START_TIMEOUT = 120.0      # a cluster's servers listening
CALL_TIMEOUT = 60.0        # any one session call (a dead or missing peer becomes an error)
PROCESS_TIMEOUT = 300.0    # a worker client process, start to exit
STOP_TIMEOUT = 30.0        # a server leaving after SIGTERM
COUNTER_READ = "graph_rewriter/sync_step/read:0"   # the ps's count of applied steps


# ----- processes ---------------------------------------------------------------------

def _env(**extra):
    """The environment of a child process: quiet TensorFlow, unbuffered output, and the
    tests folder importable (the client processes run functions of these test modules)."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _tail(path, lines=25):
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    keep = [line for line in text.splitlines()
            if not line.startswith(("I0000", "W0000", "WARNING: All log messages"))]
    return "\n".join(keep[-lines:])


class Processes:
    """The client processes one test starts; ``end_all`` kills what is still running, by
    process id (each runs in its own session, so its group id is its id)."""

    def __init__(self, log_dir, launcher):
        self.log_dir, self.launcher = log_dir, launcher
        self.started = []   # (name, Popen or fork_server.ForkedProcess, log path)

    def start(self, name, cmd, env=None):
        log_path = os.path.join(self.log_dir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = self.launcher.popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                       env=env or _env(), start_new_session=True)
        self.started.append((name, proc, log_path))
        return proc, log_path

    def wait_all(self, timeout=PROCESS_TIMEOUT):
        """Waits for every started process (one shared deadline); fails the test naming
        any that did not exit, or exited non-zero, with its log."""
        deadline = time.monotonic() + timeout
        problems = []
        for name, proc, log_path in self.started:
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"{name}: still running after {timeout:.0f} s\n{_tail(log_path)}")
                continue
            if rc != 0:
                problems.append(f"{name}: exit status {rc}\n{_tail(log_path)}")
        if problems:
            pytest.fail("\n\n".join(problems), pytrace=False)

    def end_all(self):
        for _, proc, _ in self.started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, proc, _ in self.started:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs(tmp_path, launcher):
    p = Processes(str(tmp_path), launcher)
    try:
        yield p
    finally:
        p.end_all()


def _wait_listening(port, proc, log_path, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while not accepts(port):
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode} before listening on "
                        f"port {port}\n{_tail(log_path)}", pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not listen on port {port} within {timeout:.0f} s\n"
                        f"{_tail(log_path)}", pytrace=False)
        time.sleep(0.2)


# ----- clusters ----------------------------------------------------------------------

def _start_cluster(workers, ps, dpw, log_dir, launcher):
    """Unsupervised servers (serve --no-supervise), forked by ``launcher``: these tests
    replace a server themselves when they need a new one (no test here relies on serve
    replacing a poisoned server; test_faults.py does, with supervised servers)."""
    return LocalCluster(workers=workers, ps=ps, device_type="CPU", devices_per_worker=dpw,
                        start_timeout=START_TIMEOUT, log_dir=log_dir, supervise=False,
                        launcher=launcher).start()


class ClusterPool:
    """At most one live cluster, reused by consecutive tests that ask for its shape."""

    def __init__(self, tmp_path_factory, launcher):
        self.tmp_path_factory, self.launcher = tmp_path_factory, launcher
        self.key = None
        self.cluster = None

    def get(self, workers, ps, dpw):
        key = (workers, ps, dpw)
        if self.cluster is not None and (key != self.key or not self._alive()):
            self.stop()
        if self.cluster is None:
            log_dir = str(self.tmp_path_factory.mktemp(f"servers_w{workers}_ps{ps}_d{dpw}"))
            self.cluster = _start_cluster(workers, ps, dpw, log_dir, self.launcher)
            self.key = key
        return self.cluster

    def _alive(self):
        return all(p.poll() is None for p in self.cluster.processes.values())

    def stop(self):
        if self.cluster is not None:
            self.cluster.stop()
        self.cluster, self.key = None, None

    @contextlib.contextmanager
    def use(self, workers, ps, dpw):
        """The shared cluster of this shape; discarded if the block raises (a failed
        collective or a blocked step can leave a server unusable for the next test)."""
        cluster = self.get(workers, ps, dpw)
        try:
            yield cluster
        except gr.GraphRewriteError:
            raise            # rejected before anything ran on the cluster: it is still good
        except BaseException:
            self.stop()
            raise


@pytest.fixture(scope="module")
def pool(tmp_path_factory, launcher):
    p = ClusterPool(tmp_path_factory, launcher)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def fresh_cluster(pool, tmp_path):
    """A factory of clusters of this test's own, stopped at teardown (the shared one is
    stopped first: two cores do not need idle servers competing)."""
    started = []

    def make(workers, ps, dpw):
        pool.stop()
        log_dir = tmp_path / f"servers_{len(started)}"
        log_dir.mkdir()
        started.append(_start_cluster(workers, ps, dpw, str(log_dir), pool.launcher))
        return started[-1]

    try:
        yield make
    finally:
        for c in started:
            c.stop()


def _compute_tasks(cluster):
    return [(job, i) for job in ("chief", "worker") for i in range(len(cluster.spec.get(job, [])))]


# ----- references and comparisons ----------------------------------------------------

def _build(model, optimizer, seed, **kw):
    return models.build(model, optimizer, seed=seed, **kw)


@functools.lru_cache(maxsize=None)
def _reference(model, optimizer, seed, steps=STEPS, batch=BATCH):
    """(example, global batches, single-device losses, final variables), checked to train."""
    ex = _build(model, optimizer, seed)
    batches = [ex.batch(s, size=batch) for s in range(steps)]
    _, initial = harness.run_single(ex, steps=0, feeds=batches)
    losses, values = harness.run_single(ex, steps=steps, feeds=batches)
    moved = [n for n in values if not np.allclose(values[n], initial[n])]
    assert moved, f"the single-device {model}/{optimizer} reference did not train"
    counter = _counter_variable(ex)
    assert int(values[counter]) == steps, "the single-device step counter is not the step count"
    return ex, batches, losses, values


def _counter_variable(ex):
    return next(name for name, read in ex.variables.items() if read == ex.step_counter)


def _assert_matches(what, losses, values, ref_losses, ref_values):
    np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: losses per step differ from one device")
    assert sorted(values) == sorted(ref_values), f"{what}: not the same variables"
    for name in sorted(ref_values):
        np.testing.assert_allclose(values[name], ref_values[name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: variable '{name}' differs from one device")


def _assert_agree(what, a, b):
    for name in sorted(a):
        np.testing.assert_allclose(a[name], b[name], rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                   err_msg=f"{what}: '{name}' differs between the two")


def _ps_tasks_holding_variables(graph_def):
    tasks = set()
    for node in graph_def.node:
        if node.op in ("VarHandleOp", "VariableV2"):
            m = re.search(r"/job:ps/(?:replica:\d+/)?task:(\d+)", node.device)
            if m:
                tasks.add(int(m.group(1)))
    return tasks


def _run_options(timeout=CALL_TIMEOUT):
    return tf.compat.v1.RunOptions(timeout_in_ms=int(timeout * 1000))


# ----- in-graph and between-graph runs -----------------------------------------------

def _run_in_graph(cluster, ex, strategy, dpw, batches, call_timeout=CALL_TIMEOUT, **options):
    """One client (this process) drives every worker. Returns (result, losses, values,
    {(replica prefix, variable): copy}, the ps's applied-step count or None)."""
    result = gr.rewrite(ex.graph_def, cluster.spec, strategy=strategy, device_type="CPU",
                        devices_per_worker=dpw, **options)
    assert result.num_replicas == len(_compute_tasks(cluster)) * dpw
    has_counter = any(n.name == COUNTER_READ.split(":")[0] for n in result.graph_def.node)
    opts = _run_options(call_timeout)
    with gr.Session(result, target=cluster.target("worker", 0)) as sess:
        sess.run(ex.init, options=opts)
        losses = [float(sess.run([ex.loss, ex.train_op], feed_dict=b, options=opts)[0])
                  for b in batches]
        values = {k: np.asarray(v) for k, v in sess.run(dict(ex.variables), options=opts).items()}
        prefixes = sess.result.metadata["replica_prefixes"][1:]
        read = harness.read_replica_copies(sess, ex, prefixes)
        copies = {(prefix, name): read[prefix + name] for prefix in prefixes for name in ex.variables
                  if prefix + name in read}
        applied = int(sess.run(COUNTER_READ, options=opts)) if has_counter else None
    return result, losses, values, copies, applied


class Worker:
    """One between-graph worker: its task, its rewritten graph and its rows of every batch."""

    def __init__(self, index, task, result, graph_path, feeds_path, target):
        self.index, self.task, self.result = index, task, result
        self.graph_path, self.feeds_path, self.target = graph_path, feeds_path, target

    @property
    def name(self):
        return f"worker{self.index}"

    def has_node(self, tensor):
        node = tensor.split(":")[0]
        return any(n.name == node for n in self.result.graph_def.node)


def _prepare_workers(cluster, ex, strategy, dpw, batches, tmp_path, **options):
    """Rewrites the graph once per worker task (task="job:i"), saves it, and writes that
    worker's rows of every global batch (worker k of W: rows k*B/W .. (k+1)*B/W)."""
    tasks = _compute_tasks(cluster)
    n = len(tasks)
    workers = []
    for k, (job, i) in enumerate(tasks):
        result = gr.rewrite(ex.graph_def, cluster.spec, strategy=strategy, device_type="CPU",
                            devices_per_worker=dpw, task=f"{job}:{i}", **options)
        assert result.num_replicas == n * dpw, f"{job}:{i}: replicas of the whole group"
        graph_path = str(tmp_path / f"worker{k}.pb")
        result.save(graph_path)
        feeds = {}
        for step, batch in enumerate(batches):
            for name, value in batch.items():
                rows = len(value) // n
                feeds[f"{step}/{name}"] = value[k * rows:(k + 1) * rows]
        feeds_path = str(tmp_path / f"worker{k}_feeds.npz")
        np.savez(feeds_path, **feeds)
        workers.append(Worker(k, f"{job}:{i}", result, graph_path, feeds_path, cluster.target(job, i)))
    return workers


def _worker_client_cmd(w, steps, reads, out, delay=0.0, timeout=CALL_TIMEOUT):
    cmd = [sys.executable, "-m", "graph_rewriter.worker_client", "--graph", w.graph_path,
           "--target", w.target, "--feeds", w.feeds_path, "--steps", str(steps),
           "--out", out, "--timeout", str(timeout)]
    if delay:
        cmd += ["--delay", str(delay)]
    for r in reads:
        cmd += ["--read", r]
    return cmd


def _run_between(cluster, procs, tmp_path, ex, strategy, dpw, batches, **options):
    """Every worker's own client process trains on its rows. Returns (workers, outputs):
    outputs[k] = {"losses": array, "reads": {tensor: value}}."""
    workers = _prepare_workers(cluster, ex, strategy, dpw, batches, tmp_path, **options)
    reads = list(ex.variables.values())
    outs = []
    for w in workers:
        these = reads + ([COUNTER_READ] if w.has_node(COUNTER_READ) else [])
        out = str(tmp_path / f"{w.name}_out.npz")
        procs.start(w.name, _worker_client_cmd(w, len(batches), these, out))
        outs.append(out)
    procs.wait_all()
    outputs = []
    for out in outs:
        with np.load(out) as data:
            outputs.append({"losses": data["losses"],
                            "reads": {k[len("read/"):]: data[k] for k in data.files if k.startswith("read/")}})
    return workers, outputs


# ----- equivalence on a real cluster -------------------------------------------------
# (strategy, model, optimizer, mode, devices per worker, ps tasks, extra rewrite options).
# Every cluster has 2 workers whose servers have SERVER_DEVICES CPU devices; a graph with
# 1 device per worker uses CPU:0 of each. Ordered by cluster so that each starts once.
SERVER_DEVICES = 2
CASES = [
    # allreduce, no ps
    ("allreduce", "mlp", "adam", "in", 2, 0, {}),
    ("allreduce", "embedding", "adam", "in", 2, 0, {}),
    ("allreduce", "embedding", "adagrad", "between", 2, 0, {}),
    ("allreduce", "mlp", "sgd", "between", 1, 0, {}),
    # two-level: within each worker's 2 devices, across the workers' first replicas
    ("allreduce", "mlp", "adam", "in", 2, 0, {"allreduce_algorithm": "hierarchical"}),
    ("allreduce", "embedding", "adagrad", "between", 2, 0, {"allreduce_algorithm": "hierarchical"}),
    # one ps
    ("ps", "mlp", "adam", "in", 2, 1, {}),
    ("ps", "embedding", "adam", "in", 2, 1, {}),
    ("ps", "mlp", "adagrad", "between", 2, 1, {}),
    ("ps", "embedding", "adagrad", "between", 2, 1, {}),
    ("ps", "mlp", "sgd", "between", 1, 1, {}),
    ("hybrid", "embedding", "adagrad", "in", 2, 1, {}),
    ("hybrid", "embedding", "adam", "between", 2, 1, {}),
    ("hybrid", "embedding", "adam", "between", 2, 1, {"allreduce_algorithm": "hierarchical"}),
    # two ps: variables spread over both
    ("ps", "mlp", "adagrad", "in", 1, 2, {}),
    ("ps", "embedding", "adam", "between", 2, 2, {}),
    ("hybrid", "embedding", "sgd", "between", 2, 2, {}),
    ("hybrid", "embedding", "adagrad", "between", 1, 2, {}),
    # the embedding table (20x4 float32 = 320 bytes) split by rows over both ps tasks
    ("ps", "embedding", "adagrad", "between", 2, 2, {"ps_shard_bytes": 64}),
]


def _case_id(case):
    strategy, model, optimizer, mode, dpw, ps, options = case
    extra = ("-sharded" if options.get("ps_shard_bytes") else "") + (
        "-hierarchical" if options.get("allreduce_algorithm") == "hierarchical" else "")
    return f"{strategy}-{model}-{optimizer}-{mode}-2x{dpw}dev-{ps}ps{extra}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_cluster_training_equals_one_device(case, pool, procs, tmp_path, request):
    strategy, model, optimizer, mode, dpw, num_ps, options = case
    seed = 100 + CASES.index(case)   # a graph (fingerprint) of its own on the shared cluster
    ex, batches, ref_losses, ref_values = _reference(model, optimizer, seed)
    counter = _counter_variable(ex)
    what = _case_id(case)
    with pool.use(2, num_ps, SERVER_DEVICES) as cluster:
        if mode == "in":
            result, losses, values, copies, applied = _run_in_graph(
                cluster, ex, strategy, dpw, batches, **options)
            results = [result]
        else:
            workers, outputs = _run_between(cluster, procs, tmp_path, ex, strategy, dpw, batches,
                                            **options)
            results = [w.result for w in workers]
    if mode == "in":
        _assert_matches(what, losses, values, ref_losses, ref_values)
        # every mirrored variable's copy on every replica of every worker equals the master's
        for (prefix, name), value in sorted(copies.items()):
            np.testing.assert_allclose(value, values[name], rtol=AGREE_RTOL, atol=AGREE_ATOL,
                                       err_msg=f"{what}: '{prefix}{name}' differs from the master's")
        if strategy == "allreduce":
            assert copies, f"{what}: no replica copies of mirrored variables were found"
        assert int(values[counter]) == STEPS, f"{what}: step counter {values[counter]}, not {STEPS}"
        if applied is not None:
            assert applied == STEPS, f"{what}: the ps applied {applied} steps, not {STEPS}"
    else:
        reads = [{name: o["reads"][t] for name, t in ex.variables.items()} for o in outputs]
        for o in outputs:
            assert len(o["losses"]) == STEPS
        # equal shards: the mean of the workers' mean losses is the global mean loss
        losses = np.mean([o["losses"] for o in outputs], axis=0)
        _assert_matches(f"{what} (chief)", losses, reads[0], ref_losses, ref_values)
        _assert_agree(f"{what}: worker 0 and worker 1", reads[0], reads[1])
        for k, r in enumerate(reads):
            assert int(r[counter]) == STEPS, f"{what}: worker {k} step counter {r[counter]}, not {STEPS}"
        for k, o in enumerate(outputs):
            if COUNTER_READ in o["reads"]:
                assert int(o["reads"][COUNTER_READ]) == STEPS, \
                    f"{what}: worker {k} sees {o['reads'][COUNTER_READ]} applied steps, not {STEPS}"
    if options.get("allreduce_algorithm") == "hierarchical":
        assert all(any("/across/" in n.name for n in r.graph_def.node) for r in results), \
            f"{what}: no all-reduce across the workers' first replicas"
    if strategy in ("ps", "hybrid"):
        assert all(_ps_tasks_holding_variables(r.graph_def) for r in results), \
            f"{what}: no variable is on a ps task"
    if strategy == "ps" and num_ps == 2:
        for r in results:
            assert _ps_tasks_holding_variables(r.graph_def) == {0, 1}, \
                f"{what}: variables are not spread over both ps tasks"
    if options.get("ps_shard_bytes"):
        for r in results:
            assert r.plan.variable("embedding").shards, f"{what}: the embedding table was not sharded"


# ----- staleness ---------------------------------------------------------------------

def _lead_client(argv):
    """A between-graph worker that records, after every step, how many steps the ps has
    applied. Run in a subprocess (see _lead_client_cmd); writes JSON to OUT:
    {"completed": [1, 2, ...], "applied": [...], "losses": [...], "error": null|str}."""
    graph, target, feeds_path, steps, out, timeout = argv
    steps, timeout = int(steps), float(timeout)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    record = {"completed": [], "applied": [], "losses": [], "error": None}
    try:
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout * 1000))
        with np.load(feeds_path) as data:
            feeds = {k: data[k] for k in data.files}
        with gr.Session(graph, target=target) as sess:
            sess.run("init", options=options)
            for step in range(steps):
                feed = {k.split("/", 1)[1]: v for k, v in feeds.items()
                        if k.split("/", 1)[0] == str(step)}
                loss, _ = sess.run(["loss:0", "train_op"], feed_dict=feed, options=options)
                applied = int(sess.run(COUNTER_READ, options=options))
                record["completed"].append(step + 1)
                record["applied"].append(applied)
                record["losses"].append(float(loss))
    except Exception as e:  # reported through the JSON and the exit status
        record["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:1500]}"
    with open(out, "w") as f:
        json.dump(record, f)
    return 0 if record["error"] is None else 3


def _lead_client_cmd(w, steps, out, timeout):
    code = "import sys, test_cluster; sys.exit(test_cluster._lead_client(sys.argv[1:]))"
    return [sys.executable, "-c", code, w.graph_path, w.target, w.feeds_path,
            str(steps), out, str(timeout)]


STALE_STEPS = 8
SLOW_DELAY = 0.5
STALE_CALL_TIMEOUT = 40.0


@pytest.mark.parametrize("staleness, slow, model", [(0, 0, "mlp"), (2, 0, "mlp"), (2, 1, "mlp"),
                                                    (2, 0, "batchnorm")],
                         ids=["s0-slow-chief", "s2-slow-chief", "s2-slow-worker1", "s2-slow-chief-batchnorm"])
def test_staleness_bounds_how_far_a_fast_worker_runs_ahead(staleness, slow, model, fresh_cluster, procs,
                                                           tmp_path):
    """strategy="ps", between-graph, 2 workers x 2 devices, STALE_STEPS steps: worker
    ``slow`` (graph_rewriter.worker_client --delay) sleeps SLOW_DELAY after every step;
    the other runs as fast as it may and records, after each of its steps, its completed
    steps minus the steps the ps has applied (graph_rewriter/sync_step). Both must finish,
    and the chief must see every step applied once.

    A worker's lead is bounded by the tokens it can take (s at the start, one per applied
    step); the counter is read after the step and only grows, so the measured lead never
    exceeds s. Only a non-chief can lead: the chief's own train op takes the averaged
    gradients, applies them and bumps the counter, so a chief's step is applied when it
    returns. Hence the case that shows staleness at work is a slow chief and a fast
    worker 1, which must use some of its allowance (else staleness could not be told
    from lockstep); a slow worker 1 behind a fast chief must merely not break the run.
    "batchnorm": BatchNorm whose gradients wait for the moving averages' update
    (control_dependencies(update_ops)), which the chief runs after its take of the
    statistics mid-step; worker 1's steps run ahead without it."""
    fast = 1 - slow
    kw = {"update_ops": "control"} if model == "batchnorm" else {}
    ex = _build(model, "sgd", seed=200 + 10 * staleness + slow, **kw)
    batches = [ex.batch(s, size=BATCH) for s in range(STALE_STEPS)]
    cluster = fresh_cluster(2, 1, 2)
    workers = _prepare_workers(cluster, ex, "ps", 2, batches, tmp_path, staleness=staleness)
    slow_out = str(tmp_path / "slow_out.npz")
    fast_out = str(tmp_path / "fast_out.json")
    procs.start(f"slow_worker{slow}", _worker_client_cmd(
        workers[slow], STALE_STEPS, [COUNTER_READ, ex.step_counter], slow_out, delay=SLOW_DELAY,
        timeout=STALE_CALL_TIMEOUT))
    procs.start(f"fast_worker{fast}", _lead_client_cmd(workers[fast], STALE_STEPS, fast_out,
                                                       STALE_CALL_TIMEOUT))
    procs.wait_all()                                   # both finish
    with open(fast_out) as f:
        record = json.load(f)
    assert record["completed"] == list(range(1, STALE_STEPS + 1)), record
    leads = [c - a for c, a in zip(record["completed"], record["applied"])]
    assert max(leads) <= staleness, \
        f"staleness {staleness}: worker {fast} ran {max(leads)} steps ahead (per step: {leads})"
    if staleness and fast != 0:
        assert max(leads) > 0, f"staleness {staleness}: worker {fast} never ran ahead ({leads})"
    with np.load(slow_out) as data:
        slow_losses = list(data["losses"])
        slow_reads = (int(data[f"read/{COUNTER_READ}"]), int(data[f"read/{ex.step_counter}"]))
    # the chief's view when it is done: every step applied once, the step counter with it
    chief_applied = slow_reads[0] if slow == 0 else record["applied"][-1]
    assert chief_applied == STALE_STEPS, f"the chief saw {chief_applied} applied steps"
    if slow == 0:
        assert slow_reads[1] == STALE_STEPS, f"global_step {slow_reads[1]} after {STALE_STEPS} steps"
    assert len(slow_losses) == STALE_STEPS and np.all(np.isfinite(slow_losses + record["losses"]))


# ----- asynchronous parameter servers ------------------------------------------------

ASYNC_STEPS = 30
ASYNC_BATCH = 32


def _mean_loss_at(ex, values, batches):
    """The original graph's mean loss over ``batches`` with its variables set to ``values``."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(ex.graph_def, name="")
    assigns = harness.assign_ops(graph, values)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(ex.init)
        sess.run(assigns)
        return float(np.mean([sess.run(ex.loss, feed_dict=b) for b in batches]))


def test_async_ps_training_runs_to_completion_and_learns(fresh_cluster, procs, tmp_path):
    """sync=False, between-graph, 2 workers x 1 device: no accumulators and nobody waits;
    each worker trains ASYNC_STEPS steps on its rows of two fixed global batches. Both
    finish, the step counter counts every replica's update, and the model learned: its
    loss on the training data with the final variables (read by the worker that finished
    last, after every update) is well below the loss with the initial ones. (The workers'
    own step losses are a poor measure: worker 1 starts after the chief's init, when the
    chief has already trained a few steps.)"""
    ex = _build("mlp", "sgd", seed=300, learning_rate=0.1)
    data = [ex.batch(s, size=ASYNC_BATCH) for s in range(2)]
    batches = [data[s % 2] for s in range(ASYNC_STEPS)]
    _, initial = harness.run_single(ex, steps=0, feeds=batches)
    cluster = fresh_cluster(2, 1, 1)
    workers = _prepare_workers(cluster, ex, "ps", 1, batches, tmp_path, sync=False)
    for w in workers:
        ops = {n.op for n in w.result.graph_def.node}
        assert not ops & {"ConditionalAccumulator", "AccumulatorTakeGradient"}, \
            f"{w.task}: an asynchronous graph has accumulators"
    outs = []
    for w in workers:
        out = str(tmp_path / f"{w.name}_out.npz")
        procs.start(w.name, _worker_client_cmd(w, ASYNC_STEPS, list(ex.variables.values()), out))
        outs.append(out)
    procs.wait_all()                                   # both finish
    finals = []
    for k, out in enumerate(outs):
        with np.load(out) as d:
            assert len(d["losses"]) == ASYNC_STEPS and np.all(np.isfinite(d["losses"])), k
            finals.append({name: d[f"read/{t}"] for name, t in ex.variables.items()})
    counter = _counter_variable(ex)
    counts = [int(f[counter]) for f in finals]
    # asynchronous: the step counter counts updates, one per replica step
    # (docs/strategies.md); the worker that finished last read it after every update
    assert max(counts) == ASYNC_STEPS * len(workers), counts
    last = finals[int(np.argmax(counts))]
    before, after = _mean_loss_at(ex, initial, data), _mean_loss_at(ex, last, data)
    assert after < 0.75 * before, f"loss on the training data {before:.4f} before, {after:.4f} after"


# ----- rerunning a job on the same servers -------------------------------------------

def test_ps_job_rerun_on_the_same_servers_trains_like_the_first_run(fresh_cluster):
    """Servers outlive clients (`graph-rewrite serve` pods): a client that runs the same
    rewritten graph again, init op first, must train from scratch again and get the same
    numbers, not block on accumulators or counters left over from the first run."""
    ex, batches, ref_losses, ref_values = _reference("mlp", "adam", 400)
    cluster = fresh_cluster(2, 1, 1)
    for run in (1, 2):
        try:
            _, losses, values, _, applied = _run_in_graph(cluster, ex, "ps", 1, batches, call_timeout=20)
        except tf.errors.DeadlineExceededError:
            pytest.fail(f"run {run} of the same graph on the same servers blocked (no step "
                        f"finished within 20 s)", pytrace=False)
        _assert_matches(f"run {run}", losses, values, ref_losses, ref_values)
        assert applied == STEPS


# ----- servers -----------------------------------------------------------------------

def _assert_serves_rewritten_graph(spec, target, seed):
    """The server at ``target`` lists 2 CPU devices and trains a rewritten graph (one
    worker, 2 CPU replicas, allreduce) like one device."""
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(CALL_TIMEOUT * 1000))
    with tf.compat.v1.Session(target, graph=tf.Graph(), config=config) as sess:
        cpus = [d.name for d in sess.list_devices()
                if d.device_type == "CPU" and "/job:worker/replica:0/task:0/" in d.name]
    assert len(cpus) == 2, f"the server has CPU devices {cpus}, not 2"
    ex, batches, ref_losses, ref_values = _reference("mlp", "sgd", seed)
    result = gr.rewrite(ex.graph_def, spec, strategy="allreduce", device_type="CPU",
                        devices_per_worker=2)
    opts = _run_options()
    with gr.Session(result, target=target) as sess:
        sess.run(ex.init, options=opts)
        losses = [float(sess.run([ex.loss, ex.train_op], feed_dict=b, options=opts)[0])
                  for b in batches]
        values = {k: np.asarray(v) for k, v in sess.run(dict(ex.variables), options=opts).items()}
    _assert_matches("served graph", losses, values, ref_losses, ref_values)


@pytest.mark.parametrize("how", ["flags", "tf_config"])
def test_serve_console_script_listens_serves_and_stops_on_sigterm(how, procs, pool):
    pool.stop()
    port = free_port()
    spec = {"worker": [f"localhost:{port}"]}
    cmd = [GRAPH_REWRITE, "serve", "--device-type", "CPU", "--devices-per-worker", "2"]
    env = _env()
    if how == "flags":
        cmd += ["--cluster", json.dumps(spec), "--task", "worker:0"]
    else:
        env["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}})
    proc, log_path = procs.start(f"serve_{how}", cmd, env=env)
    _wait_listening(port, proc, log_path)
    _assert_serves_rewritten_graph(spec, f"grpc://localhost:{port}", 500 + (how == "tf_config"))
    assert proc.poll() is None, f"the server exited while serving\n{_tail(log_path)}"
    os.kill(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"graph-rewrite serve still running {STOP_TIMEOUT:.0f} s after SIGTERM\n"
                    f"{_tail(log_path)}", pytrace=False)
    assert rc == 0, f"exit status {rc} after SIGTERM\n{_tail(log_path)}"
    log = _tail(log_path, 200)
    assert "serving" in log and "Traceback" not in log, log


def test_start_server_in_a_subprocess_serves_rewritten_graphs(procs, pool):
    pool.stop()
    port = free_port()
    spec = {"worker": [f"localhost:{port}"]}
    code = ("import json, sys, time\n"
            "import graph_rewriter as gr\n"
            "server = gr.start_server(json.loads(sys.argv[1]), sys.argv[2], device_type='CPU', "
            "devices_per_worker=2)\n"
            "print('started', server.target, flush=True)\n"
            "time.sleep(3600)\n")
    proc, log_path = procs.start("start_server", [sys.executable, "-c", code, json.dumps(spec), "worker:0"])
    _wait_listening(port, proc, log_path)
    _assert_serves_rewritten_graph(spec, f"grpc://localhost:{port}", 502)
    assert f"started grpc://localhost:{port}" in _tail(log_path, 200)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the start_server process still running {STOP_TIMEOUT:.0f} s after SIGTERM",
                    pytrace=False)


@pytest.mark.parametrize("update_ops", ["group", "control"])
def test_between_graph_ps_batchnorm_trains_like_allreduce(update_ops, pool, procs, tmp_path):
    """A BatchNorm model between-graph under ps (2 workers x 1 replica, 1 ps), its update
    ops run by tf.group(minimize, *UPDATE_OPS) ("group") or made the gradients' control
    dependencies ("control", the idiom of tf.layers' docs): the gradients then wait for
    the moving averages' update, which only the chief runs, after its take of the
    replicas' statistics mid-step; another worker's gradients do not wait for it. Each
    replica normalises its rows with their own statistics and the moving averages on the
    ps take the replicas' mean: the defined semantics (docs/semantics.md), which allreduce
    computes in one process on the same shards, the reference here. (Before, between-graph
    ps refused both modes, and then the control mode.)"""
    seed = 321
    ex = _build("batchnorm", "momentum", seed, update_ops=update_ops)
    batches = [ex.batch(s, size=BATCH // 2) for s in range(STEPS)]   # 2 replicas x 2 rows
    reference = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    with gr.Session(reference) as sess:
        sess.run(ex.init)
        ref_losses = [sess.run([ex.loss, ex.train_op], b)[0] for b in batches]
        ref_values = {name: sess.run(t) for name, t in ex.variables.items()}
    with pool.use(2, 1, SERVER_DEVICES) as cluster:
        _, outputs = _run_between(cluster, procs, tmp_path, ex, "ps", 1, batches)
    losses = (outputs[0]["losses"] + outputs[1]["losses"]) / 2
    values = {name: outputs[0]["reads"][t] for name, t in ex.variables.items()}
    _assert_matches(f"batchnorm ({update_ops}) ps between-graph", losses, values, ref_losses, ref_values)


@pytest.mark.parametrize("pipeline", ["initializable", "one_shot", "queue"])
def test_between_graph_workers_read_their_own_shard_of_an_in_graph_pipeline(pipeline, pool, procs, tmp_path):
    """The "iterator" model reads batches from an in-graph pipeline. Between-graph,
    worker k's graph shards the data before batching (elements k, k+2, ...), so one step
    of the two workers trains on the concatenation of their batches: the same as the
    "mlp" model (same layers and seeds) fed those rows on one device. A one-shot
    iterator's pipeline is built by its dataset_factory function: that is where the
    shard goes. TF1 queues (tf.train.batch over slice_input_producer): each worker's
    producer enqueues its own part of the row indices; the client starts the
    QueueRunners the rewritten MetaGraphDef carries."""
    seed, per_worker, steps = 7, 4, 3
    it = _build("iterator", "sgd", seed, batch_size=per_worker, pipeline=pipeline)
    mlp = _build("mlp", "sgd", seed)
    # the two models start from the same weights (so the comparison below means something)
    _, start_it = harness.run_single(it, steps=0)
    _, start_mlp = harness.run_single(mlp, steps=0)
    for name in start_mlp:
        np.testing.assert_array_equal(start_it[name], start_mlp[name], err_msg=name)
    rng = np.random.default_rng([seed, 4099])   # the pipeline's data, as the zoo makes it
    xs = rng.normal(size=(models.ITERATOR_ROWS, models.FEATURES)).astype(np.float32)
    ys = (np.sin(xs.sum(axis=1))[:, None] + 0.1 * rng.normal(size=(models.ITERATOR_ROWS, 1))).astype(np.float32)
    shards = [(xs[k::2], ys[k::2]) for k in range(2)]
    batches = [{"x:0": np.concatenate([s[0][t * per_worker:(t + 1) * per_worker] for s in shards]),
                "y:0": np.concatenate([s[1][t * per_worker:(t + 1) * per_worker] for s in shards])}
               for t in range(steps)]
    ref_losses, ref_values = harness.run_single(mlp, steps=steps, feeds=batches)
    with pool.use(2, 0, SERVER_DEVICES) as cluster:
        outs = []
        for k in range(2):
            result = gr.rewrite(it.meta_graph() if pipeline == "queue" else it.graph_def, cluster.spec,
                                device_type="CPU", devices_per_worker=1, task=f"worker:{k}")
            shard = [n for n in result.graph_def.node
                     if n.op == ("StridedSlice" if pipeline == "queue" else "ShardDataset")
                     and n.name.endswith("/shard_for_worker")]
            assert len(shard) == 1, "one shard before the one batching op (of the one producer's list)"
            if pipeline == "one_shot":
                (iterator,) = [n for n in result.graph_def.node if n.op == "OneShotIterator"]
                assert iterator.attr["dataset_factory"].func.name.endswith(f"_shard_{k}_of_2")
            path = str(tmp_path / f"it{k}.{'meta' if pipeline == 'queue' else 'pb'}")
            result.save(path)
            out = str(tmp_path / f"it{k}.npz")
            cmd = [sys.executable, "-m", "graph_rewriter.worker_client", "--graph", path,
                   "--target", cluster.target("worker", k), "--steps", str(steps), "--out", out,
                   "--timeout", str(CALL_TIMEOUT)] + sum((["--read", t] for t in it.variables.values()), [])
            procs.start(f"it{k}", cmd)
            outs.append(out)
        procs.wait_all()
    with np.load(outs[0]) as data:
        losses = data["losses"]
        values = {name: data[f"read/{t}"] for name, t in it.variables.items()}
    with np.load(outs[1]) as data:
        losses = (losses + data["losses"]) / 2
    _assert_matches("iterator between-graph", losses, values, ref_losses, ref_values)


def two_workers_read(pool, procs, tmp_path, graph, strategy, steps, reads, feeds=None, suffix="pb", options=None,
                     step_ops=None, dpw=1, halve=None, carry=()):
    """Trains ``graph`` between-graph on 2 workers x ``dpw`` replicas of a pooled cluster
    (with a ps task unless ``strategy`` is allreduce, or an allreduce Plan), each its own worker_client
    process, worker k fed the k-th half of every global batch of ``feeds`` (none: an
    in-graph pipeline; ``halve(feed, k)``, when given, makes worker k's half), ``steps``
    steps; returns worker 0's values of the ``reads`` tensors. ``suffix`` "meta" saves
    MetaGraphDefs (their QueueRunners); ``options``: more rewrite keywords; ``step_ops``:
    (loss, train op) pairs the steps run in turns (default loss:0, train_op); ``carry``:
    (fetch, feed) pairs each client carries from step to step (worker_client --carry)."""
    allreduce = strategy == "allreduce" or getattr(strategy, "strategy", None) == "allreduce"   # (or a Plan)
    with pool.use(2, 0 if allreduce else 1, SERVER_DEVICES) as cluster:
        outs = []
        for k in range(2):
            path = gr.rewrite(graph, cluster.spec, strategy=strategy, device_type="CPU", devices_per_worker=dpw,
                              task=f"worker:{k}", **(options or {})).save(str(tmp_path / f"worker{k}.{suffix}"))
            out = str(tmp_path / f"worker{k}_out.npz")
            cmd = [sys.executable, "-m", "graph_rewriter.worker_client", "--graph", path,
                   "--target", cluster.target("worker", k), "--steps", str(steps), "--out", out,
                   "--timeout", str(CALL_TIMEOUT)] + sum((["--read", t] for t in reads), [])
            for loss, train_op in step_ops or ():
                cmd += ["--loss", loss, "--train-op", train_op]
            for fetch, feed in carry:
                cmd += ["--carry", f"{fetch}={feed}"]
            if feeds is not None:
                halves = [halve(feed, k) if halve is not None else
                          {name: value[k * len(value) // 2:(k + 1) * len(value) // 2] for name, value in feed.items()}
                          for feed in feeds]
                half = {f"{s}/{name}": value for s, feed in enumerate(halves) for name, value in feed.items()}
                np.savez(tmp_path / f"worker{k}_feeds.npz", **half)
                cmd += ["--feeds", str(tmp_path / f"worker{k}_feeds.npz")]
            procs.start(f"worker{k}", cmd)
            outs.append(out)
        procs.wait_all()
    with np.load(outs[0]) as got:
        return {t: got[f"read/{t}"] for t in reads}


def two_workers_variables(pool, procs, tmp_path, graph_def, strategy, steps, feeds, options=None):
    """{variable: value} of every resource variable of ``graph_def`` (harness.resource_reads)
    after two_workers_read trains it between-graph on 2 workers x 1 replica, each fed its
    half of every batch of ``feeds``: what a loopback test compares with one device's."""
    from graph_rewriter.testing import harness
    reads = harness.resource_reads(graph_def)
    got = two_workers_read(pool, procs, tmp_path, graph_def, strategy, steps, reads.values(), feeds,
                           options=options)
    return {name: got[tensor] for name, tensor in reads.items()}


def _tutorial_variables(meta, steps):
    """{variable: value} of the CIFAR-10 tutorial's graph trained ``steps`` steps on one
    device under MonitoredTrainingSession (which starts its QueueRunners), and the
    variables' snapshot tensors by name."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta)
        variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
        snapshots = {name: v.to_proto().snapshot_name for name, v in variables.items()}
        with tf.compat.v1.train.MonitoredTrainingSession() as sess:
            for _ in range(steps):
                sess.run("train_op")
            return sess.run(variables), snapshots


@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_the_cifar10_tutorial_trains_between_graph_like_one_device(strategy, pool, procs, tmp_path):
    """TensorFlow's CIFAR-10 tutorial (scaled down: its reader pipeline over two binary
    files, weight decay in the "losses" collection, the loss averages the gradients wait
    for, the decayed learning rate, the variables' moving averages after the update),
    2 workers x 1 replica of batch 8. Worker k's producer reads file k, so a step trains on
    8 records of each: one device reading a file of those records in that order, batch
    16, ends with the same variables, all of them. Under ps the gradients wait for the
    loss averages, which the chief updates after its take of the replicas' losses
    mid-step (before, between-graph ps refused the graph)."""
    from graph_rewriter.testing.tf1_scripts import cifar10_tutorial, write_cifar_files
    steps, batch = 4, 8
    files = write_cifar_files(tmp_path)
    record = 1 + 3 * 12 * 12
    data = [open(f, "rb").read() for f in files]
    with open(tmp_path / "one_device.bin", "wb") as out:   # step t: file 1's rows, then file 2's
        for t in range(steps):
            for d in data:
                out.write(d[t * batch * record:(t + 1) * batch * record])
    want, reads = _tutorial_variables(cifar10_tutorial([str(tmp_path / "one_device.bin")], 2 * batch), steps)
    assert want["global_step"] == steps
    got = two_workers_read(pool, procs, tmp_path, cifar10_tutorial(files, batch), strategy, steps, reads.values(),
                           suffix="meta")
    for name, tensor in sorted(reads.items()):
        np.testing.assert_allclose(got[tensor], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{strategy}: {name}")


# ----- faults: a dead peer is an error in bounded time ---------------------------------

FAULT_TIMEOUT = 8.0      # the rewrite's timeout_seconds
FAULT_STEPS = 200
FAULT_MARGIN = 40.0      # process start-up and a loaded two-core machine


def _wait_for_line(log_path, pattern, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            if re.search(pattern, f.read(), re.M):
                return
        if proc.poll() is not None:
            pytest.fail(f"the client exited early:\n{_tail(log_path)}", pytrace=False)
        time.sleep(0.2)
    pytest.fail(f"no line matching {pattern!r} within {timeout:.0f} s:\n{_tail(log_path)}", pytrace=False)


@pytest.mark.parametrize("strategy, num_ps", [("allreduce", 0), ("ps", 1)])
def test_a_killed_worker_fails_the_survivors_step_within_the_timeout(strategy, num_ps, fresh_cluster, procs,
                                                                    tmp_path):
    """Between-graph, 2 workers x 1 device, rewritten with timeout_seconds=FAULT_TIMEOUT.
    Mid-training, worker 1's client and server are killed (SIGKILL). Worker 0's client
    (no per-call timeout of its own: the graph's applies) must fail with graph_rewriter's
    diagnosis within the timeout plus a margin, not hang: on the all-reduce or on the
    chief's accumulator take (the heartbeats, or the session's operation timeout)."""
    ex = _build("mlp", "sgd", seed=400 + num_ps)
    batches = [ex.batch(s, size=BATCH) for s in range(FAULT_STEPS)]
    cluster = fresh_cluster(2, num_ps, 1)
    workers = _prepare_workers(cluster, ex, strategy, 1, batches, tmp_path, timeout_seconds=FAULT_TIMEOUT)
    clients = []
    for w in workers:
        cmd = _worker_client_cmd(w, FAULT_STEPS, [], str(tmp_path / f"{w.name}_out.npz"), delay=0.1,
                                 timeout=0) + ["--progress"]
        clients.append(procs.start(w.name, cmd))
    (chief, chief_log), (other, _) = clients
    _wait_for_line(chief_log, r"^step 3 loss", chief, START_TIMEOUT)
    os.killpg(other.pid, signal.SIGKILL)
    cluster.kill("worker", 1)
    killed = time.monotonic()
    try:
        rc = chief.wait(timeout=FAULT_TIMEOUT + FAULT_MARGIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker 0 still running {FAULT_TIMEOUT + FAULT_MARGIN:.0f} s after worker 1 died:\n"
                    f"{_tail(chief_log)}", pytrace=False)
    elapsed = time.monotonic() - killed
    log = open(chief_log, errors="replace").read()
    assert rc == 3, f"worker 0 exited with {rc}:\n{log[-3000:]}"
    assert "graph_rewriter: " in log and ("did not finish within 8 s" in log or "cannot be reached" in log
                                          or "worker:1 is gone" in log), log[-3000:]
    assert elapsed <= FAULT_TIMEOUT + FAULT_MARGIN


# ----- checkpoints: kill everything, restart from the last checkpoint ----------------------

RESTART_STEPS, KILL_AFTER = 6, 3


def _checkpoint_client(argv):
    """An in-graph client (run in a subprocess, see test below): ``restore`` ('-' for
    none) then steps FIRST..LAST-1, saving a checkpoint named ckpt-<steps done> after
    each, printing "saved N" and sleeping ``delay`` seconds (a run in progress, to be
    killed); then it writes the variables to OUT."""
    graph, target, feeds_path, first, last, ckpt_dir, restore, delay, out = argv
    first, last, delay = int(first), int(last), float(delay)
    with np.load(feeds_path) as data:
        feeds = {k: data[k] for k in data.files}
    result = gr.load(graph)
    save = next(n for n in result.graph_def.node if n.op == "SaveV2").input[0].split(":")[0].rsplit("/", 1)[0]
    with gr.Session(result, target=target) as sess:
        if restore == "-":
            sess.run("init")
        else:
            sess.run(f"{save}/restore_all", {f"{save}/Const:0": restore})
        for step in range(first, last):
            feed = {k.split("/", 1)[1]: v for k, v in feeds.items() if k.split("/", 1)[0] == str(step)}
            sess.run("train_op", feed)
            path = os.path.join(ckpt_dir, f"ckpt-{step + 1}")
            sess.run(f"{save}/control_dependency:0", {f"{save}/Const:0": path})
            print(f"saved {step + 1}", flush=True)
            time.sleep(delay)
        names = json.loads(os.environ["CHECKPOINT_READS"])
        np.savez(out, **dict(zip(names, sess.run(names))))
    return 0


def _checkpoint_client_cmd(*args):
    code = "import sys, test_cluster; sys.exit(test_cluster._checkpoint_client(sys.argv[1:]))"
    return [sys.executable, "-c", code] + [str(a) for a in args]


@pytest.mark.parametrize("strategy, num_ps", [("allreduce", 0), ("ps", 1)])
def test_training_killed_and_restarted_from_its_checkpoint_ends_like_an_uninterrupted_run(
        strategy, num_ps, fresh_cluster, procs, launcher, tmp_path):
    """In-graph over 2 workers x 1 device (+ a ps): train KILL_AFTER steps saving a
    checkpoint after each, SIGKILL the client and every server, start a new cluster,
    restore the last checkpoint and train the remaining steps. The variables equal the
    one-device run of all RESTART_STEPS steps (which the uninterrupted run equals: see
    test_cluster_training_equals_one_device)."""
    ex = _build("mlp", "adam", seed=500 + num_ps)
    batches = [ex.batch(s, size=BATCH) for s in range(RESTART_STEPS)]
    _, ref_values = harness.run_single(ex, steps=RESTART_STEPS, feeds=batches)
    feeds_path = str(tmp_path / "feeds.npz")
    np.savez(feeds_path, **{f"{s}/{k}": v for s, b in enumerate(batches) for k, v in b.items()})
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    env = _env(CHECKPOINT_READS=json.dumps(list(ex.variables.values())))

    def graph_for(cluster, name):
        path = str(tmp_path / f"{name}.pb")
        gr.rewrite(ex.graph_def, cluster.spec, strategy=strategy, device_type="CPU", devices_per_worker=1,
                   timeout_seconds=60).save(path)
        return path

    first = fresh_cluster(2, num_ps, 1)
    killed = Processes(str(tmp_path), launcher)
    try:
        proc, log = killed.start("client_a", _checkpoint_client_cmd(
            graph_for(first, "a"), first.target("worker", 0), feeds_path, 0, RESTART_STEPS, ckpt_dir, "-", 5,
            tmp_path / "unused.npz"), env=env)
        _wait_for_line(log, rf"^saved {KILL_AFTER}$", proc, PROCESS_TIMEOUT)
    finally:
        killed.end_all()                                # SIGKILL: every process of the first run dies
    assert f"saved {KILL_AFTER + 1}" not in open(log).read(), "the first run was not killed mid-training"
    for job, i in first.tasks():
        first.kill(job, i)
    assert not any(p.poll() is None for p in first.processes.values())
    second = fresh_cluster(2, num_ps, 1)                # new servers, new ports, nothing kept
    out = tmp_path / "restarted.npz"
    procs.start("client_b", _checkpoint_client_cmd(
        graph_for(second, "b"), second.target("worker", 0), feeds_path, KILL_AFTER, RESTART_STEPS, ckpt_dir,
        ckpt_dir / f"ckpt-{KILL_AFTER}", 0, out), env=env)
    procs.wait_all()
    with np.load(out) as data:
        values = {name: data[t] for name, t in ex.variables.items()}
    for name, want in ref_values.items():
        np.testing.assert_allclose(values[name], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{strategy}: '{name}' after a restart differs from the uninterrupted run")
