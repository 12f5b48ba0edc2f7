"""docs/tutorial.md, run as written: its files are written, its shell blocks run in
order in a scratch folder (servers in the background, on ports from the OS instead of
the tutorial's 2222/2223), and the losses it promises are checked."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from graph_rewriter.local_cluster import accepts, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TUTORIAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tutorial.md")
BLOCK_TIMEOUT = 300
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.S | re.M)


def blocks(text):
    """(language, attributes, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]


def _loss(output, label):
    m = re.search(rf"{label}: loss (\d+\.\d+)", output)
    assert m, f"no '{label}: loss' in:\n{output}"
    return float(m.group(1))


def test_tutorial_runs_as_written_and_trains_like_one_device(tmp_path):
    text = open(TUTORIAL).read()
    ports = {"2222": str(free_port()), "2223": str(free_port())}
    for old, new in ports.items():
        text = text.replace(f"localhost:{old}", f"localhost:{new}")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    servers, outputs = [], []
    try:
        for lang, attrs, body in blocks(text):
            if attrs.startswith("file="):
                (tmp_path / attrs[len("file="):]).write_text(body)
            elif lang == "sh" and attrs == "background":
                for k, line in enumerate(l for l in body.splitlines() if l.strip()):
                    log = open(tmp_path / f"server{k}.log", "wb")
                    servers.append(subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True))
                deadline = time.monotonic() + 120
                for port in ports.values():
                    while not accepts(int(port)):
                        assert all(p.poll() is None for p in servers), "a tutorial server exited"
                        assert time.monotonic() < deadline, f"no server listening on port {port}"
                        time.sleep(0.2)
            elif lang == "sh":
                proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True)
                try:
                    out, err = proc.communicate(timeout=BLOCK_TIMEOUT)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    pytest.fail(f"tutorial block ran over {BLOCK_TIMEOUT} s:\n{body}")
                assert proc.returncode == 0, f"tutorial block failed:\n{body}\n{out}\n{err[-3000:]}"
                outputs.append(out)
    finally:
        for p in servers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in servers:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=15)
    everything = "\n".join(outputs)
    one = _loss(everything, "one device")
    assert (tmp_path / "train.pb").exists() and (tmp_path / "train_4gpu.pb").exists()
    assert "allreduce pack 0" in everything                      # inspect's report
    assert abs(_loss(everything, "two replicas") - one) <= 1e-5 * max(1.0, one)
    workers = [_loss(everything, f"worker {k}") for k in (0, 1)]
    assert abs(sum(workers) / 2 - one) <= 1e-5 * max(1.0, one)
