"""graph_rewriter.testing.fork_server: the multi-process tests' clients, forked from a
process that has imported TensorFlow, run as a new interpreter would run them.

Held: the child gets the command's arguments (``-c`` and ``-m``), environment, working
directory, PYTHONPATH and log files; it runs a module as ``__main__``; its exit status
(an exit code, an uncaught exception, a signal) reaches ``poll``/``wait``; ``wait``
times out; the child leads its own session, so ``os.killpg(pid)`` ends it; two children
draw different random numbers; a command whose import-time environment differs from the
zygote's (``TF_CPP_MIN_LOG_LEVEL``) or that is not this interpreter starts a new
process instead; closing the launcher ends the children still running; an exit status read together
with the pid is kept; and a forked
child starts with TensorFlow imported (what saves the time; no timing is asserted)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from graph_rewriter.testing import fork_server

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture(scope="module")
def forks():
    with fork_server.Launcher(enabled=True) as launcher:
        yield launcher


def _run(launcher, tmp_path, cmd, env=None, cwd=None):
    out = open(tmp_path / "out.txt", "w")
    proc = launcher.popen([sys.executable, *cmd], stdout=out, stderr=subprocess.STDOUT, env=env or ENV, cwd=cwd)
    out.close()
    return proc, proc.wait(timeout=60), (tmp_path / "out.txt").read_text()


def _lines(text):
    return [line for line in text.splitlines() if not line.startswith(("I0000", "W0000", "WARNING: All log"))]


def test_a_forked_child_gets_its_arguments_environment_folder_and_path(forks, tmp_path):
    (tmp_path / "helper_module.py").write_text("VALUE = 41\n")
    code = ("import json, os, sys, helper_module, tensorflow as tf; print(json.dumps([sys.argv, os.getcwd(), "
            "os.environ['FOO'], helper_module.VALUE + 1, os.getpgid(0) == os.getpid(), __name__, "
            "'TF_CONFIG' in os.environ, tf.__version__ != '']))")
    env = dict(ENV, FOO="bar", PYTHONPATH=str(tmp_path))
    env.pop("TF_CONFIG", None)
    proc, rc, out = _run(forks, tmp_path, ["-c", code, "a", "b"], env=env, cwd="/")
    assert isinstance(proc, fork_server.ForkedProcess) and rc == 0, out
    assert json.loads(_lines(out)[-1]) == [["-c", "a", "b"], "/", "bar", 42, True, "__main__", False, True]


def test_a_module_runs_as_main_with_its_arguments(forks, tmp_path):
    (tmp_path / "main_module.py").write_text("import sys\nif __name__ == '__main__':\n"
                                             "    print('main', sys.argv[1:])\n    sys.exit(5)\n")
    proc, rc, out = _run(forks, tmp_path, ["-m", "main_module", "x", "--y"], env=dict(ENV, PYTHONPATH=str(tmp_path)))
    assert isinstance(proc, fork_server.ForkedProcess)
    assert rc == 5 and _lines(out)[-1] == "main ['x', '--y']", out


def test_exit_statuses_reach_wait(forks, tmp_path):
    assert _run(forks, tmp_path, ["-c", "import sys; sys.exit(3)"])[1] == 3
    proc, rc, out = _run(forks, tmp_path, ["-c", "raise ValueError('boom')"])
    assert rc == 1 and "ValueError: boom" in out
    assert _run(forks, tmp_path, ["-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])[1] == -signal.SIGTERM
    assert _run(forks, tmp_path, ["-c", "import sys; sys.exit('bad flag')"])[1:] == (1, "bad flag\n")


def test_wait_times_out_and_killpg_ends_the_child(forks, tmp_path):
    proc = forks.popen([sys.executable, "-c", "import time; time.sleep(120)"], env=ENV, stdout=subprocess.DEVNULL)
    assert isinstance(proc, fork_server.ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_two_children_draw_different_random_numbers(forks, tmp_path):
    code = "import random, numpy; print(random.random(), numpy.random.rand())"
    first = _lines(_run(forks, tmp_path, ["-c", code])[2])[-1]
    second = _lines(_run(forks, tmp_path, ["-c", code])[2])[-1]
    assert first.split()[0] != second.split()[0] and first.split()[1] != second.split()[1]


def test_other_import_time_settings_start_a_new_interpreter(forks, tmp_path):
    loud = dict(ENV, TF_CPP_MIN_LOG_LEVEL="0")
    started = [forks.popen([sys.executable, "-c", "pass"], env=loud, stdout=subprocess.DEVNULL),
               forks.popen(["true"], env=ENV),
               fork_server.Launcher(enabled=False).popen([sys.executable, "-c", "pass"], env=ENV)]
    for proc in started:
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(timeout=60) == 0


def test_closing_the_launcher_ends_its_children():
    launcher = fork_server.Launcher(enabled=True)
    proc = launcher.popen([sys.executable, "-c", "import time; time.sleep(120)"], env=ENV, stdout=subprocess.DEVNULL)
    assert isinstance(proc, fork_server.ForkedProcess)
    launcher.close()
    deadline = time.monotonic() + 30
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(proc.pid)


def _alive(pid):
    """Running (a zombie no reaper collected yet has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_a_forked_child_starts_with_tensorflow_imported(forks, tmp_path):
    """What saves the import: TensorFlow is in the child's modules before its code runs
    (a new interpreter has only what site imports); graph_rewriter is not, so each child
    imports this project's modules itself, as a user's process would."""
    code = "import sys; print('tensorflow' in sys.modules, 'graph_rewriter' in sys.modules)"
    proc, rc, out = _run(forks, tmp_path, ["-c", code])
    assert isinstance(proc, fork_server.ForkedProcess) and _lines(out)[-1] == "True False", out
    fresh = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip() == "False False"


def test_an_exit_status_that_arrives_with_the_pid_is_kept():
    """A child that ends at once: the zygote's "pid" and "exit" lines can reach the
    launcher in one read; the status is not lost (a lost one read as killed, -9)."""
    ours, zygotes = socket.socketpair()
    try:
        proc = fork_server.ForkedProcess(["x"], 12345, ours, b"exit 7\n")
        assert proc.poll() == 7 and proc.wait(timeout=1) == 7
    finally:
        zygotes.close()
    ours, zygotes = socket.socketpair()
    try:
        proc = fork_server.ForkedProcess(["x"], 12345, ours, b"ex")   # the rest comes later
        assert proc.poll() is None
        zygotes.sendall(b"it 3\n")
        assert proc.wait(timeout=5) == 3
    finally:
        zygotes.close()
