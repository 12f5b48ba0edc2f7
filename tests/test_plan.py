"""The plan API: read a rewrite's per-variable decisions, edit them, apply them.

    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.set_placement("embedding", "ps")          # the table and its slots, together
    result = gr.rewrite(graph_def, strategy=plan, devices_per_worker=2, device_type="CPU")

A plan round-trips through JSON (``to_json``/``Plan.from_json``, or a .json path given as
the strategy); a plan that does not fit the graph or contradicts itself is rejected with
a GraphRewriteError naming the variable; with several ps tasks ``balance_ps`` spreads
variable groups over them by bytes, and ``ps_shard_bytes`` splits a large variable by
rows (only the plan's ``shards`` field is checked here).

Cluster specs below are structural only: rewriting for a cluster needs no servers.
"""

import json
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.plan import CutPlan, Plan, VariablePlan
from graph_rewriter.planner import balance_ps
from graph_rewriter.testing import harness, models

from test_equivalence import ATOL, BATCH, RTOL, STEPS, _reference

MODEL, OPTIMIZER = "embedding", "adagrad"   # a sparse table with an optimizer slot
TABLE, TABLE_SLOT = "embedding", "embedding/Adagrad"
DENSE = ("hidden/kernel", "hidden/bias", "output/kernel", "output/bias")
HOST_CPU = "/device:CPU:0"
TWO_PS = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2224", "localhost:2225"]}


def _ps_device(task):
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


def _variables_of(graph_def):
    return {n.name: n for n in graph_def.node if n.op in ("VarHandleOp", "VariableV2", "Variable")}


def _canonical(result):
    """The rewritten graph up to the order of control inputs (which are a set): what two
    rewrites with the same plan must agree on, whether or not the rewrite is byte-for-byte
    deterministic (tests/test_ps_equivalence.py checks that separately)."""
    out = {}
    for n in result.graph_def.node:
        data = [i for i in n.input if not i.startswith("^")]
        control = sorted(i for i in n.input if i.startswith("^"))
        out[n.name] = (n.op, n.device, tuple(data), tuple(control),
                       tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in n.attr.items())))
    return out


@pytest.fixture(scope="module")
def example():
    return models.build(MODEL, OPTIMIZER, resource=True)


@pytest.fixture
def plan(example):
    """A fresh default plan (allreduce, two CPU replicas) for every test to edit."""
    return gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU").plan


@pytest.fixture
def edited(plan):
    """The default plan with the embedding (and so its slot) on the parameter server."""
    assert plan.set_placement(TABLE, "ps") is plan
    return plan


def _rewrite(example, strategy, **kw):
    kw.setdefault("devices_per_worker", 2)
    kw.setdefault("device_type", "CPU")
    return gr.rewrite(example.graph_def, strategy=strategy, **kw)


# ----- reading and editing ------------------------------------------------------------

def test_default_plan_mirrors_everything(plan, example):
    assert isinstance(plan, Plan)
    assert plan.strategy == "allreduce" and plan.num_replicas == 2
    assert {v.name for v in plan.variables} == set(example.variables)
    assert all(v.placement == "mirrored" and v.ps_task is None for v in plan.variables)
    assert plan.cut(TABLE).kind == "sparse" and plan.cut(TABLE).sync == "allgather"
    assert all(plan.cut(n).kind == "dense" and plan.cut(n).sync == "allreduce" for n in DENSE)
    assert plan.variable(TABLE_SLOT).slot_of == TABLE


def test_set_placement_moves_a_variable_with_its_slots(edited):
    plan = edited
    assert sorted(v.name for v in plan.group(TABLE)) == [TABLE, TABLE_SLOT]
    assert [v.name for v in plan.group(TABLE_SLOT)][0] == TABLE   # a slot's group is its variable's
    for v in plan.group(TABLE):
        assert (v.placement, v.ps_task, v.shards) == ("ps", 0, None), v.name
    assert plan.cut(TABLE).sync == "accumulate"
    for name in DENSE:
        assert plan.variable(name).placement == "mirrored"
        assert plan.variable(name + "/Adagrad").placement == "mirrored"
        assert plan.cut(name).sync == "allreduce"
    # Naming the slot moves the group back, and the gradient's sync with it.
    plan.set_placement(TABLE_SLOT, "mirrored")
    assert [(v.placement, v.ps_task) for v in plan.group(TABLE)] == [("mirrored", None)] * 2
    assert plan.cut(TABLE).sync == "allgather"


def test_edited_plan_is_applied(edited, example):
    result = _rewrite(example, edited)
    assert {v.name: v.placement for v in result.plan.variables} == \
        {v.name: v.placement for v in edited.variables}
    variables = _variables_of(result.graph_def)
    nodes = {n.name for n in result.graph_def.node}
    prefixes = result.metadata["replica_prefixes"]
    assert prefixes == ["", "replica_1/"]
    for name in (TABLE, TABLE_SLOT):                     # once, on the parameter server
        assert name in variables and "replica_1/" + name not in nodes, name
        assert variables[name].device == HOST_CPU, (name, variables[name].device)
    for name in DENSE + tuple(n + "/Adagrad" for n in DENSE) + ("global_step",):   # mirrored
        assert name in variables and "replica_1/" + name in variables, name
    accumulators = [n for n in result.graph_def.node
                    if n.op in ("ConditionalAccumulator", "SparseConditionalAccumulator")]
    assert [n.op for n in accumulators] == ["SparseConditionalAccumulator"]
    assert not [n.name for n in result.graph_def.node if n.op == "CollectiveGatherV2"], \
        "the embedding's rows are still all-gathered"
    assert [n for n in result.graph_def.node if n.op == "CollectiveReduceV2"], "dense gradients"


def test_edited_plan_trains_like_one_device(edited, example):
    _, initial, losses, final = _reference(MODEL, OPTIMIZER, True)
    assert not np.array_equal(initial[TABLE], final[TABLE])
    result = _rewrite(example, edited)
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=10000)
    got_losses, got = harness.run_rewritten(result, example, steps=STEPS, batch_size=BATCH,
                                             replica_copies=True, config=config)
    np.testing.assert_allclose(got_losses, losses, rtol=RTOL, atol=ATOL)
    for name, want in final.items():
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    copies = {n for n in got if n.startswith("replica_1/")}
    assert copies == {"replica_1/" + n for n in final if n not in (TABLE, TABLE_SLOT)}
    for name in copies:
        np.testing.assert_allclose(got[name], got[name[len("replica_1/"):]], rtol=RTOL, atol=ATOL,
                                   err_msg=name)


# ----- serialisation ------------------------------------------------------------------

def test_plan_round_trips_through_json(edited):
    text = edited.to_json()
    doc = json.loads(text)
    assert doc["format"] == "graph_rewriter.plan/1"
    assert {v["name"]: v["placement"] for v in doc["variables"]}[TABLE] == "ps"
    again = Plan.from_json(text)
    assert again == edited
    assert again.to_json() == text
    assert all(isinstance(v, VariablePlan) for v in again.variables)
    assert all(isinstance(c, CutPlan) for c in again.cuts)


def test_plan_object_json_and_file_give_the_same_graph(edited, example, tmp_path):
    by_object = _rewrite(example, edited)
    by_json = _rewrite(example, Plan.from_json(edited.to_json()))
    path = tmp_path / "plan.json"
    path.write_text(edited.to_json())
    by_path = _rewrite(example, str(path))
    by_pathlike = _rewrite(example, pathlib.Path(path))
    want = _canonical(by_object)
    for other in (by_json, by_path, by_pathlike):
        assert _canonical(other) == want
        assert other.plan.to_dict() == by_object.plan.to_dict()
        assert other.plan.variable(TABLE).placement == "ps"
        assert other.plan.variable(TABLE_SLOT).placement == "ps"
    # ... and the edit mattered: the default plan's graph differs.
    assert _canonical(_rewrite(example, "allreduce")) != want


def test_file_that_is_not_a_plan_is_rejected(example, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"variables": []}))
    with pytest.raises(gr.GraphRewriteError, match="not a graph_rewriter plan"):
        _rewrite(example, str(path))


# ----- invalid plans ------------------------------------------------------------------

def _unknown_cut_variable(plan):
    plan.cut("hidden/bias").variable = "no_such_variable"
    return "no_such_variable"


def _ps_variable_with_mirrored_slot(plan):
    table = plan.variable(TABLE)
    table.placement, table.ps_task = "ps", 0
    plan.cut(TABLE).sync = "accumulate"      # consistent with its variable: only the slot is wrong
    return TABLE_SLOT


def _accumulate_on_mirrored(plan):
    plan.cut("hidden/kernel").sync = "accumulate"
    return "hidden/kernel"


def _unknown_placement(plan):
    plan.variable("output/kernel").placement = "gpu"
    return "output/kernel"


def _unknown_placement_of_a_slot(plan):
    plan.variable("output/kernel/Adagrad").placement = "somewhere"
    return "output/kernel/Adagrad"


def _ps_task_out_of_range(plan):
    plan.set_placement(TABLE, "ps", ps_task=1)   # one ps (this machine): task 0 only
    return TABLE


def _negative_ps_task(plan):
    plan.set_placement(TABLE, "ps", ps_task=-1)
    return TABLE


INVALID = [_unknown_cut_variable, _ps_variable_with_mirrored_slot, _accumulate_on_mirrored,
           _unknown_placement, _unknown_placement_of_a_slot, _ps_task_out_of_range, _negative_ps_task]


@pytest.mark.parametrize("edit", INVALID, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("via", ["object", "file"])
def test_invalid_plan_is_rejected_naming_the_variable(plan, example, tmp_path, edit, via):
    name = edit(plan)
    strategy = plan
    if via == "file":
        strategy = tmp_path / "plan.json"
        strategy.write_text(plan.to_json())
    with pytest.raises(gr.GraphRewriteError) as info:
        _rewrite(example, strategy)
    assert f"'{name}'" in str(info.value), str(info.value)


def test_unknown_placement_is_rejected_when_set(plan):
    with pytest.raises(gr.GraphRewriteError, match=f"'{TABLE}'"):
        plan.set_placement(TABLE, "nowhere")
    assert [v.placement for v in plan.group(TABLE)] == ["mirrored", "mirrored"]


def test_set_placement_of_an_unknown_variable_is_rejected(plan):
    with pytest.raises(gr.GraphRewriteError, match="'no_such_variable'"):
        plan.set_placement("no_such_variable", "ps")


@pytest.mark.parametrize("replicas", [1, 4])
def test_plan_for_other_replica_count_is_rejected(plan, example, replicas):
    with pytest.raises(gr.GraphRewriteError) as info:
        _rewrite(example, plan, devices_per_worker=replicas)
    message = str(info.value)
    assert "2 replicas" in message and re.search(rf"\b{replicas}\b", message), message


def test_valid_edit_is_not_rejected(plan, example):
    """The counterpart of the rejections: the same kind of edit, made consistently."""
    plan.set_placement(TABLE, "ps", ps_task=0)
    plan.cut("hidden/kernel").sync = "allreduce"
    assert _rewrite(example, plan).plan.variable(TABLE).placement == "ps"


# ----- several parameter servers: balance_ps and ps_shard_bytes -----------------------

def _group_loads(plan):
    loads, largest = {}, 0
    for v in plan.variables:
        if v.slot_of is None:
            group = plan.group(v.name)
            size = sum(m.bytes for m in group)
            largest = max(largest, size)
            loads[v.ps_task] = loads.get(v.ps_task, 0) + size
    return loads, largest


@pytest.mark.parametrize("model,optimizer", [("embedding", "adam"), ("mlp", "adagrad")])
def test_ps_variables_are_balanced_over_ps_tasks(model, optimizer):
    ex = models.build(model, optimizer, resource=True)
    result = gr.rewrite(ex.graph_def, TWO_PS, strategy="ps", device_type="CPU", ps_shard_bytes=0)
    plan = result.plan
    assert plan.num_ps == 2 and result.num_replicas == 2
    assert all(v.placement == "ps" and v.shards is None for v in plan.variables)
    assert {v.ps_task for v in plan.variables} == {0, 1}
    variables = _variables_of(result.graph_def)
    for v in plan.variables:
        assert variables[v.name].device == _ps_device(v.ps_task), (v.name, variables[v.name].device)
        if v.slot_of:
            assert v.ps_task == plan.variable(v.slot_of).ps_task, f"slot '{v.name}' left its variable"
            assert variables[v.name].device == variables[v.slot_of].device
    # By bytes, largest groups first: the tasks' loads differ by at most one group.
    loads, largest = _group_loads(plan)
    assert set(loads) == {0, 1}
    assert abs(loads[0] - loads[1]) <= largest, loads
    # No variable is cloned: the workers' replicas hold none.
    assert not [n for n in variables if n.startswith("replica_")]


def _var(name, nbytes, slot_of=None, shape=None):
    return VariablePlan(name=name, role="slot" if slot_of else "trainable", dtype="float32",
                        shape=shape or [nbytes // 4], bytes=nbytes, placement="ps", slot_of=slot_of)


def test_balance_ps_places_largest_groups_first_on_the_least_loaded_task():
    plan = Plan(strategy="ps", num_replicas=2, devices_per_worker=1, device_type="CPU",
                variables=[_var("a", 400), _var("a/slot", 400, "a"), _var("b", 600),
                           _var("c", 400), _var("d", 320)],
                cuts=[], packs=[], batch_inputs=[], broadcast_inputs=[], step_counters=[], num_ps=2)
    balance_ps(plan, 0)
    # groups by bytes: a+slot 800, b 600, c 400, d 320 -> 0: a (800); 1: b (600), c (1000);
    # 0: d (1120).
    assert {v.name: v.ps_task for v in plan.variables} == {"a": 0, "a/slot": 0, "b": 1, "c": 1, "d": 0}
    assert all(v.shards is None for v in plan.variables)


def test_plan_ps_task_is_honoured_with_several_ps(example):
    plan = gr.rewrite(example.graph_def, TWO_PS, device_type="CPU").plan
    assert plan.num_ps == 2
    plan.set_placement(TABLE, "ps", ps_task=1)
    result = gr.rewrite(example.graph_def, TWO_PS, strategy=plan, device_type="CPU")
    variables = _variables_of(result.graph_def)
    assert variables[TABLE].device == _ps_device(1)
    assert variables[TABLE_SLOT].device == _ps_device(1)
    assert "replica_1/" + TABLE not in variables
    assert "replica_1/hidden/kernel" in variables      # worker 1's replica mirrors the rest
    assert not [n for n in variables if TABLE in n and n not in (TABLE, TABLE_SLOT)]


@pytest.mark.parametrize("ps,rows", [(2, [10, 10]), (3, [7, 7, 6])])
def test_large_variable_is_split_by_rows(ps, rows):
    cluster = {"worker": ["localhost:2222", "localhost:2223"],
               "ps": [f"localhost:{2300 + k}" for k in range(ps)]}
    ex = models.build("embedding", "adam", resource=True)
    table_bytes = models.EMBED_ROWS * models.EMBED_DIM * 4
    threshold = table_bytes - 1          # the table (320 bytes) is above, hidden/kernel (256) below
    plan = gr.rewrite(ex.graph_def, cluster, strategy="ps", device_type="CPU",
                      ps_shard_bytes=threshold).plan
    want = [{"ps_task": k, "rows": n} for k, n in enumerate(rows)]
    assert sum(rows) == models.EMBED_ROWS
    for name in ("embedding", "embedding/Adam", "embedding/Adam_1"):
        v = plan.variable(name)
        assert v.bytes == table_bytes
        assert (v.placement, v.shards, v.ps_task) == ("ps", want, None), name
    for v in plan.variables:
        if not v.name.startswith("embedding"):
            assert v.shards is None and v.ps_task in range(ps), (v.name, v.bytes, v.shards)
    assert plan.variable("hidden/kernel").bytes < threshold


@pytest.mark.parametrize("options", [dict(ps_shard_bytes=0), dict()], ids=["never", "default"])
def test_no_split_at_or_below_the_threshold(options):
    ex = models.build("embedding", "adam", resource=True)
    plan = gr.rewrite(ex.graph_def, TWO_PS, strategy="ps", device_type="CPU", **options).plan
    assert all(v.shards is None and v.ps_task in (0, 1) for v in plan.variables)


def test_ref_variables_are_not_split():
    ex = models.build("embedding", "adam", resource=False)
    plan = gr.rewrite(ex.graph_def, TWO_PS, strategy="ps", device_type="CPU", ps_shard_bytes=100).plan
    assert all(v.kind == "ref" for v in plan.variables if v.name.startswith("embedding"))
    assert all(v.shards is None and v.ps_task in (0, 1) for v in plan.variables)


# ----- notes: hybrid without sparse gradients says so ---------------------------------

HYBRID_NOTE = "hybrid: no sparse gradients, every variable is all-reduced"


def test_hybrid_without_sparse_gradients_notes_it_in_the_plan_log_summary_and_inspect():
    from graph_rewriter.inspect_report import format_report, report
    ex = models.build("mlp", "adam", seed=0)       # dense only
    logged = []
    result = gr.rewrite(ex.graph_def, strategy="hybrid", devices_per_worker=2, device_type="CPU",
                        log=logged.append)
    assert result.plan.notes == [HYBRID_NOTE]
    assert all(v.placement == "mirrored" for v in result.plan.variables)
    assert [m for m in logged if HYBRID_NOTE in m], logged
    assert f"note: {HYBRID_NOTE}" in result.summary().splitlines()
    text = format_report(report(result))
    assert f"note:       {HYBRID_NOTE}" in text.splitlines()
    # the note travels in the plan's JSON (and so in the saved graph's metadata)
    d = json.loads(result.plan.to_json())
    assert d["notes"] == [HYBRID_NOTE]
    again = Plan.from_json(result.plan.to_json())
    assert again.notes == [HYBRID_NOTE] and again.to_json() == result.plan.to_json()
    assert result.metadata["plan"]["notes"] == [HYBRID_NOTE]
    # a saved plan applied again keeps one note, not two
    reapplied = gr.rewrite(ex.graph_def, strategy=again, devices_per_worker=2, device_type="CPU")
    assert reapplied.plan.notes == [HYBRID_NOTE]
    # otherwise hybrid trains exactly as allreduce: the same graph apart from the plan's words
    allreduce = gr.rewrite(ex.graph_def, strategy="allreduce", devices_per_worker=2, device_type="CPU")
    strip = lambda r: {n.name: (n.op, n.device, tuple(n.input)) for n in r.graph_def.node}
    assert strip(result) == strip(allreduce)


@pytest.mark.parametrize("model, strategy", [("mlp", "allreduce"), ("mlp", "ps"), ("mlp", "auto"),
                                             ("embedding", "hybrid"), ("embedding", "allreduce")])
def test_other_plans_carry_no_notes(model, strategy):
    ex = models.build(model, "adagrad", seed=0)
    result = gr.rewrite(ex.graph_def, strategy=strategy, devices_per_worker=2, device_type="CPU")
    assert result.plan.notes is None
    assert '"notes"' not in result.plan.to_json()
    assert "note:" not in result.summary()
    assert "notes" not in result.metadata["plan"]


def test_a_given_hybrid_plan_that_moves_a_variable_to_the_ps_drops_the_note():
    ex = models.build("mlp", "adagrad", seed=0)
    plan = gr.rewrite(ex.graph_def, strategy="hybrid", devices_per_worker=2, device_type="CPU").plan
    assert plan.notes == [HYBRID_NOTE]
    plan.set_placement("hidden/kernel", "ps")
    result = gr.rewrite(ex.graph_def, strategy=plan, devices_per_worker=2, device_type="CPU")
    assert result.plan.variable("hidden/kernel").placement == "ps"
    assert not result.plan.notes
    assert "notes" not in result.plan.to_dict()
