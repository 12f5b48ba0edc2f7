"""Shared test setup: quiet TensorFlow and graph mode. (pytest puts this folder on sys.path
itself, which lets test modules import each other's helpers.)

GRAPH_REWRITER_TEST_DEVICE=GPU runs the in-process equivalence tests (test_equivalence.py,
test_ps_equivalence.py, test_real_models.py) with their replicas on GPU:0..R-1 instead of
CPU:0..R-1 (graph_rewriter.testing.harness.device_type; tools/gpu_readiness.py sets it);
TensorFloat-32 is then turned off so GPU float32 rounds as the tests' tolerance expects.
Unset, nothing changes: CPU replicas."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from graph_rewriter.testing import harness  # noqa: E402

tf.compat.v1.disable_eager_execution()
if harness.device_type() == "GPU":
    harness.exact_float32()
