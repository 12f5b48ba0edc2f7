"""Server incarnations: a collective peer's restart, found before it breaks a run.

TensorFlow's collective runtime caches, on every server, the attributes of each remote
device it has formed a collective group with, the device's incarnation among them (a
random number a server draws when it starts). A peer that restarts has new incarnations,
and every server that cached the old ones refuses it for good ("... exists in cache with
a different incarnation. This usually means the remote worker has restarted"), whatever
group and instance keys the next collective uses: only a new server process clears the
cache (docs/reliability.md, "Poisoned servers"). So after one worker's server restarts,
the servers that trained with it must restart too, and a job started again before they
did fails.

The three parts of what graph_rewriter does about it:

- every server ``start_server`` (and so ``graph-rewrite serve``) starts holds its own
  number, ``INCARNATION``, an int64 variable on its host drawn before it serves anyone;
- a rewritten graph whose collectives span tasks has an op (``RECORD_OP``, the
  record_incarnations pass) that records on each compute host it runs on the numbers of
  every compute task (``RECORD``): the peers that host is about to form groups with.
  ``gr.Session`` and ``HeartbeatHook(master=...)`` run it before the first collective;
- ``graph-rewrite serve`` watches its server (``Watcher``): a record that no longer
  matches a peer's number means the cache is stale, and serve replaces its TensorFlow
  server at once, before the next run trips on it. A client waits before its first step
  until no host holds a stale record (``settle_and_record``), so a job restarted right
  after a peer came back does not race the replacement.

A fresh server has no record, so replacements do not chase each other: the servers that
had trained with the restarted peer are replaced once, and the cluster is settled.
TensorFlow is imported only where a server or session is at hand.
"""

import secrets
import threading
import time

from graph_rewriter.cluster import accepts_connections
from graph_rewriter.health import task_label

INCARNATION = "graph_rewriter/server_incarnation"   # int64 scalar, on each server's CPU:0
RECORD = "graph_rewriter/collective_peers"          # int64 [compute tasks], on each compute host
SCOPE = "graph_rewriter/incarnations"
RECORD_OP = f"{SCOPE}/record"                       # the op that writes this graph's hosts' records
# what serve's child logs when its record is stale; the supervisor replaces the child on it
STALE_MARKER = "restarted since this server formed collective groups with it"
WATCH_SECONDS = 1.0
SETTLE_SECONDS = 60.0     # at most this long a client waits for serve to replace a stale server


def task_name(task):
    return f"{task[0]}:{task[1]}"


def publish(server, cluster):
    """Draws this server's number and stores it in ``INCARNATION`` on its host. Call it
    before the server starts serving (``tf.distribute.Server(..., start=False)``): a
    session in this process reaches its own server without the network, and no client can
    read the variable before it holds the number. Returns the number (never 0, which
    readers take as "no number": a server not started by graph_rewriter)."""
    import tensorflow as tf
    task = cluster.task
    value = secrets.randbits(62) | 1
    graph = tf.Graph()
    with graph.as_default(), tf.device(cluster.device(task, "CPU", 0)):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=INCARNATION, name="incarnation")
        assign = tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(value, tf.int64))
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{task[0]}/task:{task[1]}"])
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        sess.run(assign)
    return value


def incarnation_metadata(tasks):
    """The metadata entry a client reads: the compute tasks in the record's order, per
    task the ops that read its number and its record, and the op that writes the
    records (the pass's names)."""
    return {"tasks": [task_name(t) for t in tasks], "record": RECORD_OP,
            "live": {task_name(t): f"{SCOPE}/{task_label(t)}/live:0" for t in tasks},
            "recorded": {task_name(t): f"{SCOPE}/{task_label(t)}/recorded:0" for t in tasks}}


def stale_peers(record, live, tasks):
    """The (task, recorded, live) of every peer whose number changed since ``record``
    was written; 0 (no number: a server graph_rewriter did not start) is never stale."""
    if record is None or len(record) != len(tasks):
        return []
    out = []
    for task, then in zip(tasks, record):
        now = live.get(task)
        if then and now and int(then) != int(now):
            out.append((task, int(then), int(now)))
    return out


def _read(run, tensor):
    """A variable's value through ``run``; None when it does not exist or is not
    initialized (FailedPrecondition, NotFound), "unreachable" when its server is not."""
    import tensorflow as tf
    try:
        return run(tensor)
    except (tf.errors.FailedPreconditionError, tf.errors.NotFoundError):
        return None
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
            tf.errors.CancelledError, tf.errors.InternalError):
        return "unreachable"


def cluster_state(run, info):
    """(stale, unreachable): the hosts whose record names a peer's earlier number, as
    {host: [(peer, recorded, live)]}, and the tasks that cannot be reached now."""
    tasks = info["tasks"]
    live, unreachable = {}, []
    for task in tasks:
        value = _read(run, info["live"][task])
        if isinstance(value, str):
            unreachable.append(task)
        elif value is not None:
            live[task] = int(value)
    stale = {}
    for task in tasks:
        if task in unreachable:
            continue
        record = _read(run, info["recorded"][task])
        if isinstance(record, str):
            unreachable.append(task)
        elif record is not None:
            peers = stale_peers(list(record), live, tasks)
            if peers:
                stale[task] = peers
    return stale, unreachable


def stale_message(host, peers):
    peer, then, now = peers[0]
    return (f"{peer}'s server {STALE_MARKER} (its incarnation was {then}, now {now}): TensorFlow "
            f"refuses a restarted peer in collectives on {host}'s server until that server "
            "restarts too")


def closed_addresses(addresses, timeout=1.0):
    """The tasks of ``addresses`` ({task: "host:port"}) where nothing accepts a TCP
    connection. TensorFlow's master waits without end for a task it cannot reach while it
    creates a session ("CreateSession still waiting for response from worker"), whatever
    the timeouts; this is how a client learns of such a task without hanging."""
    return [task for task, address in addresses.items() if not accepts_connections(address, timeout)]


def settle_and_record(open_session, info, timeout, sleep=0.25, addresses=None):
    """Waits until no compute host holds a stale record and every one is reachable, at
    most ``timeout`` seconds, then runs the graph's record op (``info["record"]``: this
    client's hosts record the numbers of the peers they are about to form groups with).
    Returns None once recorded, else a message saying what is still wrong.
    ``open_session()`` opens a session of the client's graph on its target (a
    tf.compat.v1.Session): one is opened again after a read found a task unreachable,
    because the server it talks to may have been replaced meanwhile (a session does not
    survive its master's restart). ``addresses`` ({task: "host:port"}, optional): a
    session is opened only when every one accepts connections (see ``closed_addresses``).
    Every session it opened is closed."""
    import tensorflow as tf
    options = tf.compat.v1.RunOptions(timeout_in_ms=5000)
    deadline = time.monotonic() + timeout
    sess = None
    try:
        while True:
            stale, unreachable = {}, closed_addresses(addresses or {})
            if not unreachable and sess is None:
                sess = open_session()
            if not unreachable:
                stale, unreachable = cluster_state(lambda t: sess.run(t, options=options), info)
            if not stale and not unreachable:
                recorded = _read(lambda t: sess.run(t, options=options), info["record"])
                if not isinstance(recorded, str):
                    return None
                unreachable = ["a task of the cluster"]    # lost between the reads and the record
            if unreachable and sess is not None:
                _close(sess)
                sess = None
            if time.monotonic() >= deadline:
                if stale:
                    host, peers = sorted(stale.items())[0]
                    return (f"graph_rewriter: {stale_message(host, peers)}, and it was not restarted "
                            f"within {timeout:g} s. Restart {host}'s server: graph-rewrite serve does "
                            "this by itself within seconds; a server started in the training process "
                            "(gr.start_server) restarts with that process")
                return (f"graph_rewriter: {', '.join(sorted(unreachable))} cannot be reached (waited "
                        f"{timeout:g} s): start its server, or wait until it is back")
            time.sleep(sleep)
    finally:
        if sess is not None:
            _close(sess)


def _close(sess):
    """Closes a session whose master may be gone ("Session ... is not found. Possibly,
    this master has restarted": nothing is left to close)."""
    import tensorflow as tf
    try:
        sess.close()
    except tf.errors.OpError:
        pass


class Watcher:
    """Watches one compute server's record against its peers' numbers, in a daemon
    thread of the server's process, every ``period`` seconds; ``on_stale(message)`` is
    called once when the record names a peer's earlier number (serve logs it, and its
    supervisor replaces this server)."""

    def __init__(self, server, cluster, on_stale, period=WATCH_SECONDS):
        self.server, self.cluster, self.on_stale, self.period = server, cluster, on_stale, period
        self.tasks = list(cluster.compute_tasks)
        self._stop = threading.Event()
        self._sessions = {}
        self._reads = {}      # task -> its read, each in a graph of its own
        self.stale = None

    def start(self):
        self._build()
        threading.Thread(target=self._loop, name="graph_rewriter-incarnations", daemon=True).start()
        return self

    def stop(self):
        self._stop.set()

    def _build(self):
        """One graph per host (a session places its whole graph, so each holds only what
        its session can see): this host's record, or a peer's number."""
        import tensorflow as tf
        for task in self.tasks:
            mine = task == self.cluster.task
            graph = tf.Graph()
            with graph.as_default(), tf.device(self.cluster.device(task, "CPU", 0)):
                handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[len(self.tasks)] if mine else [],
                                                shared_name=RECORD if mine else INCARNATION)
                self._reads[task] = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64)

    def _run(self, task):
        """One read on ``task``'s host, in a session that sees only this server and that
        host (a peer that is down does not hold up the others)."""
        import tensorflow as tf
        sess = self._sessions.get(task)
        if sess is None:
            me = self.cluster.task
            filters = sorted({f"/job:{me[0]}/task:{me[1]}", f"/job:{task[0]}/task:{task[1]}"})
            config = tf.compat.v1.ConfigProto(device_filters=filters)
            sess = self._sessions[task] = tf.compat.v1.Session(self.server.target, graph=self._reads[task].graph,
                                                               config=config)
        value = _read(lambda t: sess.run(t, options=tf.compat.v1.RunOptions(timeout_in_ms=5000)), self._reads[task])
        if isinstance(value, str):
            _close(self._sessions.pop(task))
        return value

    def check(self):
        """The message for a stale record, or None."""
        record = self._run(self.cluster.task)
        if record is None or isinstance(record, str):
            return None
        live = {}
        for task in self.tasks:
            if task != self.cluster.task:
                value = self._run(task)
                if value is not None and not isinstance(value, str):
                    live[task_name(task)] = int(value)
        peers = stale_peers(list(record), live, [task_name(t) for t in self.tasks])
        return stale_message(task_name(self.cluster.task), peers) if peers else None

    def _loop(self):
        while not self._stop.wait(self.period):
            try:
                message = self.check()
            except Exception:   # the server going down under the watcher: nothing to report
                message = None
            if message is not None:
                self.stale = message
                self.on_stale(message)
                return
