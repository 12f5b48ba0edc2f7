"""A cluster of real TensorFlow servers on this machine's loopback, one process each.

Used by the demo, the multi-process tests and the benchmarks. Ports come from
``free_port()`` (below); every wait is bounded; a server counts as started only once its
own process listens (not whatever else answers on its port); ``stop()`` (and leaving the
``with`` block, and interpreter exit) ends every process this object started, by its
process id.

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


# Why not bind(0): the port the OS hands out comes from its ephemeral range, which it
# also uses for the source port of every outgoing connection, and between free_port()
# returning and the server binding, another process (a parallel test run's server, or
# any client connecting) can take it. Ports below the ephemeral range are never handed
# out by the OS; each pytest-xdist worker takes its own slice of them, and one process
# never hands out the same port twice in a row of the slice.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000


def _ephemeral_range():
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999        # Linux's default; other systems: IANA's is 49152-65535


def _worker_slice(low, high, env):
    """This process's [start, stop) of the ports [low, high): the whole range, or the
    slice of pytest-xdist worker gwN among PYTEST_XDIST_WORKER_COUNT."""
    name, count = env.get("PYTEST_XDIST_WORKER", ""), env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (name.startswith("gw") and name[2:].isdigit() and count.isdigit() and int(count) > 0):
        return low, high
    index, count = int(name[2:]), int(count)
    size = (high - low) // count
    return low + (index % count) * size, low + (index % count + 1) * size


class PortPicker:
    """Hands out ports outside the OS's ephemeral range, in turn through this process's
    slice (starting at a place set by the process id), each one checked free by a bind."""

    def __init__(self, env=None):
        env = os.environ if env is None else env
        ephemeral_low, ephemeral_high = _ephemeral_range()
        if ephemeral_low - LOWEST_PORT >= 2000:
            low, high = LOWEST_PORT, ephemeral_low
        else:
            low, high = ephemeral_high + 1, 65536
        self.start, self.stop = _worker_slice(low, high, env)
        self._next = self.start + (os.getpid() * 7919) % max(1, self.stop - self.start)

    def pick(self):
        size = self.stop - self.start
        tries = min(size, 2000)
        for _ in range(tries):
            port = self._next
            self._next = self.start + (port + 1 - self.start) % size
            if _bindable(port):
                return port
        raise GraphRewriteError(
            f"no free TCP port among the {tries} tried in {self.start}-{self.stop - 1}; stop "
            "the servers a previous run left behind (graph-rewrite serve)")


def _bindable(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


_PICKER = None


def free_port():
    """A TCP port free now that neither the OS nor a parallel test worker hands out to
    anyone else (see PortPicker); a server should bind it soon."""
    global _PICKER
    if _PICKER is None:
        _PICKER = PortPicker()
    return _PICKER.pick()


def _listening_inodes(port):
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net;
    None where /proc/net is not there (not Linux)."""
    found, read_any = set(), False
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN; the inode is field 9
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found if read_any else None


def _group_inodes(pgid):
    """The socket inodes open in any process of process group ``pgid``."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            # fields after the parenthesised command name: state ppid pgrp ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def listens_in_group(port, pgid):
    """True if a process of group ``pgid`` listens on ``port``; where /proc cannot tell
    (not Linux), True if anything accepts connections on it."""
    listening = _listening_inodes(port)
    if listening is None:
        return accepts(port)
    return bool(listening) and bool(listening & _group_inodes(pgid))


def accepts(port):
    """True if something on this machine accepts TCP connections on ``port``."""
    return accepts_connections(f"127.0.0.1:{port}", timeout=0.5)


class LocalCluster:
    """Starts ``graph-rewrite serve`` processes for a chief/worker/ps cluster on loopback."""

    def __init__(self, workers=2, ps=0, chief=False, device_type="CPU", devices_per_worker=1,
                 start_timeout=90.0, log_dir=None, supervise=True, launcher=None):
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
        # What starts each serve process: subprocess.Popen, or an object whose
        # popen(cmd, **popen_arguments) does (the test suite's fork server: an unsupervised
        # server forked from a process that has imported TensorFlow starts in milliseconds).
        self.launcher = launcher
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
        popen = subprocess.Popen if self.launcher is None else self.launcher.popen
        self.processes[f"{job}:{i}"] = popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)

    def _wait_listening(self, job, i, deadline):
        port = int(self.spec[job][i].rsplit(":", 1)[1])
        proc = self.processes[f"{job}:{i}"]
        # The server is serve's child, in the process group serve leads (start_new_session).
        while not listens_in_group(port, proc.pid):
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
