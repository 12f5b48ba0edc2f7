"""Numeric equivalence, the backbone: a model rewritten for R replicas and trained on the
same global batches computes what one device computes.

For each example of graph_rewriter.testing.models, ``rewrite(graph_def, devices_per_worker=R,
device_type="CPU")`` run through graph_rewriter.Session must give the single-device losses
and final variables (every variable: weights, optimizer slots, step counters) within float
rounding after STEPS steps, for R in {1, 2, 4}; every replica's copy of every variable must
equal the master's; the step counter must equal the number of steps, not steps x R.

The reference is always the single-device run of the same graph on the same batches,
never a constant, and each reference is checked to have actually trained (the variables
moved), so an equal-but-idle rewrite cannot pass.

Cost: every case starts a TensorFlow session; the single-device reference of a model is
computed once and shared by its R cases. The default run takes R in {2, 4} for every
optimizer and R=1 for a representative subset (sgd, adam, adagrad, ftrl and their Keras
counterparts, dense and sparse); ``-m slow`` adds R=1 for the other optimizers.

The replicas are CPU:0..R-1; with GRAPH_REWRITER_TEST_DEVICE=GPU they are GPU:0..R-1 (see
``_device``; tools/gpu_readiness.py runs this module so on real GPUs).

BatchNorm is different (see test_batchnorm_*): each replica normalises with its own
shard's statistics, so losses differ from one device; the defined behaviour is that every
replica's moving statistics get the single-device update computed with the MEAN of the
replicas' batch statistics.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.session import session_config
from graph_rewriter.testing import harness, models

STEPS = 3
BATCH = 8                 # divisible by every R below
REPLICAS = (1, 2, 4)
RTOL, ATOL = 1e-4, 1e-6

V1 = models.OPTIMIZERS_V1
KERAS = models.OPTIMIZERS_KERAS
REPRESENTATIVE_V1 = ("sgd", "adam", "adagrad", "ftrl")
REPRESENTATIVE_KERAS = ("keras_sgd", "keras_adam", "keras_adagrad", "keras_ftrl")

DEVICE = harness.device_type()   # "CPU"; "GPU" with GRAPH_REWRITER_TEST_DEVICE=GPU

# Exhaustive variants belong to the full run; the quick run (-m "not slow") leaves them out.
slow = [pytest.mark.slow]


def _mark(params, marks):
    return [pytest.param(*p, marks=marks) if marks else p for p in params]


def _split_cases(models, optimizers, representative, resources):
    """(model, optimizer, resource, R) cases: R in {2, 4} for every optimizer and R=1
    for the representative ones by default; R=1 for the rest is marked slow (one replica
    is the least informative case, and every case costs two TensorFlow sessions)."""
    quick, exhaustive = [], []
    for model in models:
        for optimizer in optimizers:
            for resource in resources:
                for r in REPLICAS:
                    case = (model, optimizer, resource, r)
                    if optimizer in representative or r != 1:
                        quick.append(case)
                    else:
                        exhaustive.append(case)
    return quick + _mark(exhaustive, slow)


def _device(replicas):
    """The device type a test rewrites ``replicas`` replicas for: DEVICE. On GPUs, a case
    with more replicas than this machine has GPUs is skipped (GPU:R-1 must exist); on CPUs
    the session creates the virtual devices, so every case runs."""
    gpus = len(tf.config.list_physical_devices("GPU")) if DEVICE == "GPU" else 0
    if DEVICE == "GPU" and replicas > gpus:
        pytest.skip(f"{replicas} GPU replicas, this machine has {gpus} GPUs")
    return DEVICE


def _case_id(value):
    if isinstance(value, bool):
        return "resource" if value else "ref"
    if isinstance(value, int):
        return f"R{value}"
    return str(value)


# ----- the reference and the comparison ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def _reference(model, optimizer, resource, options=()):
    """(example, initial values, single-device losses, single-device final values)."""
    ex = models.build(model, optimizer, resource=resource, **dict(options))
    _, initial = harness.run_single(ex, steps=0, batch_size=BATCH)
    losses, final = harness.run_single(ex, steps=STEPS, batch_size=BATCH)
    return ex, initial, losses, final


def _step_counter_name(ex):
    return next(name for name, t in ex.variables.items() if t == ex.step_counter)


def check_equivalence(model, optimizer, resource, replicas, **options):
    device = _device(replicas)
    ex, initial, losses, final = _reference(model, optimizer, resource, tuple(sorted(options.items())))
    # The reference trained: the loss is finite and weights moved, so equality means something.
    assert np.all(np.isfinite(losses)), losses
    moved = [n for n in final if not np.array_equal(final[n], initial[n])]
    assert len(moved) >= 2, f"single-device run of {model}/{optimizer} changed only {moved}"

    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type=device)
    assert result.num_replicas == replicas
    got_losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=BATCH,
                                             replica_copies=True)

    counter = _step_counter_name(ex)
    assert int(final[counter]) == STEPS
    assert int(got[counter]) == STEPS, f"'{counter}' advanced {int(got[counter])} times in {STEPS} steps"
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL,
                               err_msg=f"losses per step of {replicas} replicas vs one device")
    for name, want in final.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"variable '{name}' after {STEPS} steps")
    # Every replica's copy equals the master's (mirrored variables never drift apart).
    prefixes = result.metadata["replica_prefixes"][1:]
    assert len(prefixes) == replicas - 1
    for prefix in prefixes:
        copies = [n for n in got if n.startswith(prefix)]
        assert sorted(copies) == sorted(prefix + n for n in final), f"copies under '{prefix}'"
        for name in copies:
            np.testing.assert_allclose(got[name], got[name[len(prefix):]], rtol=RTOL, atol=ATOL,
                                       err_msg=f"replica copy '{name}' differs from the master's")


# ----- tf.compat.v1.train optimizers: dense and sparse, resource and ref ------------------

V1_CASES = _split_cases(("mlp", "embedding"), V1, REPRESENTATIVE_V1, (True, False))


@pytest.mark.parametrize("model,optimizer,resource,replicas", V1_CASES, ids=_case_id)
def test_v1_optimizer(model, optimizer, resource, replicas):
    check_equivalence(model, optimizer, resource, replicas)


# ----- tf_keras legacy OptimizerV2: dense and sparse (scatter-based updates) ---------------

KERAS_CASES = _split_cases(("keras", "keras_embedding"), KERAS, REPRESENTATIVE_KERAS, (True,))


@pytest.mark.parametrize("model,optimizer,resource,replicas", KERAS_CASES, ids=_case_id)
def test_keras_optimizer(model, optimizer, resource, replicas):
    check_equivalence(model, optimizer, resource, replicas)


# ----- sparse updates on batches whose shards keep their unique-id counts ------------------

def _steady_ids(example, replicas):
    """Feeds whose every shard holds the same number of distinct ids at every step, with
    duplicates inside each shard and across shards. This isolates the arithmetic of the
    sparse path (gather, dedup, mean) from how it copes with row counts that change from
    step to step, which the tests above exercise."""
    def feed(step):
        out = example.batch(step, BATCH)
        rng = np.random.default_rng([example.seed, step, 31])
        ids = []
        for _ in range(replicas):
            if BATCH // replicas >= 4:
                a, b, c = rng.choice(models.ID_RANGE, 3, replace=False)
                ids += [a, a, b, c] + [a] * (BATCH // replicas - 4)
            else:
                ids += [rng.integers(models.ID_RANGE)] * (BATCH // replicas)
        out["ids:0"] = np.asarray(ids, np.int32)
        return out
    return feed


@pytest.mark.parametrize("model,optimizer,resource", [
    ("embedding", "sgd", True), ("embedding", "sgd", False), ("embedding", "adam", True),
    ("embedding", "adagrad", False), ("embedding", "ftrl", True),
    ("keras_embedding", "keras_sgd", True), ("keras_embedding", "keras_adam", True)],
    ids=_case_id)
@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_sparse_with_steady_shard_sizes(model, optimizer, resource, replicas):
    ex = models.build(model, optimizer, resource=resource)
    feeds = _steady_ids(ex, replicas)
    losses, want = harness.run_single(ex, steps=STEPS, batch_size=BATCH, feeds=feeds)
    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type=_device(replicas))
    got_losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=BATCH, feeds=feeds)
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


# ----- control flow, schedules, input pipelines -------------------------------------------

OTHER_CASES = [(m, o, res, r)
               for m in ("cond", "lstm_v1", "lstm_v2", "lr_schedule", "iterator")
               for o in ("sgd", "adam")
               for res in (True, False)
               for r in REPLICAS]


@pytest.mark.parametrize("model,optimizer,resource,replicas", OTHER_CASES, ids=_case_id)
def test_model(model, optimizer, resource, replicas):
    check_equivalence(model, optimizer, resource, replicas)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_cond_with_v1_control_flow(optimizer, replicas):
    """The same tf.cond built as Switch/Merge instead of If."""
    check_equivalence("cond", optimizer, True, replicas, control_flow="v1")


def test_cond_takes_both_branches():
    """The cond reference is only meaningful if both branches trained: each head moves."""
    ex, initial, _, final = _reference("cond", "sgd", True)
    for head in ("head_a/kernel", "head_b/kernel"):
        assert not np.array_equal(initial[head], final[head]), head


def test_lr_schedule_decays():
    """The schedule really depends on global_step (so a step counter advancing R times
    per step would change the numbers)."""
    ex, *_ = _reference("lr_schedule", "sgd", True)
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(ex.graph_def, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(ex.init)
        rates = []
        for step in range(2):
            rates.append(sess.run(ex.tensors["learning_rate"]))
            sess.run(ex.train_op, ex.batch(step, BATCH))
    assert rates[1] == pytest.approx(rates[0] / 2)


# ----- BatchNorm: per-replica statistics, averaged moving statistics ----------------------

@pytest.mark.parametrize("resource", [True, False], ids=_case_id)
def test_batchnorm_with_one_replica_is_the_original(resource):
    check_equivalence("batchnorm", "sgd", resource, 1)


def _read_replicas(result, ex, names, steps, batch):
    """Runs ``steps`` steps of the rewritten graph in a plain tf.compat.v1.Session (the
    train op by its original name runs every replica), then reads every replica's copy
    of ``names``: {(prefix, name): value}."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")
    config = session_config(result.metadata["session_config"])
    prefixes = result.metadata["replica_prefixes"]
    with tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(ex.init)
        for step in range(steps):
            sess.run(ex.train_op, batch(step))
        values = harness.read_replica_copies(sess, ex, prefixes)
    out = {(p, n): values[p + n] for p in prefixes for n in names if p + n in values}
    missing = {p + n for p in prefixes for n in names} - set(values)
    assert not missing, f"variable copies missing from the rewritten graph: {sorted(missing)}"
    return out


@pytest.mark.parametrize("update_ops", ["group", "control"])
@pytest.mark.parametrize("resource", [True, False], ids=_case_id)
@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_batchnorm_moving_statistics(replicas, resource, update_ops):
    """After one step on equal shards: moving_mean equals one device's (the mean of shard
    means is the batch mean); moving_variance equals momentum * v0 + (1 - momentum) *
    mean of the shards' (biased) batch variances; every replica holds the same values.
    ``update_ops``: UPDATE_OPS grouped with the train op, or minimize() built under
    tf.control_dependencies(UPDATE_OPS) as TF1's docs recommend."""
    ex, initial, _, _ = _reference("batchnorm", "sgd", resource, (("update_ops", update_ops),))
    feed = ex.batch(0, BATCH)
    _, single = harness.run_single(ex, steps=1, batch_size=BATCH)
    want_variance = harness.sharded_moving_variance(ex, feed, replicas, initial["bn/moving_variance"])
    # The variance of replica means differs from the batch variance: the test can tell.
    assert not np.allclose(want_variance, single["bn/moving_variance"], rtol=RTOL, atol=ATOL)

    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type=_device(replicas))
    values = _read_replicas(result, ex, ["bn/moving_mean", "bn/moving_variance"], 1,
                            lambda step: ex.batch(step, BATCH))
    for prefix in result.metadata["replica_prefixes"]:
        np.testing.assert_allclose(values[(prefix, "bn/moving_mean")], single["bn/moving_mean"],
                                   rtol=RTOL, atol=ATOL, err_msg=f"{prefix}bn/moving_mean")
        np.testing.assert_allclose(values[(prefix, "bn/moving_variance")], want_variance,
                                   rtol=RTOL, atol=ATOL, err_msg=f"{prefix}bn/moving_variance")


@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_batchnorm_replicas_stay_identical(replicas):
    """Over several steps the replicas' statistics and weights stay equal to each other,
    and the step counter advances once per step."""
    ex, *_ = _reference("batchnorm", "adam", True)
    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type=_device(replicas))
    names = list(ex.variables)
    values = _read_replicas(result, ex, names, STEPS, lambda step: ex.batch(step, BATCH))
    prefixes = result.metadata["replica_prefixes"]
    for name in names:
        for prefix in prefixes[1:]:
            np.testing.assert_allclose(values[(prefix, name)], values[("", name)], rtol=RTOL,
                                       atol=ATOL, err_msg=f"{prefix}{name}")
    assert int(values[("", "global_step")]) == STEPS


# ----- the examples themselves --------------------------------------------------------------

@pytest.mark.parametrize("model", models.MODELS)
def test_examples_build_deterministically(model):
    """Same arguments, byte-identical GraphDef, even for v2 control flow and Keras (whose
    function names TensorFlow numbers with a process-wide counter)."""
    optimizer = "keras_adam" if model in models.KERAS_MODELS else "adam"
    a = models.build(model, optimizer).graph_def.SerializeToString(deterministic=True)
    b = models.build(model, optimizer).graph_def.SerializeToString(deterministic=True)
    assert a == b


def test_embedding_batches_repeat_ids_within_and_across_shards():
    """Every batch repeats ids inside a shard and between shards, and the number of
    distinct ids per shard changes between steps (sparse gradients of varying rows)."""
    ex, *_ = _reference("embedding", "sgd", True)
    most = {2: set(), 4: set()}
    for step in range(STEPS):
        ids = ex.batch(step, BATCH)["ids:0"]
        assert len(set(ids)) < len(ids)
        for parts in (2, 4):
            shards = [set(s) for s in np.split(ids, parts)]
            assert any(len(s) < BATCH // parts for s in shards), (step, parts, ids)
            assert any(shards[i] & shards[j] for i in range(parts) for j in range(i)), \
                (step, parts, ids)
            most[parts].add(max(len(s) for s in shards))
    assert len(most[2]) > 1 and len(most[4]) > 1, most
