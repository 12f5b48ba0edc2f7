"""Checks that a refactoring keeps every emitted graph byte-identical.

    python tools/compare_outputs.py compare REV [--work DIR] [--keras]

builds the example graphs once (the model zoo of every example model with two
optimizers, the real-model suite's graphs, and with --keras a Keras ResNet50), rewrites
each of them under every strategy and a set of option combinations twice, once with the
code at git revision REV (a temporary worktree) and once with this tree, and compares
the SHA-256 of the emitted bytes (or the error message, for a combination the graph
refuses; each rewrite runs twice, and a rewrite whose two outputs differ is
reported as nondeterministic). Prints every difference with the first nodes that differ and exits 1 if any.

This tree rewrites without TensorFlow (the shipped protos and op tables) unless
--import-tensorflow is given, when it imports TensorFlow first and uses its protos and
live registries: run both to show that the two give the same bytes.

With --ignore-passes-run the metadata's list of the passes that ran is left out of
the comparison (and the pass names out of error messages), for a change that only
changes which passes a plan runs.

    python tools/compare_outputs.py time REV GRAPH.pb [--replicas 4,16] [--rounds 3] [--device-type CPU]

times ``rewrite`` of one graph with REV's code and with this tree, alternating the two in
fresh processes round after round (this machine's speed drifts over minutes), each
figure the best of 3 rewrites after a warm-up one; prints both per replica count.

    python tools/compare_outputs.py inputs DIR      # only build the input graphs
    python tools/compare_outputs.py emit DIR OUT    # rewrite them with the importable code

The input graphs are built by the current tree and fed to both, so a change of the
model zoo never shows up as a change of the rewrite. ``emit`` uses nothing but the
public ``graph_rewriter.rewrite``, so it runs unchanged against any revision.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

TWO_WORKERS = {"worker": ["w0:2222", "w1:2222"]}
PS_CLUSTER = {"ps": ["p0:2222", "p1:2222"], "worker": ["w0:2222", "w1:2222"]}

# name -> rewrite keywords (cluster passed separately as "cluster")
CONFIGS = {
    "allreduce_gpu_2x2": dict(cluster=TWO_WORKERS, devices_per_worker=2),
    "allreduce_cpu_3": dict(cluster=None, devices_per_worker=3, device_type="CPU"),
    "allreduce_materialized_3": dict(cluster=None, devices_per_worker=3, device_type="CPU",
                                     materialize_replicas=True),
    "allreduce_fp16_pack0": dict(cluster=TWO_WORKERS, compression="fp16", bytes_per_pack=0),
    "allreduce_dense_sparse": dict(cluster=TWO_WORKERS, sparse_as_dense=True),
    "allreduce_accumulate_2": dict(cluster=TWO_WORKERS, accumulation_steps=2),
    "allreduce_between_w1": dict(cluster=TWO_WORKERS, devices_per_worker=2, task=("worker", 1)),
    "allreduce_per_replica_batch": dict(cluster=None, devices_per_worker=2, device_type="CPU",
                                        batch_split="per_replica"),
    "ps_2x2": dict(cluster=PS_CLUSTER, strategy="ps"),
    "ps_shard_small": dict(cluster=PS_CLUSTER, strategy="ps", ps_shard_bytes=64),
    "ps_async": dict(cluster=PS_CLUSTER, strategy="ps", sync=False),
    "ps_stale_1": dict(cluster=PS_CLUSTER, strategy="ps", staleness=1, task=("worker", 1)),
    "ps_accumulate_2": dict(cluster=PS_CLUSTER, strategy="ps", accumulation_steps=2),
    "ps_between_w0": dict(cluster=PS_CLUSTER, strategy="ps", task=("worker", 0)),
    "ps_between_w1": dict(cluster=PS_CLUSTER, strategy="ps", task=("worker", 1)),
    "hybrid_2x2": dict(cluster=PS_CLUSTER, strategy="hybrid", devices_per_worker=2),
    "hybrid_between_w1": dict(cluster=PS_CLUSTER, strategy="hybrid", task=("worker", 1)),
    "auto_2x2": dict(cluster=PS_CLUSTER, strategy="auto", devices_per_worker=2),
    "allreduce_sync_bn_2x2": dict(cluster=TWO_WORKERS, devices_per_worker=2, sync_batch_statistics=True),
}

ZOO_OPTIMIZERS = {"keras": ("keras_adam", "keras_sgd_momentum"),
                  "keras_embedding": ("keras_adam", "keras_sgd_momentum")}
REAL_MODELS = ("bert", "bert_dropout", "bert_accumulate", "loss_scale", "loss_scale_v2", "resnet", "lstm_lm",
               "wide_deep", "vae", "barlow_twins")


def build_inputs(out_dir, keras=False):
    """Writes every input graph as OUT_DIR/<name>.pb; returns the names."""
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    from graph_rewriter.testing import models as zoo
    from graph_rewriter.testing import real_models, tf1_scripts
    os.makedirs(out_dir, exist_ok=True)
    graphs = {}
    for model in zoo.MODELS:
        for optimizer in ZOO_OPTIMIZERS.get(model, ("adam", "momentum")):
            graphs[f"{model}_{optimizer}"] = zoo.build(model, optimizer).graph_def
    graphs["cond_v1_sgd"] = zoo.build("cond", "sgd", control_flow="v1").graph_def
    graphs["mlp_ftrl_ref"] = zoo.build("mlp", "ftrl", resource=False).graph_def
    for pipeline in ("one_shot", "queue"):   # the other input pipelines a TF1 script uses
        graphs[f"iterator_{pipeline}_adam"] = zoo.build("iterator", "adam", pipeline=pipeline).graph_def
    graphs["script_cifar10_tutorial"] = tf1_scripts.cifar10_tutorial(["data_batch_1.bin", "data_batch_2.bin"],
                                                                     8).graph_def
    graphs["script_gan"] = tf1_scripts.gan()[0]
    graphs["script_word2vec"] = tf1_scripts.word2vec(8)[0]
    graphs["script_counts"] = tf1_scripts.counts_script()
    graphs["script_masked_lm"] = tf1_scripts.masked_sequence_model("losses")
    graphs["script_transformer"] = tf1_scripts.transformer_block()[0]
    graphs["script_transformer_dropout"] = tf1_scripts.transformer_block(dropout=0.1)[0]
    graphs["script_dropout_cond_v2"] = tf1_scripts.dropout_mlp("cond", control_flow="v2")
    graphs["script_dropout_loop_v1"] = tf1_scripts.dropout_mlp("in_loop", control_flow="v1")
    graphs["script_dropout_cond_in_loop"] = tf1_scripts.dropout_mlp("cond_in_loop")
    graphs["script_loss_sum_decay"] = tf1_scripts.summed_loss_mlp("sum_plus_decay")
    graphs["script_loss_sum_counted_adam"] = tf1_scripts.summed_loss_mlp("counted", optimizer="adam")
    os.makedirs(os.path.join(out_dir, "warm_start"), exist_ok=True)
    graphs["script_warm_start"] = tf1_scripts.warm_started_mlp(os.path.join(out_dir, "warm_start"))[0]
    graphs["script_dual_encoder"] = tf1_scripts.dual_encoder("in_batch")
    graphs["script_clip"] = tf1_scripts.contrastive("clip")   # in-batch products: a head over every replica's rows
    graphs["script_simclr"] = tf1_scripts.contrastive("simclr")
    graphs["script_simclr_stacked"] = tf1_scripts.contrastive("simclr_stacked")
    graphs["script_triplet"] = tf1_scripts.contrastive("triplet")
    for kind in ("mixup_shuffled", "fused_batch_norm", "labelled_rows",   # rows that meet other rows
                 "cross_correlation", "center_by_hand", "halves", "hardest_gathered", "mixup_per_row"):
        graphs[f"script_rows_{kind}"] = tf1_scripts.rows_meeting_mlp(kind)
    graphs["script_listnet"] = tf1_scripts.listwise_softmax("softmax_axis0")   # a softmax over the rows: a head
    graphs["script_attention_pooling"] = tf1_scripts.listwise_softmax("attention_pooling")
    graphs["script_class_counts"] = tf1_scripts.class_balanced_classifier("bincount")   # counts of labels
    graphs["script_loss_clamped"] = tf1_scripts.masked_sequence_model("clamped")   # a clamped normalizer
    graphs["script_sinkhorn"] = tf1_scripts.batch_assignments("sinkhorn")   # sums over transposed rows
    graphs["script_map_fn_crop_v1"] = tf1_scripts.augmented_mlp("crop", "v1")   # draws in a loop over the rows
    graphs["script_map_fn_coin_v2"] = tf1_scripts.augmented_mlp("coin", "v2")
    graphs["script_weight_norm_init"] = tf1_scripts.weight_norm_mlp()   # a state computed from another's average
    graphs["script_prototypes"] = tf1_scripts.prototypical_network()   # rows grouped by position: a head
    graphs["script_quantized"] = tf1_scripts.quantized_mlp()   # a moving range of the batch: stored extremes
    graphs["script_dp_sgd"] = tf1_scripts.dp_sgd_mlp()   # microbatches by position, only differentiated: a note
    graphs["script_loss_first_rows"] = tf1_scripts.positioned_loss_mlp("first")
    graphs["script_semihard_triplet"] = tf1_scripts.semihard_triplet()   # distances from norms, label pairs: a head
    graphs["script_same_class_weighted"] = tf1_scripts.same_class_weighted()   # a comparison of the rows alone
    graphs["script_spectral_norm"] = tf1_scripts.spectral_norm_mlp()   # a forward write: mirrored under ps
    graphs["script_pcgrad"] = tf1_scripts.gradient_surgery_mtl("per_task")   # a nonlinear join: a cut per gradient
    graphs["script_pcgrad_vectorized"] = tf1_scripts.gradient_surgery_mtl("vectorized")   # batched: a note
    graphs["script_sam"] = tf1_scripts.sharpness_aware_mlp()   # two gradients a step (refused with accumulation)
    graphs["script_gradnorm"] = tf1_scripts.differentiated_gradient_mlp("gradnorm")   # a gradient in a loss: noted
    graphs["script_kfac"] = tf1_scripts.kfac_mlp("count")   # factors over the rows, with a homogeneous coordinate
    graphs["script_kfac_constant"] = tf1_scripts.kfac_mlp("constant")   # output gradients of a mean: noted
    graphs["script_fgm_rows"] = tf1_scripts.adversarial_mlp("fgm_rows")   # an input gradient normalised per row
    graphs["script_input_penalty_sum"] = tf1_scripts.differentiated_gradient_mlp("input_penalty_sum")   # no loss sum
    graphs["script_bn_cnn_layers_cond"] = tf1_scripts.batch_norm_cnn("layers_cond")[0]   # fused, in a v1 cond
    graphs["script_bn_cnn_renorm_cond_v2"] = tf1_scripts.batch_norm_cnn("renorm_cond_v2")[0]   # two averages, one mean
    graphs["script_cox_survival"] = tf1_scripts.cox_survival_mlp()   # a running sum along the rows: a head
    graphs["script_hardest_row"] = tf1_scripts.hardest_row_mlp()   # the argmax row: a note
    graphs["script_segment_readout"] = tf1_scripts.segment_pooling_mlp()   # nodes pooled by graph: a note
    graphs["script_batch_scaled_lr"] = tf1_scripts.batch_scaled_lr_mlp()   # refused: the rate counts the rows
    graphs["script_skip_on_loss"] = tf1_scripts.conditional_update_mlp("loss_finite")   # refused: the loss decides
    graphs["script_skip_on_gradients"] = tf1_scripts.conditional_update_mlp("gradients_finite", "v1")
    graphs["script_self_paced"] = tf1_scripts.self_paced_mlp()   # a count a comparison keeps: a normalizer
    graphs["script_vq_vae_ema"] = tf1_scripts.vq_vae_ema()   # a codebook from two stored sums: summed
    graphs["script_mean_iou"] = tf1_scripts.stored_totals_classifier("mean_iou")   # a confusion matrix: summed
    graphs["script_dann_v1"] = tf1_scripts.dann("override", "v1")   # rows by position in a v1 cond: a head
    graphs["script_dann_v2"] = tf1_scripts.dann("custom", "v2")   # in a v2 cond: lowered, a head
    graphs["script_minibatch_stddev"] = tf1_scripts.minibatch_stddev_mlp()   # rows grouped by a clamped count
    graphs["script_broadcast_mean"] = tf1_scripts.stored_totals_classifier("broadcast_mean")   # a [4] into [1, 4]
    graphs["script_carried_state_static"] = tf1_scripts.carried_state_lm(4, "cell")   # PTB's fed zero state
    graphs["script_carried_state_default"] = tf1_scripts.carried_state_lm(None, "with_default", "dynamic_rnn", "v2")
    graphs["script_stateful_variables"] = tf1_scripts.carried_state_lm(4, "variables")   # a state of a row per row
    graphs["script_bn_discriminator_twice"] = tf1_scripts.batch_norm_twice("discriminator")[0]   # updated twice
    graphs["script_multi_task"] = tf1_scripts.multi_task("adam", embedding=True, clip=True)[0]   # two train ops, one encoder
    records = tf1_scripts.sparse_feature_records(16)   # a SparseTensor in the batch: fed, and from tf.data
    graphs["script_sparse_placeholder"] = tf1_scripts.sparse_features_model("placeholder")
    graphs["script_sparse_dataset"] = tf1_scripts.sparse_features_model("dataset", records=records)
    graphs["script_feature_columns"] = tf1_scripts.feature_column_model(tf1_scripts.feature_column_records(16))
    graphs["script_ctc"] = tf1_scripts.ctc_model()
    # dynamic_rnn over lengths and a token-mean loss, fed and from a padded_batch, both control flows
    graphs["script_tagger_v1"] = tf1_scripts.sequence_tagger("placeholder", "v1")
    graphs["script_tagger_dataset_v2"] = tf1_scripts.sequence_tagger("dataset", "v2")
    graphs["script_tagger_dropout_v2"] = tf1_scripts.sequence_tagger("placeholder", "v2", dropout=0.3)
    graphs["script_moco_concat"] = tf1_scripts.moco("concat")
    graphs["script_moco_pointer"] = tf1_scripts.moco("pointer")
    graphs["script_scheduled_sampling_v1"] = tf1_scripts.scheduled_sampling_decoder("v1")
    # BatchNorm's updates as the gradients' control dependencies (tf.layers' documented idiom)
    graphs["batchnorm_control_sgd"] = zoo.build("batchnorm", "sgd", update_ops="control").graph_def
    for model in REAL_MODELS:
        graphs[f"real_{model}"] = real_models.build(model)[0].graph_def
    if keras:
        import tf_keras
        g = tf.Graph()
        with g.as_default():
            m = tf_keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
            x = tf.compat.v1.placeholder(tf.float32, (None, 64, 64, 3), name="x")
            y = tf.compat.v1.placeholder(tf.int64, (None,), name="y")
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, m(x), from_logits=False), name="loss")
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train_op")
        graphs["keras_resnet50"] = g.as_graph_def()
    for name, gd in graphs.items():
        with open(os.path.join(out_dir, name + ".pb"), "wb") as f:
            f.write(gd.SerializeToString(deterministic=True))
    return sorted(graphs)


def _without_passes_run(data):
    """The output with the metadata's list of the passes that ran emptied (for comparing
    a change that only changes which passes a plan runs)."""
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef.FromString(data)
    for node in gd.node:
        if node.name == "graph_rewriter/metadata":
            doc = json.loads(node.attr["value"].tensor.string_val[0])
            doc["passes"] = []
            node.attr["value"].tensor.string_val[0] = json.dumps(
                doc, sort_keys=True, separators=(",", ":")).encode()
    return gd.SerializeToString(deterministic=True)


def _error_without_passes_run(message):
    return re.sub(r" \((?:passes run|after)[^)]*\)", "", message)


def emit(in_dir, out_path, keep_dir=None, ignore_passes_run=False, import_tensorflow=False):
    """Rewrites every input under every config; writes {input/config: sha256 or error}.
    graph_rewriter rewrites without TensorFlow unless it was imported first
    (``import_tensorflow``): then TensorFlow's protos and registries are used."""
    if import_tensorflow:
        import tensorflow  # noqa: F401
    import graph_rewriter as gr
    results = {}
    for file in sorted(os.listdir(in_dir)):
        if not file.endswith(".pb"):
            continue
        with open(os.path.join(in_dir, file), "rb") as f:
            data = f.read()
        for config, kw in CONFIGS.items():
            kw = dict(kw)
            cluster = kw.pop("cluster")
            key = f"{file[:-3]}/{config}"
            try:
                out = bytes(gr.rewrite(data, cluster, **kw).serialized())
                again = bytes(gr.rewrite(data, cluster, **kw).serialized())
            except gr.GraphRewriteError as e:
                results[key] = "error: " + (_error_without_passes_run(str(e)) if ignore_passes_run else str(e))
                continue
            if ignore_passes_run:
                out, again = _without_passes_run(out), _without_passes_run(again)
            results[key] = hashlib.sha256(out).hexdigest()
            if again != out:   # the same input and options must give the same bytes
                results[key] += " NONDETERMINISTIC " + hashlib.sha256(again).hexdigest()
            if keep_dir:
                with open(os.path.join(keep_dir, key.replace("/", "__") + ".pb"), "wb") as f:
                    f.write(out)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    return results


def _first_differences(a_path, b_path, limit=5):
    from tensorflow.core.framework import graph_pb2
    a = graph_pb2.GraphDef.FromString(open(a_path, "rb").read())
    b = graph_pb2.GraphDef.FromString(open(b_path, "rb").read())
    lines = []
    if len(a.node) != len(b.node):
        lines.append(f"    {len(a.node)} nodes before, {len(b.node)} after")
    for i, (x, y) in enumerate(zip(a.node, b.node)):
        if x != y:
            lines.append(f"    node {i}: {x.name} ({x.op}) / {y.name} ({y.op})")
            if len(lines) >= limit:
                break
    return lines


def _worktree(repo, rev, path):
    """A git worktree of ``rev`` at ``path`` (reused if it is there already)."""
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, rev], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def _stage(root, dest):
    """Copies a tree's importable code to ``dest`` so that it, and not an installed copy,
    is imported: the package, with the repository's passes/ folder both as the subpackage
    graph_rewriter.passes (how it installs) and as a top-level package (how revisions
    before the single namespace imported it)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(os.path.join(root, "graph_rewriter"), os.path.join(dest, "graph_rewriter"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    passes = os.path.join(root, "passes")
    if os.path.isdir(passes):
        for target in (os.path.join(dest, "graph_rewriter", "passes"), os.path.join(dest, "passes")):
            if not os.path.exists(target):
                shutil.copytree(passes, target, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def compare(rev, work):
    work = work or tempfile.mkdtemp(prefix="compare_outputs_")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inputs = os.path.join(work, "inputs")
    names = build_inputs(inputs, keras=ARGS.keras)
    print(f"{len(names)} input graphs x {len(CONFIGS)} configurations", flush=True)
    tree = _worktree(here, rev, os.path.join(work, "before"))
    runs = {}
    for label, root in (("before", tree), ("after", here)):
        keep = os.path.join(work, "keep_" + label)
        os.makedirs(keep, exist_ok=True)
        out = os.path.join(work, label + ".json")
        code = _stage(root, os.path.join(work, "code_" + label))
        env = dict(os.environ, PYTHONPATH=code)
        subprocess.run([sys.executable, os.path.abspath(__file__), "emit", inputs, out, "--keep", keep]
                       + (["--ignore-passes-run"] if ARGS.ignore_passes_run else [])
                       + (["--import-tensorflow"] if ARGS.import_tensorflow and label == "after" else []),
                       cwd=code, env=env, check=True)
        runs[label] = json.load(open(out))
    before, after = runs["before"], runs["after"]
    diffs = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    for k in diffs:
        print(f"DIFFERS {k}:\n  before {before.get(k)}\n  after  {after.get(k)}")
        name = k.replace("/", "__") + ".pb"
        a, b = (os.path.join(work, "keep_" + s, name) for s in ("before", "after"))
        if os.path.exists(a) and os.path.exists(b):
            print("\n".join(_first_differences(a, b)))
    errors = sum(v.startswith("error") for v in after.values())
    print(f"{len(after)} rewrites ({errors} refused with an error), {len(diffs)} differ "
          f"(revision {rev} against the working tree; files in {work})")
    subprocess.run(["git", "-C", here, "worktree", "remove", "--force", tree], check=False)
    return 1 if diffs else 0


_TIMER = r"""
import sys, time
import graph_rewriter as gr
data = open(sys.argv[1], "rb").read()
replicas, device_type = int(sys.argv[2]), sys.argv[3]
gr.rewrite(data, devices_per_worker=replicas, device_type=device_type)
best = float("inf")
for _ in range(3):
    start = time.perf_counter()
    gr.rewrite(data, devices_per_worker=replicas, device_type=device_type)
    best = min(best, time.perf_counter() - start)
print(best)
"""


def time_revisions(rev, graph, replicas, rounds, work, device_type="GPU"):
    """Best-of-3 rewrite seconds of ``graph`` with REV's code and the tree's, per replica
    count (of ``device_type`` devices), alternating the two trees in fresh processes for
    ``rounds`` rounds."""
    work = work or tempfile.mkdtemp(prefix="compare_outputs_")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = _worktree(here, rev, os.path.join(work, "before"))
    codes = {"before": _stage(tree, os.path.join(work, "code_before")),
             "after": _stage(here, os.path.join(work, "code_after"))}
    graph = os.path.abspath(graph)
    for r in replicas:
        seconds = {label: [] for label in codes}
        for _ in range(rounds):
            for label, code in codes.items():
                out = subprocess.run([sys.executable, "-c", _TIMER, graph, str(r), device_type], cwd=code,
                                     env=dict(os.environ, PYTHONPATH=code), capture_output=True,
                                     text=True, check=True)
                seconds[label].append(float(out.stdout.split()[-1]))
        print(f"{os.path.basename(graph)} x{r}: "
              + "; ".join(f"{label} ({rev if label == 'before' else 'tree'}) "
                          + " ".join(f"{x:.3f}" for x in v) + f" s, best {min(v):.3f}"
                          for label, v in seconds.items())
              + f"; after/before {min(seconds['after']) / min(seconds['before']):.3f}", flush=True)
    subprocess.run(["git", "-C", here, "worktree", "remove", "--force", tree], check=False)


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("rev")
    c.add_argument("--work")
    c.add_argument("--keras", action="store_true", help="also a Keras ResNet50 (needs tf_keras)")
    c.add_argument("--import-tensorflow", action="store_true",
                   help="this tree's rewrites import TensorFlow first (its protos and live registries) "
                        "instead of rewriting without it")
    c.add_argument("--ignore-passes-run", action="store_true",
                   help="compare outputs with the metadata's list of passes run left out (and "
                        "errors without the passes they name), for a change of which passes run")
    t = sub.add_parser("time")
    t.add_argument("rev")
    t.add_argument("graph")
    t.add_argument("--replicas", default="4,16")
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--work")
    t.add_argument("--device-type", choices=("GPU", "CPU"), default="GPU")
    i = sub.add_parser("inputs")
    i.add_argument("dir")
    i.add_argument("--keras", action="store_true")
    e = sub.add_parser("emit")
    e.add_argument("dir")
    e.add_argument("out")
    e.add_argument("--keep")
    e.add_argument("--ignore-passes-run", action="store_true")
    e.add_argument("--import-tensorflow", action="store_true")
    ARGS = p.parse_args()
    if ARGS.cmd == "inputs":
        print("\n".join(build_inputs(ARGS.dir, keras=ARGS.keras)))
    elif ARGS.cmd == "emit":
        emit(ARGS.dir, ARGS.out, ARGS.keep, ARGS.ignore_passes_run, ARGS.import_tensorflow)
    elif ARGS.cmd == "time":
        time_revisions(ARGS.rev, ARGS.graph, [int(r) for r in ARGS.replicas.split(",")], ARGS.rounds,
                       ARGS.work, ARGS.device_type)
    else:
        sys.exit(compare(ARGS.rev, ARGS.work))


if __name__ == "__main__":
    main()
