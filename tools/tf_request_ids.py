"""Shows TensorFlow's duplicate request ids with plain TensorFlow (graph_rewriter only picks the port).

TensorFlow 2.x's master runs every step (Master::RunStep) on a thread of its own
(Env::SchedClosure starts a new thread per call), and that thread draws the request ids
of the step's RunGraph calls from a thread-local mt19937_64 seeded with 32 random bits
(GetUniqueRequestId -> random::ThreadLocalNew64). A worker remembers the last 100,000
request ids and refuses a repeat: "The same RunGraph (Worker) request was received
twice". Two runs whose threads drew the same seed send the same first id, so once a
server has seen 100,000 runs, about one run in 2**32 / 100,000 = 43,000 is refused.

This script runs a trivial graph through a gRPC master ``--runs`` times on one
in-process server and reports every refused run. Exit status 0 if none was refused,
1 if some were (the defect is present), 2 on bad arguments. About 60 s for the default
250,000 runs on 2 cores. docs/reliability.md, "Duplicate request ids", has the figures.
"""

import argparse
import json
import os
import sys
import time

from graph_rewriter.local_cluster import free_port

WINDOW = 100_000          # request ids a TensorFlow worker remembers
SEEDS = 2 ** 32           # seeds a run's thread can draw


def expected_refusals(runs, window=WINDOW, seeds=SEEDS):
    """The expected number of refused runs among ``runs``: run i repeats the first id
    of one of the min(i, window) runs before it with probability min(i, window) / seeds."""
    full = max(0, runs - window)
    filling = min(runs, window)
    return (filling * (filling - 1) / 2 + full * window) / seeds


def run(runs, report_every, out=sys.stdout):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf1 = tf.compat.v1
    server = tf.distribute.Server({"worker": [f"localhost:{free_port()}"]}, job_name="worker", task_index=0)
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:worker/task:0/device:CPU:0"):
        value = tf.constant(1) + 1
    refused, other = [], []
    start = time.monotonic()
    with tf1.Session(server.target, graph=graph) as sess:
        for i in range(runs):
            try:
                sess.run(value)
            except tf.errors.OpError as e:
                (refused if "request was received twice" in e.message else other).append(i)
                if len(other) > 10:
                    raise
            if report_every and i and i % report_every == 0:
                print(f"{i} runs in {time.monotonic() - start:.0f} s, {len(refused)} refused", file=out, flush=True)
    return {"runs": runs, "seconds": round(time.monotonic() - start, 1), "refused_runs": refused,
            "refused": len(refused), "other_errors": len(other),
            "expected_refused": round(expected_refusals(runs), 2),
            "tensorflow": tf.__version__}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--runs", type=int, default=250_000, help="runs of the trivial graph")
    parser.add_argument("--report-every", type=int, default=50_000, help="print progress every this many runs (0: never)")
    parser.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.report_every < 0:
        parser.error("--runs must be >= 1 and --report-every >= 0")
    result = run(args.runs, args.report_every)
    print(f"TensorFlow {result['tensorflow']}: {result['runs']} runs in {result['seconds']} s; "
          f"refused as duplicate requests: {result['refused']} (runs {result['refused_runs']}); "
          f"expected from 32-bit seeds and a {WINDOW}-id window: {result['expected_refused']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
