"""The README's two set-up commands, as written: the first (install, then the demo) is run
in a copy of the project on a fresh virtualenv; the second (install, then the tests) is
the one `.ci/run` runs, so CI itself runs it as written."""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    m = re.search(r"^```sh\n(.*?)^```$", text, re.S | re.M)
    assert m, "README.md has no ```sh block"
    return [line for line in m.group(1).splitlines() if line.strip()]


def test_readme_has_two_commands_and_ci_runs_the_second():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    install_demo, install_tests = commands
    assert "pip install" in install_demo and install_demo.endswith("graph-rewrite demo")
    assert "pip install" in install_tests and "pytest" in install_tests
    ci = subprocess.run(["bash", "-c", "sed -n '/^```sh$/,/^```$/p' README.md | grep -m1 'pytest'"],
                        cwd=REPO, capture_output=True, text=True, timeout=30)
    assert ci.stdout.strip() == install_tests          # .ci/run's own extraction
    assert "$cmd" in open(os.path.join(REPO, ".ci", "run")).read()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_first_readme_command_installs_and_runs_the_demo_on_a_fresh_copy(tmp_path):
    copy = tmp_path / "graph_rewriter"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", ".hypothesis", "build"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "TF_CONFIG"))}
    python_dir = os.path.dirname(os.path.realpath(shutil.which("python3") or sys.executable))
    env["PATH"] = os.pathsep.join([python_dir] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                  if not p.startswith(os.path.dirname(sys.executable))])
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _setup_commands()[0]], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the same training, on 4 replicas in 2 processes" in proc.stdout
