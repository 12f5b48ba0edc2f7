"""Scale simulation: one training step's predicted communication from 1 to 1024 GPUs.

The logic of tools/simulate.py (a thin command-line wrapper around ``main``), in the
package so that tests and users import it like any module:

    python tools/simulate.py OUT.pb [--devices-per-worker 8] [--ps N] [--gpus 1,2,4,...]
    python tools/simulate.py PLAN.json ...           (a plan `graph-rewrite plan` printed)
    python tools/simulate.py --model resnet50 [--strategy allreduce|ps|hybrid] [--png scale.png] [--json]
    python tools/simulate.py --validate [--validate-workers 2,3] [--steps 20] [--rounds 3]

The plan comes from a rewritten graph (``graph-rewrite IN OUT`` or ``result.save``), from
a plan file, or from ``--model``: a synthetic plan of a well-known model's variables,
planned the way ``graph_rewriter.planner`` plans them (resnet50: tf_keras ResNet50,
1000 classes, Momentum; mlp: tools/bench_step.py's 3x1024 MLP; embedding: a
1,000,000 x 64 table looked up by 8 ids per example under a 2x1024 MLP, Adagrad;
dense4096: the --validate model). Each GPU count becomes a cluster of
ceil(gpus / devices_per_worker) machines and ``--ps`` parameter-server tasks, and
``graph_rewriter.cost_model.predict`` gives the step's communication time (allreduce,
allgather, ps) and bytes per link with the plan's own per-variable syncs and pack sizes
(ps variables keep their planned shards; when ``--ps`` differs from the plan's ps
count the shards are dealt again to the new tasks, largest first). Simulating needs no
TensorFlow, except to read a rewritten .pb.

``--validate`` instead measures, on loopback clusters of real TensorFlow servers,
what the model predicts: it calibrates the loopback link (a 64 MiB and a 4 B tensor
sent between two servers), puts that bandwidth and latency into the CostModel, runs a
communication-heavy model (three 4096x1024 float32 layers, 48 MiB of gradients, 8
examples per replica) rewritten for each cluster, and prints the measured
communication (median step time minus the median step of the same replicas without
communication) next to the prediction. docs/performance.md ("Scale simulation") has
the figures and what they mean.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import types

from graph_rewriter import cost_model  # (pure Python: no TensorFlow)
from graph_rewriter.options import DEFAULT_BYTES_PER_PACK, DEFAULT_PS_SHARD_BYTES
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.plan import PLAN_FORMAT, Plan  # (no TensorFlow either)
from graph_rewriter.planner import assign_packs, place_for_strategy  # (nor here)

PROG = "simulate"
DEFAULT_GPUS = [2 ** k for k in range(11)]  # 1, 2, 4, ..., 1024
MB = 1e6
MiB = 1 << 20


class UsageError(Exception):
    """Bad input: reported as one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message):
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(2)


# ----- plans without TensorFlow -------------------------------------------------------

class PlanView:
    """A plan dict (what ``Plan.to_dict()``, ``graph-rewrite plan`` and a rewritten graph's
    metadata hold) with the attributes ``cost_model.predict`` reads. Unlike
    ``Plan.from_dict`` it accepts a hand-written plan that gives only what the model
    reads: the fields it leaves out get Plan's defaults."""

    CUT_DEFAULTS = {"role": "gradient", "sync": "allreduce", "dtype": "float32", "shape": None, "bytes": None,
                    "rows_per_example": None, "index_dtype": None}
    VARIABLE_DEFAULTS = {"ps_task": None, "shards": None, "placement": "mirrored", "slot_of": None}

    def __init__(self, data, source="plan"):
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise UsageError(f"{source}: not a graph_rewriter plan (expected \"format\": \"{PLAN_FORMAT}\")")
        try:
            self.data = data
            self.packs = [types.SimpleNamespace(bytes=p["bytes"], algorithm=p.get("algorithm"))
                          for p in data["packs"]]
            self.cuts = [types.SimpleNamespace(**{**self.CUT_DEFAULTS, **c}) for c in data["cuts"]]
            self._variables = {v["name"]: types.SimpleNamespace(**{**self.VARIABLE_DEFAULTS, **v})
                               for v in data["variables"]}
            self.strategy = data["strategy"]
            self.num_ps = data.get("num_ps", 0)
            self.device_type = "GPU"   # what the simulator predicts, whatever the plan was made for
            missing = [k for c in self.cuts for k in ("variable", "kind") if not hasattr(c, k)]
        except (KeyError, TypeError) as e:
            raise UsageError(f"{source}: malformed plan: missing or bad {e}") from None
        if missing:
            raise UsageError(f"{source}: malformed plan: a cut has no '{missing[0]}'")
        for c in self.cuts:
            if c.variable not in self._variables:
                raise UsageError(f"{source}: malformed plan: cut of unknown variable '{c.variable}'")

    def variable(self, name):
        return self._variables[name]

    def ps_variables(self):
        """Names of the variables whose gradient goes to the parameter servers."""
        return [c.variable for c in self.cuts if c.sync == "accumulate"]

    def describe(self):
        """One line: strategy, gradient bytes, packs, variables on ps."""
        grad = sum(c.bytes or 0 for c in self.cuts)
        ps = len(self.ps_variables())
        return (f"{self.strategy}, {len(self.cuts)} gradients for {grad / MB:.1f} MB of variables, "
                f"{len(self.packs)} allreduce pack(s)"
                + (f", {ps} on {self.num_ps} ps task(s)" if ps else ""))


def load_plan(path):
    """The plan of a rewritten graph (.pb/.pbtxt/.meta: needs TensorFlow to parse) or of
    a plan JSON file (no TensorFlow)."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{path}: not a plan JSON file ({e})") from None
        return PlanView(data, path)
    from graph_rewriter.tf_runtime import import_tensorflow_quietly
    import_tensorflow_quietly()
    from graph_rewriter.api import load
    try:
        result = load(path)
    except GraphRewriteError as e:
        raise UsageError(" ".join(str(e).split())) from None
    return PlanView(result.metadata["plan"], path)


# ----- synthetic plans ------------------------------------------------------------------

@dataclasses.dataclass
class Var:
    """One variable of a synthetic model: shape, role ("trainable" or "state": batch
    statistics), and for an embedding table its ids per example."""
    name: str
    shape: list
    role: str = "trainable"
    rows_per_example: int = None     # set: a sparse gradient (embedding lookup)


def resnet50(classes=1000):
    """tf_keras.applications.ResNet50's variables (convolutions with bias, BatchNorm
    gamma/beta and moving statistics, the classifier) in the order its training graph's
    plan lists them: trainable weights in Keras' layer order (a first block's shortcut
    after its second convolution), then the batch statistics in creation order."""
    weights, stats = [], []

    def conv(name, k, cin, cout):
        weights.extend([Var(f"{name}_conv/kernel", [k, k, cin, cout]), Var(f"{name}_conv/bias", [cout])])

    def bn(name, c):
        weights.extend([Var(f"{name}_bn/gamma", [c]), Var(f"{name}_bn/beta", [c])])

    def bn_stats(name, c):
        stats.extend([Var(f"{name}_bn/moving_mean", [c], role="state"),
                      Var(f"{name}_bn/moving_variance", [c], role="state")])

    conv("conv1", 7, 3, 64)
    bn("conv1", 64)
    bn_stats("conv1", 64)
    cin = 64
    for stage, (f, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=2):
        for b in range(1, blocks + 1):
            name = f"conv{stage}_block{b}"
            conv(f"{name}_1", 1, cin, f)
            bn(f"{name}_1", f)
            conv(f"{name}_2", 3, f, f)
            bn(f"{name}_2", f)
            if b == 1:
                conv(f"{name}_0", 1, cin, 4 * f)
                conv(f"{name}_3", 1, f, 4 * f)
                bn(f"{name}_0", 4 * f)
                bn_stats(f"{name}_0", 4 * f)
            else:
                conv(f"{name}_3", 1, f, 4 * f)
            bn(f"{name}_3", 4 * f)
            for i, c in ((1, f), (2, f), (3, 4 * f)):
                bn_stats(f"{name}_{i}", c)
            cin = 4 * f
    weights.extend([Var("predictions/kernel", [2048, classes]), Var("predictions/bias", [classes])])
    return weights + stats


def mlp():
    """tools/bench_step.py's MLP: input 1024, three hidden layers of 1024, 10 classes."""
    out = []
    for i in range(3):
        out += [Var(f"dense_{i}/kernel", [1024, 1024]), Var(f"dense_{i}/bias", [1024])]
    return out + [Var("logits/kernel", [1024, 10])]


def embedding():
    """A recommender-like model: a 1,000,000 x 64 table looked up by 8 ids per example,
    their concatenation under two hidden layers of 1024."""
    return [Var("embedding", [1_000_000, 64], rows_per_example=8),
            Var("hidden_0/kernel", [512, 1024]), Var("hidden_0/bias", [1024]),
            Var("hidden_1/kernel", [1024, 1024]), Var("hidden_1/bias", [1024]),
            Var("output/kernel", [1024, 1]), Var("output/bias", [1])]


def dense4096():
    """The --validate model: three 4096x1024 float32 layers and a 4096 x 1 output."""
    dims = ((1024, 4096), (4096, 1024), (1024, 4096))
    return [Var(f"dense_{i}/kernel", list(d)) for i, d in enumerate(dims)] + [Var("out/kernel", [4096, 1])]


MODELS = {  # name: (variables, optimizer slots per trainable variable, what it is)
    "resnet50": (resnet50, ["Momentum"], "tf_keras ResNet50 (1000 classes), Momentum"),
    "mlp": (mlp, ["Momentum"], "MLP 1024-1024-1024-1024-10 (tools/bench_step.py), Momentum"),
    "embedding": (embedding, ["Adagrad"], "1,000,000 x 64 embedding (8 ids/example) + MLP 2x1024, Adagrad"),
    "dense4096": (dense4096, [], "three 4096x1024 float32 layers (the --validate model), SGD"),
}


def synthetic_plan(model, strategy="allreduce", num_ps=1, bytes_per_pack=DEFAULT_BYTES_PER_PACK,
                   ps_shard_bytes=DEFAULT_PS_SHARD_BYTES):
    """A plan dict for one of MODELS, placed and packed by graph_rewriter.planner's own
    functions for that strategy: every variable mirrored (allreduce), all on the
    parameter servers (ps), or those with sparse gradients there (hybrid); ps variables
    balanced over ``num_ps`` tasks; allreduced gradients packed."""
    build, slots, _ = MODELS[model]
    variables, cuts = [], []
    for v in build():
        nbytes = 4 * math.prod(v.shape)
        variables.append(dict(name=v.name, role=v.role, dtype="float32", shape=v.shape, bytes=nbytes,
                              placement="mirrored", slot_of=None, kind="resource", ps_task=None, shards=None))
        sparse = v.rows_per_example is not None
        cuts.append(dict(variable=v.name, kind="sparse" if sparse else "dense", values=f"{v.name}/gradient:0",
                         role="state" if v.role == "state" else "gradient",
                         sync="allgather" if sparse else "allreduce", dtype="float32", shape=v.shape,
                         bytes=nbytes, pack=None, rows_per_example=v.rows_per_example,
                         index_dtype="int32" if sparse else None, variables=[v.name]))
    for v in [v for v in variables if v["role"] == "trainable"]:
        for s in slots:
            variables.append(dict(v, name=f"{v['name']}/{s}", role="slot", slot_of=v["name"]))
    cuts.sort(key=lambda c: c["role"] != "state")   # stable: batch statistics first, as the analysis orders them
    plan = {"format": PLAN_FORMAT, "strategy": strategy, "num_replicas": 1, "devices_per_worker": 1,
            "device_type": "GPU", "variables": variables, "cuts": cuts, "packs": [], "batch_inputs": [],
            "broadcast_inputs": [], "step_counters": [], "num_ps": max(num_ps, 1)}
    planned = Plan.from_dict(plan, model)
    place_for_strategy(planned, strategy, ps_shard_bytes)
    assign_packs(planned, bytes_per_pack)
    return planned.to_dict()


def remap_ps(plan, num_ps):
    """The plan dict with its parameter-server shards dealt to ``num_ps`` tasks: each
    variable keeps its planned shards (rows), the shards go largest first to the least
    loaded task this variable does not use yet. Unchanged when ``num_ps`` is the plan's."""
    if num_ps == plan.get("num_ps") or num_ps < 1:
        return plan
    out = copy.deepcopy(plan)
    out["num_ps"] = num_ps
    by_name = {v["name"]: v for v in out["variables"]}
    cut_bytes = {c["variable"]: c["bytes"] or 0 for c in out["cuts"]}
    parts = []     # (bytes, variable, shard index)
    for name in dict.fromkeys(c["variable"] for c in out["cuts"] if c["sync"] == "accumulate"):
        var = by_name[name]
        shards = var["shards"] or [{"ps_task": var["ps_task"] or 0, "rows": 1}]
        total = sum(s["rows"] for s in shards)
        parts += [(cut_bytes[name] * s["rows"] / total, name, k) for k, s in enumerate(shards)]
    loads, used = [0.0] * num_ps, {}
    for nbytes, name, k in sorted(parts, key=lambda p: (-p[0], p[1], p[2])):
        taken = used.setdefault(name, set())
        free = [i for i in range(num_ps) if i not in taken] or list(range(num_ps))
        task = min(free, key=lambda i: (loads[i], i))
        loads[task] += nbytes
        taken.add(task)
        var = by_name[name]
        if var["shards"]:
            var["shards"][k]["ps_task"] = task
        else:
            var["ps_task"] = task
    return out


# ----- the simulation ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cluster(cost_model.Topology):
    """A Topology of ``gpus`` replicas on ceil(gpus / devices_per_worker) machines (the
    last one may be partly filled: the ring has ``gpus`` members, the fullest machine's
    NIC carries ``devices_per_worker`` replicas' ps traffic)."""
    gpus: int = 1

    @property
    def replicas(self):
        return self.gpus

    @classmethod
    def for_gpus(cls, gpus, devices_per_worker, ps_tasks):
        return cls(workers=-(-gpus // devices_per_worker), devices_per_worker=min(devices_per_worker, gpus),
                   ps_tasks=ps_tasks, gpus=gpus)


def simulate(plan, gpus_list, devices_per_worker, ps_tasks, model, algorithm=None):
    """cost_model.predict for every GPU count: a list of its dicts, each with "gpus" and
    "hierarchical_packs". ``algorithm`` ("flat", "hierarchical", "auto"; None: the
    plan's own) sets every pack's all-reduce for each GPU count; the two-level one
    applies where the cluster has two levels (several machines of several GPUs)."""
    plan = PlanView(remap_ps(plan.data, ps_tasks), "plan") if ps_tasks and ps_tasks != plan.num_ps else plan
    rows = []
    for gpus in gpus_list:
        topo = Cluster.for_gpus(gpus, devices_per_worker, ps_tasks)
        two_levels = topo.workers > 1 and topo.devices_per_worker > 1
        if algorithm == "auto":
            cost_model.choose_algorithms(plan, topo, model)
        elif algorithm is not None:
            for p in plan.packs:
                p.algorithm = "hierarchical" if algorithm == "hierarchical" and two_levels else None
        rows.append({"gpus": gpus, **cost_model.predict(plan, topo, model),
                     "hierarchical_packs": sum(p.algorithm == "hierarchical" for p in plan.packs)})
    return rows


TABLE_COLUMNS = ("GPUs", "workers", "allreduce ms", "allgather ms", "ps ms", "total ms",
                 "ring-link MB", "ps-link MB", "worker-link MB")


def table_rows(rows):
    """The printed table's cells per GPU count (times in ms, bytes in MB = 10^6 B)."""
    return [(r["gpus"], r["workers"], r["allreduce"] * 1e3, r["allgather"] * 1e3, r["ps"] * 1e3,
             r["seconds"] * 1e3, r["bytes"]["ring_link"] / MB, r["bytes"]["ps_link"] / MB,
             r["bytes"]["worker_link"] / MB) for r in rows]


def format_table(rows):
    widths = [max(len(h), 6) for h in TABLE_COLUMNS]
    lines = ["  ".join(h.rjust(w) for h, w in zip(TABLE_COLUMNS, widths))]
    for cells in table_rows(rows):
        lines.append("  ".join((f"{c:d}" if isinstance(c, int) else f"{c:.2f}").rjust(w)
                               for c, w in zip(cells, widths)))
    return "\n".join(lines)


def write_png(rows, path, title):
    """Time per step and bytes per link against log2 GPUs, two panels side by side."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--png needs matplotlib, which is not installed "
                         "(pip install matplotlib, or pip install 'graph-rewriter[tools]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpus = [r["gpus"] for r in rows]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("seconds", "total"), ("allreduce", "allreduce"), ("allgather", "allgather"), ("ps", "ps")):
        values = [r[key] * 1e3 for r in rows]
        if key == "seconds" or any(values):
            ax_t.plot(gpus, values, marker="o", label=label, linewidth=2.5 if key == "seconds" else 1.5)
    for key, label in (("ring_link", "ring link"), ("ps_link", "ps link"), ("worker_link", "worker link")):
        values = [r["bytes"][key] / MB for r in rows]
        if any(values):
            ax_b.plot(gpus, values, marker="o", label=label)
    for ax, ylabel in ((ax_t, "communication per step (ms)"), (ax_b, "bytes per step per link (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus)
        ax.set_xticklabels([str(g) for g in gpus])
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise UsageError(f"--png {path}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)


# ----- --validate: predictions against loopback clusters ---------------------------------

PER_REPLICA_BATCH = 8
CAL_BIG = 16 * MiB          # float32 elements: 64 MiB
CAL_PACK = 8 * MiB          # 32 MiB: the default allreduce pack
CAL_TINY = 1                # one float32: 4 B


def _quiet_tf():
    """TensorFlow in graph mode, imported without its start-up log lines."""
    from graph_rewriter.tf_runtime import import_tensorflow_quietly
    import_tensorflow_quietly()
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    return tf


def validation_graph(seed):
    """The communication-heavy single-device graph: x[None,1024] -> 4096 -> 1024 -> 4096
    (ReLU, no biases: three 16 MiB kernels) -> 1, mean squared error, plain SGD (its
    update is one pass over the variables, so compute stays small next to 48 MiB of
    gradients). ``seed`` differs per cluster so no two rewrites share collective keys."""
    tf = _quiet_tf()
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [None, 1024], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        for i, v in enumerate(dense4096()):
            init = tf.compat.v1.random_normal_initializer(stddev=0.01, seed=seed * 10 + i)
            w = tf.compat.v1.get_variable(v.name, v.shape, initializer=init, use_resource=True)
            h = tf.matmul(h, w)
            if v.shape[1] != 1:
                h = tf.nn.relu(h)
        loss = tf.identity(tf.reduce_mean(tf.square(h - y)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train_op")
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables(), name="init")
    return g.as_graph_def()


def baseline_graph(graph_def, workers, devices_per_worker=1):
    """A copy of the single-device graph per replica, copy i on worker i // d's CPU:i % d
    with names "r<i>/...": the per-replica computation of the rewritten graph on the same
    servers, at the same time (so with the same contention for the cores), without
    communication."""
    tf = _quiet_tf()
    gd = type(graph_def)()
    gd.CopyFrom(graph_def)
    g = tf.Graph()
    with g.as_default():
        for i in range(workers * devices_per_worker):
            copy_i = type(graph_def)()
            copy_i.CopyFrom(gd)
            for node in copy_i.node:      # resource names are per server: keep the copies apart
                if node.attr["shared_name"].s:
                    node.attr["shared_name"].s = f"r{i}/".encode() + node.attr["shared_name"].s
            with tf.device(f"/job:worker/task:{i // devices_per_worker}/device:CPU:{i % devices_per_worker}"):
                tf.compat.v1.import_graph_def(copy_i, name=f"r{i}")
    return g


def _interleaved(run_a, run_b, steps, rounds, warmup):
    """Median seconds of ``run_a`` and ``run_b``, alternated step by step (this machine's
    speed drifts: alternating keeps both under the same conditions), per round and over
    all rounds."""
    for _ in range(warmup):
        run_a()
        run_b()
    per_round = []
    all_a, all_b = [], []
    for _ in range(rounds):
        ta, tb = [], []
        for _ in range(steps):
            start = time.perf_counter()
            run_a()
            ta.append(time.perf_counter() - start)
            start = time.perf_counter()
            run_b()
            tb.append(time.perf_counter() - start)
        per_round.append((statistics.median(ta), statistics.median(tb)))
        all_a += ta
        all_b += tb
    return statistics.median(all_a), statistics.median(all_b), per_round


def _options(tf, timeout):
    return tf.compat.v1.RunOptions(timeout_in_ms=int(timeout * 1000))


def calibrate(cluster, steps, rounds, warmup, timeout, devices=None):
    """The loopback link between worker 0 and worker 1, and TensorFlow's collective over it.

    Link: a 64 MiB and a 4 B tensor read on worker 1 from a variable on worker 0, each
    against a control step that touches both workers without moving anything (so only
    the transfer differs): bandwidth = (64 MiB - 4 B) / (t_64MiB - t_4B), latency = t_4B.
    Also 64 MiB both ways at once (how a ring uses a link), and a 2-worker
    CollectiveReduceV2 of 32 MiB (the default pack size) and of 4 B: its ring sends the
    whole tensor in two messages per worker, which gives the collective's own
    effective bandwidth and latency per message. ``devices``: the two ends (default: CPU:0
    of worker 0 and of worker 1; two CPU devices of one worker calibrate the link within
    a machine).
    """
    tf = _quiet_tf()
    g = tf.Graph()
    dev = devices or [f"/job:worker/task:{i}/device:CPU:0" for i in range(2)]
    fetch = {}

    def first(t, on):
        with tf.device(dev[on]):
            return tf.strided_slice(t, [0], [1]) + 1.0

    with g.as_default():
        for key, (label, size) in enumerate((("big", CAL_BIG), ("tiny", CAL_TINY), ("pack", CAL_PACK)), start=1):
            reads = []
            for i in range(2):
                with tf.device(dev[i]):
                    v = tf.compat.v1.get_variable(f"simulate_calibration/{label}_{i}", [size],
                                                  initializer=tf.compat.v1.ones_initializer(), use_resource=True)
                    reads.append(v.read_value())
            fetch[f"{label}_control"] = [first(reads[0], 0), first(reads[1], 1)]
            fetch[f"{label}_one_way"] = [first(reads[0], 1), first(reads[1], 1)]
            fetch[f"{label}_both_ways"] = [first(reads[0], 1), first(reads[1], 0)]
            reduced = []
            for i in range(2):
                with tf.device(dev[i]):
                    r = tf.raw_ops.CollectiveReduceV2(
                        input=reads[i], group_size=2, group_key=7, instance_key=key,
                        ordering_token=[], merge_op="Add", final_op="Div", communication_hint="auto",
                        timeout_seconds=float(timeout))
                    reduced.append(tf.strided_slice(r, [0], [1]))
            fetch[f"{label}_collective"] = reduced
        init = tf.compat.v1.global_variables_initializer()
    opts = _options(tf, timeout)
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(timeout * 1000))
    figures = (("big", "one_way"), ("tiny", "one_way"), ("big", "both_ways"),
               ("pack", "collective"), ("tiny", "collective"))
    out = {}
    with tf.compat.v1.Session(cluster.target("worker", 0), graph=g, config=config) as sess:
        sess.run(init, options=opts)
        for label, kind in figures:
            t, base, _ = _interleaved(lambda: sess.run(fetch[f"{label}_{kind}"], options=opts),
                                      lambda: sess.run(fetch[f"{label}_control"], options=opts),
                                      steps, rounds, warmup)
            out[f"{label}_{kind}"] = max(t - base, 1e-7)
    big, tiny, pack = CAL_BIG * 4, CAL_TINY * 4, CAL_PACK * 4
    latency = out["tiny_one_way"]
    bandwidth = (big - tiny) / max(out["big_one_way"] - latency, 1e-9)
    coll_latency = out["tiny_collective"] / 2                  # 2 (n - 1) messages, n = 2
    coll_bandwidth = (pack - tiny) / max(out["pack_collective"] - out["tiny_collective"], 1e-9)
    return {"bandwidth": bandwidth, "latency": latency, "collective_bandwidth": coll_bandwidth,
            "collective_latency": coll_latency, "seconds": out,
            "duplex_factor": out["big_both_ways"] / out["big_one_way"]}


def measure_case(strategy, workers, ps, seed, models, args, devices_per_worker=1, algorithm=None):
    """One validation case on a cluster of its own: the rewritten graph's median step
    against the median step of the same replicas without communication, and the
    predictions for the rewrite's plan under each calibrated CostModel. With
    ``devices_per_worker`` > 1, ``algorithm`` ("flat", "hierarchical") is the packs'
    all-reduce."""
    tf = _quiet_tf()
    import numpy as np

    import graph_rewriter as gr
    from graph_rewriter.local_cluster import LocalCluster
    gd = validation_graph(seed)
    n = workers * devices_per_worker
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(n * PER_REPLICA_BATCH, 1024)).astype(np.float32)
    ys = rng.normal(size=(n * PER_REPLICA_BATCH, 1)).astype(np.float32)
    opts = _options(tf, args.call_timeout)
    with LocalCluster(workers=workers, ps=ps, device_type="CPU", devices_per_worker=devices_per_worker,
                      start_timeout=args.start_timeout) as c:
        result = gr.rewrite(gd, c.spec, strategy=strategy, device_type="CPU", devices_per_worker=devices_per_worker,
                            timeout_seconds=args.call_timeout, allreduce_algorithm=algorithm)
        base = baseline_graph(gd, workers, devices_per_worker)
        feeds = {}
        for i in range(n):
            feeds[f"r{i}/x:0"] = xs[i * PER_REPLICA_BATCH:(i + 1) * PER_REPLICA_BATCH]
            feeds[f"r{i}/y:0"] = ys[i * PER_REPLICA_BATCH:(i + 1) * PER_REPLICA_BATCH]
        base_ops = [f"r{i}/train_op" for i in range(n)]
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(args.call_timeout * 1000))
        with gr.Session(result, target=c.target("worker", 0)) as sr, \
                tf.compat.v1.Session(c.target("worker", 0), graph=base, config=config) as sb:
            sr.run("init", options=opts)
            sb.run([f"r{i}/init" for i in range(n)], options=opts)
            step, no_comm, per_round = _interleaved(
                lambda: sr.run("train_op", {"x:0": xs, "y:0": ys}, options=opts),
                lambda: sb.run(base_ops, feeds, options=opts), args.steps, args.rounds, args.warmup)
        plan = PlanView(result.plan.to_dict(), "rewrite")
    topo = cost_model.Topology(workers=workers, devices_per_worker=devices_per_worker, ps_tasks=ps)
    row = {"case": f"{strategy}, {workers} workers" + (f" x {devices_per_worker} CPUs, {algorithm}" if algorithm else "")
           + (f" + {ps} ps" if ps else ""), "strategy": strategy,
           "workers": workers, "devices_per_worker": devices_per_worker, "algorithm": algorithm,
           "ps": ps, "step_s": step, "no_comm_s": no_comm, "measured_s": step - no_comm,
           "measured_per_round_s": [a - b for a, b in per_round],
           "gradient_bytes": sum(cut.bytes or 0 for cut in plan.cuts),
           "packs": [p.bytes for p in plan.packs]}
    for key, model in models.items():
        if model is None:
            row[f"predicted_{key}_s"] = None
            continue
        pred = cost_model.predict(plan, topo, model)
        row[f"predicted_{key}_s"] = pred["seconds"]
        row[f"predicted_{key}"] = pred
    return row


class MeasurementError(Exception):
    """A --validate measurement failed (a server did not start, a step ran past
    --call-timeout): one line and exit status 1, the input was fine."""


def _guard(what, measure):
    """``measure()``, with a failure of the cluster or of TensorFlow turned into a
    MeasurementError naming ``what`` (every cluster is stopped by then: its ``with``)."""
    tf = _quiet_tf()
    try:
        return measure()
    except (GraphRewriteError, tf.errors.OpError, OSError) as e:
        raise MeasurementError(f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:400]}") from None


def validate(args):
    """Calibrates the loopback link, then measures each case; returns the report dict."""
    from graph_rewriter.local_cluster import LocalCluster
    cases = [("allreduce", w, 0, 1, None) for w in args.validate_workers]
    if 2 in args.validate_workers:
        cases.append(("ps", 2, 1, 1, None))
    if args.validate_hierarchical:   # the same 2 x 2 replicas, one ring against two levels
        cases += [("allreduce", 2, 0, 2, "flat"), ("allreduce", 2, 0, 2, "hierarchical")]
    report = {"cores": os.cpu_count(), "per_replica_batch": PER_REPLICA_BATCH, "steps": args.steps,
              "rounds": args.rounds, "cases": []}
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"calibrating the loopback link (2 workers; {args.rounds} rounds x {args.steps} steps per figure) ...")

    def calibration():
        with LocalCluster(workers=2, device_type="CPU", start_timeout=args.start_timeout) as c:
            return calibrate(c, args.steps, args.rounds, args.warmup, args.call_timeout)
    cal = _guard("calibration", calibration)
    report["calibration"] = cal
    s = cal["seconds"]
    say(f"  one way:   64 MiB {s['big_one_way'] * 1e3:.1f} ms, 4 B {s['tiny_one_way'] * 1e3:.3f} ms"
        f"  => link {cal['bandwidth'] / 1e9:.2f} GB/s, latency {cal['latency'] * 1e6:.0f} us")
    say(f"  both ways: 64 MiB {s['big_both_ways'] * 1e3:.1f} ms  = {cal['duplex_factor']:.2f} x one way")
    say(f"  CollectiveReduceV2, 2 workers: 32 MiB {s['pack_collective'] * 1e3:.1f} ms, 4 B "
        f"{s['tiny_collective'] * 1e3:.3f} ms  => {cal['collective_bandwidth'] / 1e9:.2f} GB/s, "
        f"{cal['collective_latency'] * 1e6:.0f} us per message")
    link = cost_model.CostModel(inter_bandwidth=cal["bandwidth"], inter_latency=cal["latency"],
                                batch_size=PER_REPLICA_BATCH)
    coll = cost_model.CostModel(inter_bandwidth=cal["collective_bandwidth"],
                                inter_latency=cal["collective_latency"], batch_size=PER_REPLICA_BATCH)
    if args.validate_hierarchical:
        # the 2 x 2 cases also move data within a worker: its link, calibrated the same way
        # between two CPU devices of one server
        say("calibrating the link within a worker (CPU:0 and CPU:1 of one server) ...")

        def within_calibration():
            with LocalCluster(workers=1, device_type="CPU", devices_per_worker=2,
                              start_timeout=args.start_timeout) as c:
                return calibrate(c, args.steps, args.rounds, args.warmup, args.call_timeout,
                                 devices=["/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1"])
        within = _guard("calibration within a worker", within_calibration)
        report["calibration_within"] = within
        copy = ("no copy (one process: the tensor is handed over)" if within["bandwidth"] > 1e12
                else f"{within['bandwidth'] / 1e9:.2f} GB/s")
        say(f"  one way: link {copy}, latency {within['latency'] * 1e6:.0f} us; "
            f"CollectiveReduceV2: {within['collective_bandwidth'] / 1e9:.2f} GB/s, "
            f"{within['collective_latency'] * 1e6:.0f} us per message")
        link_2x2 = dataclasses.replace(link, intra_bandwidth=within["bandwidth"], intra_latency=within["latency"])
        coll_2x2 = dataclasses.replace(coll, intra_bandwidth=within["collective_bandwidth"],
                                       intra_latency=within["collective_latency"])
    for k, (strategy, workers, ps, dpw, algorithm) in enumerate(cases):
        say(f"measuring {strategy} on {workers} workers" + (f" x {dpw} CPUs, {algorithm}" if algorithm else "")
            + (f" + {ps} ps" if ps else "") + " ...")
        base_link, base_coll = (link_2x2, coll_2x2) if dpw > 1 else (link, coll)
        models = {"link": dataclasses.replace(base_link, batch_size=workers * dpw * PER_REPLICA_BATCH),
                  "collective": dataclasses.replace(base_coll, batch_size=workers * dpw * PER_REPLICA_BATCH)
                  if strategy == "allreduce" else None}
        row = _guard(f"{strategy} on {workers} workers",
                     lambda: measure_case(strategy, workers, ps, seed=101 + k, models=models, args=args,
                                          devices_per_worker=dpw, algorithm=algorithm))
        report["cases"].append(row)
        say(f"  step {row['step_s'] * 1e3:.1f} ms, without communication {row['no_comm_s'] * 1e3:.1f} ms; "
            f"per round: " + ", ".join(f"{x * 1e3:.0f}" for x in row["measured_per_round_s"]) + " ms")
    return report


def format_validation(report):
    head = ("case", "step ms", "no-comm ms", "measured ms", "predicted ms", "meas/pred",
            "pred (coll.) ms", "meas/pred (coll.)")
    rows = []
    for r in report["cases"]:
        pl, pc = r["predicted_link_s"], r["predicted_collective_s"]
        rows.append((r["case"], f"{r['step_s'] * 1e3:.1f}", f"{r['no_comm_s'] * 1e3:.1f}",
                     f"{r['measured_s'] * 1e3:.1f}", f"{pl * 1e3:.1f}", f"{r['measured_s'] / pl:.2f}",
                     f"{pc * 1e3:.1f}" if pc else "-", f"{r['measured_s'] / pc:.2f}" if pc else "-"))
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for x in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths))))
    return "\n".join(lines)


# ----- command line -------------------------------------------------------------------

def _positive_list(text, flag):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} must be a comma-separated list of positive integers, got {text!r}")
    return values


def _cost_model(args):
    """The CostModel of the flags (GB/s and microseconds); unset flags keep the defaults."""
    fields = {}
    for flag, scale in (("intra_bandwidth", 1e9), ("inter_bandwidth", 1e9),
                        ("intra_latency", 1e-6), ("inter_latency", 1e-6)):
        value = getattr(args, flag)
        if value is None:
            continue
        latency = "latency" in flag
        if not (value >= 0 if latency else value > 0) or not math.isfinite(value):
            raise UsageError(f"--{flag.replace('_', '-')} must be a {'non-negative' if latency else 'positive'} "
                             f"number ({'microseconds' if latency else 'GB/s'}), got {value:g}")
        fields[flag] = value * scale
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be a positive number of examples (the global batch), "
                             f"got {args.batch_size}")
        fields["batch_size"] = args.batch_size
    return cost_model.CostModel(**fields)


def parser():
    p = _Parser(prog="simulate.py", description=__doc__.splitlines()[0])
    p.add_argument("plan", nargs="?", metavar="FILE",
                   help="a rewritten graph (.pb/.pbtxt/.meta, needs TensorFlow) or a plan .json")
    p.add_argument("--model", choices=sorted(MODELS), help="simulate a synthetic plan of this model instead of FILE")
    p.add_argument("--strategy", choices=("allreduce", "ps", "hybrid"),
                   help="with --model: how to plan it (default allreduce)")
    p.add_argument("--bytes-per-pack", type=int, metavar="BYTES",
                   help=f"with --model: largest allreduce pack (default {DEFAULT_BYTES_PER_PACK}; 0: one per dtype)")
    p.add_argument("--ps-shard-bytes", type=int, metavar="BYTES",
                   help=f"with --model: ps variables above this are split across the ps tasks "
                        f"(default {DEFAULT_PS_SHARD_BYTES}; 0: never)")
    p.add_argument("--allreduce-algorithm", choices=("flat", "hierarchical", "auto"),
                   help="every pack's all-reduce: one ring, two levels (within each machine, across "
                        "one GPU per machine, back), or the cost model's choice per pack and GPU count "
                        "(default: the plan's own, flat for --model)")
    p.add_argument("--devices-per-worker", type=int, default=8, metavar="N", help="GPUs per machine (default 8)")
    p.add_argument("--ps", type=int, metavar="N",
                   help="parameter-server tasks (default: the plan's count when it keeps variables there, "
                        "1 for --model with ps/hybrid, else 0)")
    p.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)), metavar="LIST",
                   help="GPU counts to simulate (default 1,2,4,...,1024)")
    p.add_argument("--intra-bandwidth", type=float, metavar="GB/S", help="within a machine (default 12)")
    p.add_argument("--inter-bandwidth", type=float, metavar="GB/S", help="between machines (default 1.25)")
    p.add_argument("--intra-latency", type=float, metavar="US", help="per message within a machine (default 10)")
    p.add_argument("--inter-latency", type=float, metavar="US", help="per message between machines (default 50)")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="global batch: sets the rows a sparse gradient moves (default 256)")
    p.add_argument("--png", metavar="FILE", help="also plot time and bytes per link against GPUs (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the data as JSON instead of the table")
    v = p.add_argument_group("validation (--validate: loopback clusters of real servers; takes minutes)")
    v.add_argument("--validate", action="store_true", help="measure what the model predicts on this machine")
    v.add_argument("--validate-workers", default="2,3", metavar="LIST",
                   help="allreduce cases' worker counts (default 2,3); 2 adds the case 2 workers + 1 ps")
    v.add_argument("--validate-hierarchical", action="store_true",
                   help="also 2 workers x 2 CPU devices with flat and with hierarchical packs")
    v.add_argument("--steps", type=int, default=20, help="steps per round and figure (default 20)")
    v.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    v.add_argument("--warmup", type=int, default=5, help="warm-up steps (default 5)")
    v.add_argument("--call-timeout", type=float, default=120.0, metavar="S",
                   help="bound on any one step, collective or session call (default 120)")
    v.add_argument("--start-timeout", type=float, default=120.0, metavar="S",
                   help="bound on a cluster's servers starting to listen (default 120)")
    return p


def _check(args):
    """Flag combinations and values argparse cannot check; raises UsageError."""
    if args.validate:
        for flag in ("plan", "model", "strategy", "png", "allreduce_algorithm"):
            if getattr(args, flag) is not None:
                name = "FILE" if flag == "plan" else f"--{flag.replace('_', '-')}"
                raise UsageError(f"--validate measures its own model and prints a table: {name} does not apply")
        args.validate_workers = _positive_list(args.validate_workers, "--validate-workers")
        if any(w < 2 for w in args.validate_workers):
            raise UsageError(f"--validate-workers needs counts of at least 2 (communication needs two servers), "
                             f"got {args.validate_workers}")
        for flag in ("steps", "rounds"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
        if args.warmup < 0:
            raise UsageError(f"--warmup must be at least 0, got {args.warmup}")
        for flag in ("call_timeout", "start_timeout"):
            if not getattr(args, flag) > 0:
                raise UsageError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
        return
    if (args.plan is None) == (args.model is None):
        raise UsageError("give a plan FILE (a rewritten graph or a plan .json) or --model NAME, one of them")
    if args.plan is not None:
        for flag in ("strategy", "bytes_per_pack", "ps_shard_bytes"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies to --model only: "
                                 f"a rewritten graph's plan fixes it")
    if args.bytes_per_pack is not None and args.bytes_per_pack < 0:
        raise UsageError(f"--bytes-per-pack must be 0 or a positive number of bytes, got {args.bytes_per_pack}")
    if args.ps_shard_bytes is not None and args.ps_shard_bytes < 0:
        raise UsageError(f"--ps-shard-bytes must be 0 or a positive number of bytes, got {args.ps_shard_bytes}")
    if args.devices_per_worker < 1:
        raise UsageError(f"--devices-per-worker must be at least 1, got {args.devices_per_worker}")
    if args.ps is not None and args.ps < 0:
        raise UsageError(f"--ps must be 0 or a positive number of ps tasks, got {args.ps}")
    args.gpus = _positive_list(args.gpus, "--gpus")
    if args.png is not None:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(folder):
            raise UsageError(f"--png {args.png}: folder '{folder}' does not exist")


def run(args):
    """The simulation table (or JSON) for the parsed, checked flags."""
    model = _cost_model(args)
    if args.model:
        strategy = args.strategy or "allreduce"
        ps = args.ps if args.ps is not None else (1 if strategy != "allreduce" else 0)
        plan = PlanView(synthetic_plan(
            args.model, strategy, num_ps=max(ps, 1),
            bytes_per_pack=DEFAULT_BYTES_PER_PACK if args.bytes_per_pack is None else args.bytes_per_pack,
            ps_shard_bytes=DEFAULT_PS_SHARD_BYTES if args.ps_shard_bytes is None else args.ps_shard_bytes),
            args.model)
        source = f"--model {args.model}: {MODELS[args.model][2]}"
    else:
        plan = load_plan(args.plan)
        ps = args.ps if args.ps is not None else (plan.num_ps if plan.ps_variables() else 0)
        source = args.plan
    multi = [g for g in args.gpus if g > args.devices_per_worker]
    if plan.ps_variables() and ps == 0 and multi:
        raise UsageError(f"--ps 0: the plan keeps {len(plan.ps_variables())} variable(s) on parameter servers, and "
                         f"{multi[0]} GPUs at --devices-per-worker {args.devices_per_worker} are several machines: "
                         f"give --ps N (N >= 1)")
    rows = simulate(plan, args.gpus, args.devices_per_worker, ps, model, args.allreduce_algorithm)
    header = (f"plan: {source} ({plan.describe()}"
              + (f", all-reduce {args.allreduce_algorithm}" if args.allreduce_algorithm else "")
              + f"); cluster: {args.devices_per_worker} GPUs per worker, "
              f"{ps} ps task(s); links: intra {model.intra_bandwidth / 1e9:g} GB/s {model.intra_latency * 1e6:g} us, "
              f"inter {model.inter_bandwidth / 1e9:g} GB/s {model.inter_latency * 1e6:g} us; "
              f"global batch {model.batch_size}")
    if args.png:
        write_png(rows, args.png, header if len(header) < 140 else header.replace("; cluster", ";\ncluster", 1))
    if args.json:
        print(json.dumps({"plan": source, "strategy": plan.strategy, "allreduce_algorithm": args.allreduce_algorithm,
                          "devices_per_worker": args.devices_per_worker,
                          "ps_tasks": ps, "cost_model": model.to_dict(), "rows": rows}, indent=1))
    else:
        print(f"# {args.command}")
        print(f"# {header}")
        print(format_table(rows))
        if args.png:
            print(f"wrote {args.png}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser().parse_args(argv)
    args.command = " ".join(["simulate.py"] + argv)
    try:
        _check(args)
        if not args.validate:
            run(args)
            return 0
        report = validate(args)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {' '.join(str(e).split())}\n")
        return 2
    except MeasurementError as e:
        sys.stderr.write(f"{PROG}: error: --validate failed: {e}\n")
        return 1
    if args.json:
        print(json.dumps(report, indent=1, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o)))
    else:
        print(f"# {args.command}   (cores: {os.cpu_count()})")
        print(format_validation(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
