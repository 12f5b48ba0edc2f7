"""Synchronised BatchNorm on a deep network: how close 2 replicas come to one device.

tests/test_sync_batch_statistics.py shows small networks equal to one device to 1e-7.
A deep one at initialisation (tf_keras' ResNet50, 53 BatchNorms, called with
training=True) is sensitive to float rounding itself: a ReLU or max-pool whose input is
near a tie flips under a different summation order, and its gradient flips with it. So
this compares four runs of one training step on the same graph and batch against one
device with oneDNN's kernels: one device with Eigen's kernels instead
(TF_ENABLE_ONEDNN_OPTS=0, the float noise of the model itself), 2 CPU replicas with
sync_batch_statistics, and 2 without. Each run is its own process (the oneDNN switch is
read at import). Prints, per kind of variable, the median and largest norm-relative
difference ||a - b|| / ||b|| after the step (a convolution's bias before a BatchNorm has
a gradient of zero, which rounding makes a small random value: its relative difference is
about 1 in every run).

    python tools/check_sync_batch_norm.py [--batch 64] [--image 32] [--learning-phase]

``--learning-phase`` calls the model without ``training``, as a Keras script in a TF1
graph does, and feeds the Keras learning phase True: each BatchNorm is then in a v2
cond, which the rewrite lowers to Switch and Merge to sync it (passes/lower_conds.py).

Needs tensorflow and tf-keras. About two minutes on 2 cores.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

RUNS = (("one device, Eigen kernels", "one", "0"), ("2 replicas, sync_batch_statistics", "sync", "1"),
        ("2 replicas, per-replica statistics", "nosync", "1"))


def build(path, image, learning_phase=False):
    """tf_keras ResNet50 (random init, 10 classes) called on x with training=True (or
    behind the learning phase), its updates for x and a Momentum step in train_op;
    written to ``path``."""
    import tensorflow as tf
    import tf_keras
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        model = tf_keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=10)
        x = tf1.placeholder(tf.float32, (None, image, image, 3), name="x")
        y = tf1.placeholder(tf.int64, (None,), name="y")
        out = model(x) if learning_phase else model(x, training=True)
        loss = tf.identity(tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(y, out)), name="loss")
        tf.group(tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss), *model.get_updates_for(x), name="train_op")
        tf1.global_variables_initializer()
    with open(path, "wb") as f:   # tf_keras seeds its initialisers at random: one graph for every run
        f.write(g.as_graph_def().SerializeToString())


def run(graph_path, mode, batch, image, out):
    """One step of the graph at ``graph_path`` (mode one, sync or nosync); the loss and
    every variable after it, saved to ``out``."""
    import tensorflow as tf
    import graph_rewriter as gr
    tf1 = tf.compat.v1
    with open(graph_path, "rb") as f:
        gd = tf1.GraphDef.FromString(f.read())
    rng = np.random.RandomState(0)
    feed = {"x:0": rng.randn(batch, image, image, 3).astype(np.float32), "y:0": rng.randint(0, 10, batch)}
    if any(n.name == "keras_learning_phase" for n in gd.node):
        feed["keras_learning_phase:0"] = True
    reads = {n.name: n.name + "/Read/ReadVariableOp:0" for n in gd.node if n.op == "VarHandleOp"}
    if mode == "one":
        g = tf.Graph()
        with g.as_default():
            tf1.import_graph_def(gd, name="")
        sess = tf1.Session(graph=g)
    else:
        sess = gr.Session(gr.rewrite(gd, devices_per_worker=2, device_type="CPU",
                                     sync_batch_statistics=mode == "sync"))
    with sess:
        sess.run("init")
        loss = sess.run(["loss:0", "train_op"], feed)[0]
        values = sess.run(reads)
    np.savez(out, loss=loss, **{k.replace("/", "|"): v for k, v in values.items()})


def differences(a_path, b_path):
    """{kind of variable: (median, largest) norm-relative difference}, and the losses."""
    a, b = np.load(a_path), np.load(b_path)
    kinds = {}
    for k in b.files:
        if k == "loss" or "Momentum" in k:
            continue
        kinds.setdefault(k.rsplit("|", 1)[1], []).append(
            float(np.linalg.norm(a[k] - b[k]) / (np.linalg.norm(b[k]) + 1e-12)))
    return {kind: (float(np.median(v)), max(v)) for kind, v in sorted(kinds.items())}, float(a["loss"]), float(b["loss"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--image", type=int, default=32, help="image side (default 32)")
    parser.add_argument("--learning-phase", action="store_true",
                        help="call the model behind the Keras learning phase (fed True), not training=True")
    parser.add_argument("--run", nargs=3, metavar=("GRAPH", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        run(args.run[0], args.run[1], args.batch, args.image, args.run[2])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        graph = os.path.join(tmp, "resnet50.pb")
        build(graph, args.image, args.learning_phase)
        outs = {}
        for _, mode, onednn in (("", "reference", "1"),) + RUNS:
            outs[mode] = os.path.join(tmp, f"{mode}.npz")
            env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="3")
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--image", str(args.image),
                   "--run", graph, "one" if mode == "reference" else mode, outs[mode]]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        print(f"tf_keras ResNet50{' behind the learning phase' if args.learning_phase else ''}, "
              f"{args.image}x{args.image} images, global batch {args.batch}, one Momentum step; "
              "against one device (oneDNN kernels): norm-relative difference, median / largest")
        for label, mode, _ in RUNS:
            kinds, loss, reference = differences(outs[mode], outs["reference"])
            print(f"  {label:<36} loss {loss:.6f} vs {reference:.6f}; "
                  + ", ".join(f"{kind} {m:.2g} / {top:.2g}" for kind, (m, top) in kinds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
