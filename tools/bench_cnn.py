"""A small CNN on 2 CPU replicas: our rewrite against tf_cnn_benchmarks' replicated mode.

    python tools/bench_cnn.py --peer-dir DIR [--batch-size 128] [--num-batches 100] [--rounds 5]

DIR is a checkout of tf_cnn_benchmarks (the directory holding ``tf_cnn_benchmarks.py``,
or a checkout of tensorflow/benchmarks holding ``scripts/tf_cnn_benchmarks``) that the
user provides; nothing of it is copied here. Each round runs, each in a fresh process,
one after the other (the order alternates from round to round: this machine's speed
drifts):

- peer: the peer's own script,
  ``tf_cnn_benchmarks.py --model=lenet --device=cpu --num_gpus=2
  --local_parameter_device=cpu --variable_update=replicated --data_format=NHWC
  --batch_size=B/2 --num_batches=N --num_warmup_batches=W``
  (two CPU towers of B/2 images: ``--num_gpus`` is its tower count, and with
  ``--device=cpu`` it asks the session for that many CPU devices); its
  ``total images/sec`` line is parsed. It runs with ``TF_USE_LEGACY_KERAS=1``: on
  TensorFlow 2.16+ the script fails at import without it (``tf.nn.rnn_cell.BasicLSTMCell``
  "is not available with Keras 3", from its DeepSpeech model's class body), and with it
  ``tf.nn.rnn_cell`` comes from tf_keras.
- ours: the same model as a single-device tf.compat.v1 graph (the peer's lenet5 on its
  synthetic ImageNet shapes: 28x28x3 images, conv 5x5x32 SAME + ReLU, max-pool 2x2,
  conv 5x5x64 SAME + ReLU, max-pool 2x2, dense 512 + ReLU, dense 1001; mean sparse
  softmax cross-entropy plus 4e-5 times the L2 loss of every variable, plain SGD at
  0.005, as the peer's defaults), rewritten by graph_rewriter for 2 CPU replicas
  (``device_type="CPU", devices_per_worker=2``, and ``--allreduce-algorithm``) and trained through ``gr.Session``
  fed the global batch of B images (values as the peer's synthetic ones: normal, mean
  127, stddev 60, clipped to 2 stddevs; random labels). Images/sec over N steps after W
  warm-up steps, as the peer counts them (N * B / the loop's wall time).

Differences that stay: the peer's images live in a variable on each tower and it draws
labels in the graph, ours are fed every step (B x 28 x 28 x 3 float32: 1.2 MB at B=128);
the peer uses reference variables (it disables resource variables), ours resource
variables; the peer computes the L2 loss on its last tower only, each of our replicas
computes it (the single-device graph's loss, which the rewrite keeps).

Prints per round both figures and ours / peer (>= 1: ours is not slower), then the
medians.

    python tools/bench_cnn.py --plan-variant JSON [--rounds 3] [--num-batches 200]

measures, without the peer, what a change of the plan costs or saves on this model: our
rewrite as it is and the same rewrite given its plan with JSON's fields replaced
(``'{"invariant_terms": []}'``: every replica computes its weight decay's gradient
terms), each in its own session of one process (a fresh one per round), stepped in turn
with the order alternating, so both see the same machine; prints the milliseconds per
step of each (median) and the median of the per-step ratios, variant / as it is. ``--with-single`` adds two one-device runs per round, the peer with one tower
of B images (``--num_gpus=1``) and our single-device graph in a plain
tf.compat.v1.Session: the model's cost on each side without any replication.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

IMAGE, CHANNELS, CLASSES = 28, 3, 1001
WEIGHT_DECAY, LEARNING_RATE = 4e-5, 0.005


def peer_script(peer_dir):
    for d in (peer_dir, os.path.join(peer_dir, "scripts", "tf_cnn_benchmarks")):
        path = os.path.join(d, "tf_cnn_benchmarks.py")
        if os.path.isfile(path):
            return path
    raise SystemExit(f"no tf_cnn_benchmarks.py in {peer_dir} or {peer_dir}/scripts/tf_cnn_benchmarks")


def run_peer(script, batch, num_batches, warmup, timeout, towers=2):
    """The peer's images/sec (its 'total images/sec' line) for the global ``batch`` on
    ``towers`` CPU towers; SystemExit with the end of its output when it fails."""
    cmd = [sys.executable, os.path.basename(script), "--model=lenet", "--device=cpu", f"--num_gpus={towers}",
           "--local_parameter_device=cpu", "--variable_update=replicated", "--data_format=NHWC",
           f"--batch_size={batch // towers}", f"--num_batches={num_batches}", f"--num_warmup_batches={warmup}"]
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(cmd, cwd=os.path.dirname(script), capture_output=True, text=True,
                          timeout=timeout, env=env)
    found = re.findall(r"total images/sec: ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"the peer failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return float(found[-1])


def build_graph():
    """The single-device LeNet training graph (module doc)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        images = tf1.placeholder(tf.float32, [None, IMAGE, IMAGE, CHANNELS], name="images")
        labels = tf1.placeholder(tf.int32, [None], name="labels")

        def var(name, shape, init):
            return tf1.get_variable(name, shape, initializer=init, use_resource=True)

        h = images
        for i, (depth, cin) in enumerate(((32, CHANNELS), (64, 32))):
            w = var(f"conv{i}/kernel", [5, 5, cin, depth], tf1.variance_scaling_initializer())
            b = var(f"conv{i}/bias", [depth], tf1.zeros_initializer())
            h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, [1, 1, 1, 1], "SAME"), b))
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.reshape(h, [-1, 64 * 7 * 7])
        for i, (units, relu) in enumerate(((512, True), (CLASSES, False))):
            cin = int(h.shape[1])
            w = var(f"affine{i}/weights", [cin, units], tf1.truncated_normal_initializer(stddev=(1.0 / cin) ** 0.5))
            b = var(f"affine{i}/biases", [units], tf1.zeros_initializer())
            h = tf.matmul(h, w) + b
            if relu:
                h = tf.nn.relu(h)
        xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h))
        l2 = tf.add_n([tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
        loss = tf.identity(xent + WEIGHT_DECAY * l2, name="loss")
        tf1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def measure_ours(batch, num_batches, warmup, single=False, algorithm="flat"):
    """Images/sec of the rewritten graph on 2 CPU replicas through gr.Session (``single``:
    of the original graph on one device, in a plain tf.compat.v1.Session)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import graph_rewriter as gr
    graph_def = build_graph()
    rng = np.random.default_rng(0)
    batches = [(np.clip(rng.normal(127, 60, size=(batch, IMAGE, IMAGE, CHANNELS)), 7, 247).astype(np.float32),
                rng.integers(0, CLASSES - 1, size=batch).astype(np.int32)) for _ in range(4)]
    if single:
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        session = tf.compat.v1.Session(graph=graph)
    else:
        session = gr.Session(gr.rewrite(graph_def, device_type="CPU", devices_per_worker=2,
                                        allreduce_algorithm=algorithm))
    with session as sess:
        sess.run("init")
        for i in range(warmup):
            x, y = batches[i % 4]
            sess.run("train_op", {"images:0": x, "labels:0": y})
        start = time.perf_counter()
        for i in range(num_batches):
            x, y = batches[i % 4]
            sess.run("train_op", {"images:0": x, "labels:0": y})
        elapsed = time.perf_counter() - start
    return num_batches * batch / elapsed


def measure_plan_variant(batch, num_batches, warmup, algorithm, fields):
    """(ms per step as rewritten, ms per step with the plan's ``fields`` replaced, the
    median per-step ratio variant / as rewritten), the two stepped in turn in one process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import graph_rewriter as gr
    graph_def = build_graph()
    options = dict(device_type="CPU", devices_per_worker=2, allreduce_algorithm=algorithm)
    result = gr.rewrite(graph_def, **options)
    plan = {**result.plan.to_dict(), **fields}
    sessions = [gr.Session(result), gr.Session(gr.rewrite(graph_def, strategy=gr.Plan.from_dict(plan), **options))]
    rng = np.random.default_rng(0)
    batches = [{"images:0": np.clip(rng.normal(127, 60, size=(batch, IMAGE, IMAGE, CHANNELS)), 7, 247).astype(np.float32),
                "labels:0": rng.integers(0, CLASSES - 1, size=batch).astype(np.int32)} for _ in range(4)]
    times = [[], []]
    try:
        for sess in sessions:
            sess.run("init")
            for i in range(warmup):
                sess.run("train_op", batches[i % 4])
        for step in range(num_batches):
            for k in ((0, 1) if step % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                sessions[k].run("train_op", batches[step % 4])
                times[k].append(time.perf_counter() - start)
    finally:
        for sess in sessions:
            sess.close()
    return (1000 * statistics.median(times[0]), 1000 * statistics.median(times[1]),
            statistics.median(b / a for a, b in zip(*times)))


def run_ours(batch, num_batches, warmup, timeout, single=False, algorithm="flat"):
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-ours", "--batch-size", str(batch),
           "--num-batches", str(num_batches), "--warmup", str(warmup),
           "--allreduce-algorithm", algorithm] + (["--single"] if single else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise SystemExit(f"ours failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def run_plan_variant(args):
    """--plan-variant: a fresh process per round, each stepping both rewrites in turn."""
    try:
        fields = json.loads(args.plan_variant)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--plan-variant: not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise SystemExit("--plan-variant: give a JSON object of plan fields, e.g. '{\"invariant_terms\": []}'")
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}   (cores: {os.cpu_count()})")
    rounds = []
    for r in range(args.rounds):
        cmd = [sys.executable, os.path.abspath(__file__), "--measure-variant", "--plan-variant", args.plan_variant,
               "--batch-size", str(args.batch_size), "--num-batches", str(args.num_batches),
               "--warmup", str(args.warmup), "--allreduce-algorithm", args.allreduce_algorithm]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        if proc.returncode != 0:
            raise SystemExit(f"the measurement failed:\n{proc.stderr[-3000:]}")
        plain, variant, ratio = json.loads(proc.stdout.strip().splitlines()[-1])
        rounds.append((plain, variant, ratio))
        print(f"round {r + 1}: as rewritten {plain:.2f} ms/step, variant {variant:.2f} ms/step, "
              f"variant / as rewritten {ratio:.3f}", flush=True)
    print(f"as rewritten: {statistics.median(x[0] for x in rounds):.2f} ms/step, variant: "
          f"{statistics.median(x[1] for x in rounds):.2f} ms/step (medians); variant / as rewritten = "
          f"{statistics.median(x[2] for x in rounds):.3f} (median of the rounds' per-step medians)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-dir", help="a checkout of tf_cnn_benchmarks (required unless --measure-ours)")
    p.add_argument("--batch-size", type=int, default=128, help="global batch (each of the 2 replicas: half)")
    p.add_argument("--num-batches", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing (the peer's default: 10)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--with-single", action="store_true",
                   help="also run both sides on one device (the peer with one tower) each round")
    p.add_argument("--allreduce-algorithm", default="flat", choices=("flat", "reduce_to_one", "auto"),
                   help="our rewrite's allreduce_algorithm (default: flat, the rewrite's default)")
    p.add_argument("--plan-variant", metavar="JSON",
                   help="measure our rewrite against the same rewrite given its plan with these fields "
                        "replaced, in one process (no peer); e.g. '{\"invariant_terms\": []}'")
    p.add_argument("--measure-ours", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-variant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch_size % 2:
        p.error("--batch-size must be even (2 replicas)")
    if args.measure_ours:
        print(measure_ours(args.batch_size, args.num_batches, args.warmup, args.single, args.allreduce_algorithm))
        return
    if args.measure_variant:
        print(json.dumps(measure_plan_variant(args.batch_size, args.num_batches, args.warmup,
                                              args.allreduce_algorithm, json.loads(args.plan_variant))))
        return
    if args.plan_variant:
        run_plan_variant(args)
        return
    if not args.peer_dir:
        p.error("--peer-dir is required")
    script = peer_script(args.peer_dir)
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}   (cores: {os.cpu_count()})")
    rounds = []
    kinds = ("peer", "ours") + (("peer_1", "ours_1") if args.with_single else ())
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        got = {}
        for who in order:
            if who.startswith("peer"):
                got[who] = run_peer(script, args.batch_size, args.num_batches, args.warmup, args.timeout,
                                    towers=1 if who == "peer_1" else 2)
            else:
                got[who] = run_ours(args.batch_size, args.num_batches, args.warmup, args.timeout,
                                    single=who == "ours_1", algorithm=args.allreduce_algorithm)
        rounds.append(got)
        extra = (f"; one device: peer {got['peer_1']:.1f}, ours {got['ours_1']:.1f}, ours / peer "
                 f"{got['ours_1'] / got['peer_1']:.3f}" if args.with_single else "")
        print(f"round {r + 1} ({' then '.join(order)}): peer {got['peer']:.1f} images/sec, "
              f"ours {got['ours']:.1f} images/sec, ours / peer {got['ours'] / got['peer']:.3f}{extra}", flush=True)
    for k in kinds:
        print(f"{k:>6}: {statistics.median(x[k] for x in rounds):.1f} images/sec (median)")
    print(f"ours / peer = {statistics.median(x['ours'] / x['peer'] for x in rounds):.3f} "
          f"(median of per-round ratios; >= 1: ours is not slower)")
    if args.with_single:
        print(f"one device: ours / peer = {statistics.median(x['ours_1'] / x['peer_1'] for x in rounds):.3f}; "
              f"2 replicas / one device: peer {statistics.median(x['peer'] / x['peer_1'] for x in rounds):.3f}, "
              f"ours {statistics.median(x['ours'] / x['ours_1'] for x in rounds):.3f}")


if __name__ == "__main__":
    main()
