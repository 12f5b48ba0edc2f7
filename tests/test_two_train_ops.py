"""A graph with two train ops run at different steps: a GAN.

A TF1 GAN script builds a discriminator update and a generator update, each minimize()
over its own variables with its own optimizer, and runs them in turns. Rewritten, each
train op must still compute only its own gradients: a pack all-reducing gradients of
both would make the discriminator's step run the generator's backward pass too (the
pack's concatenation reads every gradient in it). So the analysis records each
gradient's train ops when they differ, and the planner packs them apart.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.testing.tf1_scripts import gan

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)
tf1 = tf.compat.v1
STEPS = 6
RTOL, ATOL = 1e-5, 1e-6


def feeds(rows=8):
    rng = np.random.RandomState(0)
    return [{"real:0": rng.randn(rows, 4).astype(np.float32), "z:0": rng.randn(rows, 2).astype(np.float32)}
            for _ in range(STEPS)]


def train(session, names):
    """D's step at even steps, G's at odd ones; (losses, variables)."""
    session.run("init")
    losses = [session.run(["d_loss:0", "d_train"] if i % 2 == 0 else ["g_loss:0", "g_train"], f)[0]
              for i, f in enumerate(feeds())]
    return losses, {n: session.run(f"{n}/Read/ReadVariableOp:0") for n in names}


def _one_device(graph_def, names):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        return train(sess, names)


def _ancestors(graph_def, name):
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    seen, stack = set(), [name]
    while stack:
        for p in inputs[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("ps", 2), ("ps", 4)])
def test_alternating_train_ops_train_as_one_device(strategy, replicas):
    """Under ps each train op's takes bump the step counter apart; with 4 replicas (a
    template replica standing for 3) as with 2."""
    graph_def, names = gan()
    want_losses, want = _one_device(graph_def, names)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    with gr.Session(result) as sess:
        losses, got = train(sess, names)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert got["global_step"] == STEPS // 2
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_the_gradients_of_each_train_op_get_packs_of_their_own():
    graph_def, _ = gan()
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").metadata["plan"]
    owners = [{c["train_ops"][0] for c in plan["cuts"] if c["pack"] == i} for i in range(len(plan["packs"]))]
    assert sorted(map(sorted, owners)) == [["d_train"], ["g_train"]]


@pytest.mark.parametrize("strategy, task, devices", [
    ("allreduce", None, 2), ("ps", None, 2), ("allreduce", "worker:0", 2),
    ("ps", "worker:0", 2), ("ps", "worker:1", 2), ("ps", "worker:1", 1)],
    ids=["allreduce", "ps", "allreduce-between", "ps-chief", "ps-worker", "ps-worker-1-replica"])
def test_each_train_op_computes_only_its_own_gradients(strategy, task, devices):
    """Running d_train reaches none of G's backward pass (tf.gradients' second scope,
    "gradients_1/") and the other way round: the packs of the two train ops are chained
    apart (each pack's collective otherwise waits for the previous pack's), and under
    ps each train op's updates wait for a bump of the step counter after its own takes
    only (before, one bump after every take: ps computed both backward passes).
    Between-graph, a worker's train op waits for its own token only, and keeps only
    its own gradients' applies (a worker with one replica kept the other train op's
    too: it pushed a gradient the next step's take averaged in)."""
    graph_def, _ = gan()
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]} if task else None
    out = gr.rewrite(graph_def, cluster, devices_per_worker=devices, device_type="CPU", strategy=strategy,
                     task=task).graph_def
    d, g = _ancestors(out, "d_train"), _ancestors(out, "g_train")
    assert not [n for n in d if "gradients_1" in n.split("/") or "accumulators/G" in n]
    assert not [n for n in g if "gradients" in n.split("/") or "accumulators/D" in n]
    if strategy == "ps" and task:
        assert "graph_rewriter/tokens/wait" in d and "graph_rewriter/tokens/group_1/wait" not in d
        assert "graph_rewriter/tokens/group_1/wait" in g and "graph_rewriter/tokens/wait" not in g


@pytest.mark.slow
def test_two_workers_with_variables_on_the_ps_train_as_one_device(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica on loopback servers, d_train and g_train in
    turns. Each train op has a step of its own: the chief releases the workers after that
    train op's takes and updates only. Before, the chief's one step sequence applied both
    train ops' updates at every step (the variables 0.02 off one device after four
    steps, the global step 4 where one device counts 2), and such graphs were refused."""
    graph_def, names = gan()
    _, want = _one_device(graph_def, names)
    reads = {n: f"{n}/Read/ReadVariableOp:0" for n in names}
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "ps", STEPS, reads.values(), feeds(),
                              step_ops=(("d_loss:0", "d_train"), ("g_loss:0", "g_train")))
    assert want["global_step"] == STEPS // 2
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)