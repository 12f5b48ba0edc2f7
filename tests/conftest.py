"""Shared test setup: quiet TensorFlow and graph mode. (pytest puts this folder on sys.path
itself, which lets test modules import each other's helpers.)

GRAPH_REWRITER_TEST_DEVICE=GPU runs the in-process equivalence tests (test_equivalence.py,
test_ps_equivalence.py, test_real_models.py) with their replicas on GPU:0..R-1 instead of
CPU:0..R-1 (graph_rewriter.testing.harness.device_type; tools/gpu_readiness.py sets it);
TensorFloat-32 is then turned off so GPU float32 rounds as the tests' tolerance expects.
Unset, nothing changes: CPU replicas.

The ``launcher`` fixture starts the multi-process tests' Python clients and unsupervised
servers (graph_rewriter.testing.fork_server): forked from one process per pytest worker
that has imported TensorFlow, instead of a new interpreter each (about 4.5 s of CPU saved
per process); GRAPH_REWRITER_TEST_FORK=0 starts every one as a new interpreter."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from graph_rewriter.testing import fork_server, harness  # noqa: E402

tf.compat.v1.disable_eager_execution()
if harness.device_type() == "GPU":
    harness.exact_float32()


@pytest.fixture(scope="session")
def launcher():
    """Starts client processes (``launcher.popen``, as subprocess.Popen); the zygote
    starts on first use and ends, with any child left, when the session ends."""
    with fork_server.Launcher() as started:
        yield started
