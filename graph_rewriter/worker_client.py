"""One worker's client of a between-graph run: its own rewritten graph, its own batches.

    python -m graph_rewriter.worker_client --graph worker1.pb --target grpc://host:port \\
        --feeds batches.npz --steps 30 --read w:0 --out result.npz [--timeout 120]

``--feeds`` is an .npz whose keys are "<step>/<tensor name>" (the original feed names);
the client runs the init op, then ``--steps`` steps of [loss, train op], and writes the
losses and the values of the ``--read`` tensors to ``--out``. Several ``--train-op``
(with as many ``--loss``) take turns, step k running the (k mod n)-th: a GAN's or a
multi-task script's train ops run in alternation. ``--carry FETCH=FEED`` fetches FETCH
with every step and feeds its value as FEED in the next one: a recurrent language
model's final state carried into its initial state (TensorFlow's PTB tutorial). Every session call is
bounded by ``--timeout`` seconds: a dead peer becomes an error, not a hang. Used by the
demo and the multi-process tests; also a template for a user's own worker script.
"""

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def run_worker(graph, target, feeds, steps, reads, loss="loss:0", train_op="train_op",
               init="init", timeout=120.0, delay=0.0, log=None, carry=()):
    """Trains ``steps`` steps; returns (losses, {read name: value}, step times). ``loss``
    and ``train_op`` may be lists of one length: step k runs their (k mod n)-th.
    ``carry``: (fetch, feed) pairs; each step fetches ``fetch`` and the next feeds its
    value as ``feed`` (the first step feeds what ``feeds`` gives, or nothing)."""
    import tensorflow as tf

    import graph_rewriter as gr
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout * 1000)) if timeout else None
    losses, times = [], []
    with gr.Session(graph, target=target) as sess, _queue_runners(sess):
        sess.run(init, options=options)
        for step in range(steps):
            feed = {name.split("/", 1)[1]: value for name, value in feeds.items()
                    if name.split("/", 1)[0] == str(step)}
            started = time.perf_counter()
            pair = [loss, train_op] if isinstance(train_op, str) else [
                loss[step % len(loss)], train_op[step % len(train_op)]]
            if step:
                feed.update(zip([name for _, name in carry], carried))
            value, _, carried = sess.run(pair + [[name for name, _ in carry]], feed_dict=feed, options=options)
            times.append(time.perf_counter() - started)
            losses.append(float(value))
            if log is not None:
                log(step, losses[-1])
            if delay:
                time.sleep(delay)
        values = dict(zip(reads, sess.run(list(reads), options=options))) if reads else {}
    return losses, values, times


@contextlib.contextmanager
def _queue_runners(sess):
    """Runs the graph's QueueRunners (tf.train.batch and its kin; none for other graphs)
    while the block runs, as a TF1 script's start_queue_runners does: the threads fill
    the queues the steps dequeue from; on the way out they are stopped and joined."""
    import tensorflow as tf
    coord = tf.compat.v1.train.Coordinator()
    threads = tf.compat.v1.train.start_queue_runners(sess, coord=coord)
    try:
        yield
    finally:
        coord.request_stop()
        coord.join(threads, stop_grace_period_secs=10)


def main(argv=None):
    p = argparse.ArgumentParser(description="Run one worker of a between-graph training job.")
    p.add_argument("--graph", required=True, help="this worker's rewritten graph")
    p.add_argument("--target", required=True, help="grpc://host:port of this worker's server")
    p.add_argument("--feeds", help=".npz of '<step>/<tensor>' arrays")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--read", action="append", default=[], help="tensor to read after training")
    p.add_argument("--out", required=True, help=".npz to write losses and read values to")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="bound on every session call (s); 0: the graph's own timeout_seconds")
    p.add_argument("--delay", type=float, default=0.0, help="sleep after each step (s): a slow worker")
    p.add_argument("--progress", action="store_true", help="print 'step N loss L' after every step")
    p.add_argument("--train-op", action="append", default=None,
                   help="the op a step runs (default train_op); repeated: they take turns, step k runs the (k mod n)-th")
    p.add_argument("--loss", action="append", default=None,
                   help="the loss a step fetches (default loss:0); one per --train-op")
    p.add_argument("--carry", action="append", default=[], metavar="FETCH=FEED",
                   help="fetch FETCH with every step and feed its value as FEED in the next (an RNN's state)")
    args = p.parse_args(argv)
    carry = [tuple(pair.split("=", 1)) for pair in args.carry]
    if any(len(pair) != 2 or not all(pair) for pair in carry):
        p.error(f"--carry takes FETCH=FEED, got {args.carry}")
    train_ops, step_losses = args.train_op or ["train_op"], args.loss or ["loss:0"]
    if len(train_ops) != len(step_losses):
        p.error(f"{len(train_ops)} --train-op but {len(step_losses)} --loss: give one --loss per --train-op")
    import numpy as np
    feeds = dict(np.load(args.feeds)) if args.feeds else {}
    try:
        log = (lambda step, loss: print(f"step {step} loss {loss:.6f}", flush=True)) if args.progress else None
        losses, values, times = run_worker(args.graph, args.target, feeds, args.steps, args.read,
                                           loss=step_losses, train_op=train_ops,
                                           timeout=args.timeout, delay=args.delay, log=log, carry=carry)
    except Exception as e:  # reported to the parent through the exit status and stderr
        sys.stderr.write(f"worker_client: {type(e).__name__}: {' '.join(str(e).split())[:2000]}\n")
        return 3
    out = {"losses": np.asarray(losses), "step_seconds": np.asarray(times)}
    out.update({f"read/{k}": np.asarray(v) for k, v in values.items()})
    np.savez(args.out, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
