"""One worker's client of a rewritten graph, driven the way TF1 scripts drive training:
``tf.compat.v1.train.MonitoredTrainingSession`` with the default Scaffold and the
standard hooks, the chief checkpointing and writing summaries.

    python -m graph_rewriter.testing.mts_worker --graph w0.meta --target grpc://... \\
        --chief --checkpoint-dir ckpt --last-step 4 --batches batches.npz --out out.json

The rewritten MetaGraphDef is imported with ``tf.compat.v1.train.import_meta_graph``;
of graph_rewriter only ``gr.HeartbeatHook(master=target)`` runs, among the hooks (the
client waits for a settled cluster and its peers' clients before the session is
created, and a step waiting for a worker whose client is gone fails within seconds). Run
``--last-step`` steps (counted by the graph's global step, so a restarted client resumes
where the checkpoint left off), feeding batch ``step`` of the ``.npz`` (arrays ``<feed>__<step>``), and write the
losses and the final values of ``--read`` variables as JSON. ``--stop-after N`` makes
the client exit abruptly (os._exit) after N steps of this run: a killed worker;
``--pause-after N`` makes it stop stepping after N steps of this run and wait (at most
``--timeout`` seconds) to be killed, so a test that kills a server "mid-training" knows
how far the checkpoint got; ``--progress`` prints "step N" after each step (the fault
tests wait for it).
"""

import argparse
import json
import os
import sys
import time

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(prog="mts_worker")
    p.add_argument("--graph", required=True)
    p.add_argument("--target", default="")
    p.add_argument("--chief", action="store_true")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--last-step", type=int, required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--read", action="append", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--stop-after", type=int, default=0)
    p.add_argument("--pause-after", type=int, default=0)
    p.add_argument("--device-count", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--progress", action="store_true", help="print 'step N' after every step")
    args = p.parse_args(argv)

    import tensorflow as tf
    tf1 = tf.compat.v1
    tf1.disable_eager_execution()
    data = np.load(args.batches)
    feeds = {}
    for key in data.files:
        name, step = key.rsplit("__", 1)
        feeds.setdefault(int(step), {})[name] = data[key]
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(args.graph)
        loss = graph.get_tensor_by_name("loss:0")
        step = tf1.train.get_global_step()
        import graph_rewriter as gr
        hooks = [gr.HeartbeatHook(master=args.target), tf1.train.StopAtStepHook(last_step=args.last_step),
                 tf1.train.NanTensorHook(loss),
                 tf1.train.LoggingTensorHook({"loss": loss.name, "step": step.name}, every_n_iter=1)]
        if args.chief and args.checkpoint_dir:
            hooks.append(tf1.train.StepCounterHook(every_n_steps=1, output_dir=args.checkpoint_dir))
        config = tf1.ConfigProto(operation_timeout_in_ms=int(args.timeout * 1000))
        if args.device_count:
            config.device_count["CPU"] = args.device_count
            config.inter_op_parallelism_threads = args.device_count + 2
        losses, steps = [], []
        with tf1.train.MonitoredTrainingSession(
                master=args.target, is_chief=args.chief,
                checkpoint_dir=args.checkpoint_dir if args.chief else None,
                save_checkpoint_steps=args.save_steps if args.chief else None,
                save_summaries_steps=1 if args.chief else None,
                hooks=hooks, config=config, stop_grace_period_secs=10, max_wait_secs=args.timeout) as sess:
            def raw(fetch):   # a run the hooks do not see
                return sess.run_step_fn(lambda step_context: step_context.session.run(fetch))
            done = 0
            while not sess.should_stop():
                at = int(raw(step))
                if at >= args.last_step:   # restored at the last step: nothing left to run
                    break
                value, _ = sess.run([loss, "train_op"], feed_dict=feeds[at])
                losses.append(float(value))
                steps.append(at)
                done += 1
                if args.progress:
                    print(f"step {at}", flush=True)
                if args.stop_after and done >= args.stop_after:
                    sys.stdout.flush()
                    os._exit(17)
                if args.pause_after and done >= args.pause_after:
                    print("paused", flush=True)
                    time.sleep(args.timeout)    # the test kills this process long before
                    os._exit(18)
            values = {name: raw(graph.get_tensor_by_name(name)).tolist() for name in args.read}
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "steps": steps, "values": values}, f)


if __name__ == "__main__":
    main()
