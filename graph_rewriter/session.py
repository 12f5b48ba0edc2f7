"""Session: a tf.compat.v1.Session that runs a rewritten graph with the original names.

``Session(result, target="", config=None)``. The contract is docs/api.md; docs/semantics.md
gives these rules in full.

- Feeds: the original placeholders; the graph itself splits a batch across replicas.
  A SparseTensor of the batch may be fed under one key (as tf.compat.v1.Session
  allows) and is split by its dense shape's rows, which must divide evenly.
  A batch smaller than the replica count, or one that does not divide evenly, is
  rejected here with a GraphRewriteError naming the input, before TensorFlow runs. A
  placeholder taken per replica with a static batch B takes exactly R*B rows (the R
  replicas' batches concatenated in replica order); another row count is rejected the
  same way, naming the rows expected.
- Fetches (strings "op" or "op:0", tf.Tensor/tf.Operation, or nested lists, tuples and
  dicts of them): an op runs on every replica; a tensor that depends on the batch is
  merged across replicas (a scalar averaged, a tensor with the batch as its first
  dimension concatenated, anything else taken from replica 0; with static per-replica
  batches, a first dimension equal to a static batch counts as the batch); the rewrite's ``merge``
  option overrides per tensor. Everything else comes from replica 0. An output the graph
  merges itself (the metadata's ``merged``, see passes/merge_outputs.py) holds the merged
  value under its original name: it is fetched as one tensor, never merged twice.
- Config: the ConfigProto is completed with what the graph needs (CPU device count for
  CPU replicas, enough inter-op threads for in-process collectives).
"""

import os
import time

import numpy as np
import tensorflow as tf

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.health import Heartbeat
from graph_rewriter.ir import split_tensor_name
from graph_rewriter.metadata import METADATA_NODE, decode_metadata


def _load_result(result):
    from graph_rewriter.api import RewriteResult, load
    if isinstance(result, RewriteResult):
        return result
    if isinstance(result, (str, os.PathLike)):
        return load(result)
    raise GraphRewriteError(
        f"Session needs the result of graph_rewriter.rewrite() or a path to a rewritten graph, "
        f"got {type(result).__name__}",
        hint="pass what rewrite() returned, or the path result.save() or graph-rewrite wrote")


def session_config(required, config=None):
    """``config`` (a ConfigProto or None) completed with the graph's requirements."""
    out = tf.compat.v1.ConfigProto()
    if config is not None:
        out.CopyFrom(config)
    for device, count in required.get("device_count", {}).items():
        out.device_count[device] = max(out.device_count.get(device, 0), count)
    if required.get("operation_timeout_in_ms") and not out.operation_timeout_in_ms:
        out.operation_timeout_in_ms = required["operation_timeout_in_ms"]
    threads = required.get("inter_op_parallelism_threads", 0)
    if threads and 0 < out.inter_op_parallelism_threads < threads:
        out.inter_op_parallelism_threads = threads
    elif threads and out.inter_op_parallelism_threads == 0:
        out.inter_op_parallelism_threads = max(threads, os.cpu_count() or 1)
    return out


class Session(tf.compat.v1.Session):
    """Session(result, target="", config=None): runs a rewritten graph by the original names.

    A tf.compat.v1.Session of the rewritten graph: it imports ``result``'s GraphDef into a
    tf.Graph of its own (``sess.graph``, with ``name=""``) and runs it there.

    Args:
      result: what ``graph_rewriter.rewrite`` returned (a RewriteResult), or the path of
        a file ``RewriteResult.save`` or ``graph-rewrite`` wrote (read with
        ``graph_rewriter.load``).
      target: the TensorFlow server to connect to, as for tf.compat.v1.Session: "" runs in
        this process; between-graph, this worker's server ("grpc://host:port").
      config: a tf.compat.v1.ConfigProto or None, completed with what the graph needs
        (the CPU devices of CPU replicas, inter-op threads for the collectives).

    ``run(fetches, feed_dict=None, options=None, run_metadata=None)`` takes the original
    graph's names: strings "op" or "op:0", tf.Tensor or tf.Operation of ``sess.graph``,
    and nested lists, tuples and dicts of them.

    - Feeds: a batch input's rows are split across this session's replicas in order; a
      batch that does not divide evenly (or a per-replica input fed another row count)
      raises GraphRewriteError naming the input, before TensorFlow runs. A SparseTensor
      key (tf.SparseTensor) takes a SparseTensorValue or an (indices, values,
      dense_shape) tuple, split by its rows. Other feeds (a learning rate) are read by
      every replica.
    - Fetches: an op runs on every replica. A tensor computed from the batch is merged: a
      scalar is averaged over the replicas, a tensor with the batch as its first
      dimension is concatenated in replica order, the rewrite's ``merge`` option decides
      per tensor; anything else comes from replica 0.

    ``num_replicas`` is the number of replicas this session drives (between-graph: this
    worker's); ``result`` is the RewriteResult it runs (``result.saver()`` saves and
    restores its variables under the original names).

    The contract, and the rules in full: docs/api.md and docs/semantics.md.
    """

    def __init__(self, result, target="", config=None):
        """``result``: a RewriteResult or the path of a saved one; ``target``: a server
        (grpc://host:port) or "" for this process; ``config``: a ConfigProto, completed
        with what the graph needs. The session makes its own graph (see the class doc)."""
        self.result = _load_result(result)
        md = self.result.metadata
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(self.result.graph_def, name="")
            _add_queue_runners(self.result.meta_graph)
        self._config = session_config(md["session_config"], config)
        self._heartbeat = None
        super().__init__(target=target, graph=graph, config=self._config)
        if md.get("incarnations"):
            # collectives across tasks: nothing runs until no server holds a restarted
            # peer's earlier incarnation (serve replaces it within seconds). This session
            # reaches its server at its first run, after the wait (its reads go through
            # sessions of their own: one does not outlive its server's replacement)
            settle(lambda: tf.compat.v1.Session(target=target, graph=graph, config=self._config), md,
                   self._config.operation_timeout_in_ms / 1000)
        self._prefixes = md["replica_prefixes"]
        self._variant = set(md["variant"])
        self._merged_in_graph = set(md.get("merged", {}))   # op names holding the merged value
        self._merge = {_tensor_key(k): v for k, v in md.get("merge", {}).items()}
        self._batch_inputs = {_tensor_key(n) for n in md["batch_inputs"]}
        # the batch's SparseTensors: dense shape name -> (indices, values) names
        self._sparse = {_tensor_key(s): (_tensor_key(i), _tensor_key(v))
                        for i, v, s in md["plan"].get("sparse_inputs") or []}
        self._entries = {name for pair in self._sparse.values() for name in pair}
        self._inputs = {_tensor_key(i["name"]): i for i in md.get("inputs") or []}
        self._static_batches = {i["static_batch"] for i in self._inputs.values()
                                if i["mode"] == "per_replica" and i["static_batch"] is not None}
        self._num_replicas = md.get("local_replicas", md["num_replicas"])
        # values with a row per row of the batch that hold every replica's rows under
        # their name (an RNN's zero state, fed with the last step's final state)
        self._row_defaults = {_tensor_key(n) for n in md["plan"].get("row_defaults") or []
                              if n in self._merged_in_graph}
        self._node_names = {n.name for n in self.result.graph_def.node}
        # between-graph ps: the chief draws this run's id before it first beats, and declares
        # the run started if its first run resets nothing (graph_rewriter/ps_state.py)
        self._reset = md.get("ps_reset")
        if self._reset and "draw" in self._reset:
            super().run(self._reset["draw"])
        if md.get("heartbeat"):
            # between-graph: beat, and end a step that waits for a peer whose client is gone
            base = super()
            self._heartbeat = Heartbeat(lambda fetches, options: base.run(fetches, options=options),
                                        md["heartbeat"], lambda message: base.close()).start()

    @property
    def num_replicas(self):
        """Replicas this session drives (this worker's, in between-graph replication)."""
        return self._num_replicas

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        feeds = self._check_feeds(feed_dict)
        flat = []
        plan = self._plan(fetches, flat)
        if self._heartbeat is not None:
            self._wait_for_peers(options)
            self._heartbeat.step_started()
        if self._reset is not None:
            self._start_run(flat, options)
        try:
            values = super().run(flat, feed_dict=feeds, options=options, run_metadata=run_metadata)
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
            raise type(e)(e.node_def, e.op, self._diagnosis(e, options)) from e
        except (tf.errors.AbortedError, tf.errors.InternalError) as e:
            lead = duplicate_request_lead(e.message)
            if lead is None:
                raise
            raise type(e)(e.node_def, e.op, f"{lead}. TensorFlow said: {e.message}") from e
        except (tf.errors.CancelledError, RuntimeError) as e:
            if self._heartbeat is not None and self._heartbeat.gone:
                raise tf.errors.UnavailableError(None, None, self._heartbeat.gone) from e
            raise
        finally:
            if self._heartbeat is not None:
                self._heartbeat.step_ended()
        return _build(plan, values)

    def _limit(self, options):
        return (options.timeout_in_ms / 1000 if options is not None and options.timeout_in_ms
                else self._config.operation_timeout_in_ms / 1000)

    def _wait_for_peers(self, options):
        """Before its first step a between-graph client waits (within the step's timeout)
        until every other worker's client beats (``wait_for_peers``)."""
        wait_for_peers(self._heartbeat, self.result.metadata, self._limit(options))

    def _start_run(self, flat, options):
        """Between-graph ps, before this client's first run: the chief declares the run
        started unless that run resets the shared state (its init op or a restore);
        another worker waits for the chief's reset of this run (``wait_for_chief_reset``)."""
        reset, self._reset = self._reset, None
        if "draw" in reset:
            if not {split_tensor_name(name)[0] for name in flat} & set(reset["resets"]):
                super().run(reset["declare"], options=options)
        else:
            base = super()
            wait_for_chief_reset(lambda t: base.run(t, options=options), self.result.metadata, self._limit(options))

    def __exit__(self, exc_type, exc_value, traceback):
        if exc_type is not None and self._heartbeat is not None:
            # interrupted or failed: the peers must see this client as gone, not as done
            self._heartbeat.stop(leave=False)
        return super().__exit__(exc_type, exc_value, traceback)

    def close(self):
        """Closes the session; between-graph, first tells the peers this client left."""
        if getattr(self, "_heartbeat", None) is not None:
            self._heartbeat.stop(leave=True)
        try:
            super().close()
        except tf.errors.OpError:
            pass   # closing after a failed step: TensorFlow may report that step's error again

    def _diagnosis(self, error, options):
        """TensorFlow's message for a step that timed out or lost a peer, led by what
        that most likely means for a rewritten graph."""
        md = self.result.metadata
        cluster = md.get("cluster") or {}
        tasks = ", ".join(f"{job}:{i}" for job, addrs in sorted(cluster.items()) for i in range(len(addrs)))
        if isinstance(error, tf.errors.DeadlineExceededError):
            limit = (options.timeout_in_ms / 1000 if options is not None and options.timeout_in_ms
                     else self._config.operation_timeout_in_ms / 1000)
            lead = (f"graph_rewriter: the step did not finish within {limit:g} s (timeout_seconds): "
                    "a worker or parameter server it waits for is probably dead, missing or stuck")
        else:
            lead = "graph_rewriter: a task of the cluster cannot be reached: it is probably dead or not started"
        if tasks:
            task = md.get("task")
            lead += f" (cluster tasks: {tasks}; this graph is {'%s:%s' % tuple(task) if task else 'the in-graph client'}'s)"
        return f"{lead}. TensorFlow said: {error.message}"

    # ----- feeds -----------------------------------------------------------------
    def _check_feeds(self, feed_dict):
        if not feed_dict:
            return feed_dict
        out, defaults = {}, []
        for key, value in _expand_sparse_feeds(feed_dict).items():
            name = key if isinstance(key, str) else getattr(key, "name", None)
            if name is None:
                raise GraphRewriteError(f"feed key {key!r} is not a tensor name or a tf.Tensor",
                                        hint="feed by the original graph's names, e.g. \"x:0\"")
            tname = _tensor_key(name)
            static = self._inputs.get(tname, {}).get("static_batch")
            if tname in self._entries:
                pass   # a SparseTensor's entries: its dense shape tells its rows
            elif tname in self._sparse and self._num_replicas > 1:
                self._check_sparse_rows(tname, value)
            elif tname in self._inputs and self._inputs[tname]["mode"] == "per_replica" and static is not None:
                self._check_static_rows(tname, value, static)
            elif tname in self._row_defaults and self._num_replicas > 1:
                defaults.append((tname, value))
            elif tname in self._batch_inputs and self._num_replicas > 1:
                rows = np.shape(value)[0] if np.ndim(value) > 0 else None
                r = self._num_replicas
                if rows is None or rows < r:
                    raise GraphRewriteError(
                        f"input '{tname}' gets a batch of {rows or 0} row(s), which cannot be split "
                        f"across {r} replicas", hint=f"feed at least {r} rows")
                if rows % r and tname in self._inputs and self._inputs[tname]["mode"] == "per_replica":
                    raise GraphRewriteError(
                        f"input '{tname}' gets {rows} rows, which are not {r} equal per-replica "
                        f"batches (batch_split per_replica: the feed holds each replica's batch, "
                        f"concatenated in replica order)", hint=f"feed a multiple of {r} rows")
                if rows % r:
                    raise GraphRewriteError(
                        f"input '{tname}' gets {rows} rows, which do not split evenly across {r} "
                        f"replicas (the mean of replica means would differ from the batch mean)",
                        hint=f"feed a multiple of {r} rows")
            elif self._num_replicas > 1 and self._copies(tname):
                out.update(self._feed_every_copy(tname, value))
                continue
            out[tname] = value
        # (a split batch fed with them says how many rows they take)
        split = [np.shape(v)[0] for k, v in out.items() if k in self._batch_inputs and np.ndim(v) > 0
                 and self._inputs.get(k, {}).get("mode", "split") == "split"]
        for tname, value in defaults:
            self._check_row_default(tname, value, split[0] if split else None)
        for shape, (indices, _) in self._sparse.items():
            if indices in out and shape not in out and self._num_replicas > 1:
                raise GraphRewriteError(
                    f"the SparseTensor fed as '{indices}' comes without its dense shape '{shape}': its "
                    f"first dimension says how many rows each of the {self._num_replicas} replicas takes",
                    hint="feed the SparseTensor itself ({sparse_tensor: tf.compat.v1.SparseTensorValue(...)}) "
                         f"or '{shape}' with the others")
        return out

    def _copies(self, tname):
        """Every local replica's copy of an original tensor the graph computes once per
        replica (none for a node that exists once, a merged output, an unknown name)."""
        op, index = split_tensor_name(tname)
        if op not in self._node_names or op in self._merged_in_graph:
            return []
        names = self._replica_names(op)
        return [f"{n}:{index}" for n in names] if len(names) == self._num_replicas else []

    def _feed_every_copy(self, tname, value):
        """A tensor the graph computes in every replica, fed by its original name: a value
        of every replica's rows is split across the replicas in order, as a batch input
        is (the tensor depends on the batch and its first dimension is unknown, or its
        first dimension is a static per-replica batch and the value holds R of them);
        any other value is fed to every replica's copy, so no replica keeps its own (a
        learning rate computed in the graph, fed to override it)."""
        copies, r = self._copies(tname), self._num_replicas
        shape = self.graph.get_tensor_by_name(tname).shape
        rows = np.shape(value)[0] if np.ndim(value) > 0 else None
        first = shape[0] if shape.rank else None
        if shape.rank and first is None and split_tensor_name(tname)[0] in self._variant:
            if rows is None or rows < r or rows % r:
                raise GraphRewriteError(
                    f"'{tname}' gets {'a scalar' if rows is None else f'{rows} row(s)'}: it holds the batch's "
                    f"rows, each of {r} replicas computing its own, so a value fed for it is split across them",
                    hint=f"feed every replica's rows, a multiple of {r}, concatenated in replica order")
        elif first is None or first not in self._static_batches or rows != r * first:
            return dict.fromkeys(copies, value)
        return dict(zip(copies, np.split(np.asarray(value), r)))

    def _check_sparse_rows(self, tname, value):
        r = self._num_replicas
        shape = np.asarray(value)
        rows = int(shape.reshape(-1)[0]) if shape.ndim == 1 and shape.size else None
        if rows is None or rows < r or rows % r:
            raise GraphRewriteError(
                f"the SparseTensor whose dense shape is '{tname}' gets "
                f"{'no dense shape' if rows is None else f'{rows} row(s)'} (the dense shape's first "
                f"dimension), which do not split evenly across {r} replicas",
                hint=f"feed a multiple of {r} rows")

    def _check_row_default(self, tname, value, batch_rows):
        """A fed value with a row per row of the batch holds every local replica's rows:
        as many as its tensor's static first dimension says, else as many as the batch
        fed with it (``batch_rows``), else a multiple of R."""
        r = self._num_replicas
        rows = np.shape(value)[0] if np.ndim(value) > 0 else None
        shape = self.graph.get_tensor_by_name(tname).shape
        want = shape[0] if shape.rank else None
        want = batch_rows if want is None else want
        if want is not None:
            wrong, takes = rows != want, f"{want} rows"
        else:
            wrong, takes = rows is None or rows < r or rows % r != 0, f"a multiple of {r} rows"
        if wrong:
            got = "a scalar" if rows is None else f"{rows} row(s)"
            raise GraphRewriteError(
                f"'{tname}' gets {got}, but it holds a row per row of the batch for each of {r} "
                f"replicas: it takes {takes}",
                hint="feed every replica's rows, concatenated in replica order: a value this Session fetches "
                     "(an RNN's final state) holds them where its rank is known; one of unknown rank (a v1 "
                     "while loop's output) is replica 0's unless rewrite's merge={name: 'concat'} says so")

    def _check_static_rows(self, tname, value, batch):
        r = self._num_replicas
        rows = np.shape(value)[0] if np.ndim(value) > 0 else None
        if rows != r * batch:
            raise GraphRewriteError(
                f"input '{tname}' gets {'a scalar' if rows is None else f'{rows} row(s)'}, but takes "
                f"{r * batch} rows: its static batch of {batch} for each of {r} replica(s)",
                hint=f"feed {r * batch} rows, the {r} replicas' batches of {batch} concatenated "
                     "in replica order")

    # ----- fetches -----------------------------------------------------------------
    def _plan(self, fetch, flat):
        if isinstance(fetch, (list, tuple)):
            items = [self._plan(f, flat) for f in fetch]
            return ("seq", type(fetch), items)
        if isinstance(fetch, dict):
            return ("dict", type(fetch), {k: self._plan(v, flat) for k, v in fetch.items()})
        name = fetch if isinstance(fetch, str) else getattr(fetch, "name", None)
        if name is None:
            raise GraphRewriteError(f"fetch {fetch!r} is not a name, tf.Tensor or tf.Operation",
                                    hint="fetch by the original graph's names, e.g. \"loss:0\" or \"train_op\"")
        if ":" not in name:  # an op: run every replica's copy
            names = self._replica_names(name)
            start = len(flat)
            flat.extend(names)
            return ("op", start, len(names))
        op, index = split_tensor_name(name)
        if op not in self._variant or op in self._merged_in_graph or len(self._replica_names(op)) == 1:
            flat.append(name)
            return ("one", len(flat) - 1)
        start = len(flat)
        flat.extend(f"{n}:{index}" for n in self._replica_names(op))
        how = self._merge.get(_tensor_key(name))
        if how is None:
            shape = self.graph.get_tensor_by_name(f"{op}:{index}").shape
            batch_first = shape.rank is not None and shape.rank >= 1 and (
                shape[0] is None or tf.compat.dimension_value(shape[0]) in self._static_batches)
            how = "auto-concat" if batch_first else "auto"
        return ("merge", start, self._num_replicas, how)

    def _replica_names(self, op):
        if op not in self._node_names:
            raise GraphRewriteError(f"fetch '{op}' names no node of the rewritten graph",
                                    hint="fetch by a name of the original graph")
        names = [op]
        for prefix in self._prefixes[1:]:
            if prefix + op in self._node_names:
                names.append(prefix + op)
        return names


DUPLICATE_REQUEST = "request was received twice"
PEER_STEP_FAILED = "Delete called on non-empty BufRendezvous"


def duplicate_request_lead(message):
    """What an error TensorFlow's duplicate request ids cause means, or None.

    TensorFlow 2.x's master runs every step on a new thread, and that thread draws the
    step's request ids from a generator seeded with 32 random bits; a server remembers
    the last 100,000 ids and refuses a repeat. So about one run in 43,000 per server is
    refused (`tools/tf_request_ids.py` shows it with plain TensorFlow), and its collective
    peers then fail with a BufRendezvous error (docs/reliability.md, "Duplicate request
    ids")."""
    if DUPLICATE_REQUEST in message:
        what = "TensorFlow refused this step's request to a server as a duplicate"
    elif PEER_STEP_FAILED in message:
        what = ("a collective peer's step ended before this one received from it (most "
                "often TensorFlow refused the peer's request as a duplicate)")
    else:
        return None
    return (f"graph_rewriter: {what}: TensorFlow 2.x draws request ids from a 32-bit seed per "
            "run, so about one run in 43,000 per server is refused (docs/reliability.md, "
            "\"Duplicate request ids\"). The step did not complete; graph-rewrite serve replaces a "
            "server whose collectives it aborted. Start the clients again: training resumes "
            "from the last checkpoint")


def _read_options():
    return tf.compat.v1.RunOptions(timeout_in_ms=5000)


def _whose(md):
    task = md.get("task")
    return f"{task[0]}:{task[1]}'s" if task else "the in-graph client's"


def settle(open_session, md, limit):
    """Before its session runs anything, a client whose collectives span tasks waits
    until no server still holds a restarted peer's earlier incarnation and every compute
    task is reachable (serve replaces such a server within seconds;
    graph_rewriter/incarnations.py), at most ``limit`` seconds (0: no limit of its own) and
    never more than ``SETTLE_SECONDS``: a run started before that fails in TensorFlow's
    collective runtime. Then it records, on its hosts, the peers they are about to form
    groups with. Raises FailedPreconditionError or UnavailableError, having run nothing
    but reads."""
    from graph_rewriter.incarnations import SETTLE_SECONDS, settle_and_record
    limit = min(limit, SETTLE_SECONDS) if limit else SETTLE_SECONDS
    addresses = {f"{job}:{i}": address for job, hosts in (md.get("cluster") or {}).items()
                 for i, address in enumerate(hosts) if f"{job}:{i}" in md["incarnations"]["tasks"]}
    problem = settle_and_record(open_session, md["incarnations"], limit, addresses=addresses)
    if problem is not None:
        error = tf.errors.UnavailableError if "cannot be reached" in problem else tf.errors.FailedPreconditionError
        raise error(None, None, f"{problem} (this graph is {_whose(md)}). Nothing ran")


def wait_for_peers(heartbeat, md, limit, what="the step did not start"):
    """Between-graph, before its first step, a client waits until every other worker's
    client beats, at most ``limit`` seconds: a step run alone starts collectives its peers
    never join, and a cancelled first collective can leave the servers' collective state
    half-made (docs/reliability.md). Raises DeadlineExceededError naming the missing
    peers, having run nothing but the heartbeats. Once every peer was seen, returns at once."""
    if heartbeat.peers_seen:
        return
    missing = heartbeat.wait_for_peers(limit)
    if missing:
        raise tf.errors.DeadlineExceededError(
            None, None, f"graph_rewriter: {what}: no heartbeat within {limit:g} s from "
            f"{', '.join(missing)}, whose client is not running (this graph is {_whose(md)}). Start every "
            "worker's client; nothing ran, so the servers are as they were")
    heartbeat.peers_seen = True


def wait_for_chief_reset(run, md, limit):
    """Between-graph ps, before its first step, a worker other than the chief waits until
    the chief's client has reset the shared state for this run (its init op or restore
    empties the accumulators: a gradient pushed earlier would be drained, and the chief's
    first take would wait for ever), at most ``limit`` seconds. Called once this client
    has seen the chief beat, so the run id it reads is the one this run's chief drew; a
    chief client that drew none (a plain session, or HeartbeatHook without ``master``)
    leaves 0, and there is nothing to wait for. Raises DeadlineExceededError."""
    info = md.get("ps_reset") or {}
    if "run_id" not in info:
        return
    deadline = time.monotonic() + limit if limit else None
    while True:
        # (both read each time: without heartbeats the run id may be drawn meanwhile)
        run_id = int(run(info["run_id"]))
        if not run_id or int(run(info["reset_done"])) == run_id:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise tf.errors.DeadlineExceededError(
                None, None, f"graph_rewriter: the step did not start: the chief's client has not initialized or "
                f"restored the parameter servers' state within {limit:g} s (this graph is {_whose(md)}). The "
                "chief starts a run with its init op or a restore (MonitoredTrainingSession does); check "
                "the chief's client")
        time.sleep(0.1)


def _add_queue_runners(meta_graph):
    """The input's QueueRunners (a MetaGraphDef's ``queue_runners`` collection: the
    threads filling the queues of tf.train.batch and its kin) in the default graph's
    collection, so that ``tf.compat.v1.train.start_queue_runners(sess)`` starts them as
    in the single-device script. The queues are the input's own nodes, kept once."""
    if meta_graph is None or "queue_runners" not in meta_graph.collection_def:
        return
    from tensorflow.core.protobuf import queue_runner_pb2
    for raw in meta_graph.collection_def["queue_runners"].bytes_list.value:
        runner = tf.compat.v1.train.QueueRunner(queue_runner_def=queue_runner_pb2.QueueRunnerDef.FromString(raw))
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.QUEUE_RUNNERS, runner)


def _expand_sparse_feeds(feed_dict):
    """``feed_dict`` with each SparseTensor key (a tf.SparseTensor, or anything with
    ``indices``, ``values`` and ``dense_shape`` tensors) replaced by its three tensors'
    names, as tf.compat.v1.Session feeds one: its value a SparseTensorValue or an
    (indices, values, dense_shape) tuple."""
    if not any(hasattr(k, "dense_shape") for k in feed_dict):
        return feed_dict
    out = {}
    for key, value in feed_dict.items():
        if not hasattr(key, "dense_shape"):
            out[key] = value
            continue
        parts = ((value.indices, value.values, value.dense_shape) if hasattr(value, "dense_shape")
                 else tuple(value) if isinstance(value, (tuple, list)) and len(value) == 3 else None)
        if parts is None:
            raise GraphRewriteError(
                f"the SparseTensor feed '{key.indices.name}' is given a {type(value).__name__}",
                hint="feed a tf.compat.v1.SparseTensorValue or an (indices, values, dense_shape) tuple")
        for tensor, part in zip((key.indices, key.values, key.dense_shape), parts):
            out[tensor.name] = part
    return out


def _build(plan, values):
    kind = plan[0]
    if kind == "seq":
        items = [_build(p, values) for p in plan[2]]
        return plan[1](items) if plan[1] in (list, tuple) else plan[1](*items)
    if kind == "dict":
        return plan[1]({k: _build(p, values) for k, p in plan[2].items()})
    if kind == "op":
        return None
    if kind == "one":
        return values[plan[1]]
    _, start, n, how = plan
    parts = values[start:start + n]
    return merge_values(parts, how)


def merge_values(parts, how):
    """Merges one tensor's per-replica values (see the module doc for the rules)."""
    if how == "master":
        return parts[0]
    if how == "sum":
        return np.sum(np.stack(parts), axis=0)
    if how == "mean":
        return np.mean(np.stack(parts), axis=0)
    if how == "concat":
        return np.concatenate(parts, axis=0)
    first = np.asarray(parts[0])
    if first.ndim == 0:
        return np.mean(np.stack(parts), axis=0) if first.dtype.kind in "fiuc" else parts[0]
    if how == "auto-concat":
        return np.concatenate(parts, axis=0)
    return parts[0]


def _tensor_key(name):
    op, index = split_tensor_name(name)
    return f"{op}:{index}"


class HeartbeatHook(tf.compat.v1.train.SessionRunHook):
    """What ``gr.Session`` does around a rewritten graph's steps, for a
    MonitoredTrainingSession client: between-graph, this client beats, and a step that
    waits for a peer whose client has sent no heartbeat for ``heartbeat_seconds`` is
    ended by closing the session (its run raises CancelledError; the reason, naming the
    peer, is logged as an error).

    Given ``master`` (the target MonitoredTrainingSession gets), the hook also waits
    before the session is created, at most ``wait_seconds`` (default: the graph's
    operation timeout, else 600 s), as ``gr.Session`` waits before its first step: until
    no server still holds a restarted peer's earlier incarnation (serve replaces such a
    server within seconds), between-graph until every peer's client beats, and with
    parameter servers, on a worker other than the chief, until the chief's client has
    reset their state for this run (the chief's hook draws the run's id).
    MonitoredTrainingSession runs the init ops while it creates the session, and their
    collectives fail on an unsettled cluster or, started by a client alone, can leave the
    servers' collective state half-made (docs/reliability.md). A client whose peers never
    come raises DeadlineExceededError naming them, with nothing run. Without ``master``
    the hook cannot run anything before the session exists, and does not wait. Does
    nothing for a graph that needs neither (one task, or no collectives and no
    heartbeats).

        hooks = [gr.HeartbeatHook(master=target), tf.compat.v1.train.StopAtStepHook(last_step=1000)]
        with tf.compat.v1.train.MonitoredTrainingSession(master=target, hooks=hooks) as sess: ...
    """

    def __init__(self, master=None, wait_seconds=None):
        self._master = master
        self._wait_seconds = wait_seconds
        self._info = None
        self._heartbeat = None
        self._session = None
        self._beats = None
        self.gone = None        # the reason, once a peer was taken as gone

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        try:
            op = graph.get_operation_by_name(METADATA_NODE)
        except KeyError:
            return
        md = decode_metadata(op.get_attr("value"))
        self._info = md.get("heartbeat")
        if self._master is None or not (self._info or md.get("incarnations")):
            return
        limit = self._wait_seconds
        if limit is None:
            limit = (md.get("session_config") or {}).get("operation_timeout_in_ms", 600_000) / 1000
        if md.get("incarnations"):
            settle(lambda: tf.compat.v1.Session(target=self._master, graph=graph), md, limit)
        if self._info:
            self._beats = tf.compat.v1.Session(target=self._master, graph=graph)
            reset = md.get("ps_reset") or {}
            if "draw" in reset:   # the chief: this run's id, before its first beat
                self._beats.run(reset["draw"])
            self._start()
            try:
                wait_for_peers(self._heartbeat, md, limit, what="the session was not created")
                wait_for_chief_reset(lambda t: self._beats.run(t, options=_read_options()), md, limit)
            except tf.errors.OpError:
                self.end(None, leave=False)
                raise

    def _start(self):
        # beats go through a session of their own: MonitoredTrainingSession closes and
        # recreates its session while it recovers from an unreachable task, and this
        # client must go on beating meanwhile, or its peers would take it as gone
        beats = self._beats
        self._heartbeat = Heartbeat(lambda fetches, options: beats.run(fetches, options=options),
                                    self._info, self._gone).start()

    def after_create_session(self, session, coord):
        if not self._info:
            return
        # the session whose waiting step a gone peer ends; a recovered one replaces it
        self._session = session
        if self._heartbeat is None:
            self._beats = tf.compat.v1.Session(target=session.sess_str, graph=session.graph)
            self._start()

    def _gone(self, message):
        self.gone = message
        tf.compat.v1.logging.error(message)
        if self._session is not None:
            self._session.close()

    def before_run(self, run_context):
        if self._heartbeat is not None:
            self._heartbeat.step_started()

    def after_run(self, run_context, run_values):
        if self._heartbeat is not None:
            self._heartbeat.step_ended()

    def end(self, session, leave=True):
        """Stops beating; ``leave`` (a clean end) tells the peers this client left on purpose."""
        if self._heartbeat is not None:
            self._heartbeat.stop(leave=leave)
            self._heartbeat = None
        if self._beats is not None:
            self._beats.close()
            self._beats = None
