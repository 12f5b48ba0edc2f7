"""Gradient accumulation: ``rewrite(..., accumulation_steps=k)`` (passes/micro_batches.py).

Every run of the rewritten train op is one micro-batch. Each replica sums its gradients
over k runs; on every k-th run the mean of the k micro-batches' gradients is synchronised
(all-reduce, all-gather or the parameter-server accumulators) and applied once; on the
other runs no variable, optimizer slot or step counter changes.

What is held, against the single-device run of the same graph (never a constant):

- k runs of the rewritten graph, fed the k consecutive 1/k-slices of a batch in order,
  end with every variable (weights, slots, step counter) equal to ONE single-device step
  on the whole batch; the next k runs equal the second step (the sums were reset).
  After each of the other runs every variable, and every replica's copy of it, is
  exactly what it was after the last applying run (the initial values in the first
  window). Every mirrored replica copy equals the master's.
- The loss fetched on each run is the mean loss of that micro-batch (the single-device
  graph's loss on it, with the variables at the start of the window).
- The init op and a Saver restore reset a window in progress (counter and sums).
- Structure: k=1 adds nothing; k>1 is recorded in the plan (and survives save/load), and
  with GPU replicas every replica's sums live on that replica's GPU.
- Slow: between-graph on real loopback servers (allreduce; ps with one ps task).

Cases: every v1 optimizer on "mlp" (dense) and "embedding" (sparse gradient with
duplicate ids) and every Keras legacy optimizer on "keras" (dense) and "keras_embedding"
(dense and sparse gradients), all with strategy allreduce, 2 CPU replicas, k=2; a smaller
set for strategies ps and hybrid, for one replica, for four (ps and hybrid with a
template replica), for ref variables, and for k=3 and k=4. BatchNorm is left out: its moving statistics are not gradients and update on every
micro-batch (a documented limitation).
"""

import functools
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.local_cluster import LocalCluster
from graph_rewriter.testing import harness, models

from test_cluster import procs  # noqa: F401  (a fixture: client processes, ended by their ids)
from test_equivalence import ATOL, RTOL, _case_id, _step_counter_name

V1 = models.OPTIMIZERS_V1
KERAS = models.OPTIMIZERS_KERAS
MICRO = 8             # rows of one micro-batch (a whole batch is k of them)
WINDOWS = 2           # applied steps per case: two windows of k runs
OP_TIMEOUT_MS = 20000  # a blocked step (accumulator, collective) fails instead of hanging
MICRO_SCOPE = "graph_rewriter/micro_batches"


def _config():
    return tf.compat.v1.ConfigProto(operation_timeout_in_ms=OP_TIMEOUT_MS)


def _micro(batch, j, k):
    """Rows j/k .. (j+1)/k of every batch input (in order)."""
    out = {}
    for name, value in batch.items():
        rows = len(value) // k
        assert rows * k == len(value), f"test setup: {name} has {len(value)} rows for k={k}"
        out[name] = value[j * rows:(j + 1) * rows]
    return out


def _import(graph_def):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return graph


# ----- the single-device reference ------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _reference(model, optimizer, resource, k, seed=0):
    """(example, whole batches, micro-batch losses, states) of the original graph on one
    device: ``states[s]`` holds every variable after s steps on the whole batches
    (states[0]: after init); ``losses[s * k + j]`` is the loss on micro-batch j of batch s
    with the variables of states[s] (evaluated before step s, nothing trained by it)."""
    ex = models.build(model, optimizer, resource=resource, seed=seed)
    batches = [ex.batch(s, size=MICRO * k) for s in range(WINDOWS)]
    graph = _import(ex.graph_def)
    names = dict(ex.variables)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(ex.init)
        states = [{n: np.asarray(v) for n, v in sess.run(names).items()}]
        losses = []
        for batch in batches:
            for j in range(k):
                losses.append(float(sess.run(ex.loss, _micro(batch, j, k))))
            whole, _ = sess.run([ex.loss, ex.train_op], batch)
            # equal micro-batches of a mean loss: the batch's loss is the mean of theirs
            np.testing.assert_allclose(whole, np.mean(losses[-k:]), rtol=1e-5, atol=1e-6)
            states.append({n: np.asarray(v) for n, v in sess.run(names).items()})
    counter = _step_counter_name(ex)
    for s in range(1, WINDOWS + 1):
        assert int(states[s][counter]) == s, "the single-device step counter is not the step count"
        moved = [n for n in states[s] if not np.array_equal(states[s][n], states[s - 1][n])]
        assert len(moved) >= 3, f"single-device step {s} of {model}/{optimizer} changed only {moved}"
    assert np.all(np.isfinite(losses)), losses
    return ex, batches, losses, states


# ----- running the rewritten graph run by run -------------------------------------------

def _expected_copies(result, ex):
    """{prefix + name} that must exist: every variable on the master, and a copy on every
    other replica of every variable not on a parameter server."""
    on_ps = {v.name for v in result.plan.variables if v.placement == "ps"}
    prefixes = result.metadata["replica_prefixes"]
    return {p + n for p in prefixes for n in ex.variables if p == "" or n not in on_ps}


def _assert_state(what, got, want, exact_to=None):
    """Every copy in ``got`` ({prefix + name}) is close to ``want[name]``; with
    ``exact_to`` (a previous ``got``) every copy is also bit-for-bit unchanged."""
    for key, value in sorted(got.items()):
        name = key.split("/", 1)[1] if key.startswith("replica_") else key
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: '{key}' differs from one device")
        if exact_to is not None:
            np.testing.assert_array_equal(value, exact_to[key],
                                          err_msg=f"{what}: '{key}' changed on a run that only accumulates")


def check_windows(model, optimizer, resource=True, strategy="allreduce", replicas=2, k=2):
    ex, batches, ref_losses, states = _reference(model, optimizer, resource, k)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=replicas,
                        device_type="CPU", accumulation_steps=k)
    assert result.num_replicas == replicas
    assert result.plan.accumulation_steps == k
    counter = _step_counter_name(ex)
    what = f"{model}/{optimizer} {strategy} R={replicas} k={k}"
    with gr.Session(result, config=_config()) as sess:
        read = harness.ReplicaCopies(sess, ex, result.metadata["replica_prefixes"])
        sess.run(ex.init)
        last = read()
        assert set(last) == _expected_copies(result, ex), f"{what}: variable copies"
        _assert_state(f"{what}, after init", last, states[0])
        for s, batch in enumerate(batches):
            for j in range(k):
                run = s * k + j + 1
                loss, _ = sess.run([ex.loss, ex.train_op], _micro(batch, j, k))
                np.testing.assert_allclose(
                    loss, ref_losses[s * k + j], rtol=RTOL, atol=ATOL,
                    err_msg=f"{what}: loss of run {run} is not the loss of micro-batch {j} of batch {s}")
                got = read()
                if j < k - 1:
                    _assert_state(f"{what}, run {run} (accumulating)", got, states[s], exact_to=last)
                    assert int(got[counter]) == s, f"{what}: '{counter}' is {got[counter]} after run {run}"
                else:
                    _assert_state(f"{what}, run {run} (applying step {s + 1})", got, states[s + 1])
                    assert int(got[counter]) == s + 1, f"{what}: '{counter}' is {got[counter]} after run {run}"
                    last = got


# ----- equivalence: allreduce, 2 replicas, k=2, every optimizer -----------------------------

V1_CASES = [(m, o) for m in ("mlp", "embedding") for o in V1]


@pytest.mark.parametrize("model,optimizer", V1_CASES, ids=_case_id)
def test_v1_optimizer(model, optimizer):
    check_windows(model, optimizer)


KERAS_CASES = [(m, o) for m in ("keras", "keras_embedding") for o in KERAS]


@pytest.mark.parametrize("model,optimizer", KERAS_CASES, ids=_case_id)
def test_keras_optimizer(model, optimizer):
    check_windows(model, optimizer)


# ----- other strategies, replica counts, ref variables, window lengths ------------------

OTHER_CASES = [
    # (model, optimizer, resource, strategy, replicas, k)
    ("mlp", "adam", True, "ps", 2, 2),
    ("embedding", "adagrad", True, "ps", 2, 2),
    ("embedding", "adam", True, "ps", 2, 2),
    ("keras_embedding", "keras_adam", True, "ps", 2, 2),
    ("embedding", "adam", True, "hybrid", 2, 2),
    ("embedding", "ftrl", True, "hybrid", 2, 2),
    ("keras_embedding", "keras_adagrad", True, "hybrid", 2, 2),
    ("mlp", "adam", True, "allreduce", 1, 2),
    ("embedding", "adagrad", True, "allreduce", 1, 2),
    ("embedding", "adam", True, "ps", 1, 2),
    ("mlp", "momentum", False, "allreduce", 2, 2),
    ("embedding", "adam", False, "allreduce", 2, 2),
    ("embedding", "adagrad", False, "ps", 2, 2),
    ("embedding", "ftrl", False, "hybrid", 2, 2),
    ("mlp", "adam", True, "allreduce", 2, 3),
    ("embedding", "adagrad", True, "allreduce", 2, 3),
    ("embedding", "adam", True, "allreduce", 2, 4),
    ("embedding", "adam", True, "hybrid", 2, 3),
    ("mlp", "rmsprop_momentum", True, "ps", 2, 4),
    # four replicas: replica 1 is the template of replicas 2 and 3 (test_template_replicas.py)
    ("embedding", "adam", True, "ps", 4, 2),
    ("keras_embedding", "keras_adagrad", True, "hybrid", 4, 2),
]


def _other_id(case):
    model, optimizer, resource, strategy, replicas, k = case
    return f"{model}-{optimizer}-{'resource' if resource else 'ref'}-{strategy}-R{replicas}-k{k}"


@pytest.mark.parametrize("case", OTHER_CASES, ids=[_other_id(c) for c in OTHER_CASES])
def test_strategies_replicas_and_window_lengths(case):
    model, optimizer, resource, strategy, replicas, k = case
    check_windows(model, optimizer, resource, strategy, replicas, k)


# ----- the init op and a checkpoint restore reset a window in progress ------------------

RESET_CASES = [
    ("mlp", "adam", "allreduce", 2),
    ("embedding", "adagrad", "allreduce", 3),
    ("embedding", "adam", "ps", 2),
    ("embedding", "adam", "hybrid", 3),
]


def _reset_id(case):
    return "-".join(str(x) for x in case[:3]) + f"-k{case[3]}"


def _junk(ex, k):
    """A batch none of the reference steps sees: its sums must not survive a reset."""
    return ex.batch(50, size=MICRO * k)


def _train_window(sess, ex, batch, k, runs=None):
    """Runs the train op on micro-batches 0 .. runs-1 (default: all k) of ``batch``."""
    for j in range(k if runs is None else runs):
        sess.run([ex.loss, ex.train_op], _micro(batch, j, k))


def _single_steps_from(ex, start, batches):
    """The original graph on one device with its variables set to ``start`` (every
    variable) and trained on ``batches``: [start, after step 1, ...]."""
    graph = _import(ex.graph_def)
    assigns = harness.assign_ops(graph, start)
    names = dict(ex.variables)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(ex.init)
        sess.run(assigns)
        states = [{n: np.asarray(v) for n, v in sess.run(names).items()}]
        for batch in batches:
            sess.run(ex.train_op, batch)
            states.append({n: np.asarray(v) for n, v in sess.run(names).items()})
    for name, value in start.items():
        np.testing.assert_array_equal(states[0][name], value, err_msg=f"test setup: '{name}' not set")
    return states


@pytest.mark.parametrize("case", RESET_CASES, ids=[_reset_id(c) for c in RESET_CASES])
def test_init_resets_a_window_in_progress(case):
    """k-1 runs, then the init op again: the next k runs are one step from the values
    that init gave (a counter left at k-1 would apply after one run; sums left over would
    add the earlier runs' gradients). Seeded random initializers draw new values when
    the init op runs again in the same session, so the reference starts from the values
    read after the second init, not from the first. Done twice: after k-1 runs on other
    data from a fresh init, and after k-1 runs in the middle of the second window."""
    model, optimizer, strategy, k = case
    ex, batches, _, states = _reference(model, optimizer, True, k)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2, device_type="CPU",
                        accumulation_steps=k)
    what = f"{model}/{optimizer} {strategy} k={k}"
    with gr.Session(result, config=_config()) as sess:
        read = harness.ReplicaCopies(sess, ex, result.metadata["replica_prefixes"])
        sess.run(ex.init)
        start = read()
        _assert_state(f"{what}: after init", start, states[0])
        _train_window(sess, ex, _junk(ex, k), k, runs=k - 1)
        _assert_state(f"{what}: mid-window", read(), states[0], exact_to=start)
        for attempt in range(2):
            sess.run(ex.init)
            restarted = read()
            _assert_state(f"{what}: replica copies after init {attempt + 2}", restarted,
                          {n: restarted[n] for n in ex.variables})
            want = _single_steps_from(ex, {n: restarted[n] for n in ex.variables}, batches)
            _train_window(sess, ex, batches[0], k)
            one = read()
            _assert_state(f"{what}: step 1 after init {attempt + 2} mid-window", one, want[1])
            _train_window(sess, ex, batches[1], k, runs=k - 1)
            _assert_state(f"{what}: accumulating towards step 2 after init {attempt + 2}", read(), want[1],
                          exact_to=one)
        # the window in progress goes on: its last micro-batch applies step 2
        sess.run([ex.loss, ex.train_op], _micro(batches[1], k - 1, k))
        _assert_state(f"{what}: step 2 after the last init", read(), want[2])


def _saver_scope(graph_def):
    save = next(n for n in graph_def.node if n.op == "SaveV2")
    return save.input[0].split(":")[0].rsplit("/", 1)[0]


@pytest.mark.parametrize("case", RESET_CASES, ids=[_reset_id(c) for c in RESET_CASES])
def test_checkpoint_restore_resets_a_window_in_progress(case, tmp_path):
    """The graph's own Saver: saved mid-window (holding the initial values, nothing
    applied yet) and restored after more accumulating runs, the next k runs are one step
    from the restored values; saved after a whole step and restored after a run on other
    data, the next k runs are the second step."""
    model, optimizer, strategy, k = case
    ex, batches, _, states = _reference(model, optimizer, True, k)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2, device_type="CPU",
                        accumulation_steps=k)
    scope = _saver_scope(result.graph_def)
    assert scope == _saver_scope(ex.graph_def), "the rewrite renamed the Saver"
    what = f"{model}/{optimizer} {strategy} k={k}"

    def save(sess, path):
        sess.run(f"{scope}/control_dependency:0", {f"{scope}/Const:0": path})

    def restore(sess, path):
        sess.run(f"{scope}/restore_all", {f"{scope}/Const:0": path})

    junk = _junk(ex, k)
    mid, after_one = str(tmp_path / "mid.ckpt"), str(tmp_path / "step1.ckpt")
    with gr.Session(result, config=_config()) as sess:
        read = harness.ReplicaCopies(sess, ex, result.metadata["replica_prefixes"])
        sess.run(ex.init)
        start = read()
        _train_window(sess, ex, junk, k, runs=k - 1)              # mid-window
        save(sess, mid)
        _train_window(sess, ex, junk, k, runs=k - 1)              # would complete a window with k=2
        restore(sess, mid)
        _assert_state(f"{what}: restored mid-window", read(), states[0], exact_to=start)
        _train_window(sess, ex, batches[0], k)
        _assert_state(f"{what}: step 1 after a restore mid-window", read(), states[1])
        save(sess, after_one)
        _train_window(sess, ex, junk, k, runs=k - 1)
        restore(sess, after_one)
        _assert_state(f"{what}: restored step 1", read(), states[1])
        _train_window(sess, ex, batches[1], k)
        _assert_state(f"{what}: step 2 after a restore mid-window", read(), states[2])


# ----- structure (rewrite only) ---------------------------------------------------------

@pytest.mark.parametrize("model,optimizer,strategy", [
    ("mlp", "adam", "allreduce"), ("embedding", "adagrad", "ps"), ("embedding", "adam", "hybrid")],
    ids=_case_id)
def test_one_step_adds_nothing(model, optimizer, strategy):
    """accumulation_steps=1 (the default) is the plain rewrite: no micro_batches node and
    the same graph as without the option; k=2 does add them (so the check can fail)."""
    ex = models.build(model, optimizer)
    kw = dict(strategy=strategy, devices_per_worker=2, device_type="CPU")
    plain = gr.rewrite(ex.graph_def, **kw)
    one = gr.rewrite(ex.graph_def, accumulation_steps=1, **kw)
    assert one.plan.accumulation_steps == 1
    assert not [n.name for n in one.graph_def.node if MICRO_SCOPE in n.name]
    assert (one.graph_def.SerializeToString(deterministic=True)
            == plain.graph_def.SerializeToString(deterministic=True))
    two = gr.rewrite(ex.graph_def, accumulation_steps=2, **kw)
    assert [n.name for n in two.graph_def.node if n.name.startswith(MICRO_SCOPE)]
    assert [n.name for n in two.graph_def.node if n.name.startswith("replica_1/" + MICRO_SCOPE)]


@pytest.mark.parametrize("k", [2, 5])
def test_plan_records_accumulation_steps(k, tmp_path):
    ex = models.build("embedding", "adam")
    result = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU", accumulation_steps=k)
    assert result.plan.accumulation_steps == k
    path = str(tmp_path / "rewritten.pb")
    result.save(path)
    assert gr.load(path).plan.accumulation_steps == k
    # a saved plan carries it to another rewrite
    again = gr.rewrite(ex.graph_def, strategy=result.plan, devices_per_worker=2, device_type="CPU")
    assert again.plan.accumulation_steps == k
    assert any(n.name.startswith(MICRO_SCOPE) for n in again.graph_def.node)


@pytest.mark.parametrize("model,optimizer,strategy", [
    ("mlp", "adam", "allreduce"), ("embedding", "adam", "allreduce"), ("mlp", "sgd", "ps"),
    ("embedding", "adagrad", "hybrid"), ("keras_embedding", "keras_adam", "allreduce")],
    ids=_case_id)
def test_sums_live_on_the_replicas_gpus(model, optimizer, strategy):
    """device_type="GPU", 2 replicas: replica i's dense sums ("<var>/sum") and sparse rows
    ("<var>/rows") of every gradient are variables on /device:GPU:i."""
    ex = models.build(model, optimizer)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2, device_type="GPU",
                        accumulation_steps=2)
    nodes = {n.name: n for n in result.graph_def.node}
    prefixes = result.metadata["replica_prefixes"]
    assert prefixes == ["", "replica_1/"]
    cuts = [c for c in result.plan.cuts if c.role != "state"]
    assert {c.variable for c in cuts} >= {v for v in ex.variables if v.endswith("kernel")}
    if "embedding" in model:
        assert any(c.kind == "sparse" for c in cuts), "no sparse gradient in an embedding model"
    for i, prefix in enumerate(prefixes):
        for cut in cuts:
            name = f"{prefix}{MICRO_SCOPE}/{cut.variable}/{'sum' if cut.kind == 'dense' else 'rows'}"
            assert name in nodes, f"no '{name}'"
            assert nodes[name].op == "VarHandleOp", name
            assert nodes[name].device == f"/device:GPU:{i}", f"'{name}' is on '{nodes[name].device}'"


def test_accepted_next_to_its_rejections():
    """The combinations next to the refused ones (tests/test_bad_input.py) are accepted:
    sync parameter servers, hybrid with one in-graph client, between-graph allreduce and
    ps, and between-graph hybrid without accumulation."""
    ex = models.build("embedding", "adam")
    cluster = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224"]}
    cpu = dict(devices_per_worker=1, device_type="CPU")
    for kw in (dict(strategy="ps", sync=True, accumulation_steps=2),
               dict(strategy="hybrid", cluster_spec=cluster, accumulation_steps=2),
               dict(strategy="allreduce", cluster_spec={"worker": cluster["worker"]}, task="worker:1",
                    accumulation_steps=2),
               dict(strategy="ps", cluster_spec=cluster, task="worker:0", accumulation_steps=2),
               dict(strategy="hybrid", cluster_spec=cluster, task="worker:0", accumulation_steps=1)):
        result = gr.rewrite(ex.graph_def, **cpu, **kw)
        assert result.plan.accumulation_steps == kw["accumulation_steps"], kw


# ----- slow: between-graph workers on real loopback servers ---------------------------------

START_TIMEOUT = 120.0      # the servers listening
CALL_TIMEOUT = 60.0        # any one session call of a worker client
PROCESS_TIMEOUT = 300.0    # a worker client process, start to exit
SLOW_K = 2
SLOW_WORKERS = 2


def _between_client(argv):
    """One between-graph worker (run in its own process, see _between_client_cmd): init,
    then one run of [loss, train op] per micro-batch in FEEDS (keys "<run>/<tensor>"),
    reading the variables after init and after every run; writes OUT (.npz):
    "losses" and "after<r>/<tensor>" (r = 0 after init)."""
    graph, target, feeds_path, runs, out, reads = argv[0], argv[1], argv[2], int(argv[3]), argv[4], argv[5:]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(CALL_TIMEOUT * 1000))
    with np.load(feeds_path) as data:
        feeds = {key: data[key] for key in data.files}
    saved, losses = {}, []
    with gr.Session(graph, target=target) as sess:
        sess.run("init", options=options)
        for r in range(runs + 1):
            if r:
                feed = {key.split("/", 1)[1]: v for key, v in feeds.items() if key.split("/", 1)[0] == str(r - 1)}
                loss, _ = sess.run(["loss:0", "train_op"], feed_dict=feed, options=options)
                losses.append(float(loss))
            for tensor, value in zip(reads, sess.run(list(reads), options=options)):
                saved[f"after{r}/{tensor}"] = np.asarray(value)
    np.savez(out, losses=np.asarray(losses), **saved)
    return 0


def _between_client_cmd(*args):
    # run by test_cluster's Processes, whose environment makes the tests folder importable
    code = "import sys, test_accumulation; sys.exit(test_accumulation._between_client(sys.argv[1:]))"
    return [sys.executable, "-c", code] + [str(a) for a in args]


@pytest.fixture
def cluster_factory(tmp_path, launcher):
    """Starts LocalClusters (ports from free_port(); every server process ended by its id in
    stop()) and stops them at teardown, whatever happens. Their servers are unsupervised,
    forked by the suite's launcher (tests/conftest.py)."""
    started = []

    def make(workers, ps):
        log_dir = tmp_path / f"servers_{len(started)}"
        log_dir.mkdir()
        started.append(LocalCluster(workers=workers, ps=ps, device_type="CPU", devices_per_worker=1,
                                    start_timeout=START_TIMEOUT, log_dir=str(log_dir), supervise=False,
                                    launcher=launcher).start())
        return started[-1]

    try:
        yield make
    finally:
        for c in started:
            c.stop()


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy,num_ps,optimizer", [("allreduce", 0, "adam"), ("ps", 1, "adam")])
@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_between_graph_workers_equal_one_device(strategy, num_ps, optimizer, model, cluster_factory,
                                                procs, tmp_path):
    """2 workers x 1 CPU replica, between-graph (one client process per worker, each fed
    its half of every micro-batch), k=2, two windows: the variables equal the
    single-device steps after each window and are unchanged after the other runs; the
    mean of the workers' losses on a run is the micro-batch's loss; the workers agree."""
    k = SLOW_K
    # a seed of its own: graph fingerprints (shared names, collective keys) never repeat
    seed = 700 + 10 * num_ps + (model == "embedding")
    ex, batches, ref_losses, states = _reference(model, optimizer, True, k, seed)
    cluster = cluster_factory(SLOW_WORKERS, num_ps)
    runs = WINDOWS * k
    reads = list(ex.variables.values())
    outs = []
    for w in range(SLOW_WORKERS):
        result = gr.rewrite(ex.graph_def, cluster.spec, strategy=strategy, device_type="CPU",
                            devices_per_worker=1, task=f"worker:{w}", accumulation_steps=k)
        assert result.num_replicas == SLOW_WORKERS and result.plan.accumulation_steps == k
        graph_path = str(tmp_path / f"worker{w}.pb")
        result.save(graph_path)
        feeds = {}
        for s, batch in enumerate(batches):
            for j in range(k):
                for name, value in _micro(_micro(batch, j, k), w, SLOW_WORKERS).items():
                    feeds[f"{s * k + j}/{name}"] = value
        feeds_path = str(tmp_path / f"worker{w}_feeds.npz")
        np.savez(feeds_path, **feeds)
        out = str(tmp_path / f"worker{w}_out.npz")
        procs.start(f"worker{w}", _between_client_cmd(graph_path, cluster.target("worker", w), feeds_path,
                                                      runs, out, *reads))
        outs.append(out)
    procs.wait_all(PROCESS_TIMEOUT)
    got = []
    for out in outs:
        with np.load(out) as data:
            got.append({"losses": data["losses"],
                        "after": [{name: data[f"after{r}/{t}"] for name, t in ex.variables.items()}
                                  for r in range(runs + 1)]})
    what = f"{model}/{optimizer} {strategy} between-graph k={k}"
    # Every worker's reads after every run, except where a ps makes them racy. On a ps only
    # the chief applies updates, and it may start its next applying run while another
    # worker is still reading after this one: sparse Adam decays its slots (m *= beta1)
    # before the gradients arrive, so that read can see the next update half-applied (seen
    # in CI: 0.9x one device's `embedding/Adam` on the rows of the next micro-batch). So on
    # a ps the other workers' reads are checked after init and after the last run, when
    # the chief has no update left to start; the chief's reads are checked after every run.
    for w, g in enumerate(got):
        _assert_state(f"{what}: worker {w} after init", g["after"][0], states[0])
        for r in range(1, runs + 1):
            step, phase = divmod(r, k)
            if strategy == "ps" and w > 0 and r < runs:
                continue
            if phase:
                _assert_state(f"{what}: worker {w} after run {r} (accumulating)", g["after"][r], states[step],
                              exact_to=g["after"][r - phase])
            else:
                _assert_state(f"{what}: worker {w} after run {r} (applying step {step})", g["after"][r],
                              states[step])
    losses = np.mean([g["losses"] for g in got], axis=0)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: the workers' mean loss per run is not the micro-batch loss")
    for name in ex.variables:
        np.testing.assert_allclose(got[1]["after"][runs][name], got[0]["after"][runs][name],
                                   rtol=1e-6, atol=1e-7, err_msg=f"{what}: '{name}' differs between the workers")
