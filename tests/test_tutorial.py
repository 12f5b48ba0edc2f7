"""docs/tutorial.md, run as written: its files are written, its shell blocks run in
order in a scratch folder (servers in the background, on ports from free_port() instead of
the tutorial's 2222/2223), and what it promises is checked: the losses, the checkpoints
(the one-device graph restores what the replicas trained; a restarted
MonitoredTrainingSession resumes at its checkpoint's step and ends where one device
does), the merged loss summary. Its `pip install` block is not run: its version must be
the TensorFlow's, and installed."""

import importlib.metadata
import os
import re
import shlex
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
    m = re.search(rf"^{re.escape(label)}: loss (-?\d+\.\d+)", output, re.M)
    assert m, f"no '{label}: loss' in:\n{output}"
    return float(m.group(1))


def _values(output, label):
    """The numbers printed after '<label>' at the start of a line."""
    m = re.search(rf"^{re.escape(label)}((?: -?\d+\.\d+)+)$", output, re.M)
    assert m, f"no '{label}' in:\n{output}"
    return [float(v) for v in m.group(1).split()]


def _check_install_line(body):
    """The tutorial's install line names the installed TensorFlow's tf-keras, which is installed."""
    import tensorflow as tf
    words = shlex.split(body.strip())
    assert words[:2] == ["pip", "install"], body
    spec = next(w for w in words if w.startswith("tf-keras=="))
    series = spec[len("tf-keras=="):].removesuffix(".*")
    tf_series = ".".join(tf.__version__.split(".")[:2])
    assert series == tf_series, f"the tutorial installs tf-keras {series}, TensorFlow is {tf.__version__}"
    assert importlib.metadata.version("tf-keras").startswith(series + "."), "tf-keras is not installed"


# Not part of the tutorial: one device, trained on the same batches, against the checkpoints
# the rewritten graph wrote (after 10 steps with gr.Session, after 20 with the restarted
# MonitoredTrainingSession): every variable, slots and step counter included.
ONE_DEVICE_CHECK = """
import numpy as np
import tensorflow as tf
from data import batches
from model import build

tf.compat.v1.disable_eager_execution()
x, y, loss, train_op, init = build()
variables = tf.compat.v1.global_variables()
with tf.compat.v1.Session() as sess:
    sess.run(init)
    for step, (xb, yb) in enumerate(batches(20), start=1):
        sess.run(train_op, {x: xb, y: yb})
        for path in {10: ["ckpt/model-10", "mts/model.ckpt-10"], 20: ["mts/model.ckpt-20"]}.get(step, []):
            reader = tf.train.load_checkpoint(path)
            assert sorted(reader.get_variable_to_shape_map()) == sorted(v.op.name for v in variables), path
            for v, value in zip(variables, sess.run(variables)):
                np.testing.assert_allclose(reader.get_tensor(v.op.name), value, rtol=1e-4, atol=1e-5,
                                           err_msg=f"{path}: {v.op.name}")
            print("equal to one device:", path)
"""


def test_tutorial_runs_as_written_and_trains_like_one_device(tmp_path):
    text = open(TUTORIAL).read()
    ports = {"2222": str(free_port()), "2223": str(free_port())}
    for old, new in ports.items():
        text = text.replace(f"localhost:{old}", f"localhost:{new}")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.pop("TF_USE_LEGACY_KERAS", None)       # the tutorial sets it where it needs it
    servers, outputs = [], []
    installs, keras3_error = 0, None
    try:
        for lang, attrs, body in blocks(text):
            if attrs.startswith("file="):
                (tmp_path / attrs[len("file="):]).write_text(body)
            elif lang == "sh" and attrs == "install":
                _check_install_line(body)
                installs += 1
            elif lang == "text" and "Keras 3" in body:
                keras3_error = body.strip()
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
        # what step 4 says happens without TF_USE_LEGACY_KERAS
        proc = subprocess.run([sys.executable, "train_layers.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT)
        assert proc.returncode != 0 and keras3_error and keras3_error in proc.stderr, proc.stderr[-3000:]
        (tmp_path / "one_device_check.py").write_text(ONE_DEVICE_CHECK)
        proc = subprocess.run([sys.executable, "one_device_check.py"], cwd=tmp_path, env=dict(env, TF_USE_LEGACY_KERAS="1"),
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert proc.stdout.count("equal to one device:") == 3, proc.stdout
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

    # 4 and 5: tf.compat.v1.layers, one device and the live graph rewritten for two replicas
    assert installs == 1
    layers = _loss(everything, "layers, one device")
    assert abs(_loss(everything, "layers, two replicas") - layers) <= 1e-5 * max(1.0, layers)
    assert (tmp_path / "layers_2cpu.meta").exists()
    # 6: the rewritten graph's checkpoint, with the original names, restores into one device
    assert re.search(r"^latest checkpoint: ckpt/model-10$", everything, re.M)
    names = re.search(r"^variables in it: (.*)$", everything, re.M).group(1).split(", ")
    assert {"global_step", "hidden/kernel", "logits/bias", "logits/bias/Adam"} <= set(names)
    assert not [n for n in names if "replica" in n]
    rewritten = _values(everything, "two replicas, step 10: logits/bias")
    assert _values(everything, "one device, restored step 10: logits/bias") == pytest.approx(rewritten, abs=2e-6)
    # 7: the loss summary is the mean over replicas: the loss gr.Session fetches
    summaries = re.findall(r"^summaries, step \d: loss (\S+), loss summary (\S+)$", everything, re.M)
    assert len(summaries) == 5 and all(abs(float(a) - float(b)) <= 1e-5 for a, b in summaries)
    assert list((tmp_path / "logs" / "2cpu").glob("events.out.tfevents.*"))
    # 8: MonitoredTrainingSession trains, checkpoints, and a restart resumes at the checkpoint's step
    assert re.findall(r"^MonitoredTrainingSession: starting at step (\d+)$", everything, re.M) == ["0", "10"]
    assert re.findall(r"^latest checkpoint: (mts/\S+)$", everything, re.M) == ["mts/model.ckpt-10",
                                                                               "mts/model.ckpt-20"]
    assert re.search(r"^one device, restored step 20: logits/bias", everything, re.M)
    assert list((tmp_path / "mts").glob("events.out.tfevents.*"))
