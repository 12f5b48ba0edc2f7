"""A cluster of real TensorFlow servers on this machine's loopback, one process each.

Used by the demo, the multi-process tests and the benchmarks. Ports come from the OS;
every wait is bounded; ``stop()`` (and leaving the ``with`` block, and interpreter exit)
ends every process this object started, by its process id.

    with LocalCluster(workers=2, ps=1, device_type="CPU", devices_per_worker=2) as c:
        result = gr.rewrite(gd, c.spec, strategy="ps", device_type="CPU", devices_per_worker=2)
        with gr.Session(result, target=c.target("worker", 0)) as sess: ...
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time

from graph_rewriter.cluster import accepts_connections
from graph_rewriter.errors import GraphRewriteError


def free_port():
    """A TCP port the OS says is free now (a later bind may still race; tests accept it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port):
    """True if something on this machine accepts TCP connections on ``port``."""
    return accepts_connections(f"127.0.0.1:{port}", timeout=0.5)


class LocalCluster:
    """Starts ``graph-rewrite serve`` processes for a chief/worker/ps cluster on loopback."""

    def __init__(self, workers=2, ps=0, chief=False, device_type="CPU", devices_per_worker=1,
                 start_timeout=90.0, log_dir=None, supervise=True):
        self.spec = {}
        if chief:
            self.spec["chief"] = [f"localhost:{free_port()}"]
        if workers:
            self.spec["worker"] = [f"localhost:{free_port()}" for _ in range(workers)]
        if ps:
            self.spec["ps"] = [f"localhost:{free_port()}" for _ in range(ps)]
        self.device_type = device_type
        self.devices_per_worker = devices_per_worker
        self.start_timeout = start_timeout
        self.log_dir = log_dir
        self.supervise = supervise   # False: serve --no-supervise (no server is ever replaced)
        self.processes = {}  # "job:index" -> Popen
        self._logs = []

    def tasks(self):
        return [(job, i) for job, addrs in self.spec.items() for i in range(len(addrs))]

    def target(self, job="worker", index=0):
        return f"grpc://{self.spec[job][index]}"

    def start(self):
        atexit.register(self.stop)
        for job, i in self.tasks():
            self._spawn(job, i)
        deadline = time.monotonic() + self.start_timeout
        for job, i in self.tasks():
            self._wait_listening(job, i, deadline)
        return self

    def _spawn(self, job, i):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "graph_rewriter.cli", "serve", "--cluster", json.dumps(self.spec),
               "--task", f"{job}:{i}", "--device-type", self.device_type,
               "--devices-per-worker", str(self.devices_per_worker)]
        if not self.supervise:
            cmd.append("--no-supervise")
        if self.log_dir:
            log = open(os.path.join(self.log_dir, f"{job}_{i}.log"), "ab")
            self._logs.append(log)
        else:
            log = subprocess.DEVNULL
        self.processes[f"{job}:{i}"] = subprocess.Popen(
            cmd, stdout=log, stderr=log, env=env, start_new_session=True)

    def _wait_listening(self, job, i, deadline):
        port = int(self.spec[job][i].rsplit(":", 1)[1])
        proc = self.processes[f"{job}:{i}"]
        while not accepts(port):
            if proc.poll() is not None:
                self.stop()
                raise GraphRewriteError(f"the server for {job}:{i} exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise GraphRewriteError(
                    f"the server for {job}:{i} did not listen on port {port} within "
                    f"{self.start_timeout:.0f} s")
            time.sleep(0.2)

    def restart(self, job, index):
        """Starts ``job:index``'s server again on its address (after ``kill``), as a
        restarted pod would; returns once it listens."""
        self.kill(job, index)
        self._spawn(job, index)
        self._wait_listening(job, index, time.monotonic() + self.start_timeout)

    def kill(self, job, index):
        """Kills one task's server at once (SIGKILL), as a crash would."""
        proc = self.processes.get(f"{job}:{index}")
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self):
        for proc in self.processes.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for log in self._logs:
            log.close()
        self._logs = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
