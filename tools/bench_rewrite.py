"""Rewrite speed and memory: graph_rewriter against its floor and its peer.

    python tools/bench_rewrite.py [--models resnet50,densenet121,nasnetmobile,bert24]
                                  [--replicas 2,4,8,16,64] [--peer-replicas 16] [--repeat 3]
                                  [--strategy allreduce] [--ps 0]

For each model's training graph (tf_keras applications, or bertL: the suite's BERT with
L layers; built once, cached in --cache-dir) and each
replica count R, prints (medians over --repeat runs, each in a fresh process):

- floor: copying the input's nodes R times into one GraphDef and serializing it;
- ours: graph_rewriter.rewrite(serialized input, devices_per_worker=R, GPU, --strategy)
  end to end (parse, passes, verifier, export) plus serializing the result; with
  ``--ps N`` on a cluster of N ps tasks and one worker holding the R GPUs (in-graph), as
  the ps and hybrid strategies need parameter servers;
- peer: one tf.import_graph_def per replica into a tf.Graph, then serializing it (how
  AutoDist's and Parallax's replicators clone), for R in --peer-replicas only (slow);
- peak memory: the rewrite process's peak resident size above its size before the
  rewrite, against the serialized output's size.

Ratios are computed in one run because the machine is noisy: the runs are interleaved
in rounds (floor, ours, peer), each ratio is taken within a round, and the table shows
the median of the per-round ratios next to the median seconds. The figures in
docs/performance.md come from this script; the command line is printed with them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def build_model(name, path):
    """A tf_keras model's single-device training graph (SGD with momentum, BatchNorm
    updates included), serialized to ``path``; ``bertL`` (bert2, bert24): the test suite's
    BERT-style classifier (graph_rewriter/testing/real_models.py: global-norm clipping, a
    hand-written AdamW, dropout 0.1) with L encoder layers, to see the cost grow with depth."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if name.startswith("bert") and name[4:].isdigit():
        from graph_rewriter.testing import real_models
        example, _ = real_models.build_bert(dropout=0.1, layers=int(name[4:]))
        with open(path, "wb") as f:
            f.write(example.graph_def.SerializeToString())
        return
    import tensorflow as tf
    import tf_keras
    tf.compat.v1.disable_eager_execution()
    ctors = {"resnet50": tf_keras.applications.ResNet50, "densenet121": tf_keras.applications.DenseNet121,
             "nasnetmobile": tf_keras.applications.NASNetMobile, "mobilenetv2": tf_keras.applications.MobileNetV2}
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        model = ctors[name](weights=None, input_shape=(224, 224, 3), classes=10)
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        loss = tf.identity(tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(labels, model.output)),
                           name="loss")
        opt = tf_keras.optimizers.legacy.SGD(0.01, momentum=0.9)
        tf.group(*opt.get_updates(loss, model.trainable_weights), *model.updates, name="train_op")
        tf.compat.v1.variables_initializer(tf.compat.v1.global_variables() + opt.variables(), name="init")
    with open(path, "wb") as f:
        f.write(g.as_graph_def().SerializeToString())


def _cluster(ps):
    """The rewrite's cluster: None (this machine), or N ps tasks and one worker."""
    if not ps:
        return None
    return {"ps": [f"ps{k}:2222" for k in range(ps)], "worker": ["worker0:2222"]}


def _measure(kind, path, replicas, strategy="allreduce", ps=0):
    """Runs in a fresh process; prints one JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import resource

    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    with open(path, "rb") as f:
        data = f.read()
    gd = tf.compat.v1.GraphDef.FromString(data)
    if kind == "ours":
        # Imported before the clock starts, as TensorFlow is for every column: a
        # once-per-process cost, not part of a rewrite. (graph_rewriter loads its API
        # module, and with it the passes, on first use of ``rewrite``.)
        from graph_rewriter import rewrite
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"kind": kind, "replicas": replicas, "nodes_in": len(gd.node)}
    start = time.perf_counter()
    if kind == "floor":
        copy = tf.compat.v1.GraphDef()
        for _ in range(replicas):
            copy.node.extend(gd.node)
        result = copy.SerializeToString()
        out["nodes_out"] = len(copy.node)
    elif kind == "peer":
        graph = tf.Graph()
        with graph.as_default():
            for r in range(replicas):
                tf.compat.v1.import_graph_def(gd, name=f"replica_{r}")
        result = graph.as_graph_def().SerializeToString()
    else:
        res = rewrite(data, _cluster(ps), devices_per_worker=replicas, device_type="GPU", strategy=strategy)
        result = res.serialized()   # what save() and the CLI write
        out["nodes_out"] = res.num_nodes
        passes = {}
        for name, s, _ in res.timings:      # the verifier runs many times: its total
            passes[name] = passes.get(name, 0.0) + s
        out["passes"] = {name: round(s, 4) for name, s in passes.items()}
    out["seconds"] = time.perf_counter() - start
    out["bytes_out"] = len(result)
    out["peak_extra_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024
    print(json.dumps(out))


def _run(kind, path, replicas, timeout, strategy="allreduce", ps=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", kind, path, str(replicas),
           "--strategy", strategy, "--ps", str(ps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        raise SystemExit(f"{kind} R={replicas} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,densenet121,nasnetmobile")
    # small replica counts first: one machine's GPUs are the common case, and there the
    # fixed cost of a rewrite (analysis, plan, verification) weighs most against the floor
    p.add_argument("--replicas", default="2,4,8,16,64")
    p.add_argument("--peer-replicas", default="16")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "graph_rewriter_bench"))
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--strategy", default="allreduce", help="the rewrite's strategy (ours only)")
    p.add_argument("--ps", type=int, default=0,
                   help="parameter-server tasks: rewrite for N ps tasks and one worker (ours only)")
    p.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--build-model", nargs=2, help=argparse.SUPPRESS)   # NAME PATH, in a fresh process
    args = p.parse_args()
    if args.build_model:
        return build_model(*args.build_model)
    if args.measure:
        kind, path, replicas = args.measure
        return _measure(kind, path, int(replicas), args.strategy, args.ps)
    os.makedirs(args.cache_dir, exist_ok=True)
    rows = []
    print(f"# {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}   (cores: {os.cpu_count()})")
    print(f"{'model':13} {'nodes':>6} {'R':>3} {'floor s':>8} {'ours s':>8} {'ours/floor':>10} "
          f"{'peer s':>8} {'peer/ours':>9} {'out MB':>7} {'peak/out':>8}")
    for model in args.models.split(","):
        path = os.path.join(args.cache_dir, f"{model}.pb")
        if not os.path.exists(path):
            subprocess.run([sys.executable, os.path.abspath(__file__), "--build-model", model, path],
                           check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        for r in [int(x) for x in args.replicas.split(",")]:
            # Interleaved rounds (floor, ours, then peer in the first rounds): this
            # machine's speed drifts by tens of percent over minutes, so each ratio is
            # taken within a round, then the median over rounds.
            with_peer = str(r) in args.peer_replicas.split(",")
            floor, ours, peer = [], [], []
            for k in range(args.repeat):
                floor.append(_run("floor", path, r, 600))
                ours.append(_run("ours", path, r, 3600, args.strategy, args.ps))
                if with_peer and k < max(1, args.repeat // 3):
                    peer.append(_run("peer", path, r, 3600))
            f_s = statistics.median(m["seconds"] for m in floor)
            o_s = statistics.median(m["seconds"] for m in ours)
            p_s = statistics.median(m["seconds"] for m in peer) if peer else None
            ours_floor = statistics.median(o["seconds"] / f["seconds"] for o, f in zip(ours, floor))
            peer_ours = statistics.median(p["seconds"] / o["seconds"] for p, o in zip(peer, ours)) if peer else None
            out_b = ours[0]["bytes_out"]
            peak = statistics.median(m["peak_extra_bytes"] for m in ours)
            row = {"model": model, "nodes_in": ours[0]["nodes_in"], "nodes_out": ours[0]["nodes_out"],
                   "replicas": r, "floor_s": f_s, "ours_s": o_s, "peer_s": p_s, "out_bytes": out_b,
                   "peak_extra_bytes": peak, "passes": ours[0]["passes"],
                   "ours_over_floor": ours_floor, "peer_over_ours": peer_ours}
            rows.append(row)
            print(f"{model:13} {row['nodes_in']:>6} {r:>3} {f_s:>8.2f} {o_s:>8.2f} {ours_floor:>10.1f} "
                  f"{(f'{p_s:8.2f}' if p_s else '       -'):>8} {(f'{peer_ours:9.1f}' if p_s else '        -'):>9} "
                  f"{out_b / 1e6:>7.1f} {peak / out_b:>8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
