"""Numeric equivalence for the parameter-server strategies, on one machine.

The contract of tests/test_equivalence.py, for ``strategy="ps"`` (every variable on the
parameter server) and ``strategy="hybrid"`` (variables with sparse gradients and their
slots on the parameter server, the others mirrored and all-reduced). With no cluster the
parameter server is this machine's host CPU and the replicas are CPU:0..R-1
(``device_type="CPU"``; GPU:0..R-1 with GRAPH_REWRITER_TEST_DEVICE=GPU, see
test_equivalence._device). After STEPS steps on the same global batches, the losses and
every final variable (weights, optimizer slots, step counters) equal the single-device
run within float rounding; the step counter equals STEPS; a parameter-server variable
exists once (no replica copy) and every mirrored variable's replica copies equal the
master's.

Structural checks (rewrite only, nothing runs): with "ps" no variable is cloned and
every variable lives on the host CPU even when the replicas are GPUs; with "hybrid" the
embedding table and its slots exist once while dense variables have replica copies; each
parameter-server gradient has exactly one accumulator (with a shared_name), one take and
one apply per replica.

A rewritten step that blocks (an accumulator waiting for gradients that never come, a
token queue nobody fills) fails after OP_TIMEOUT_MS instead of hanging the suite.

Cost: the single-device references are shared with tests/test_equivalence.py (same
cache when both run in one session). Every case runs by default (about two minutes on
two cores): every v1 optimizer on "mlp" and "embedding" for both strategies at R=2
(resource and ref variables), R in {1, 4} for sgd/adam/adagrad/ftrl (resource and ref),
the Keras legacy optimizers at R=2, and the other models with adam at R=2 under "ps"
and at R=4 under "ps" (and "hybrid" for keras_embedding). From R=3 on, the rewrite
builds replica 1 as the template of replicas 1..R-1 (tests/test_template_replicas.py):
those cases check that it does and train the template graphs.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.session import session_config
from graph_rewriter.testing import harness, models

from test_equivalence import (ATOL, BATCH, REPRESENTATIVE_V1, RTOL, STEPS, _case_id, _device,
                              _reference, _step_counter_name)

V1 = models.OPTIMIZERS_V1
KERAS = models.OPTIMIZERS_KERAS
STRATEGIES = ("ps", "hybrid")
HOST_CPU = "/device:CPU:0"
OP_TIMEOUT_MS = 10000
ACCUMULATORS = ("ConditionalAccumulator", "SparseConditionalAccumulator")
TAKES = {"ConditionalAccumulator": "AccumulatorTakeGradient",
         "SparseConditionalAccumulator": "SparseAccumulatorTakeGradient"}
APPLIES = {"ConditionalAccumulator": "AccumulatorApplyGradient",
           "SparseConditionalAccumulator": "SparseAccumulatorApplyGradient"}


def _config():
    return tf.compat.v1.ConfigProto(operation_timeout_in_ms=OP_TIMEOUT_MS)


def _variables_of(graph_def):
    return {n.name: n for n in graph_def.node if n.op in ("VarHandleOp", "VariableV2", "Variable")}


def _replica_of(name, prefixes):
    """Index of the replica a node of the rewritten graph belongs to (0: the master's
    names, which also hold the global nodes)."""
    for i, p in sorted(enumerate(prefixes), key=lambda ip: -len(ip[1])):
        if p and name.startswith(p):
            return i
    return 0


def _expected_on_ps(plan, strategy):
    """What the strategy must put on the parameter server, from the graph's gradients
    (not from the placements being checked): everything for "ps"; for "hybrid" the
    variables with a sparse gradient and their slots."""
    if strategy == "ps":
        return {v.name for v in plan.variables}
    sparse = {c.variable for c in plan.cuts if c.kind == "sparse"}
    return {v.name for v in plan.variables if v.name in sparse or v.slot_of in sparse}


def check_ps_equivalence(model, optimizer, resource, strategy, replicas, **options):
    device = _device(replicas)
    ex, initial, losses, final = _reference(model, optimizer, resource, tuple(sorted(options.items())))
    # The reference trained: the loss is finite and weights moved, so equality means something.
    assert np.all(np.isfinite(losses)), losses
    moved = [n for n in final if not np.array_equal(final[n], initial[n])]
    assert len(moved) >= 2, f"single-device run of {model}/{optimizer} changed only {moved}"

    lines = []
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=replicas,
                        device_type=device, log=lines.append)
    assert result.num_replicas == replicas
    templated = any(line.startswith("replicate:") and "the template of the others" in line for line in lines)
    assert templated == (replicas >= 3), "replica 1 is the template of the others from R=3 on"
    plan = result.plan
    assert plan.strategy == strategy
    assert {v.name for v in plan.variables} == set(ex.variables)
    on_ps = {v.name for v in plan.variables if v.placement == "ps"}
    assert on_ps == _expected_on_ps(plan, strategy), "variables placed on the parameter server"
    if strategy == "hybrid" and model in ("embedding", "keras_embedding"):
        assert on_ps, "hybrid put no variable of an embedding model on the parameter server"

    got_losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=BATCH,
                                             replica_copies=True, config=_config())

    counter = _step_counter_name(ex)
    assert int(final[counter]) == STEPS
    assert int(got[counter]) == STEPS, f"'{counter}' advanced {int(got[counter])} times in {STEPS} steps"
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL,
                               err_msg=f"losses per step of {strategy} with {replicas} replicas vs one device")
    for name, want in final.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"variable '{name}' after {STEPS} steps ({strategy})")
    # Parameter-server variables exist once; mirrored ones have a copy per replica, equal
    # to the master's.
    prefixes = result.metadata["replica_prefixes"][1:]
    assert len(prefixes) == replicas - 1
    for prefix in prefixes:
        copies = {n for n in got if n.startswith(prefix)}
        assert copies == {prefix + n for n in final if n not in on_ps}, f"copies under '{prefix}'"
        for name in copies:
            np.testing.assert_allclose(got[name], got[name[len(prefix):]], rtol=RTOL, atol=ATOL,
                                       err_msg=f"replica copy '{name}' differs from the master's")


# ----- tf.compat.v1.train optimizers: dense and sparse, resource and ref ------------------

V1_CASES = [(m, o, res, s, 2) for m in ("mlp", "embedding") for o in V1 for res in (True, False)
            for s in STRATEGIES]


@pytest.mark.parametrize("model,optimizer,resource,strategy,replicas", V1_CASES, ids=_case_id)
def test_v1_optimizer(model, optimizer, resource, strategy, replicas):
    check_ps_equivalence(model, optimizer, resource, strategy, replicas)


REPLICA_COUNT_CASES = [(m, o, res, s, r) for m in ("mlp", "embedding") for o in REPRESENTATIVE_V1
                       for res in (True, False) for s in STRATEGIES for r in (1, 4)]


@pytest.mark.parametrize("model,optimizer,resource,strategy,replicas", REPLICA_COUNT_CASES,
                         ids=_case_id)
def test_v1_replica_counts(model, optimizer, resource, strategy, replicas):
    check_ps_equivalence(model, optimizer, resource, strategy, replicas)


# ----- tf_keras legacy OptimizerV2: dense and sparse --------------------------------------

KERAS_CASES = [(m, o, True, s, 2) for m in models.KERAS_MODELS for o in KERAS for s in STRATEGIES]


@pytest.mark.parametrize("model,optimizer,resource,strategy,replicas", KERAS_CASES, ids=_case_id)
def test_keras_optimizer(model, optimizer, resource, strategy, replicas):
    check_ps_equivalence(model, optimizer, resource, strategy, replicas)


# ----- control flow, schedules, input pipelines -------------------------------------------

@pytest.mark.parametrize("model", ["lstm_v1", "lstm_v2", "cond", "lr_schedule", "iterator"])
def test_model(model):
    check_ps_equivalence(model, "adam", True, "ps", 2)


@pytest.mark.parametrize("model,optimizer,strategy", [
    ("lstm_v1", "adam", "ps"), ("cond", "adam", "ps"), ("iterator", "adam", "ps"),
    ("keras_embedding", "keras_adam", "ps"), ("keras_embedding", "keras_adam", "hybrid")])
def test_template_replicas(model, optimizer, strategy):
    """Four replicas: replicas 2 and 3 exist only as the export's copies of replica 1."""
    check_ps_equivalence(model, optimizer, True, strategy, 4)


# ----- BatchNorm: what tests/test_equivalence.py asserts for it ---------------------------

def test_batchnorm_with_one_replica_is_the_original():
    check_ps_equivalence("batchnorm", "adam", True, "ps", 1)


def _train_plain(result, ex, steps):
    """``steps`` steps of the rewritten graph in a plain tf.compat.v1.Session (the train op
    by its original name runs every replica); then every copy of every variable:
    {node name: value}."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.import_graph_def(result.graph_def, name="")
    config = session_config(result.metadata["session_config"], _config())
    with tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(ex.init)
        for step in range(steps):
            sess.run(ex.train_op, ex.batch(step, BATCH))
        return harness.read_replica_copies(sess, ex, result.metadata["replica_prefixes"])


@pytest.mark.parametrize("update_ops", ["group", "control"])
@pytest.mark.parametrize("resource", [True, False], ids=_case_id)
def test_batchnorm_moving_statistics(resource, update_ops):
    """After one step on equal shards, the one copy of the moving statistics on the
    parameter server holds: moving_mean as on one device (the mean of shard means is the
    batch mean); moving_variance = momentum * v0 + (1 - momentum) * the mean of the
    shards' (biased) batch variances."""
    replicas = 2
    ex, initial, _, _ = _reference("batchnorm", "adam", resource, (("update_ops", update_ops),))
    feed = ex.batch(0, BATCH)
    _, single = harness.run_single(ex, steps=1, batch_size=BATCH)
    want_variance = harness.sharded_moving_variance(ex, feed, replicas, initial["bn/moving_variance"])
    # The variance of replica means differs from the batch variance: the test can tell.
    assert not np.allclose(want_variance, single["bn/moving_variance"], rtol=RTOL, atol=ATOL)

    result = gr.rewrite(ex.graph_def, strategy="ps", devices_per_worker=replicas, device_type=_device(replicas))
    values = _train_plain(result, ex, 1)
    assert not [n for n in values if n.startswith("replica_")], "ps variables were cloned"
    np.testing.assert_allclose(values["bn/moving_mean"], single["bn/moving_mean"],
                               rtol=RTOL, atol=ATOL, err_msg="bn/moving_mean")
    np.testing.assert_allclose(values["bn/moving_variance"], want_variance,
                               rtol=RTOL, atol=ATOL, err_msg="bn/moving_variance")


@pytest.mark.parametrize("update_ops", ["group", "control"])
def test_batchnorm_normalises_each_replica_with_its_own_statistics(update_ops):
    """docs/semantics.md, BatchNorm: each replica normalises its shard with the shard's
    statistics, and only the moving averages' updates read the mean of the replicas'. So
    ps trains a BatchNorm model exactly as allreduce does. (Before, under ps every reader
    of a statistic read the averaged one: the forward pass normalised with the replicas'
    mean variance, and after one SGD step the weights differed from allreduce's by 0.03.)"""
    ex = models.build("batchnorm", "sgd", update_ops=update_ops)
    values = {}
    for strategy in ("allreduce", "ps"):
        with gr.Session(gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2,
                                   device_type="CPU")) as sess:
            sess.run(ex.init)
            for step in range(STEPS):
                sess.run(ex.train_op, ex.batch(step, BATCH))
            values[strategy] = {name: sess.run(t) for name, t in ex.variables.items()}
    for name, want in values["allreduce"].items():
        np.testing.assert_allclose(values["ps"][name], want, rtol=RTOL, atol=ATOL, err_msg=name)


def test_batchnorm_trains_with_one_step_counter():
    """Over several steps: one copy of every variable, the weights and statistics all
    move, and global_step advances once per step."""
    ex, initial, *_ = _reference("batchnorm", "adam", True)
    result = gr.rewrite(ex.graph_def, strategy="ps", devices_per_worker=2, device_type=_device(2))
    values = _train_plain(result, ex, STEPS)
    assert set(values) == set(ex.variables)
    for name in ("hidden/kernel", "bn/gamma", "bn/moving_mean", "bn/moving_variance"):
        assert np.all(np.isfinite(values[name])), name
        assert not np.array_equal(values[name], initial[name]), f"'{name}' did not train"
    assert int(values["global_step"]) == STEPS


# ----- structure: where the variables live, and the accumulators --------------------------

@pytest.mark.parametrize("model,optimizer,strategy", [
    ("mlp", "adam", "ps"), ("embedding", "adagrad", "ps"), ("embedding", "adam", "hybrid")],
    ids=_case_id)
def test_rewrite_is_deterministic(model, optimizer, strategy):
    """docs/api.md (CLI): same input, same options, byte-identical output (three rewrites in one
    process, so that anything ordered by object identity shows)."""
    ex = models.build(model, optimizer)
    outputs = {gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2, device_type="CPU")
               .graph_def.SerializeToString(deterministic=True) for _ in range(3)}
    assert len(outputs) == 1, f"{len(outputs)} different graphs from 3 rewrites of one input"


STRUCTURE_CASES = [("mlp", "adam", True), ("embedding", "adagrad", False),
                   ("keras_embedding", "keras_adam", True), ("lstm_v1", "momentum", False)]


@pytest.mark.parametrize("model,optimizer,resource", STRUCTURE_CASES, ids=_case_id)
def test_ps_variables_exist_once_on_the_host_cpu(model, optimizer, resource):
    """strategy="ps" with GPU replicas: every variable (and slot) keeps its name, is not
    cloned, and is placed on the host CPU, while the replicas' compute is on the GPUs."""
    replicas = 2
    ex = models.build(model, optimizer, resource=resource)
    result = gr.rewrite(ex.graph_def, strategy="ps", devices_per_worker=replicas, device_type="GPU")
    prefixes = result.metadata["replica_prefixes"]
    assert prefixes == [""] + [f"replica_{i}/" for i in range(1, replicas)]
    nodes = {n.name: n for n in result.graph_def.node}
    variables = _variables_of(result.graph_def)
    assert set(ex.variables) <= set(variables)
    for name in ex.variables:
        assert variables[name].device == HOST_CPU, f"'{name}' is on '{variables[name].device}'"
        for prefix in prefixes[1:]:
            assert prefix + name not in nodes, f"'{name}' was cloned as '{prefix + name}'"
    assert not [n for n in variables if _replica_of(n, prefixes) != 0], "variables in a replica"
    # The replicas do run on the GPUs (the test would not tell otherwise).
    for i in range(replicas):
        assert any(n.device == f"/device:GPU:{i}" for n in result.graph_def.node), f"nothing on GPU:{i}"


@pytest.mark.parametrize("model,optimizer,table", [
    ("embedding", "adam", "embedding"), ("embedding", "ftrl", "embedding"),
    ("keras_embedding", "keras_adagrad", "embedding/embeddings")], ids=_case_id)
@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_hybrid_embedding_once_dense_mirrored(model, optimizer, table, replicas):
    ex = models.build(model, optimizer)
    result = gr.rewrite(ex.graph_def, strategy="hybrid", devices_per_worker=replicas, device_type="CPU")
    plan = result.plan
    group = {v.name for v in plan.group(table)}
    assert len(group) >= 2, f"no optimizer slots for '{table}': {group}"
    variables = _variables_of(result.graph_def)
    prefixes = result.metadata["replica_prefixes"]
    assert len(prefixes) == replicas
    for name in group:
        assert name in variables, name
        assert [n for n in variables if n.endswith("/" + name) or n == name] == [name], \
            f"'{name}' exists more than once"
        assert variables[name].device == HOST_CPU, f"'{name}' is on '{variables[name].device}'"
    dense = [n for n in ex.variables if n not in group]
    assert any(n.endswith("kernel") for n in dense)
    for name in dense:
        for prefix in prefixes[1:]:
            assert prefix + name in variables, f"dense variable '{name}' has no copy '{prefix + name}'"


@pytest.mark.parametrize("model,optimizer,strategy", [
    ("mlp", "adam", "ps"), ("embedding", "adagrad", "ps"), ("embedding", "adam", "hybrid"),
    ("keras_embedding", "keras_ftrl", "ps")], ids=_case_id)
@pytest.mark.parametrize("replicas", [2, 4], ids=_case_id)
def test_one_accumulator_per_ps_gradient(model, optimizer, strategy, replicas):
    """Each parameter-server gradient: one accumulator of the gradient's kind with a
    shared_name of its own, one take feeding that variable's update, and one apply per
    replica, each applying that replica's gradient."""
    ex = models.build(model, optimizer)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=replicas, device_type="CPU")
    plan = result.plan
    prefixes = result.metadata["replica_prefixes"]
    ps_cuts = {c.variable: c for c in plan.cuts if plan.variable(c.variable).placement == "ps"}
    assert ps_cuts, f"no parameter-server gradient in the {strategy} plan"
    assert all(c.sync == "accumulate" for c in ps_cuts.values()), ps_cuts
    consumers = {}
    for n in result.graph_def.node:
        for ref in n.input:
            if not ref.startswith("^"):
                consumers.setdefault(ref.split(":")[0], []).append(n)
    accumulators = [n for n in result.graph_def.node if n.op in ACCUMULATORS]
    assert len(accumulators) == len(ps_cuts), \
        f"{len(accumulators)} accumulators for {len(ps_cuts)} parameter-server gradients"
    shared_names = [a.attr["shared_name"].s for a in accumulators]
    assert all(shared_names) and len(set(shared_names)) == len(shared_names), shared_names
    owners = {}
    for acc in accumulators:
        users = consumers.get(acc.name, [])
        # (the init op's drain of an earlier run's leftovers is a take too)
        takes = [u for u in users if u.op == TAKES[acc.op] and not u.name.endswith("/drain")]
        applies = [u for u in users if u.op == APPLIES[acc.op]]
        assert len(takes) == 1, f"{acc.name}: takes {[t.name for t in takes]}"
        assert len(applies) == replicas, f"{acc.name}: applies {[a.name for a in applies]}"
        gradient_pos = 3 if acc.op == "SparseConditionalAccumulator" else 2
        from_replicas = sorted(_replica_of(a.input[gradient_pos], prefixes) for a in applies)
        assert from_replicas == list(range(replicas)), f"{acc.name}: gradients of replicas {from_replicas}"
        # Which variable's update the take feeds (data edges only).
        reached, stack, seen = set(), [takes[0].name], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for c in consumers.get(name, []):
                reached.update(ref.split(":")[0] for ref in c.input if not ref.startswith("^"))
                stack.append(c.name)
        fed = [v for v in ps_cuts if {m.name for m in plan.group(v)} & reached]
        assert len(fed) == 1, f"{acc.name}: its take feeds the updates of {fed}"
        kind = "sparse" if acc.op == "SparseConditionalAccumulator" else "dense"
        assert ps_cuts[fed[0]].kind == kind, f"{acc.name}: a {kind} accumulator for '{fed[0]}'"
        owners.setdefault(fed[0], []).append(acc.name)
    assert sorted(owners) == sorted(ps_cuts)
    assert all(len(a) == 1 for a in owners.values()), owners


def test_a_ps_init_that_broadcasts_a_mirrored_variable_ends_with_a_workers_barrier():
    """Under ps a variable the forward pass writes (spectral normalization's vector u)
    is mirrored, so the init op broadcasts its initial value: a collective, so the step
    takes its id from the sequence the workers share. The chief's init also writes the
    ps (its reset of the run's state, RESET_DONE); without a barrier worker 1's init,
    done once it had the broadcast, cleaned that step id up on the ps while the chief's
    write was still under way ('Aborted: Cleanup <step id>' on reset_done/set: a loopback
    test failed once on CI). Now the init ends with a barrier after all it runs on the
    ps; the train op runs no collective and keeps its own step ids, without a barrier."""
    from graph_rewriter.testing.tf1_scripts import spectral_norm_mlp
    cluster = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224"]}
    graphs = [gr.rewrite(spectral_norm_mlp(), cluster, strategy="ps", task=f"worker:{k}",
                         devices_per_worker=1, device_type="CPU").graph_def for k in (0, 1)]
    ends = [_ends_with_barrier(gd, "init") for gd in graphs]
    assert all(ends), "the init op does not end with a barrier"
    keys = [(_const_int(gd, e.input[2]), _const_int(gd, e.input[3])) for gd, e in zip(graphs, ends)]
    assert keys[0] == keys[1], f"the workers' barriers do not meet: {keys}"
    for k, (gd, end) in enumerate(zip(graphs, ends)):
        nodes = {n.name: n for n in gd.node}
        after = _ancestors(nodes, "init") - _ancestors(nodes, end.name) - {end.name}
        on_ps = sorted(n for n in after if nodes[n].device.startswith("/job:ps"))
        assert not on_ps, f"worker {k}: the init runs {on_ps} on the ps after its barrier"
        assert _ends_with_barrier(gd, "train_op") is None


def _ancestors(nodes, name):
    seen, stack = set(), [name]
    while stack:
        n = stack.pop().lstrip("^").split(":")[0]
        if n not in seen:
            seen.add(n)
            stack.extend(nodes[n].input)
    return seen


def _ends_with_barrier(gd, op_name):
    """The collective every control input of ``op_name`` funnels into, or None."""
    nodes = {n.name: n for n in gd.node}
    controls = [i[1:] for i in nodes[op_name].input if i.startswith("^")]
    if len(controls) != 1 or nodes[controls[0]].op != "CollectiveReduceV2":
        return None
    return nodes[controls[0]]


def _const_int(gd, ref):
    node = {n.name: n for n in gd.node}[ref.split(":")[0]]
    return node.attr["value"].tensor.int_val[0]


@pytest.mark.parametrize("strategy, barrier", [("hybrid", True), ("ps", False)])
def test_between_graph_hybrid_steps_end_with_a_workers_barrier(strategy, barrier):
    """Collectives spanning workers give their steps one id, so the workers' train and
    init ops end with an all-reduce over the workers' host CPUs (see sync_queues); plain
    ps needs none (no collective, random step ids)."""
    ex = models.build("embedding", "adam")
    cluster = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224"]}
    graphs = [gr.rewrite(ex.graph_def, cluster, strategy=strategy, task=f"worker:{k}",
                         devices_per_worker=2, device_type="CPU").graph_def for k in (0, 1)]
    for op in (ex.train_op, "init"):
        ends = [_ends_with_barrier(gd, op) for gd in graphs]
        if not barrier:
            assert ends == [None, None], op
            continue
        assert all(ends), f"{op} does not end with a barrier"
        for k, (gd, end) in enumerate(zip(graphs, ends)):
            assert end.device == f"/job:worker/replica:0/task:{k}/device:CPU:0"
            assert _const_int(gd, end.input[1]) == 2                    # group size: the workers
        keys = [(_const_int(gd, e.input[2]), _const_int(gd, e.input[3])) for gd, e in zip(graphs, ends)]
        assert keys[0] == keys[1], f"{op}: the workers' barriers do not meet: {keys}"
