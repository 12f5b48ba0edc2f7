"""Soak run: a long between-graph training run on loopback, watched for leaks and slowdowns.

    python tools/soak.py [--strategy both|ps|allreduce] [--steps 2000] [--sample-every 100]
                         [--warmup 200] [--window 200] [--json OUT] [--load-tolerant]

Issue 17 asks for a cluster that survives a long run: servers and clients whose memory
does not grow step after step, steps that do not get slower, and nothing left behind on
the servers when the run ends. Per strategy (ps, then allreduce, each on a fresh
cluster) this tool:

1. starts a LocalCluster (1 ps + 2 workers, CPU, 1 device per worker; every server is a
   supervised ``graph-rewrite serve``: a parent and its TensorFlow server child);
2. rewrites the "mlp" test model (sgd, global batch 8) once per worker task and gives
   worker k rows 4k..4k+3 of every global batch;
3. runs ``--steps`` steps with ONE client process per worker (``soak.py client``, below)
   that lives the whole run; every ``--sample-every`` steps each client prints its own
   RSS and, when the chief's client does, this tool reads the RSS of every server's
   parent and child and the CPU counters from /proc; the clients write every step's
   time at the end;
4. after the run, in fresh sessions on the same servers, checks that nothing was left
   behind: ps: every queue of the chief's graph (the workers' sync token queues, the init
   queue) is empty, every gradient accumulator holds no gradient, the step counter
   ``graph_rewriter/sync_step`` equals the steps run; both strategies: the two workers'
   copies of the variables agree, and one more step, run by the two fresh sessions at
   once, gives the variables one device gives from the same values and batch (for
   allreduce this is the check that no collective or step-id state was left); and that
   no server's TensorFlow child was replaced (the supervisor replaces a poisoned one).

Criteria (printed with the figures; exit status 0 if all pass, 1 otherwise):

- step time: per client, the median step time of the last ``--window`` steps over the
  median of the first window after ``--warmup`` steps, divided by the machine speed
  probe's ratio over the same two windows (``SpeedProbe``: a fixed loop timed on every
  core beside the run), at most ``--max-step-ratio`` (1.10). The median, not the mean: a
  step here takes 3-6 ms, so one scheduling hiccup of 100 ms moves a window's mean by a
  sixth, while anything that grows with the steps (a longer queue, more state to look up)
  moves every step and so the median. The probe, because on a virtual machine the whole
  machine slows by up to 50% for seconds at a time, which a step-time ratio alone would
  blame on the run. The raw ratio and the means are reported too.
- memory: per process (each server's parent and child, each client), the RSS at the
  end minus the RSS after warm-up (the sample at step ``--warmup``), at most
  ``--max-growth-mib`` MiB (16). TensorFlow's allocators and gRPC's buffers grow during
  the first steps and then stay; what is left is noise of a few MiB. A leak of one
  object per step would not stay under the bound: 2000 steps x 8 KiB = 16 MiB.
  The slope of the RSS after warm-up (KiB per 1000 steps, least squares) is reported.

Also reported, for each window: the CPU time every process of the soak used per step
(servers, clients, this tool; /proc/<pid>/stat) and the CPU the machine's OTHER
processes used (/proc/stat minus the soak's), in cores. The soak itself keeps 1.2-1.6
of 2 cores busy, so on a shared machine another job's load shows up directly in the
wall step time; the CPU per step moves much less with it. A run whose other processes
used more than 0.25 cores in either window is marked disturbed; with ``--load-tolerant``
(for shared machines: the slow test) a client whose wall-time ratio fails in a disturbed run is
judged by the CPU-per-step ratio instead, and the report says so.

Every wait is bounded (servers starting, every session call by ``--call-timeout``, the
clients by ``--run-timeout``); every process this tool starts is ended by its id
(LocalCluster.stop for the servers, the clients in a ``finally``).

``--inject-fault`` checks the checks: after the run it leaves something behind on
purpose (ps: one extra token in worker 1's sync token queue; allreduce: worker 1's copy
of one variable nudged), and the run must then FAIL. The figures in
docs/reliability.md ("Soak") come from this script.

The client, which the tool starts itself (documented by ``soak.py client --help``):

    python tools/soak.py client --graph W.pb --target grpc://... --feeds F.npz --steps N
                                --sample-every K --out OUT.npz [--call-timeout S]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODEL, OPTIMIZER, SEED = "mlp", "sgd", 17
BATCH = 8                         # the global batch; each of the 2 workers feeds 4 rows
WORKERS, PS = 2, 1
RTOL, ATOL = 1e-4, 1e-6           # one more step against one device (as tests/test_cluster.py)
AGREE_RTOL, AGREE_ATOL = 1e-6, 1e-7
CLIENT_START_SECONDS = 120.0      # a client's import, session and init op
STOP_SECONDS = 15.0
QUIET_LOAD = 0.25                 # cores the machine's other processes may use in a quiet window
MIB = 1024.0


# ----- /proc ---------------------------------------------------------------------------

def rss_kib(pid):
    """The resident set size (VmRSS, KiB) of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def children(pid):
    """The process ids of ``pid``'s children (from every one of its threads)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return sorted(set(out))


def cpu_ticks(pid):
    """User + system CPU time (clock ticks) of a process so far; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])   # utime, stime (fields 14 and 15 of stat)


def host_busy_ticks():
    """CPU time (clock ticks) every core of this machine spent busy so far."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4]   # all but idle and iowait


class SpeedProbe:
    """The machine's own speed beside the run: one thread per core, pinned to it, times a
    fixed pure-Python loop by that thread's CPU time every ``every`` seconds.

    Why: on a virtual machine the host takes a core away for seconds at a time without the
    guest counting it as steal; the same work then takes up to 50% longer in CPU time as
    well as in wall time (measured: two such loops on an idle 2-core VM, each core slowed
    by 30-50% for 2-8 s at different moments). A soak window lasts a second or two, so a
    step-time ratio alone cannot tell such a phase from a slowdown of the run itself; the
    probe's ratio over the same windows can, and the step time is judged divided by it.
    Cost: about 0.15 ms of CPU per core every 100 ms (0.15% of each core)."""

    LOOP = 2_000

    def __init__(self, enabled=True, every=0.1):
        self.every = every
        self.samples = []   # (monotonic time, core, ms of CPU for the loop)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(core,), daemon=True,
                                          name=f"speed-probe-{core}")
                         for core in (sorted(os.sched_getaffinity(0)) if enabled else ())]

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)

    def _run(self, core):
        try:
            os.sched_setaffinity(0, {core})   # 0: this thread
        except OSError:   # not allowed here: the thread samples whichever core it runs on
            pass
        while not self._stop.wait(self.every):
            started = time.thread_time_ns()
            total = 0
            for i in range(self.LOOP):
                total += i * i
            self.samples.append((time.monotonic(), core, (time.thread_time_ns() - started) / 1e6))

    def ms(self, start, end):
        """The loop's CPU ms between two moments: the median per core, averaged over the
        cores (None when a core has no sample in between)."""
        per_core = {}
        for when, core, ms in list(self.samples):
            if start <= when < end:
                per_core.setdefault(core, []).append(ms)
        if not self._threads or len(per_core) < len(self._threads):
            return None
        return statistics.fmean(statistics.median(v) for v in per_core.values())


# ----- the client ----------------------------------------------------------------------

def client_main(argv):
    """One worker's client: init, then ``--steps`` steps; prints "sample STEP RSS_KIB" every
    ``--sample-every`` steps and writes step times and losses to ``--out``."""
    p = argparse.ArgumentParser(
        prog="soak.py client",
        description="One worker's client of a soak run (started by soak.py itself): runs the "
                    "init op, then --steps steps of [loss:0, train_op] with its rows of each "
                    "batch; prints 'initialized', then 'sample STEP RSS_KIB' every --sample-every "
                    "steps (its own resident memory), then writes the step times and losses.")
    p.add_argument("--graph", required=True, help="this worker's rewritten graph (result.save)")
    p.add_argument("--target", required=True, help="grpc://host:port of this worker's server")
    p.add_argument("--feeds", required=True,
                   help=".npz: one array per feed name (e.g. 'x:0'), shaped [steps, rows, ...]")
    p.add_argument("--steps", type=int, required=True, help="steps to run")
    p.add_argument("--sample-every", type=int, required=True, help="steps between two 'sample' lines")
    p.add_argument("--out", required=True, help=".npz to write step_seconds and losses to")
    p.add_argument("--call-timeout", type=float, default=60.0, help="bound on every session call (s)")
    args = p.parse_args(argv)

    import numpy as np
    import tensorflow as tf

    import graph_rewriter as gr
    with np.load(args.feeds) as data:
        feeds = {name: data[name] for name in data.files}
    for name, value in feeds.items():
        if len(value) < args.steps:
            p.error(f"--feeds: '{name}' holds {len(value)} steps, fewer than --steps {args.steps}")
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(args.call_timeout * 1000))
    # preallocated: the client's own bookkeeping must not grow with the steps
    seconds = np.zeros(args.steps)
    losses = np.zeros(args.steps)
    with gr.Session(args.graph, target=args.target) as sess:
        sess.run("init", options=options)
        print("initialized", flush=True)
        print(f"sample 0 {rss_kib(os.getpid())}", flush=True)
        fetches = ["loss:0", "train_op"]
        for step in range(args.steps):
            feed = {name: value[step] for name, value in feeds.items()}
            started = time.perf_counter()
            loss, _ = sess.run(fetches, feed_dict=feed, options=options)
            seconds[step] = time.perf_counter() - started
            losses[step] = loss
            if (step + 1) % args.sample_every == 0 or step + 1 == args.steps:
                print(f"sample {step + 1} {rss_kib(os.getpid())}", flush=True)
    np.savez(args.out, step_seconds=seconds, losses=losses)
    print("done", flush=True)
    return 0


class Client:
    """A client process and what it printed: its RSS samples {step: KiB}. A thread reads
    its output; ``on_sample(step)`` is called (from that thread) after each sample."""

    def __init__(self, name, cmd, log_path, on_sample=None):
        self.name, self.log_path, self.on_sample = name, log_path, on_sample
        self.rss = {}
        self.initialized = threading.Event()
        self.done = False
        self._log = open(log_path, "wb")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
        env.pop("TF_CONFIG", None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            words = raw.decode(errors="replace").split()
            if words[:1] == ["sample"] and len(words) == 3:
                step = int(words[1])
                self.rss[step] = int(words[2])
                if self.on_sample is not None:
                    self.on_sample(step)
            elif words == ["initialized"]:
                self.initialized.set()
            elif words == ["done"]:
                self.done = True

    def wait(self, deadline):
        """The exit status; raises TimeoutError naming the client if it runs past ``deadline``."""
        try:
            status = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"client {self.name} still running at its deadline") from None
        self._reader.join(timeout=STOP_SECONDS)
        return status

    def tail(self, lines=15):
        self._log.flush()
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        keep = [line for line in text.splitlines() if not line.startswith(("I0000", "W0000", "WARNING"))]
        return "\n".join(keep[-lines:])

    def end(self):
        """Kills the client (its own session: its group id is its id) if it still runs."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()


# ----- one strategy --------------------------------------------------------------------

class Sampler:
    """Samples, on request (at the chief client's sample lines): the RSS of every server's
    serve parent and TensorFlow child, the CPU time used so far by every process of the
    soak (servers, clients, this tool) and by the whole machine, and the clock."""

    def __init__(self, cluster):
        self.servers = {}   # task -> (parent pid, child pid)
        for task, proc in sorted(cluster.processes.items()):
            kids = children(proc.pid)
            if len(kids) != 1:
                raise RuntimeError(f"server {task}: serve process {proc.pid} has children {kids}, "
                                   f"not one TensorFlow server")
            self.servers[task] = (proc.pid, kids[0])
        self.clients = []   # pids
        self.samples = {}   # step -> {"rss": {label: KiB or None}, "cpu_ours", "cpu_busy", "time"}
        self._lock = threading.Lock()

    def pids(self):
        return [os.getpid()] + [p for pair in self.servers.values() for p in pair] + self.clients

    def sample(self, step):
        rss = {}
        for task, (parent, child) in self.servers.items():
            rss[f"{task} parent"] = rss_kib(parent)
            rss[f"{task} server"] = rss_kib(child)
        out = {"rss": rss, "time": time.monotonic(), "cpu_busy": host_busy_ticks(),
               "cpu_ours": sum(cpu_ticks(p) for p in self.pids())}
        with self._lock:
            self.samples[step] = out

    def cpu(self, a, b):
        """Between the samples at steps a and b: the soak's CPU ms per step and the CPU the
        machine's other processes used, in cores (a busy core: 1.0)."""
        s, e = self.samples[a], self.samples[b]
        hz = os.sysconf("SC_CLK_TCK")
        ours = (e["cpu_ours"] - s["cpu_ours"]) / hz
        others = (e["cpu_busy"] - s["cpu_busy"]) / hz - ours
        return {"cpu_ms_per_step": 1000 * ours / (b - a),
                "other_load_cores": max(0.0, others) / (e["time"] - s["time"])}

    def probe_ms(self, probe, a, b):
        """The speed probe's loop time (CPU ms) between the samples at steps a and b."""
        return probe.ms(self.samples[a]["time"], self.samples[b]["time"])

    def trace(self, probe):
        """Between consecutive samples: [{"steps": [a, b], soak CPU per step, other load,
        the speed probe's loop time}]."""
        steps = sorted(self.samples)
        return [dict(self.cpu(a, b), steps=[a, b], probe_ms=self.probe_ms(probe, a, b))
                for a, b in zip(steps, steps[1:])]

    def replaced(self, cluster):
        """Tasks whose TensorFlow child is no longer the one the run started with."""
        return [task for task, (parent, child) in self.servers.items()
                if children(cluster.processes[task].pid) != [child]]


def _prepare(cluster, ex, strategy, batches, work_dir):
    """Per worker: (task, rewritten result, graph path, feeds path, target)."""
    import numpy as np

    import graph_rewriter as gr
    workers = []
    for k in range(WORKERS):
        task = f"worker:{k}"
        result = gr.rewrite(ex.graph_def, cluster.spec, strategy=strategy, device_type="CPU",
                            devices_per_worker=1, task=task)
        graph_path = os.path.join(work_dir, f"{strategy}_worker{k}.pb")
        result.save(graph_path)
        rows = BATCH // WORKERS
        feeds = {name: np.stack([b[name][k * rows:(k + 1) * rows] for b in batches])
                 for name in batches[0]}
        feeds_path = os.path.join(work_dir, f"{strategy}_worker{k}_feeds.npz")
        np.savez(feeds_path, **feeds)
        workers.append({"task": task, "result": result, "graph": graph_path, "feeds": feeds_path,
                        "target": cluster.target("worker", k)})
    return workers


def _windows(steps, warmup, window):
    """The first window of steps after warm-up and the last window: [(a, b), (a, b)]."""
    return [(warmup, warmup + window), (steps - window, steps)]


def _step_times(seconds, spans):
    """One client's step times in each span [a, b): {"steps", "median_ms", "mean_ms"}."""
    out = []
    for a, b in spans:
        part = [float(s) for s in seconds[a:b]]
        out.append({"steps": [a, b], "median_ms": 1000 * statistics.median(part),
                    "mean_ms": 1000 * statistics.fmean(part)})
    return out


def _slope_kib_per_1000(points):
    """Least-squares slope of [(step, KiB)] in KiB per 1000 steps (0 for fewer than 2 points)."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def _memory(series, warmup, steps, bound_mib):
    """Per process label: RSS after warm-up and at the end, growth, slope, pass."""
    out = {}
    for label, points in sorted(series.items()):
        points = sorted(p for p in points if p[0] >= warmup)
        if not points or points[0][0] != warmup or points[-1][0] != steps:
            out[label] = {"error": f"no RSS sample at step {warmup} and at step {steps}", "ok": False}
            continue
        start, end = points[0][1], points[-1][1]
        growth = (end - start) / MIB
        out[label] = {"after_warmup_mib": start / MIB, "end_mib": end / MIB,
                      "max_mib": max(p[1] for p in points) / MIB, "growth_mib": growth,
                      "growth_pct": 100.0 * (end - start) / start,
                      "slope_kib_per_1000_steps": _slope_kib_per_1000(points),
                      "ok": growth <= bound_mib}
    return out


def _left_behind(strategy, workers, ex, batch, steps, inject, call_timeout):
    """After the run, from fresh sessions on the same servers: what is left in the chief's
    queues and accumulators and the step counter (ps), whether the workers' variables
    agree, and one more step of both workers against one device. {check: {...,"ok"}}."""
    import numpy as np
    import tensorflow as tf

    import graph_rewriter as gr
    from graph_rewriter.ps_state import COUNTER, TOKENS
    from graph_rewriter.testing import harness

    options = tf.compat.v1.RunOptions(timeout_in_ms=int(call_timeout * 1000))
    plain_run = tf.compat.v1.Session.run    # by the rewritten graph's own node names
    checks = {}
    sessions = [gr.Session(w["graph"], target=w["target"]) for w in workers]
    try:
        chief = sessions[0]
        if strategy == "ps":
            if inject:
                with chief.graph.as_default():
                    queue = chief.graph.get_operation_by_name(f"{TOKENS}/worker_1").outputs[0]
                    extra = tf.raw_ops.QueueEnqueueV2(handle=queue, components=[tf.constant(0, tf.int64)],
                                                      name="soak/injected_token")
                plain_run(chief, extra, options=options)
            sizes = {}
            with chief.graph.as_default():
                for op in chief.graph.get_operations():
                    with tf.device(op.device):
                        if op.type == "FIFOQueueV2":
                            sizes[f"queue {op.name}"] = tf.raw_ops.QueueSizeV2(
                                handle=op.outputs[0], name=f"soak/size/{op.name}")
                        elif op.type in ("ConditionalAccumulator", "SparseConditionalAccumulator"):
                            sizes[f"accumulator {op.name}"] = tf.raw_ops.AccumulatorNumAccumulated(
                                handle=op.outputs[0], name=f"soak/num_accumulated/{op.name}")
            if not sizes:
                raise RuntimeError("the chief's ps graph has no queue and no accumulator to check")
            for name, value in plain_run(chief, sizes, options=options).items():
                checks[name] = {"holds": int(value), "expected": 0, "ok": int(value) == 0}
            counter = int(plain_run(chief, f"{COUNTER}/read:0", options=options))
            checks["step counter graph_rewriter/sync_step"] = {
                "holds": counter, "expected": steps, "ok": counter == steps}
        elif inject:
            graph = sessions[1].graph
            var = next(graph.get_operation_by_name(name) for name in sorted(ex.variables)
                       if graph.get_operation_by_name(name).get_attr("dtype") == tf.float32)
            with graph.as_default():
                value = tf.raw_ops.ReadVariableOp(resource=var.outputs[0], dtype=tf.float32)
                nudge = tf.raw_ops.AssignAddVariableOp(resource=var.outputs[0], value=0.01 * tf.ones_like(value),
                                                       name="soak/nudge")
            plain_run(sessions[1], nudge, options=options)

        before = [{k: np.asarray(v) for k, v in s.run(dict(ex.variables), options=options).items()}
                  for s in sessions]
        differ = [k for k in sorted(before[0]) if not np.allclose(
            before[0][k], before[1][k], rtol=AGREE_RTOL, atol=AGREE_ATOL)]
        checks["workers' variables agree"] = {"differ": differ, "ok": not differ}

        # one more step, both fresh sessions at once (each its own rows)
        rows = BATCH // WORKERS
        losses, errors = [None] * WORKERS, []

        def step(k):
            try:
                feed = {n: v[k * rows:(k + 1) * rows] for n, v in batch.items()}
                losses[k] = float(sessions[k].run([ex.loss, ex.train_op], feed_dict=feed, options=options)[0])
            except Exception as e:   # reported as the check's failure
                errors.append(f"worker {k}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        threads = [threading.Thread(target=step, args=(k,)) for k in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=call_timeout + 10)
        if any(t.is_alive() for t in threads):
            errors.append(f"the extra step still runs after {call_timeout + 10:.0f} s")
        if errors:
            checks["one more step equals one device"] = {"errors": errors, "ok": False}
            return checks
        after = [{k: np.asarray(v) for k, v in s.run(dict(ex.variables), options=options).items()}
                 for s in sessions]
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(ex.graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as one:
            one.run(ex.init)
            one.run(harness.assign_ops(graph, before[0]))
            ref_loss, _ = one.run([ex.loss, ex.train_op], feed_dict=batch)
            ref = one.run(dict(ex.variables))
        differ = [f"worker {k}: {name}" for k in range(WORKERS) for name in sorted(ref)
                  if not np.allclose(after[k][name], ref[name], rtol=RTOL, atol=ATOL)]
        loss = float(np.mean(losses))
        if not np.isclose(loss, float(ref_loss), rtol=RTOL, atol=ATOL):
            differ.append(f"loss {loss:.6g}, one device {float(ref_loss):.6g}")
        checks["one more step equals one device"] = {"differ": differ, "ok": not differ}
    finally:
        for s in sessions:
            s.close()
    return checks


def soak(strategy, args, work_dir, say):
    """One strategy's run on a fresh cluster; returns its figures (JSON-able)."""
    import numpy as np

    from graph_rewriter.local_cluster import LocalCluster
    from graph_rewriter.testing import models

    ex = models.build(MODEL, OPTIMIZER, seed=SEED)
    batches = [ex.batch(step, size=BATCH) for step in range(args.steps + 1)]   # +1: the extra step
    log_dir = os.path.join(work_dir, f"{strategy}_logs")
    os.makedirs(log_dir, exist_ok=True)
    figures = {"strategy": strategy, "steps": args.steps, "ok": False}
    started = time.monotonic()
    with LocalCluster(workers=WORKERS, ps=PS, device_type="CPU", devices_per_worker=1,
                      start_timeout=args.start_timeout, log_dir=log_dir) as cluster:
        sampler = Sampler(cluster)
        workers = _prepare(cluster, ex, strategy, batches[:args.steps], work_dir)
        clients = []
        probe = SpeedProbe(enabled=args.speed_probe).start()
        try:
            for k, w in enumerate(workers):
                cmd = [sys.executable, os.path.abspath(__file__), "client", "--graph", w["graph"],
                       "--target", w["target"], "--feeds", w["feeds"], "--steps", str(args.steps),
                       "--sample-every", str(args.sample_every), "--call-timeout", str(args.call_timeout),
                       "--out", os.path.join(work_dir, f"{strategy}_worker{k}_out.npz")]
                # the chief's samples are the moments the servers are sampled at
                clients.append(Client(f"worker{k}", cmd, os.path.join(log_dir, f"client{k}.log"),
                                      on_sample=sampler.sample if k == 0 else None))
                sampler.clients.append(clients[-1].proc.pid)
            say(f"{strategy}: cluster {json.dumps(cluster.spec)}; clients "
                f"{', '.join(str(c.proc.pid) for c in clients)} running {args.steps} steps")
            deadline = time.monotonic() + args.run_timeout
            statuses = []
            for c in clients:
                try:
                    statuses.append(c.wait(deadline))
                except TimeoutError as e:
                    raise RuntimeError(f"{e} ({args.run_timeout:.0f} s, --run-timeout)\n{c.tail()}") from None
            for c, status in zip(clients, statuses):
                if status != 0 or not c.done:
                    raise RuntimeError(f"client {c.name} exited with status {status}\n{c.tail()}")
        finally:
            probe.stop()
            for c in clients:
                c.end()
        run_seconds = time.monotonic() - started
        checks = _left_behind(strategy, workers, ex, batches[args.steps], args.steps,
                              args.inject_fault, args.call_timeout)
        replaced = sampler.replaced(cluster)
        checks["no server replaced"] = {"replaced": replaced, "ok": not replaced}

    series = {}
    for step, sample in sampler.samples.items():
        for label, kib in sample["rss"].items():
            if kib is not None:
                series.setdefault(label, []).append((step, kib))
    for c in clients:
        series[f"client {c.name}"] = sorted(c.rss.items())
    spans = _windows(args.steps, args.warmup, args.window)
    # not a criterion of its own: what explains a step-time change (more work per step, or
    # other load), and with --load-tolerant the judge of a disturbed run
    cpu = [dict(sampler.cpu(a, b), steps=[a, b], probe_ms=sampler.probe_ms(probe, a, b)) for a, b in spans]
    cpu_ratio = cpu[1]["cpu_ms_per_step"] / cpu[0]["cpu_ms_per_step"]
    # the machine's own slowdown from the first window to the last (1.0 if unmeasured)
    speed_ratio = (cpu[1]["probe_ms"] / cpu[0]["probe_ms"]
                   if cpu[0]["probe_ms"] and cpu[1]["probe_ms"] else 1.0)
    busy = max(c["other_load_cores"] for c in cpu)
    disturbed = busy > QUIET_LOAD
    step_time = {}
    trace = sampler.trace(probe)
    for k in range(WORKERS):
        with np.load(os.path.join(work_dir, f"{strategy}_worker{k}_out.npz")) as out:
            seconds = out["step_seconds"]
            losses = out["losses"]
        first, last = _step_times(seconds, spans)
        for entry, times in zip(trace, _step_times(seconds, [tuple(e["steps"]) for e in trace])):
            entry[f"worker{k}_median_ms"] = times["median_ms"]
        ratio = last["median_ms"] / first["median_ms"]
        judged_by_cpu = args.load_tolerant and disturbed and ratio / speed_ratio > args.max_step_ratio
        # (judged by CPU per step, a machine that seems faster in the last window is no
        # slowdown of the soak's: the other load that disturbed the run slowed the probe's
        # first window too, and dividing by it blamed the soak for it)
        judged = cpu_ratio / max(speed_ratio, 1.0) if judged_by_cpu else ratio / speed_ratio
        step_time[f"client worker{k}"] = {
            "first": first, "last": last, "ratio": ratio, "mean_ratio": last["mean_ms"] / first["mean_ms"],
            "speed_ratio": speed_ratio, "judged_ratio": judged,
            "overall_median_ms": 1000 * float(np.median(seconds)),
            "loss_first": float(losses[0]), "loss_last": float(losses[-1]),
            "judged_by": "cpu per step (other load)" if judged_by_cpu else "wall time",
            "ok": judged <= args.max_step_ratio}
    memory = _memory(series, args.warmup, args.steps, args.max_growth_mib)
    figures.update({
        "run_seconds": run_seconds, "step_time": step_time, "disturbed": disturbed,
        "cpu": cpu, "cpu_ratio": cpu_ratio, "speed_ratio": speed_ratio, "trace": trace, "memory": memory,
        "left_behind": checks,
        "server_pids": {task: {"parent": p, "server": c} for task, (p, c) in sampler.servers.items()},
        "ok": all(v["ok"] for part in (step_time, memory, checks) for v in part.values())})
    return figures


# ----- report --------------------------------------------------------------------------

def report(figures, bounds):
    """The table printed at the end (also the source of docs/reliability.md's)."""
    lines = []
    for f in figures:
        s = f["strategy"]
        if "error" in f:
            lines.append(f"{s}: FAILED to run: {f['error']}")
            continue
        lines.append(f"{s}: {f['steps']} steps in {f['run_seconds']:.0f} s "
                     f"(cluster start, clients, steps)")
        lines.append(f"  {'step time':<22} {'first window':>20} {'last window':>20} {'ratio':>6}  "
                     f"{'judged':>6}  (median; mean)")
        for who, t in f["step_time"].items():
            a, b = t["first"], t["last"]
            lines.append(f"  {who:<22} {a['median_ms']:6.2f} ms {str(a['steps']):>9}  "
                         f"{b['median_ms']:6.2f} ms {str(b['steps']):>9}  {t['ratio']:5.3f}  "
                         f"{t['judged_ratio']:6.3f}  "
                         f"({a['mean_ms']:.2f} -> {b['mean_ms']:.2f} ms, {t['mean_ratio']:.3f})"
                         f"{'' if t['ok'] else '  FAIL'}"
                         f"{'  (judged by CPU per step: other load)' if t['judged_by'] != 'wall time' else ''}")
        a, b = f["cpu"]
        if a["probe_ms"] and b["probe_ms"]:
            lines.append(f"  {'machine speed probe':<22} {a['probe_ms']:6.3f} ms {' ':9}  "
                         f"{b['probe_ms']:6.3f} ms {' ':9}  {f['speed_ratio']:5.3f}  "
                         f"(a fixed loop's CPU time per core; 'judged' is the ratio divided by this)")
        else:
            lines.append(f"  {'machine speed probe':<22} no sample in a window: ratios judged as measured")
        lines.append(f"  {'soak CPU per step':<22} {a['cpu_ms_per_step']:6.2f} ms {' ':9}  "
                     f"{b['cpu_ms_per_step']:6.2f} ms {' ':9}  "
                     f"{f['cpu_ratio']:5.3f}  (servers, clients, this tool)")
        lines.append(f"  {'other load':<22} {a['other_load_cores']:6.2f} cores {' ':6}  "
                     f"{b['other_load_cores']:6.2f} cores {' ':6}         (the machine's other processes"
                     f"{'; more than ' + str(QUIET_LOAD) + ': step times disturbed' if f['disturbed'] else ''})")
        lines.append(f"  {'RSS':<22} {'after warm-up':>14} {'end':>10} {'growth':>18} "
                     f"{'slope':>16}")
        for who, m in f["memory"].items():
            if "error" in m:
                lines.append(f"  {who:<22} {m['error']}  FAIL")
                continue
            lines.append(f"  {who:<22} {m['after_warmup_mib']:10.1f} MiB {m['end_mib']:6.1f} MiB "
                         f"{m['growth_mib']:+7.2f} MiB {m['growth_pct']:+6.2f}% "
                         f"{m['slope_kib_per_1000_steps']:+8.0f} KiB/kstep{'' if m['ok'] else '  FAIL'}")
        lines.append("  left behind")
        for what, c in f["left_behind"].items():
            detail = {k: v for k, v in c.items() if k != "ok"}
            lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'} {what}: {json.dumps(detail)}")
    lines.append(f"bounds: step time ratio (median, last/first window, over the machine speed probe's "
                 f"ratio) <= {bounds['max_step_ratio']}"
                 f"{' (soak CPU per step instead when other load disturbed it)' if bounds['load_tolerant'] else ''}; "
                 f"RSS growth after warm-up <= {bounds['max_growth_mib']} MiB per process")
    ok = all(f.get("ok") for f in figures)
    lines.append("PASS" if ok else "FAIL")
    return "\n".join(lines)


def markdown(figures, command, machine):
    """The figures as the markdown table of docs/reliability.md ("Soak")."""
    lines = [f"`{command}` ({machine})", "",
             "| strategy | process | step time, first window -> last (median) | ratio (judged) | "
             "RSS after warm-up -> end | growth | slope |",
             "|---|---|---|---|---|---|---|"]
    for f in figures:
        if "error" in f:
            lines.append(f"| {f['strategy']} | FAILED to run: {f['error']} | | | | | |")
            continue
        for who, m in f["memory"].items():
            t = f["step_time"].get(who)
            times = (f"{t['first']['median_ms']:.2f} ms (steps {t['first']['steps'][0]}-"
                     f"{t['first']['steps'][1]}) -> {t['last']['median_ms']:.2f} ms (steps "
                     f"{t['last']['steps'][0]}-{t['last']['steps'][1]})") if t else ""
            ratio = f"{t['ratio']:.3f} ({t['judged_ratio']:.3f})" if t else ""
            lines.append(f"| {f['strategy']} | {who} | {times} | {ratio} | "
                         f"{m['after_warmup_mib']:.1f} -> {m['end_mib']:.1f} MiB | "
                         f"{m['growth_mib']:+.2f} MiB ({m['growth_pct']:+.2f}%) | "
                         f"{m['slope_kib_per_1000_steps']:+.0f} KiB/1000 steps |")
        a, b = f["cpu"]
        if a["probe_ms"] and b["probe_ms"]:
            lines.append(f"| {f['strategy']} | machine speed probe (a fixed loop's CPU time) | "
                         f"{a['probe_ms']:.3f} -> {b['probe_ms']:.3f} ms | {f['speed_ratio']:.3f} | | | |")
        lines.append(f"| {f['strategy']} | all soak processes: CPU per step | {a['cpu_ms_per_step']:.2f} -> "
                     f"{b['cpu_ms_per_step']:.2f} ms | {f['cpu_ratio']:.3f} | other processes: "
                     f"{a['other_load_cores']:.2f} -> {b['other_load_cores']:.2f} cores | | |")
    lines.append("")
    for f in figures:
        if "error" in f:
            continue
        bad = [name for name, c in f["left_behind"].items() if not c["ok"]]
        lines.append(f"- {f['strategy']}, {f['steps']} steps in {f['run_seconds']:.0f} s, left behind: "
                     + (f"FAILED {', '.join(bad)}" if bad else
                        f"nothing ({len(f['left_behind'])} checks: "
                        + "; ".join(_check_text(n, c) for n, c in f["left_behind"].items()) + ")"))
    lines.append(f"- verdict: {'PASS' if all(f.get('ok') for f in figures) else 'FAIL'}")
    return "\n".join(lines) + "\n"


def _check_text(name, check):
    if "holds" in check:
        return f"{name} {check['holds']}"
    return name


def _parser():
    p = argparse.ArgumentParser(
        prog="soak.py",
        description="Soak run (issue 17): a long between-graph run (1 ps + 2 workers on loopback, "
                    "one client process per worker), watched for memory growth, step-time drift "
                    "and state left on the servers. Exit status 0 if every criterion holds, 1 "
                    "if not. The worker client it starts: 'soak.py client --help'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", choices=("both", "ps", "allreduce"), default="both",
                   help="which strategy to soak; both: ps, then allreduce, each on a fresh cluster")
    p.add_argument("--steps", type=int, default=2000, help="training steps per strategy")
    p.add_argument("--sample-every", type=int, default=100,
                   help="steps between two memory and CPU samples (must divide --warmup, --window "
                        "and --steps)")
    p.add_argument("--warmup", type=int, default=200,
                   help="steps before the first step-time window and the memory baseline")
    p.add_argument("--window", type=int, default=200,
                   help="steps in each step-time window (the first after warm-up, the last)")
    p.add_argument("--max-step-ratio", type=float, default=1.10,
                   help="bound on each client's last/first window median step time")
    p.add_argument("--max-growth-mib", type=float, default=16.0,
                   help="bound on each process's RSS growth from the warm-up sample to the end (MiB)")
    p.add_argument("--call-timeout", type=float, default=60.0, help="bound on every session call (s)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="bound on the clients' whole run, per strategy (s)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="bound on the servers' start (s)")
    p.add_argument("--work-dir",
                   help="where graphs, feeds, client outputs and server logs go (default: a "
                        "temporary folder, removed at the end)")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT, with a trace: for every interval "
                        "between two samples, the soak's CPU per step, the other processes' load and "
                        "each client's median step time")
    p.add_argument("--markdown", metavar="OUT",
                   help="also write the figures as a markdown table to OUT (docs/reliability.md's)")
    p.add_argument("--load-tolerant", action="store_true",
                   help=f"for shared machines: when the machine's other processes used more than "
                        f"{QUIET_LOAD} cores during a step-time window and a client's wall-time ratio "
                        f"exceeds --max-step-ratio, judge that client by the soak's CPU time per step "
                        f"instead (both are printed)")
    p.add_argument("--speed-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="time a fixed loop on every core beside the run and judge each step-time "
                        "ratio divided by the loop's ratio over the same windows (the machine's own "
                        "slowdown, e.g. a virtual machine's host taking cores away); "
                        "--no-speed-probe judges the ratios as measured")
    p.add_argument("--inject-fault", action="store_true",
                   help="check the checks: after the run leave something behind on purpose (ps: an "
                        "extra token in worker 1's queue; allreduce: worker 1's copy of a variable "
                        "nudged); the run must then fail")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    p = _parser()
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--sample-every", args.sample_every),
                        ("--window", args.window)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    if any(v % args.sample_every for v in (args.warmup, args.window, args.steps)):
        p.error(f"--sample-every {args.sample_every} must divide --warmup {args.warmup}, --window "
                f"{args.window} and --steps {args.steps} (samples are compared at those steps)")
    if args.steps < args.warmup + 2 * args.window:
        p.error(f"--steps {args.steps} leaves no room for two windows of {args.window} steps "
                f"after a warm-up of {args.warmup}")
    strategies = ("ps", "allreduce") if args.strategy == "both" else (args.strategy,)
    bounds = {"max_step_ratio": args.max_step_ratio, "max_growth_mib": args.max_growth_mib,
              "load_tolerant": args.load_tolerant, "quiet_load_cores": QUIET_LOAD}

    def say(message):
        print(message, flush=True)

    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    figures = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work_dir = args.work_dir or tmp
        os.makedirs(work_dir, exist_ok=True)
        for strategy in strategies:
            try:
                figures.append(soak(strategy, args, work_dir, say))
            except Exception as e:   # a run that could not finish is a failed run, reported
                figures.append({"strategy": strategy, "ok": False,
                                "error": f"{type(e).__name__}: {e}"})
            say(report(figures[-1:], bounds).rsplit("\n", 2)[0])
    text = report(figures, bounds)
    say("\n" + text)
    command = " ".join(["python tools/soak.py"] + argv)
    machine = {"cores": os.cpu_count(), "python": platform.python_version(),
               "tensorflow": tf.__version__, "platform": platform.platform()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine, "bounds": bounds, "strategies": figures,
                       "ok": all(f.get("ok") for f in figures)}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(figures, command, f"{machine['cores']} cores, TensorFlow {machine['tensorflow']}"))
    return 0 if all(f.get("ok") for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
