"""A reference batch fed whole beside the batch (graph_rewriter.testing.tf1_scripts.
reference_batch_norm_mlp): virtual batch normalization normalises every example by the
moments of a fixed reference batch, fed at every step. Its placeholder with a static
first dimension, ``[64, d]`` beside a ``[None, d]`` batch, is no batch input: every
replica reads it whole, and R replicas train as one device. With ``[None, d]`` it is a
batch input like the batch, split across the replicas, and its moments are each
replica's shard's: the plan notes them as batch statistics (this is how a script says
which of its inputs is the batch, docs/semantics.md#feeds-batch-inputs).
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import REFERENCE_ROWS, reference_batch_norm_mlp

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6


def _feeds():
    rng = np.random.RandomState(0)
    reference = rng.randn(REFERENCE_ROWS, 4).astype(np.float32)
    return [{"x:0": rng.randn(BATCH, 4).astype(np.float32), "y:0": rng.randn(BATCH, 1).astype(np.float32),
             "ref:0": reference} for _ in range(STEPS)]


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2)])
def test_a_static_reference_batch_is_read_whole_by_every_replica(strategy, replicas):
    graph_def, feeds = reference_batch_norm_mlp(), _feeds()
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    plan = result.metadata["plan"]
    assert plan["batch_inputs"] == ["x:0", "y:0"] and "ref:0" in plan["broadcast_inputs"]
    assert not result.plan.notes
    harness.assert_trained_alike(f"{strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds),
                                 want, RTOL, ATOL)


def test_a_dynamic_reference_batch_is_split_and_its_moments_noted():
    graph_def, feeds = reference_batch_norm_mlp(static_reference=False), _feeds()
    want_losses, _ = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert any(n.startswith(ROWS_MEET_START) and "'moments/mean', 'moments/variance'" in n
               for n in result.plan.notes or [])
    losses, _ = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 1e-2
