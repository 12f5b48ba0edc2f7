"""Optimizer.minimize's keywords that change how the backward pass is built
(graph_rewriter.testing.tf1_scripts.minimize_options_mlp): colocated gradients (the
default of tensor2tensor and TensorFlow's NMT), GATE_GRAPH and GATE_NONE, AccumulateNV2 and
tree aggregation of a variable's two gradients, gradient checkpointing by
tf.recompute_grad. Each trains as one device under allreduce at 2 and 4 replicas, ps and
hybrid at 2, and with colocated gradients every replica's gradient ops colocate with
that replica's own forward ops and sit on its own GPU (a colocation left naming replica
0's op would pull replica 1's backward pass onto GPU:0)."""

import pytest

import graph_rewriter as gr
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import MINIMIZE_OPTIONS, dropout_batches, minimize_options_mlp

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
RUNS = [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)]


@pytest.mark.parametrize("kind", MINIMIZE_OPTIONS)
def test_minimize_options_train_as_one_device(kind):
    graph_def, feeds = minimize_options_mlp(kind), dropout_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    for strategy, replicas in RUNS:
        result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
        got = harness.trained_rewritten(result, graph_def, feeds)
        harness.assert_trained_alike(f"{kind} {strategy} {replicas}", got, want, RTOL, ATOL)


@pytest.mark.parametrize("kind", ["colocate", "all"])
def test_colocated_gradients_follow_their_own_replica(kind):
    graph_def = minimize_options_mlp(kind)
    colocated = [n for n in graph_def.node if n.name.startswith("gradients/") and "_class" in n.attr]
    assert len(colocated) > 10   # (the keyword did colocate the backward pass)
    out = gr.rewrite(graph_def, devices_per_worker=2, device_type="GPU").graph_def
    gradients = [n for n in out.node if n.name.startswith("replica_1/gradients/")]
    assert len(gradients) >= len(colocated)
    for n in gradients:
        assert n.device.endswith("GPU:1"), (n.name, n.device)
        for target in n.attr["_class"].list.s if "_class" in n.attr else []:
            assert target.decode().startswith("loc:@replica_1/"), (n.name, target)
