"""``graph-rewrite serve``'s supervisor: runs the TensorFlow server in a child process and
starts a new one, on the same address, when TensorFlow has poisoned the old one.

Why a child process: once a collective fails on a TensorFlow server (a peer's server
died mid-step, a group a cancelled step left half-formed, a member that restarted),
TensorFlow aborts that server's collective executor, and every later collective on it
fails ("Collective ops is aborted by: ...") until the process ends; no RPC or API resets
it. The supervisor reads the child's log for TensorFlow's own report of that state and
replaces the child. The new server starts empty: its variables and queues are gone, and
the training client restores them from its last checkpoint (docs/reliability.md).

A child that exits on its own is started again too, unless it keeps exiting within
``FAST_EXIT_SECONDS`` of its start (a port in use, a bad flag): then serve gives up with
the child's status.
"""

import os
import signal
import subprocess
import sys
import threading
import time

from graph_rewriter.incarnations import STALE_MARKER

# What says that a server's collective state is broken for good: TensorFlow's own log
# lines (at ERROR) when the collective executor aborted or the group leader refused a
# member (a cancelled group, a member whose incarnation changed because its server
# restarted), and serve's own report that a peer this server formed groups with has
# restarted since (incarnations.py).
POISON_MARKERS = ("BaseCollectiveExecutor::StartAbort", "Bad status from CompleteGroupDistributed",
                  STALE_MARKER)

PROG = "graph-rewrite"
FAST_EXIT_SECONDS = 10.0
FAST_EXITS_ALLOWED = 3
GRACE_SECONDS = 0.5       # lets the abort's error reach the clients before the server goes
STOP_SECONDS = 5.0        # a child's time to leave after SIGTERM before SIGKILL


def poison_reason(line):
    """The reason in a log line reporting a poisoned collective state (TensorFlow's, or
    serve's own watcher's), or None."""
    for marker in POISON_MARKERS:
        at = line.find(marker)
        if at >= 0:
            return " ".join(line[at:].split())[:300]
    return None


def _tf_log_level(line):
    """0-3 for a TensorFlow C++ log line (I, W, E, F), None for any other line."""
    if len(line) > 5 and line[0] in "IWEF" and line[1:5].isdigit():
        return "IWEF".index(line[0])
    return None


class Supervisor:
    """Keeps one server child running (``argv`` is its command) until stopped."""

    def __init__(self, argv, task, log, env=None, forward_level=3):
        self.argv, self.task, self.log = argv, task, log
        self.env = dict(os.environ if env is None else env)
        # The child logs TensorFlow's errors so that the supervisor can read them; they
        # reach this process's stderr only at the level the user asked for.
        self.forward_level = forward_level
        self.env["TF_CPP_MIN_LOG_LEVEL"] = str(min(2, forward_level))
        self.restarts = 0
        self._stop = threading.Event()
        self._poisoned = None
        self._lock = threading.Lock()
        self.child = None

    def stop(self, *_):
        self._stop.set()

    def _read(self, child):
        forward = True
        for raw in child.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            reason = poison_reason(line)
            if reason is not None:
                with self._lock:
                    if self.child is child and self._poisoned is None:
                        self._poisoned = reason
            level = _tf_log_level(line)
            if level is not None:
                forward = level >= self.forward_level
            elif line.startswith(f"{PROG}:"):
                forward = True
            # other lines continue the last TensorFlow message (its gRPC details)
            if forward:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def _start(self):
        child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env)
        with self._lock:
            self.child, self._poisoned = child, None
        threading.Thread(target=self._read, args=(child,), daemon=True).start()
        return child

    def _end(self, child, sig=signal.SIGTERM):
        if child.poll() is None:
            child.send_signal(sig)
            try:
                child.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=STOP_SECONDS)

    def run(self):
        """Supervises until stop(); returns serve's exit status."""
        fast_exits = 0
        child, started = self._start(), time.monotonic()
        try:
            while not self._stop.wait(0.2):
                with self._lock:
                    reason = self._poisoned
                if reason is not None:
                    time.sleep(GRACE_SECONDS)
                    self._end(child, signal.SIGKILL)
                    self.restarts += 1
                    child, started = self._start(), time.monotonic()
                    self.log(f"{self.task}: this server's collectives are unusable until its process "
                             f"ends ({reason}): started a new server (process "
                             f"{child.pid}, restart {self.restarts}); its variables and queues start "
                             f"empty, restore them from the last checkpoint")
                    continue
                status = child.poll()
                if status is None:
                    continue
                if status == 2:
                    return 2       # bad input: the child said what, in its one line
                fast_exits = fast_exits + 1 if time.monotonic() - started < FAST_EXIT_SECONDS else 0
                if fast_exits >= FAST_EXITS_ALLOWED:
                    self.log(f"{self.task}: the server exited with status {status}; giving up")
                    return status if status else 1
                self.restarts += 1
                child, started = self._start(), time.monotonic()
                self.log(f"{self.task}: the server exited with status {status}: started a new one "
                         f"(process {child.pid}, restart {self.restarts})")
        finally:
            self._end(child)
        return 0
