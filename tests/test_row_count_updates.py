"""An update that reads the batch's count of rows (tf1_scripts.batch_scaled_lr_mlp).

A learning rate scaled by the batch size computed in the graph, ``base * tf.shape(x)[0]
/ 256`` (the linear scaling rule), is on each replica computed from the replica's shard:
a share of one device's count, so the replicas would update with a learning rate R
times smaller. Such an update was refused, but the error said it could not find the
gradient and told to name it, which does not help; it now names the count and says to
compute the rate from the global batch size as a constant. (A count of rows that a state
stores, a counter of the examples seen, is summed over the replicas and needs nothing:
tests/test_batch_counts.py.)
"""

import subprocess
import sys

import pytest

import graph_rewriter as gr
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import batch_scaled_lr_mlp, dropout_batches

WHY = (r"of variable 'w[12]' reads '(truediv|mul):0', computed from the batch's count of rows \('Shape', a Shape\): "
       r"each replica counts its own shard's rows.*compute it from the global batch size as a constant")


@pytest.mark.parametrize("kind", ["momentum", "adam"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps", "hybrid"])
def test_a_learning_rate_from_the_row_count_is_refused_naming_the_count(kind, strategy):
    with pytest.raises(gr.GraphRewriteError, match=WHY):
        gr.rewrite(batch_scaled_lr_mlp(kind), devices_per_worker=2, device_type="CPU", strategy=strategy)


@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 4)])
def test_a_warm_up_on_the_examples_seen_trains_as_one_device(strategy, replicas):
    """The counter is summed over the replicas, so the rate it warms up is one device's."""
    graph_def, feeds = batch_scaled_lr_mlp("warmup"), dropout_batches(4, 8)
    want = harness.trained_on_one_device(graph_def, feeds)
    assert want[1]["examples_seen"] == 32
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    harness.assert_trained_alike(f"{strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds), want,
                                 1e-5, 1e-6)


def test_the_cli_refuses_it_with_exit_2_and_no_output(tmp_path):
    src, out = tmp_path / "in.pb", tmp_path / "out.pb"
    src.write_bytes(batch_scaled_lr_mlp().SerializeToString())
    proc = subprocess.run([sys.executable, "-m", "graph_rewriter.cli", str(src), str(out), "--devices-per-worker", "2",
                           "--device-type", "CPU"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not out.exists() and "Traceback" not in proc.stderr
    assert "computed from the batch's count of rows ('Shape', a Shape)" in proc.stderr
