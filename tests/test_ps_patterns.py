"""Parameter-server training patterns that once hung on the second step (issue 15).

Each model is built here, seeded, and trained STEPS steps on one device and through
graph_rewriter.Session rewritten for "ps" and "hybrid" (in-graph, CPU replicas, the
host CPU as the parameter server). Every loss and every variable (weights, optimizer
slots, step counters) must equal the single-device run's, and graph_rewriter's own
step counter (``graph_rewriter/sync_step``) must have advanced once per step: it
counts the accumulators' takes, which advance the accumulators' own steps, so a
counter that lags makes the next step's gradients look stale and the take waits
forever. A rewrite gets TIMEOUT_S, so a hang fails in seconds.

- Wide & Deep: FTRL on a sparse linear part (a [vocab, 1] ref variable read by
  tf.gather) and Adagrad on an embedding and two dense layers, in one train op, neither
  given global_step; global_step bumped once by an assign_add under control
  dependencies of both updates. Trained by that assign_add itself (what a script that
  returns it as its train op runs: graph_rewriter.Session receives the object
  tf.compat.v1.assign_add returns, whose name is the assign op, which a read of it
  follows) and by a tf.group of all three.
- Conditional updates: the optimizer's update under a tf.cond (v1 control flow: Switch
  and Merge, the branch not taken is dead; v2: an If op), the predicate fed per step
  or read from a variable (update every other step). Skipped steps change nothing, not
  even global_step; applied steps apply the averaged gradient. The v2 cond names its
  gradients (``gradients=``): the analysis does not yet find the cuts of an If that
  receives several gradients.
- Between-graph (slow: real servers, one client per worker): on a skipped step the
  chief still releases the workers' tokens.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.ps_state import COUNTER
from graph_rewriter.session import Session
from graph_rewriter.testing import harness, models

import test_cluster as tc
from test_cluster import fresh_cluster, pool, procs  # noqa: F401 (fixtures)

STEPS = 6
BATCH = 8                 # divisible by every replica count below
RTOL, ATOL = 1e-4, 1e-5
TIMEOUT_S = 20
VOCAB, DIM, FEATURES, HIDDEN = 12, 4, 3, 8
COUNTER_READ = f"{COUNTER}/read:0"


def _config():
    return tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_S * 1000)


def _batch(step, predicate=None):
    rng = np.random.default_rng([15, step])
    ids = rng.integers(0, VOCAB, size=BATCH).astype(np.int32)
    ids[1] = ids[0]                          # a duplicate row in the first replica's shard
    ids[BATCH - 1] = ids[0]                  # and in the last one's
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = (np.sin(x.sum(axis=1)) + 0.1 * rng.normal(size=BATCH))[:, None].astype(np.float32)
    feed = {"ids:0": ids, "x:0": x, "y:0": y}
    if predicate is not None:
        feed["apply_now:0"] = np.asarray(predicate(step))
    return feed


def _variable(name, shape, seed, resource=True, dtype=tf.float32, stddev=0.3, trainable=True):
    if dtype == tf.int64:
        init = tf.compat.v1.zeros_initializer()
    elif len(shape) == 1:
        init = tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=seed)
    else:
        init = tf.compat.v1.random_normal_initializer(stddev=stddev, seed=seed)
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), use_resource=resource):
        return tf.compat.v1.get_variable(name, shape, dtype, initializer=init, trainable=trainable)


def _deep(ids, x, table, w1, b1, w2, b2):
    rows = tf.nn.embedding_lookup(table, ids)
    h = tf.tanh(tf.matmul(tf.concat([rows, x], axis=1), w1) + b1)
    return tf.matmul(h, w2) + b2


def _finish(graph, feeds, train_op, tensors=None):
    variables = tf.compat.v1.global_variables()
    tf.compat.v1.variables_initializer(variables, name="init")
    tf.compat.v1.train.Saver(var_list=variables)
    step = tf.compat.v1.train.get_global_step()
    names = {v.op.name: models._read_tensor_name(v) for v in variables}
    return models.Example(graph_def=graph.as_graph_def(), model="issue15", optimizer="mixed",
                            resource=True, feeds=feeds, variables=names,
                            step_counter=models._read_tensor_name(step), train_op=train_op,
                            tensors=dict(tensors or {}))


@functools.lru_cache(maxsize=None)
def wide_and_deep(train_op):
    """train_op: "assign" (the global_step bump, fetched as the object assign_add returns)
    or "group" (tf.group of both updates and the bump)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(15)
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.variable_scope("linear"):
            wide = _variable("weights", [VOCAB, 1], 1, resource=False)
        with tf.compat.v1.variable_scope("dnn"):
            deep = [_variable("embedding", [VOCAB, DIM], 2, stddev=0.5),
                    _variable("hidden/kernel", [DIM + FEATURES, HIDDEN], 3),
                    _variable("hidden/bias", [HIDDEN], 4),
                    _variable("logits/kernel", [HIDDEN, 1], 5),
                    _variable("logits/bias", [1], 6)]
        logits = tf.gather(wide, ids) + _deep(ids, x, *deep)
        loss = tf.identity(tf.reduce_mean(tf.square(logits - y)), name="loss")
        grads = tf.gradients(loss, [wide] + deep)
        ftrl = tf.compat.v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.001,
                                                l2_regularization_strength=0.001)
        adagrad = tf.compat.v1.train.AdagradOptimizer(0.1)
        linear_update = ftrl.apply_gradients([(grads[0], wide)])
        dnn_update = adagrad.apply_gradients(list(zip(grads[1:], deep)))
        with tf.control_dependencies([linear_update, dnn_update]):
            bump = tf.compat.v1.assign_add(global_step, 1)
        if train_op == "assign":
            # What graph_rewriter.Session runs when given the object assign_add returned:
            # its name, the AssignAddVariableOp's (a read of the variable follows it).
            fetch = bump.name
            assert ":" not in fetch and graph.get_operation_by_name(fetch).outputs == []
        else:
            fetch = tf.group(linear_update, dnn_update, bump, name="train_op").name
        return _finish(graph, ["ids:0", "x:0", "y:0"], fetch)


@functools.lru_cache(maxsize=None)
def conditional_update(control_flow, predicate, sparse, optimizer="adam"):
    """An optimizer update under tf.cond; predicate "fed" (placeholder apply_now) or
    "variable" (every other step, by a counter of runs bumped after the cond); with
    ``sparse`` the model reads an embedding table (a sparse gradient: hybrid puts it on
    the parameter server), else only dense layers."""
    graph = tf.Graph()
    with graph.as_default(), models.ControlFlow(control_flow):
        tf.compat.v1.set_random_seed(16)
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        if sparse:
            table = _variable("embedding", [VOCAB, DIM], 7, stddev=0.5)
        else:   # a constant table: only dense gradients
            table = tf.constant(np.random.default_rng(7).normal(0, 0.5, (VOCAB, DIM)), tf.float32)
        params = [_variable("hidden/kernel", [DIM + FEATURES, HIDDEN], 8),
                  _variable("hidden/bias", [HIDDEN], 9),
                  _variable("logits/kernel", [HIDDEN, 1], 10),
                  _variable("logits/bias", [1], 11)]
        loss = tf.identity(tf.reduce_mean(tf.square(_deep(ids, x, table, *params) - y)), name="loss")
        variables = ([table] if sparse else []) + params
        opt = {"adam": tf.compat.v1.train.AdamOptimizer(0.02),
               "adagrad": tf.compat.v1.train.AdagradOptimizer(0.1)}[optimizer]
        pairs = opt.compute_gradients(loss, variables)
        if predicate == "fed":
            apply_now = tf.compat.v1.placeholder(tf.bool, [], name="apply_now")
        else:
            runs = _variable("runs", [], 0, dtype=tf.int64, trainable=False)
            apply_now = tf.equal(tf.math.floormod(runs.read_value(), 2), 0, name="apply_now")
        train = tf.cond(apply_now, lambda: tf.group(opt.apply_gradients(pairs, global_step=global_step)),
                        tf.no_op, name="maybe_apply")
        if predicate == "fed":
            tf.group(train, name="train_op")
        else:
            with tf.control_dependencies([train]):
                bump = runs.assign_add(1, read_value=False)
            tf.group(train, bump, name="train_op")
        feeds = ["ids:0", "x:0", "y:0"]
        tensors = {"gradients": {v.op.name: g.name for g, v in pairs}} if not sparse else {}
        return _finish(graph, feeds, "train_op", tensors)


def _gradient_hints(ex):
    return ex.tensors.get("gradients")


def _train(sess, ex, feed, snapshot, counter=None):
    """(losses, variables after each step, graph_rewriter's counter after each step)."""
    sess.run(ex.init)
    losses, values, counts = [], [snapshot()], []
    for step in range(STEPS):
        loss, _ = sess.run([ex.loss, ex.train_op], feed_dict=feed(step))
        losses.append(float(loss))
        values.append(snapshot())
        if counter is not None:
            counts.append(int(tf.compat.v1.Session.run(sess, counter)))
    return losses, values, counts


@functools.lru_cache(maxsize=None)
def _reference(build, args, fed):
    ex = build(*args)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(ex.graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        reader = harness.ReplicaCopies(sess, ex, [""])
        losses, values, _ = _train(sess, ex, lambda s: _batch(s, fed), reader)
    return ex, losses, values


def check(build, args, strategy, replicas, applies=None, fed=None, on_ps=True):
    """``applies(step)``: whether the step applies its update (None: every step does);
    ``fed``: the same, when it is fed to the placeholder apply_now; ``on_ps``: some
    variable must be on the parameter server."""
    ex, losses, values = _reference(build, args, fed)
    initial, final = values[0], values[-1]
    assert np.all(np.isfinite(losses)), losses
    moved = [n for n in final if not np.array_equal(final[n], initial[n])]
    assert len(moved) >= len(final) - 1, f"the single-device run left {set(final) - set(moved)} unchanged"
    counter = next(n for n, t in ex.variables.items() if t == ex.step_counter)
    applied = STEPS if applies is None else sum(map(applies, range(STEPS)))
    assert int(final[counter]) == applied

    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=replicas, device_type="CPU",
                        timeout_seconds=TIMEOUT_S, gradients=_gradient_hints(ex))
    accumulated = any(c.sync == "accumulate" for c in result.plan.cuts)
    assert accumulated or not on_ps, f"{strategy}: no gradient goes to a parameter server"
    with Session(result, config=_config()) as sess:
        reader = harness.ReplicaCopies(sess, ex, [""])
        got_losses, got, counts = _train(sess, ex, lambda s: _batch(s, fed), reader,
                                         COUNTER_READ if accumulated else None)

    if accumulated:
        # One take of every accumulator per step, applied or skipped, when the gradients
        # are taken before the cond (the analysis moves the cuts to the backward pass);
        # a cut inside the branch would be taken, and counted, on applied steps only.
        in_branch = [c.variable for c in result.plan.cuts if c.sync == "accumulate"
                     and any(t and t.startswith("maybe_apply/") for t in (c.values, c.indices))]
        want = (list(range(1, STEPS + 1)) if not in_branch
                else list(np.cumsum([applies(s) for s in range(STEPS)])))
        assert counts == want, f"'{COUNTER}' after each step: {counts}"
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL, err_msg="losses per step")
    for step, (want, have) in enumerate(zip(values, got)):
        for name in want:
            np.testing.assert_allclose(have[name], want[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"variable '{name}' after {step} step(s)")
    assert int(got[-1][counter]) == applied
    if applies is not None:   # a skipped step changes nothing, an applied one every weight
        for step in range(STEPS):
            before, after = got[step], got[step + 1]
            changed = {n for n in after if not np.array_equal(after[n], before[n])} - {"runs"}
            if applies(step):
                assert "hidden/kernel" in changed and counter in changed, f"step {step}: {changed}"
            else:
                assert not changed, f"step {step} was skipped but changed {sorted(changed)}"


# ----- Wide & Deep: two optimizers, one global_step bump ----------------------------------

@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("strategy", ["ps", "hybrid"])
@pytest.mark.parametrize("train_op", ["assign", "group"])
def test_wide_and_deep(train_op, strategy, replicas):
    check(wide_and_deep, (train_op,), strategy, replicas)


# ----- updates under a tf.cond --------------------------------------------------------------

def _every_third_skipped(step):
    return step % 3 != 1


def _even(step):
    return step % 2 == 0


# A sparse gradient routed into a v1 cond reaches its update through a Switch; its
# rows are averaged before the cond (nothing combines them on the way), so the table
# goes to the parameter server under "ps" and "hybrid" alike, and hybrid mixes an
# accumulated table with all-reduced dense layers under one cond.
COND_CASES = [("v1", "fed", True, "adam", "ps", 2), ("v1", "fed", True, "adagrad", "ps", 2),
              ("v1", "fed", False, "adam", "ps", 2), ("v1", "fed", False, "adam", "ps", 4),
              ("v1", "variable", False, "adam", "ps", 2), ("v1", "variable", True, "adagrad", "ps", 2),
              ("v1", "fed", True, "adam", "hybrid", 2), ("v1", "variable", True, "adagrad", "hybrid", 2),
              ("v2", "fed", False, "adam", "ps", 2), ("v2", "variable", False, "adagrad", "ps", 2)]


@pytest.mark.parametrize("control_flow,predicate,sparse,optimizer,strategy,replicas", COND_CASES)
def test_conditional_update(control_flow, predicate, sparse, optimizer, strategy, replicas):
    fed = predicate == "fed"
    applies = _every_third_skipped if fed else _even
    assert 0 < sum(map(applies, range(STEPS))) < STEPS
    check(conditional_update, (control_flow, predicate, sparse, optimizer), strategy, replicas,
          applies=applies, fed=applies if fed else None, on_ps=strategy == "ps" or sparse)


# ----- between-graph: the chief's tokens must not wait for a skipped update ----------------

def _between_graph_workers(cluster, ex, batches, tmp_path, **options):
    """test_cluster's workers, with a scalar feed (the predicate) given to every worker
    whole rather than split by rows."""
    tasks = tc._compute_tasks(cluster)
    workers = []
    for k, (job, i) in enumerate(tasks):
        result = gr.rewrite(ex.graph_def, cluster.spec, strategy="ps", device_type="CPU",
                            devices_per_worker=1, task=f"{job}:{i}", **options)
        graph_path = str(tmp_path / f"worker{k}.pb")
        result.save(graph_path)
        feeds = {}
        for step, batch in enumerate(batches):
            for name, value in batch.items():
                rows = len(value) // len(tasks) if np.ndim(value) else None
                feeds[f"{step}/{name}"] = value if rows is None else value[k * rows:(k + 1) * rows]
        feeds_path = str(tmp_path / f"worker{k}_feeds.npz")
        np.savez(feeds_path, **feeds)
        workers.append(tc.Worker(k, f"{job}:{i}", result, graph_path, feeds_path, cluster.target(job, i)))
    return workers


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("predicate", ["fed", "variable"])
def test_conditional_update_between_graph(predicate, fresh_cluster, procs, tmp_path):
    """strategy "ps", 2 workers x 1 device, 1 ps, each worker its own client: on a
    skipped step the chief's train op still bumps the counter and releases the workers'
    tokens (the update ops it would wait for are dead), so nobody waits; the run equals
    one device's."""
    applies = _every_third_skipped if predicate == "fed" else _even
    fed = applies if predicate == "fed" else None
    ex, losses, values = _reference(conditional_update, ("v1", predicate, False, "adam"), fed)
    batches = [_batch(s, fed) for s in range(STEPS)]
    cluster = fresh_cluster(2, 1, 1)
    workers = _between_graph_workers(cluster, ex, batches, tmp_path, timeout_seconds=TIMEOUT_S)
    reads = list(ex.variables.values()) + [COUNTER_READ]
    outs = []
    for w in workers:
        outs.append(str(tmp_path / f"{w.name}_out.npz"))
        procs.start(w.name, tc._worker_client_cmd(w, STEPS, reads, outs[-1], timeout=3 * TIMEOUT_S))
    procs.wait_all()
    got = []
    for out in outs:
        with np.load(out) as data:
            got.append((data["losses"], {k[len("read/"):]: data[k] for k in data.files if k.startswith("read/")}))
    # equal shards: the mean of the workers' mean losses is the global mean loss
    np.testing.assert_allclose(np.mean([g[0] for g in got], axis=0), losses, rtol=RTOL, atol=ATOL)
    for k, (_, read) in enumerate(got):
        assert int(read[COUNTER_READ]) == STEPS, f"worker {k}: '{COUNTER}' {read[COUNTER_READ]}"
        for name, tensor in ex.variables.items():
            np.testing.assert_allclose(read[tensor], values[-1][name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"worker {k}: variable '{name}'")


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_between_graph_worker_graph_is_deterministic(model):
    """A non-chief worker's graph drops the chief's work; the control inputs it keeps
    once followed the order of a set of nodes, so the same rewrite gave different
    bytes from one run to the next."""
    gd = models.build(model, "adam").graph_def
    cluster = {"ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"]}
    outs = {bytes(gr.rewrite(gd, cluster, strategy="ps", task=("worker", 1)).serialized())
            for _ in range(4)}
    assert len(outs) == 1
