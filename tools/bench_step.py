"""Step time of emitted graphs: one device, the rewritten graph, tf.distribute.

    python tools/bench_step.py [--replicas 2] [--steps 100] [--warmup 20] [--device-type CPU|GPU]
                               [--kinds single,rewritten,mirrored,no_comm] [--variant NAME=JSON ...]
                               [--dropout RATE]

The same model three ways, each in a fresh process, on this machine's CPU:

- one device: a tf.compat.v1 MLP (input 1024, 3 hidden layers of 1024, 10 classes,
  softmax cross-entropy, Momentum 0.9), global batch 512;
- rewritten: that graph rewritten by graph_rewriter for --replicas CPU replicas
  (allreduce), run through graph_rewriter.Session on the same batches;
- MirroredStrategy: TensorFlow's own tf.distribute.MirroredStrategy over --replicas
  logical CPUs running the same model (tf_keras layers, SGD momentum, tf.function step);
- no communication: the rewritten graph with every CollectiveReduceV2 replaced by an
  Identity of its input (each replica applies its own gradient: numerically wrong, and
  only a measurement): the step time that no way of averaging gradients can beat.

Prints median step times and the ratios the performance targets name
(rewritten/one device, rewritten/MirroredStrategy). The figures in
docs/performance.md come from this script.

``--kinds`` picks the runs of a round (in that order). ``--variant NAME=JSON`` adds two
runs per round, ``rewritten@NAME`` and ``no_comm@NAME``: the graph rewritten with the
rewrite keywords JSON (e.g. ``old='{"bytes_per_pack": 33554432}'``), so that two rewrite
choices are compared in the same interleaved rounds; their ratios to each other and to
their own no-communication run are printed per round and as medians (with
``--same-process``, each variant's rewritten run is also divided by the plain
no-communication run: the bound, which a variant without collectives, such as
``allreduce_algorithm="reduce_to_one"``, cannot be measured against otherwise).

``--same-process`` measures the rewritten runs (rewritten, no_comm and every variant's)
in one process instead, each in its own session, one step of each in turn (the order
rotating from step to step): each cycle of steps gives per-step ratios taken within
milliseconds of each other, immune to the drift between processes that other jobs on
a shared machine cause. Their medians over every cycle of every round are printed.

``--dropout RATE`` adds a seeded dropout after every hidden layer (a Keras Dropout in the
MirroredStrategy model). The rewritten graph then draws every replica's rows of each
mask on each replica (docs/semantics.md, "Random ops"); a variant whose JSON has
``"random_draws": []`` (the plan's field, not a rewrite keyword) keeps the clones'
draws, so ``--variant clones='{"random_draws": []}'`` measures what that costs.

``--device-type GPU`` measures the same on GPUs instead: one device is GPU:0, the
rewritten graph's replicas GPU:0..N-1, MirroredStrategy mirrors over /gpu:0..N-1
(tools/gpu_readiness.py uses ``run_measure`` this way).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

FEATURES, HIDDEN, LAYERS, CLASSES, BATCH = 1024, 1024, 3, 10, 512


def _batches(n):
    import numpy as np
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, size=BATCH).astype(np.int32)) for _ in range(n)]


def _graph(dropout=0.0):
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        h = x
        for i in range(LAYERS):
            w = tf1.get_variable(f"dense_{i}/kernel", [h.shape[1], HIDDEN], use_resource=True)
            b = tf1.get_variable(f"dense_{i}/bias", [HIDDEN], initializer=tf1.zeros_initializer(), use_resource=True)
            h = tf.nn.relu(tf.matmul(h, w) + b)
            if dropout:
                h = tf.nn.dropout(h, rate=dropout)
        w = tf1.get_variable("logits/kernel", [HIDDEN, CLASSES], use_resource=True)
        logits = tf.matmul(h, w)
        loss = tf.identity(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)),
                           name="loss")
        tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _time(run, batches, steps, warmup):
    for i in range(warmup):
        run(*batches[i % len(batches)])
    times = []
    for i in range(steps):
        start = time.perf_counter()
        run(*batches[i % len(batches)])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind, replicas, steps, warmup, device_type="CPU", options=None, dropout=0.0):
    """Median seconds per step of one ``kind`` ("single", "rewritten", "mirrored",
    "no_comm") in this process, its replicas on ``device_type`` ("CPU": logical CPUs;
    "GPU": GPU:0..replicas-1); ``options``: more rewrite keywords (rewritten, no_comm);
    ``dropout``: a seeded dropout at that rate after every hidden layer."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    batches = _batches(8)
    if kind == "mirrored":
        if device_type == "CPU":
            cpus = tf.config.list_physical_devices("CPU")
            tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
        import tf_keras
        strategy = tf.distribute.MirroredStrategy([f"/{device_type.lower()}:{i}" for i in range(replicas)])
        with strategy.scope():
            layers = []
            for _ in range(LAYERS):
                layers.append(tf_keras.layers.Dense(HIDDEN, activation="relu"))
                if dropout:
                    layers.append(tf_keras.layers.Dropout(dropout, seed=0))
            model = tf_keras.Sequential(layers + [tf_keras.layers.Dense(CLASSES, use_bias=False)])
            model.build((None, FEATURES))
            opt = tf_keras.optimizers.SGD(0.01, momentum=0.9)
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=BATCH)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
            return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

        datasets = [strategy.experimental_distribute_values_from_function(
            lambda ctx, x=x, y=y: (x[ctx.replica_id_in_sync_group::replicas], y[ctx.replica_id_in_sync_group::replicas]))
            for x, y in batches]
        seconds = _time(lambda xy: step(*xy), [(d,) for d in datasets], steps, warmup)
        return {"kind": kind, "seconds": seconds}
    tf.compat.v1.disable_eager_execution()
    gd = _graph(dropout)
    if kind == "single":
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(gd, name="")
        sess = tf.compat.v1.Session(graph=graph)
    else:
        import graph_rewriter as gr
        result = _rewrite(gd, replicas, device_type, options)
        if kind == "no_comm":
            _drop_collectives(result.graph_def)
        sess = gr.Session(result)
    sess.run("init")
    seconds = _time(lambda x, y: sess.run("train_op", {"x:0": x, "y:0": y}), batches, steps, warmup)
    sess.close()
    return {"kind": kind, "seconds": seconds}


def _rewrite(gd, replicas, device_type, options):
    """gr.rewrite with the rewrite keywords ``options``; their key "random_draws" (a list)
    is the plan's field instead: ``[]`` keeps the clones' draws (docs/semantics.md,
    "Random ops"), to measure what drawing every replica's rows costs."""
    import graph_rewriter as gr
    options = dict(options or {})
    draws = options.pop("random_draws", None)
    keywords = dict(devices_per_worker=replicas, device_type=device_type, **options)
    if draws is None:
        return gr.rewrite(gd, **keywords)
    plan = gr.rewrite(gd, **keywords).plan
    plan.random_draws = draws
    return gr.rewrite(gd, **dict(keywords, strategy=plan))


def measure_together(runs, replicas, steps, warmup, device_type="CPU", dropout=0.0):
    """``runs``: {name: (kind, rewrite keywords)} of kinds "rewritten" and "no_comm", each
    in its own gr.Session of this process, stepped in turn (module doc). Returns
    {name: [seconds of each step]} (the same step count for every run, aligned by cycle)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import graph_rewriter as gr
    batches = _batches(8)
    gd = _graph(dropout)
    sessions = {}
    for name, (kind, options) in runs.items():
        result = _rewrite(gd, replicas, device_type, options)
        if kind == "no_comm":
            _drop_collectives(result.graph_def)
        elif kind != "rewritten":
            raise ValueError(f"--same-process runs rewritten graphs only, not {kind!r}")
        sessions[name] = gr.Session(result)
        sessions[name].run("init")
    names = list(sessions)
    times = {name: [] for name in names}
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            sessions[name].run("train_op", {"x:0": x, "y:0": y})
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    for sess in sessions.values():
        sess.close()
    return times


def _drop_collectives(graph_def):
    """Replaces every all-reduce by an Identity of the tensor it would reduce (in place)."""
    for n in graph_def.node:
        if n.op == "CollectiveReduceV2":
            data = [n.input[0]] + [i for i in n.input if i.startswith("^")]
            dtype = n.attr["T"].type
            n.op = "Identity"
            del n.input[:]
            n.input.extend(data)
            for key in list(n.attr):
                del n.attr[key]
            n.attr["T"].type = dtype


def run_measure(kind, replicas, steps, warmup, device_type="CPU", options=None, dropout=0.0):
    """``measure`` in a fresh process (this script with --measure): median seconds per
    step. A failed measurement raises RuntimeError with the end of its stderr."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", kind, "--replicas", str(replicas),
           "--steps", str(steps), "--warmup", str(warmup), "--device-type", device_type,
           "--options", json.dumps(options or {}), "--dropout", str(dropout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def _same_process(args, runs):
    """--same-process: every round one process stepping every run in turn."""
    cmd = [sys.executable, os.path.abspath(__file__), "--together", json.dumps(runs), "--replicas",
           str(args.replicas), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device-type", args.device_type, "--dropout", str(args.dropout)]
    names = list(runs)
    first = names[0]
    all_times = {n: [] for n in names}
    for r in range(args.rounds):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        if proc.returncode != 0:
            raise SystemExit(f"round {r + 1} failed:\n{proc.stderr[-3000:]}")
        times = json.loads(proc.stdout.strip().splitlines()[-1])
        for n in names:
            all_times[n].extend(times[n])
        print(f"round {r + 1}: " + ", ".join(
            f"{n} {statistics.median(times[n]) * 1000:.1f} ms" + (
                f" ({statistics.median(a / b for a, b in zip(times[n], times[first])):.3f}x {first})"
                if n != first else "") for n in names), flush=True)
    print(f"all rounds, {len(all_times[first])} cycles (median step; median of per-cycle ratios):")
    for n in names:
        print(f"{n:>24}: {statistics.median(all_times[n]) * 1000:8.1f} ms/step")
    pairs = [(a, b) for a in names for b in names
             if a.startswith("rewritten") and b == "no_comm" + a[len("rewritten"):]]
    pairs += [(a, first) for a in names[1:] if a.startswith("rewritten")]
    if "no_comm" in names:   # the bound: a variant without collectives has no no_comm of its own
        pairs += [(a, "no_comm") for a in names if a.startswith("rewritten@")]
    for a, b in pairs:
        print(f"{a} / {b} = {statistics.median(x / y for x, y in zip(all_times[a], all_times[b])):.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (one device, rewritten, MirroredStrategy, no communication); ratios are per round, "
                        "then the median: the machine's speed drifts between processes")
    p.add_argument("--device-type", choices=("CPU", "GPU"), default="CPU",
                   help="where the replicas run (GPU: one device is GPU:0, the replicas GPU:0..N-1)")
    p.add_argument("--kinds", default="single,rewritten,mirrored,no_comm",
                   help="the runs of a round, comma-separated (single, rewritten, mirrored, no_comm)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="also run rewritten@NAME and no_comm@NAME, rewritten with these rewrite keywords")
    p.add_argument("--same-process", action="store_true",
                   help="step the rewritten runs in turn within one process per round (module doc)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="a seeded dropout at this rate after every hidden layer (0: none); with "
                        "--variant NAME='{\"random_draws\": []}' the rewritten graph keeps the clones' draws")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--together", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.together:
        runs = json.loads(args.together)
        print(json.dumps(measure_together(runs, args.replicas, args.steps, args.warmup, args.device_type,
                                          args.dropout)))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args.replicas, args.steps, args.warmup, args.device_type,
                                 json.loads(args.options), args.dropout)))
        return
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}   (cores: {os.cpu_count()})")
    kinds = [k for k in args.kinds.split(",") if k]
    runs = {k: (k, {}) for k in kinds}
    for v in args.variant:
        name, _, options = v.partition("=")
        for k in ("rewritten", "no_comm"):
            runs[f"{k}@{name}"] = (k, json.loads(options))
    kinds = list(runs)
    if args.same_process:
        _same_process(args, runs)
        return
    rounds = []
    for r in range(args.rounds):
        results = {}
        for kind, (base, options) in runs.items():
            try:
                results[kind] = run_measure(base, args.replicas, args.steps, args.warmup, args.device_type,
                                            options, args.dropout)
            except RuntimeError as e:
                raise SystemExit(str(e)) from None
        rounds.append(results)
        print(f"round {r + 1}: " + ", ".join(f"{k} {results[k] * 1000:.1f} ms/step" for k in kinds), flush=True)

    def ratio(a, b):
        return statistics.median(x[a] / x[b] for x in rounds)
    for kind in kinds:
        print(f"{kind:>10}: {statistics.median(x[kind] for x in rounds) * 1000:8.1f} ms/step (median)")
    for v in args.variant:
        name = v.partition("=")[0]
        per_round = ", ".join(f"{x[f'rewritten@{name}'] / x[f'no_comm@{name}']:.3f}" for x in rounds)
        print(f"rewritten@{name} / no_comm@{name} = {ratio(f'rewritten@{name}', f'no_comm@{name}'):.3f}"
              f"   (per round: {per_round})")
        if "rewritten" in kinds:
            per_round = ", ".join(f"{x['rewritten'] / x[f'rewritten@{name}']:.3f}" for x in rounds)
            print(f"rewritten / rewritten@{name} = {ratio('rewritten', f'rewritten@{name}'):.3f}"
                  f"   (per round: {per_round})")
    if not {"single", "rewritten", "mirrored", "no_comm"} <= set(kinds):
        if {"rewritten", "no_comm"} <= set(kinds):
            per_round = ", ".join(f"{x['rewritten'] / x['no_comm']:.3f}" for x in rounds)
            print(f"rewritten / no communication = {ratio('rewritten', 'no_comm'):.3f}   (per round: {per_round})")
        return
    print(f"rewritten / one device       = {ratio('rewritten', 'single'):.2f}   (target <= 1.2; median of rounds)")
    print(f"rewritten / MirroredStrategy = {ratio('rewritten', 'mirrored'):.2f}   (target <= 0.75)")
    print(f"MirroredStrategy / one device = {ratio('mirrored', 'single'):.2f}")
    per_round = ", ".join(f"{x['rewritten'] / x['no_comm']:.3f}" for x in rounds)
    print(f"rewritten / no communication = {ratio('rewritten', 'no_comm'):.3f}   (per round: {per_round})")
    print(f"no communication / one device = {ratio('no_comm', 'single'):.2f}   "
          f"(no_comm / MirroredStrategy = {ratio('no_comm', 'mirrored'):.2f}: the best any reduction reaches)")


if __name__ == "__main__":
    main()
