"""Step time of emitted graphs: one device, the rewritten graph, tf.distribute.

    python tools/bench_step.py [--replicas 2] [--steps 100] [--warmup 20] [--device-type CPU|GPU]

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


def _graph():
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


def measure(kind, replicas, steps, warmup, device_type="CPU"):
    """Median seconds per step of one ``kind`` ("single", "rewritten", "mirrored",
    "no_comm") in this process, its replicas on ``device_type`` ("CPU": logical CPUs;
    "GPU": GPU:0..replicas-1)."""
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
            model = tf_keras.Sequential([tf_keras.layers.Dense(HIDDEN, activation="relu") for _ in range(LAYERS)]
                                        + [tf_keras.layers.Dense(CLASSES, use_bias=False)])
            model.build((None, FEATURES))
            opt = tf_keras.optimizers.SGD(0.01, momentum=0.9)
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(y, model(x)), global_batch_size=BATCH)
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
    gd = _graph()
    if kind == "single":
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(gd, name="")
        sess = tf.compat.v1.Session(graph=graph)
    else:
        import graph_rewriter as gr
        result = gr.rewrite(gd, devices_per_worker=replicas, device_type=device_type)
        if kind == "no_comm":
            _drop_collectives(result.graph_def)
        sess = gr.Session(result)
    sess.run("init")
    seconds = _time(lambda x, y: sess.run("train_op", {"x:0": x, "y:0": y}), batches, steps, warmup)
    sess.close()
    return {"kind": kind, "seconds": seconds}


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


def run_measure(kind, replicas, steps, warmup, device_type="CPU"):
    """``measure`` in a fresh process (this script with --measure): median seconds per
    step. A failed measurement raises RuntimeError with the end of its stderr."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", kind, "--replicas", str(replicas),
           "--steps", str(steps), "--warmup", str(warmup), "--device-type", device_type]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


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
    p.add_argument("--measure", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.replicas, args.steps, args.warmup, args.device_type)))
        return
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}   (cores: {os.cpu_count()})")
    kinds = ("single", "rewritten", "mirrored", "no_comm")
    rounds = []
    for r in range(args.rounds):
        results = {}
        for kind in kinds:
            try:
                results[kind] = run_measure(kind, args.replicas, args.steps, args.warmup, args.device_type)
            except RuntimeError as e:
                raise SystemExit(str(e)) from None
        rounds.append(results)
        print(f"round {r + 1}: " + ", ".join(f"{k} {results[k] * 1000:.1f} ms/step" for k in kinds), flush=True)

    def ratio(a, b):
        return statistics.median(x[a] / x[b] for x in rounds)
    for kind in kinds:
        print(f"{kind:>10}: {statistics.median(x[kind] for x in rounds) * 1000:8.1f} ms/step (median)")
    print(f"rewritten / one device       = {ratio('rewritten', 'single'):.2f}   (target <= 1.2; median of rounds)")
    print(f"rewritten / MirroredStrategy = {ratio('rewritten', 'mirrored'):.2f}   (target <= 0.75)")
    print(f"MirroredStrategy / one device = {ratio('mirrored', 'single'):.2f}")
    print(f"no communication / one device = {ratio('no_comm', 'single'):.2f}   "
          f"(no_comm / MirroredStrategy = {ratio('no_comm', 'mirrored'):.2f}: the best any reduction reaches)")


if __name__ == "__main__":
    main()
