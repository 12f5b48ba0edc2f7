"""Heartbeats between the clients of a between-graph run (the graph side is the
heartbeat pass): this client beats, and a peer that was seen beating and stops for
``heartbeat_seconds`` while this client waits in a step ends that step.

The step is ended by closing the session from the watching thread: TensorFlow then
cancels the step ("Step was cancelled by an explicit call to Session::Close()"), which
leaves every server usable, unlike a collective's own timeout (docs/reliability.md).
TensorFlow is imported only when a Heartbeat runs, so the rewrite does not need it.
"""

import threading
import time

SCOPE = "graph_rewriter/heartbeat"
LEFT = -1.0          # the value a client that left cleanly leaves behind
BEATS_PER_PERIOD = 5


def task_label(task):
    job, index = task
    return f"{job}_{index}"


def heartbeat_metadata(cluster, seconds):
    """The metadata entry graph_rewriter.health reads: the period, the ops, each peer's read."""
    return {"seconds": seconds, "beat": f"{SCOPE}/beat", "leave": f"{SCOPE}/leave",
            "peers": {f"{job}:{index}": f"{SCOPE}/{task_label((job, index))}/read:0"
                      for job, index in cluster.compute_tasks if (job, index) != cluster.task}}


class Heartbeat:
    """Beats for this client and watches its peers, in a daemon thread.

    ``run(fetches, options)``: runs a fetch in a session of the rewritten graph (TF1
    sessions take runs from several threads); ``info``: the metadata's ``heartbeat``
    entry; ``on_gone(message)``: called once, from the thread, when a peer is taken as
    gone while a step runs (it should close the session)."""

    def __init__(self, run, info, on_gone):
        self.run, self.on_gone = run, on_gone
        self.seconds = float(info["seconds"])
        self.period = self.seconds / BEATS_PER_PERIOD
        self.beat_op, self.leave_op = info["beat"], info["leave"]
        self.peers = dict(info["peers"])
        self.gone = None          # the message, once a peer was taken as gone
        self._busy = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._seen = {}           # peer -> (last value, when it last changed; None: never seen to)
        self.peers_seen = False   # wait_for_peers found every peer beating once

    def start(self):
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="graph_rewriter-heartbeat", daemon=True)
        self._thread.start()
        return self

    def step_started(self):
        with self._lock:
            self._busy += 1

    def step_ended(self):
        with self._lock:
            self._busy = max(0, self._busy - 1)

    def _options(self):
        import tensorflow as tf
        return tf.compat.v1.RunOptions(timeout_in_ms=max(1000, int(self.period * 2000)))

    def _beat(self):
        import tensorflow as tf
        try:
            self.run(self.beat_op, self._options())
        except (tf.errors.OpError, RuntimeError):
            pass   # this client's own server is gone: its step fails on its own

    def _read(self, tensor):
        import tensorflow as tf
        try:
            return float(self.run(tensor, self._options()))
        except (tf.errors.OpError, RuntimeError):
            return None   # not started yet (uninitialized), or its server is unreachable

    def check(self, now=None):
        """Reads every peer once; returns the message for a peer taken as gone, or None."""
        now = time.monotonic() if now is None else now
        for task, tensor in self.peers.items():
            value = self._read(tensor)
            last = self._seen.get(task)
            if value is None:
                continue
            if last is None:
                # what a client of an earlier run may have left: not a sign of life yet
                self._seen[task] = (value, None)
            elif value != last[0]:
                self._seen[task] = (value, now)
        with self._lock:
            busy = self._busy > 0
        if not busy:
            return None
        for task, (value, changed) in sorted(self._seen.items()):
            if changed is None or value == LEFT:
                continue
            age = now - changed
            if age > self.seconds:
                return (f"graph_rewriter: {task} is gone: its client has sent no heartbeat for "
                        f"{age:.1f} s (heartbeat_seconds={self.seconds:g}), so this step, which "
                        f"waits for it, was cancelled and this session closed. Start every "
                        f"worker's client again; training resumes from the last checkpoint")
        return None

    def wait_for_peers(self, timeout):
        """Waits until every peer has been seen beating (its client runs now), at most
        ``timeout`` seconds (0: forever); returns the peers still missing. A client that
        waits here before its first step never starts a collective alone, which is what
        leaves TensorFlow's collective state half-made when a worker is missing."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            self.check()
            missing = [task for task in self.peers if (self._seen.get(task) or (None, None))[1] is None]
            if not missing or (deadline is not None and time.monotonic() >= deadline):
                return missing
            time.sleep(self.period / 2)

    def _loop(self):
        while not self._stop.wait(self.period):
            self._beat()
            message = self.check()
            if message is not None and self.gone is None:
                self.gone = message
                self.on_gone(message)
                return

    def stop(self, leave=True):
        """Stops beating (once); ``leave`` tells the peers this client left on purpose."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period * 4 + 5)
        if leave and self.gone is None:
            import tensorflow as tf
            try:
                self.run(self.leave_op, self._options())
            except (tf.errors.OpError, RuntimeError):
                pass
