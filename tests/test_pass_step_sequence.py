"""The step_sequence pass (passes/step_sequence.py).

What is held:

- A between-graph graph whose collectives span tasks gets one never-running V1
  CollectiveReduce on its host, on the true branch of a cond whose predicate
  (Timestamp() < 0) is never true and cannot be folded, merged with the false branch;
  the merge is a control input of every collective of the graph (every replica's, the
  init broadcasts, the hybrid barriers), so any step that runs a collective carries the
  marker. The marker's instance key is the job's own: the same for every worker's graph
  of a rewrite, another for another model or plan.
- In-graph graphs (one master numbers every step), ps graphs (no collective) and
  single-worker graphs have none of it.
- The marker is excluded from what inspect reports and from the MetaGraphDef's init op
  (a step that runs it takes a step id from the job's sequence: an init op without
  collectives must not).
- For real, the cluster case that hung before this pass
  (`test_cluster_training_equals_one_device[...between-2x2dev-0ps-hierarchical]`, after an
  in-graph job on the same servers) is in tests/test_cluster.py.
"""

import pytest

import graph_rewriter as gr
from graph_rewriter.collectives import NEVER_RUNS, STEP_SEQUENCE, step_sequence_key
from graph_rewriter.testing import models

SPEC = {"worker": ["localhost:2222", "localhost:2223"], "ps": ["localhost:2225"]}


def _nodes(result):
    return {n.name: n for n in result.graph_def.node}


@pytest.mark.parametrize("strategy, dpw", [("allreduce", 1), ("allreduce", 2), ("hybrid", 2)])
def test_every_collective_of_a_between_graph_graph_waits_for_the_jobs_marker(strategy, dpw):
    ex = models.build("embedding", "adam", seed=1)
    results = [gr.rewrite(ex.graph_def, SPEC, task=f"worker:{k}", strategy=strategy, device_type="CPU",
                          devices_per_worker=dpw) for k in range(2)]
    keys = []
    for k, result in enumerate(results):
        nodes = _nodes(result)
        host = f"/job:worker/replica:0/task:{k}/device:CPU:0"
        marker = nodes[STEP_SEQUENCE]
        assert marker.op == "Merge" and marker.device == host
        key_op, other = (nodes[i.split(":")[0]] for i in marker.input)
        assert key_op.op == "CollectiveReduce" and NEVER_RUNS in key_op.attr and key_op.device == host
        switch = nodes[key_op.input[0].split(":")[0]]
        assert key_op.input[0].endswith(":1") and other is switch and switch.op == "Switch"
        never = nodes[switch.input[1]]
        assert never.op == "Less" and nodes[never.input[0]].op == "Timestamp"
        keys.append(key_op.attr["instance_key"].i)
        collectives = [n for n in result.graph_def.node if "Collective" in n.op and n.name != key_op.name]
        assert collectives
        for n in collectives:
            assert f"^{STEP_SEQUENCE}" in n.input, n.name
        # the init op the MetaGraphDef names runs no collective, so not the marker either
        init_op = result.meta_graph.collection_def["init_op"].node_list.value[0]
        assert f"^{STEP_SEQUENCE}" not in nodes[init_op].input
    assert keys[0] == keys[1] == step_sequence_key(results[0].plan)


def test_another_model_or_plan_has_another_sequence():
    ex = models.build("embedding", "adam", seed=1)
    other = models.build("mlp", "adam", seed=1)

    def key(graph_def, **kw):
        result = gr.rewrite(graph_def, SPEC, task="worker:0", device_type="CPU", **kw)
        return _nodes(result)[f"{STEP_SEQUENCE}/key"].attr["instance_key"].i

    base = key(ex.graph_def)
    assert len({base, key(other.graph_def), key(ex.graph_def, devices_per_worker=2),
                key(ex.graph_def, strategy="hybrid")}) == 4


@pytest.mark.parametrize("spec, kwargs", [
    (SPEC, dict()),                                      # in-graph: one master numbers every step
    (SPEC, dict(strategy="ps", task="worker:1")),        # no collective
    ({"worker": ["localhost:1"]}, dict(task="worker:0", devices_per_worker=2)),
], ids=["in-graph", "ps-between-graph", "one-worker"])
def test_graphs_one_master_numbers_or_without_collectives_have_no_marker(spec, kwargs):
    ex = models.build("mlp", "sgd", seed=1)
    result = gr.rewrite(ex.graph_def, spec, device_type="CPU", **kwargs)
    assert not any(n.name.startswith(STEP_SEQUENCE) for n in result.graph_def.node)
    assert "step_sequence" not in result.metadata["passes"]


def test_inspect_does_not_count_the_marker_as_a_collective():
    from graph_rewriter.inspect_report import report
    ex = models.build("mlp", "adam", seed=1)
    result = gr.rewrite(ex.graph_def, SPEC, task="worker:1", device_type="CPU")
    names = [c["name"] for c in report(result)["collectives"]]
    assert names and not any(n.startswith(STEP_SEQUENCE) for n in names)
