"""tools/gpu_readiness.py on a machine without GPUs, and the device switch it uses.

The script's checks need NVIDIA GPUs; what can be checked here is that without them it
says so in one line and exits 2, that its pieces (the GPU check, pytest's summary, the
rows, the table, the exit status, the communication check on CPU replicas) do what they
say, and that the tests' device switch (GRAPH_REWRITER_TEST_DEVICE, read by
graph_rewriter.testing.harness.device_type) leaves the equivalence tests on CPU replicas
unless it is set.
"""

import importlib
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.testing import harness

import test_equivalence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
TOOL = os.path.join(TOOLS, "gpu_readiness.py")
HAS_GPU = tf.test.is_built_with_cuda() and bool(tf.config.list_physical_devices("GPU"))


@pytest.fixture(scope="module")
def readiness():
    """tools/gpu_readiness.py imported as a module, its folder on sys.path for the import
    as when it runs (it imports tools/bench_step.py)."""
    sys.path.insert(0, TOOLS)
    try:
        return importlib.import_module("gpu_readiness")
    finally:
        sys.path.remove(TOOLS)


def describe(proc):
    return f"exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"


# ----- the script without GPUs ----------------------------------------------------------------

@pytest.mark.skipif(HAS_GPU, reason="this machine has GPUs: the script would run every check")
def test_without_gpus_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}   # its own quiet import
    proc = subprocess.run([sys.executable, TOOL], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, describe(proc)
    assert proc.stdout == "", describe(proc)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, describe(proc)
    line = lines[0]
    assert line.startswith(f"gpu_readiness: no GPU visible to TensorFlow {tf.__version__} (built with CUDA: "), line
    assert "graph-rewriter[gpu]" in line or "nvidia-smi" in line, line


def test_check_gpus_names_what_is_missing(readiness):
    with pytest.raises(GraphRewriteError) as e:
        readiness.check_gpus("2.21.0", False, 0)
    assert str(e.value) == ("no GPU visible to TensorFlow 2.21.0 (built with CUDA: no). To fix this, install "
                            "'graph-rewriter[gpu]' (tensorflow[and-cuda]) on a machine with NVIDIA GPUs and drivers")
    with pytest.raises(GraphRewriteError, match=r"built with CUDA: yes\). To fix this, .*nvidia-smi.*"
                                                r"CUDA_VISIBLE_DEVICES"):
        readiness.check_gpus("2.21.0", True, 0)
    readiness.check_gpus("2.21.0", True, 2)   # ready: nothing raised


# ----- the pieces ----------------------------------------------------------------------------

def test_pytest_counts_reads_the_summary_line(readiness):
    out = "....s.F\nFAILED tests/x.py::test_a - assert 1 == 2\n3 failed, 120 passed, 40 skipped in 81.20s (0:01:21)\n"
    assert readiness.pytest_counts(out) == {"failed": 3, "passed": 120, "skipped": 40}
    assert readiness.pytest_counts("1 error in 0.50s") == {"error": 1}
    assert readiness.pytest_counts("ERROR: file or directory not found: tests/nope.py\n") == {}


def test_suite_row(readiness):
    row = readiness.suite_row(0, {"passed": 120, "skipped": 40})
    assert row == ("equivalence suite on GPUs", "passed", "120 passed, 0 failed, 40 skipped")
    assert readiness.suite_row(1, {"passed": 118, "failed": 2}).result == "FAILED"
    assert readiness.suite_row(0, {"skipped": 5}).result == "FAILED"      # nothing ran: not a pass
    assert readiness.suite_row(4, {}) == ("equivalence suite on GPUs", "FAILED", "pytest exited 4 with no summary")


def test_suite_runs_with_the_device_switched_to_gpu(readiness):
    env = readiness.suite_environment({"PATH": "/bin"})
    assert env["GRAPH_REWRITER_TEST_DEVICE"] == "GPU" and env["PATH"] == "/bin"
    assert harness.device_type(env) == "GPU"
    for path in readiness.SUITE:
        assert os.path.exists(os.path.join(REPO, path)), path


def test_communication_rows(readiness):
    assert readiness.run_communication("nccl", 1) == readiness.communication_row("nccl", 1, None)
    skipped = readiness.communication_row("nccl", 1, None)
    assert skipped.result == "skipped" and "needs 2 GPUs, this machine has 1" in skipped.figure
    good = readiness.communication_row("ring", 4, {"models": 2, "collectives": 12, "largest": 3e-8, "wrong": []})
    assert good == ("ring collectives: training equals one device", "passed",
                    "2 models on 4 GPUs, 12 collectives; largest difference 3.0e-08")
    bad = readiness.communication_row("nccl", 2, {"models": 2, "collectives": 6, "largest": 0.5,
                                                  "wrong": ["mlp: a", "mlp: b", "mlp: c", "mlp: d"]})
    assert bad.result == "FAILED" and bad.figure == "4 differ: mlp: a, mlp: b, mlp: c, ..."


def test_error_line_names_the_error(readiness):
    tf_stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                 "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n\n"
                 "Node: 'dense_0/kernel'\nCannot assign a device for operation dense_0/kernel\n"
                 "\t [[dense_0/kernel]]\n")
    assert readiness.error_line(tf_stderr) == "Cannot assign a device for operation dense_0/kernel"
    assert readiness.error_line("Traceback ...:\n  File\nValueError: bad\n") == "ValueError: bad"
    assert readiness.error_line("") == "no error message"
    assert len(readiness.error_line("E" * 500)) == 160


def test_differences(readiness):
    import numpy as np
    want = {"a": np.ones(3), "b": np.zeros(2), "c": 1.0, "d": np.ones(2)}
    got = {"a": np.ones(3) + 1e-9, "b": np.array([0.0, 0.5]), "d": np.ones(3)}
    wrong, largest = readiness.differences(want, got)
    assert wrong == ["b", "c (missing)", "d (shape (3,), want (2,))"]
    assert largest == pytest.approx(0.5)


def test_step_time_row(readiness):
    rounds = [{"single": 0.010, "rewritten": 0.006, "mirrored": 0.010},
              {"single": 0.010, "rewritten": 0.007, "mirrored": 0.010},
              {"single": 0.010, "rewritten": 0.020, "mirrored": 0.010}]
    row = readiness.step_time_row(rounds, 4)
    assert row.result == "passed"                      # median ratio 0.70 <= 0.75
    assert row.figure.startswith("0.70x MirroredStrategy (target <= 0.75): rewritten 7.0 ms, "
                                 "MirroredStrategy 10.0 ms, one GPU 10.0 ms (0.70x) per step, 4 GPUs, batch 512")
    assert readiness.step_time_row(rounds, 4, target=0.5).result == "FAILED"


def test_table_and_exit_status(readiness):
    Row = readiness.Row
    rows = [Row("equivalence suite on GPUs", "passed", "10 passed, 0 failed, 0 skipped"),
            Row("nccl collectives: training equals one device", "skipped", "needs 2 GPUs, this machine has 1")]
    assert readiness.format_table(rows).splitlines() == [
        "| check | result | figure |",
        "|---|---|---|",
        "| equivalence suite on GPUs | passed | 10 passed, 0 failed, 0 skipped |",
        "| nccl collectives: training equals one device | skipped | needs 2 GPUs, this machine has 1 |"]
    assert readiness.exit_status(rows) == 0            # a skipped check is not a failure
    assert readiness.exit_status(rows + [Row("step time vs MirroredStrategy", "FAILED", "0.90x")]) == 1


def test_communication_check_on_cpu_replicas(readiness):
    """The check itself, with the ring on 2 CPU replicas (NCCL needs GPUs): both models
    train as on one device and their collectives ask for the ring."""
    found = readiness.check_communication("ring", 2, device_type="CPU")
    assert found["wrong"] == [], found
    assert found["models"] == 2 and found["collectives"] >= 2, found
    assert found["largest"] < 1e-5, found


# ----- the device switch -----------------------------------------------------------------------

def test_device_switch_defaults_to_cpu(monkeypatch):
    monkeypatch.delenv(harness.DEVICE_ENV, raising=False)
    assert harness.device_type() == "CPU"
    assert harness.device_type({}) == "CPU"
    assert harness.device_type({"GRAPH_REWRITER_TEST_DEVICE": ""}) == "CPU"
    assert harness.device_type({"GRAPH_REWRITER_TEST_DEVICE": "cpu"}) == "CPU"
    assert harness.device_type({"GRAPH_REWRITER_TEST_DEVICE": "gpu"}) == "GPU"
    with pytest.raises(GraphRewriteError, match=r"GRAPH_REWRITER_TEST_DEVICE='TPU' .*set it to GPU"):
        harness.device_type({"GRAPH_REWRITER_TEST_DEVICE": "TPU"})


@pytest.mark.skipif(harness.device_type() != "CPU", reason="the suite runs with GRAPH_REWRITER_TEST_DEVICE set")
def test_equivalence_tests_use_cpu_replicas_when_the_switch_is_unset():
    assert test_equivalence.DEVICE == "CPU"
    for replicas in (1, 2, 4, 16):                       # virtual CPUs: never skipped
        assert test_equivalence._device(replicas) == "CPU"


@pytest.mark.skipif(HAS_GPU, reason="this machine has GPUs")
def test_gpu_cases_beyond_the_gpus_are_skipped(monkeypatch):
    monkeypatch.setattr(test_equivalence, "DEVICE", "GPU")
    with pytest.raises(pytest.skip.Exception, match="2 GPU replicas, this machine has 0 GPUs"):
        test_equivalence._device(2)
