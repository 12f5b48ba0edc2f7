"""Gradient terms every replica computes alike (passes/invariant_terms.py): weight decay
as public training scripts add it (graph_rewriter.testing.tf1_scripts.weight_decay_mlp).
On CPU replicas of one machine the plan lists each weight's decay term; the first
replica adds it R times, the others leave it out and wait for the reads it made; every
kind trains as one device (flat ring, template replicas, reduce_to_one, hybrid), a loss
fetched with the train op is the one before the update, and a given plan can opt out.
Where the terms are not the same on every replica (a stateful draw, a fed rate), or the
gradient is not all-reduced to its mean in one step, nothing changes."""

import numpy as np
import pytest

import graph_rewriter as gr
import test_cluster as tc
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import WEIGHT_DECAYS, dropout_batches, weight_decay_mlp
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
EVERY = {"w1", "b1", "w2"}
LISTED = {**dict.fromkeys(WEIGHT_DECAYS, EVERY), "noisy": {"b1", "w2"}, "fed_rate": set()}
RUNS = [{"devices_per_worker": 2}, {"devices_per_worker": 4},
        {"devices_per_worker": 2, "allreduce_algorithm": "reduce_to_one"},
        {"devices_per_worker": 2, "strategy": "hybrid"}]


def _cpu(graph_def, **options):
    return gr.rewrite(graph_def, device_type="CPU", **{"devices_per_worker": 2, **options})


def _listed(plan):
    return {key for key, _, _ in plan.invariant_terms or []}


def _train(sess, graph_def, feeds):
    """train_and_read, with ref variables (and their slots) read by name too."""
    losses, values = harness.train_and_read(sess, graph_def, feeds)
    refs = {n.name: n.name + ":0" for n in graph_def.node if n.op == "VariableV2"}
    return losses, {**values, **sess.run(refs)}


def _trained_rewritten(result, graph_def, feeds):
    with gr.Session(result) as sess:
        return _train(sess, graph_def, feeds)


def _without_terms(graph_def, **options):
    """The same rewrite with a given plan whose invariant_terms is []."""
    plan = _cpu(graph_def, **options).plan.to_dict()
    plan["invariant_terms"] = []
    return _cpu(graph_def, strategy=gr.Plan.from_dict(plan), **options)


@pytest.mark.parametrize("kind", WEIGHT_DECAYS)
def test_the_plan_lists_the_terms_computed_from_variables_alone(kind):
    assert _listed(_cpu(weight_decay_mlp(kind)).plan) == LISTED[kind]


@pytest.mark.parametrize("kind", WEIGHT_DECAYS)
def test_every_kind_trains_as_one_device(kind):
    graph_def, feeds = weight_decay_mlp(kind), dropout_batches(STEPS, BATCH)
    with harness.one_device_session(graph_def) as sess:
        want = _train(sess, graph_def, feeds)
    for options in RUNS:
        result = _cpu(graph_def, **options)
        assert _listed(result.plan) == LISTED[kind], options
        got = _trained_rewritten(result, graph_def, feeds)
        harness.assert_trained_alike(f"{kind} {options}", got, want, RTOL, ATOL)


@pytest.mark.parametrize("kind", ["l2", "ref"])
def test_the_first_replica_adds_each_term_r_times_and_the_others_wait_for_its_reads(kind):
    result = _cpu(weight_decay_mlp(kind), devices_per_worker=4)   # replica 1 a template for 1..3
    nodes = {n.name: n for n in result.graph_def.node}
    assert len(result.plan.invariant_terms) == 3
    for key, name, (term,) in result.plan.invariant_terms:
        term_op = term.split(":")[0]
        first = [i for i in nodes[name].input if not i.startswith("^")]
        scaled = nodes[f"{term_op}/times_4"]
        assert scaled.op == "Mul" and scaled.name in first and term_op not in first
        factor = nodes[scaled.input[1]].attr["value"].tensor
        assert factor.float_val == [4.0]
        for r in (1, 2, 3):
            other = nodes[f"replica_{r}/{name}"]
            data = [i for i in other.input if not i.startswith("^")]
            assert len(data) == len(first) - 1 == other.attr["N"].i
            assert not any(i.startswith(f"replica_{r}/{term_op}") for i in data)
            waits = [nodes[i[1:]] for i in other.input if i.startswith("^")]
            if kind == "l2":   # the read the term made: a snapshot, taken before the update
                reads = [w for w in waits if w.op == "ReadVariableOp"]
                assert len(reads) == 1 and reads[0].name.startswith(f"replica_{r}/"), (name, r, waits)
                assert reads[0].input[0] in (key, f"replica_{r}/{key}"), reads[0].input
            else:              # a ref read is no snapshot: the forward l2_loss itself runs first
                assert [w.op for w in waits] == ["L2Loss"], (name, r, waits)
                assert waits[0].name.startswith(f"replica_{r}/")


def test_a_loss_fetched_with_the_train_op_reads_the_variables_before_their_update():
    # Without the waits, replica 1's l2_loss for the fetched loss raced the update of its
    # variables (found so: 4 runs in 6 gave a loss off by up to 6e-4).
    graph_def, feeds = weight_decay_mlp("regularizer"), dropout_batches(STEPS, BATCH)
    with harness.one_device_session(graph_def) as sess:
        want = _train(sess, graph_def, feeds)
    result = _cpu(graph_def, allreduce_algorithm="reduce_to_one")
    for attempt in range(5):
        got = _trained_rewritten(result, graph_def, feeds)
        harness.assert_trained_alike(f"run {attempt}", got, want, RTOL, ATOL)


def test_a_stateful_draw_among_what_the_terms_waited_for_still_runs_on_every_replica():
    result = _cpu(weight_decay_mlp("noisy"))
    nodes = {n.name: n for n in result.graph_def.node}
    for key, name, _ in result.plan.invariant_terms:
        waits = {nodes[i[1:]].op for i in nodes[f"replica_1/{name}"].input if i.startswith("^")}
        assert "RandomStandardNormal" in waits, (key, waits)


def test_an_empty_list_in_a_given_plan_keeps_every_replica_computing_the_terms():
    graph_def = weight_decay_mlp("l2")
    result = _without_terms(graph_def)
    assert result.plan.invariant_terms == [] and '"invariant_terms": []' in result.plan.to_json()
    nodes = {n.name: n for n in result.graph_def.node}
    for n in result.graph_def.node:
        assert "/times_2" not in n.name
    assert len([i for i in nodes["replica_1/gradients/AddN"].input if not i.startswith("^")]) == 2
    feeds = dropout_batches(STEPS, BATCH)
    with harness.one_device_session(graph_def) as sess:
        want = _train(sess, graph_def, feeds)
    harness.assert_trained_alike("opted out", _trained_rewritten(result, graph_def, feeds), want, RTOL, ATOL)


def test_the_written_plan_gives_the_same_graph():
    graph_def = weight_decay_mlp("clipped")
    result = _cpu(graph_def)
    again = _cpu(graph_def, strategy=gr.Plan.from_json(result.plan.to_json()))
    assert again.serialized() == result.serialized()


@pytest.mark.parametrize("entry, says", [
    (["w1", "gradients/AddN_2", ["gradients/MatMul_grad/tuple/control_dependency_1:0"]],
     "names 'gradients/MatMul_grad/tuple/control_dependency_1:0' in the gradient 'gradients/AddN_2' of variable 'w1'"),
    (["w1", "gradients/AddN", ["gradients/L2Loss_grad/mul:0"]], "of variable 'w1'"),
    (["gradients/AddN_2", ["gradients/L2Loss_grad/mul:0"]], "is not [variable, AddN name, [its input tensors]]"),
])
def test_a_given_plan_naming_a_term_that_is_not_one_is_refused(entry, says):
    graph_def = weight_decay_mlp("l2")
    plan = _cpu(graph_def).plan.to_dict()
    plan["invariant_terms"] = [entry]
    with pytest.raises(gr.GraphRewriteError) as e:
        _cpu(graph_def, strategy=gr.Plan.from_dict(plan))
    assert says in str(e.value)


@pytest.mark.parametrize("options", [
    {"device_type": "GPU"},                # GPUs work side by side: the first one's step is no shorter
    {"strategy": "ps"},                    # accumulators, not an all-reduce
    {"accumulation_steps": 2},             # summed over micro-batches first
    {"cluster_spec": {"worker": ["localhost:1", "localhost:2"]}},   # several machines
])
def test_not_planned_by_default_where_it_does_not_apply(options):
    options = {"device_type": "CPU", **options}
    assert gr.rewrite(weight_decay_mlp("l2"), devices_per_worker=2, **options).plan.invariant_terms is None


def test_between_graph_only_the_task_with_group_rank_0_scales():
    graph_def = weight_decay_mlp("l2")
    cluster = {"worker": ["localhost:1", "localhost:2"]}
    entries = _cpu(graph_def).plan.invariant_terms
    plans = {}
    for task in ("worker:0", "worker:1"):
        plan = gr.rewrite(graph_def, cluster, devices_per_worker=2, device_type="CPU", task=task).plan.to_dict()
        plan["invariant_terms"] = entries
        result = gr.rewrite(graph_def, cluster, devices_per_worker=2, device_type="CPU", task=task,
                            strategy=gr.Plan.from_dict(plan))
        plans[task] = {n.name: n for n in result.graph_def.node}
    scaled = {task: sorted(n for n in nodes if "/times_4" in n and nodes[n].op == "Mul")
              for task, nodes in plans.items()}
    assert len(scaled["worker:0"]) == 3 and scaled["worker:1"] == []
    for key, name, _ in entries:
        for task, replicas in (("worker:0", ["replica_1/"]), ("worker:1", ["", "replica_1/"])):
            total = plans[task][replicas[-1] + name]
            assert total.attr["N"].i == 1, (task, name)
            if task == "worker:1":
                assert plans[task][name].attr["N"].i == 1


def test_the_mean_of_the_replicas_gradient_fetched_by_name_is_one_devices():
    # replica 0's own sum holds R times the term; merged by "mean", a fetch of the
    # gradient by its name is one device's gradient, as it was before the terms moved
    graph_def, feeds = weight_decay_mlp("l2"), dropout_batches(1, BATCH)
    name = "gradients/AddN_2:0"   # w1's
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = sess.run(name, feeds[0])
    result = _cpu(graph_def, merge={name: "mean"})
    assert "w1" in _listed(result.plan)
    with gr.Session(result) as sess:
        sess.run("init")
        got = sess.run(name, feeds[0])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_inspect_names_the_variables_whose_terms_moved():
    from graph_rewriter.inspect_report import format_report, report
    text = format_report(report(_cpu(weight_decay_mlp("l2"))))
    assert "gradient terms every replica computes alike" in text
    assert "of: w2, b1, w1" in text


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_given_the_terms_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph, 2 workers x 2 replicas, each worker its own client fed its half of
    every batch, with a given plan listing the terms (not the default across machines):
    worker 0's first replica adds them 4 times, the other three replicas leave them out."""
    graph_def, feeds = weight_decay_mlp("l2"), dropout_batches(STEPS, 4 * BATCH)
    plan = gr.rewrite(graph_def, {"worker": ["localhost:1", "localhost:2"]}, devices_per_worker=2,
                      device_type="CPU", task="worker:0").plan.to_dict()
    assert plan.get("invariant_terms") is None
    plan["invariant_terms"] = _cpu(graph_def).plan.invariant_terms
    reads = harness.resource_reads(graph_def)
    with harness.one_device_session(graph_def) as sess:
        _, want = harness.train_and_read(sess, graph_def, feeds)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, gr.Plan.from_dict(plan), STEPS, reads.values(),
                              feeds, dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("kind", ["l2", "ref", "noisy"])
def test_the_template_export_equals_every_replica_built(kind):
    """Four replicas from a template replica: the export leaves the terms out of
    replicas 1..3, with their waits, as building every replica does."""
    from test_template_replicas import _assert_same_graph, _rewrite_both, _used_template
    built, template, lines, result = _rewrite_both(weight_decay_mlp(kind), devices_per_worker=4, device_type="CPU")
    assert _used_template(lines) and result.plan.invariant_terms
    _assert_same_graph(built, template)
