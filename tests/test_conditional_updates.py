"""A step that skips its update under a condition (tf1_scripts.conditional_update_mlp).

Conditioned on the gradients (their global norm's finiteness, as loss scaling skips a
step that overflows), every replica reads the averaged gradients, decides alike, and R
replicas train as one device, the skipped step included: a row whose error overflows
makes one device's batch gradient infinite, and its average over the replicas too.
Conditioned on the batch's loss (a step skipped when the loss is not finite, or spikes),
each replica would decide on its own shard's loss where one device decides on the whole
batch's. That was refused as before, but the error said "cannot find the gradient of
variable 'w1'" and told to name the gradient, which does not help; it now names the
condition and says what to condition on instead.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import conditional_update_batches, conditional_update_mlp

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 4)])
def test_a_step_skipped_on_the_gradients_trains_as_one_device(control_flow, strategy, replicas):
    graph_def = conditional_update_mlp("gradients_finite", control_flow)
    feeds = conditional_update_batches(STEPS, BATCH)
    want = harness.trained_on_one_device(graph_def, feeds)
    assert np.isinf(want[0][1]) and np.all(np.isfinite(want[0][2:]))   # one device skipped the overflow
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    harness.assert_trained_alike(f"{strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds), want,
                                 RTOL, ATOL)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
@pytest.mark.parametrize("condition, predicate", [("loss_finite", "IsFinite:0"), ("loss_below", "Less:0")])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_step_skipped_on_the_loss_is_refused_naming_the_condition(control_flow, condition, predicate, strategy):
    with pytest.raises(gr.GraphRewriteError, match=(
            rf"variable 'w[12]' runs under a condition computed from the batch \('{predicate}', the predicate "
            r".*condition the update on the gradients.*tf.math.is_finite\(tf.linalg.global_norm\(grads\)\)")):
        gr.rewrite(conditional_update_mlp(condition, control_flow), devices_per_worker=2, device_type="CPU",
                   strategy=strategy)


def test_the_cli_refuses_it_with_exit_2_and_no_output(tmp_path):
    import subprocess
    import sys
    src, out = tmp_path / "in.pb", tmp_path / "out.pb"
    src.write_bytes(conditional_update_mlp("loss_finite", "v1").SerializeToString())
    proc = subprocess.run([sys.executable, "-m", "graph_rewriter.cli", str(src), str(out), "--devices-per-worker", "2",
                           "--device-type", "CPU"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not out.exists()
    assert "runs under a condition computed from the batch ('IsFinite:0'" in proc.stderr
    assert "Traceback" not in proc.stderr
