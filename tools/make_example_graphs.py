"""Writes example single-device training graphs to try graph-rewrite on.

    python tools/make_example_graphs.py OUT_DIR [--model mlp] [--optimizer adam]

writes OUT_DIR/<model>_<optimizer>.pb, .pbtxt and .meta (the .meta keeps the Saver's
SaverDef and collections). Every graph is one of graph_rewriter.testing.models: placeholders
x (and y, ids) with an unknown batch dimension, "loss", "train_op", "init".
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--model", default="mlp", help="one of graph_rewriter.testing.models.MODELS")
    p.add_argument("--optimizer", default="adam", help="an optimizer name of graph_rewriter.testing.models")
    p.add_argument("--resource", choices=("yes", "no"), default="yes", help="resource or ref variables")
    args = p.parse_args()
    import tensorflow as tf

    from graph_rewriter.testing import models
    tf.compat.v1.disable_eager_execution()
    ex = models.build(args.model, args.optimizer, resource=args.resource == "yes")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"{args.model}_{args.optimizer}")
    tf.io.write_graph(ex.graph_def, args.out_dir, os.path.basename(stem) + ".pb", as_text=False)
    tf.io.write_graph(ex.graph_def, args.out_dir, os.path.basename(stem) + ".pbtxt", as_text=True)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(ex.graph_def, name="")
    # The example's Saver is in the graph already; describe it for the MetaGraphDef.
    saver_def = tf.compat.v1.train.SaverDef(
        filename_tensor_name="save/Const:0", save_tensor_name="save/control_dependency:0",
        restore_op_name="save/restore_all", version=tf.compat.v1.train.SaverDef.V2)
    tf.compat.v1.train.export_meta_graph(stem + ".meta", graph=graph, saver_def=saver_def)
    print(f"wrote {stem}.pb, {stem}.pbtxt, {stem}.meta (feeds {', '.join(ex.feeds)}; "
          f"fetch {ex.loss}, run {ex.train_op} and {ex.init})")


if __name__ == "__main__":
    main()
