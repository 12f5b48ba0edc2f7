"""Step time of a language model that carries its state through the feed, with and without
the row_defaults pass (docs/semantics.md, "A state carried through the feed").

    python tools/bench_carried_state.py [--replicas 2] [--rows 64] [--steps 100] [--rounds 5]

graph_rewriter.testing.tf1_scripts.carried_state_lm (dynamic batches, rnn_cell's zero
state, the steps unrolled) rewritten twice for --replicas CPU replicas: as planned (the
initial state's name holds every replica's rows: a concat and a split on the host per
state tensor per step) and with the plan's ``"row_defaults": []`` (each replica its own
zeros; graph_rewriter.Session then splits a fed state over the replicas' copies in
Python). Both run in one process, each in its own graph_rewriter.Session, on the same
--rows rows, feeding the final state back as the script does; the runs alternate in
rounds of --steps steps after a warm-up round (the machine's speed drifts), and the
medians of the rounds' mean step times are printed with the median of their ratios.
The figure in docs/performance.md comes from this script.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rows", type=int, default=64, help="the global batch's rows (streams)")
    p.add_argument("--steps", type=int, default=100, help="steps per round and run")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import graph_rewriter as gr
    from graph_rewriter.testing.tf1_scripts import (LM_STEPS, carried_state_lm, carried_state_names,
                                                    carried_state_text)
    initial, final = carried_state_names()
    graph_def = carried_state_lm(None, "cell")
    planned = gr.rewrite(graph_def, devices_per_worker=args.replicas, device_type="CPU")
    plan = planned.plan.to_dict()
    plan["row_defaults"] = []
    kept = gr.rewrite(graph_def, devices_per_worker=args.replicas, device_type="CPU", strategy=gr.Plan.from_dict(plan))
    text = carried_state_text(args.rows, 1)
    feed = {"x:0": text[:, :LM_STEPS], "y:0": text[:, 1:LM_STEPS + 1]}
    runs = {"row_defaults": gr.Session(planned), "own zeros": gr.Session(kept)}
    states = {}
    for name, sess in runs.items():
        sess.run("init")
        states[name] = sess.run(final, feed)
    times = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):   # (the first, a warm-up, is not counted)
        for name, sess in runs.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                states[name], _ = sess.run([final, "train_op"], dict(feed, **dict(zip(initial, states[name]))))
            if round_:
                times[name].append((time.perf_counter() - started) / args.steps)
    print(f"# bench_carried_state.py --replicas {args.replicas} --rows {args.rows} --steps {args.steps} "
          f"--rounds {args.rounds}   (cores: {os.cpu_count()})")
    for name, values in times.items():
        print(f"{name:<14} median {1000 * statistics.median(values):.3f} ms/step  rounds: "
              + " ".join(f"{1000 * v:.3f}" for v in values))
    ratio = statistics.median(a / b for a, b in zip(times["row_defaults"], times["own zeros"]))
    print(f"row_defaults / own zeros: {ratio:.3f} (median of the rounds' ratios)")
    for sess in runs.values():
        sess.close()


if __name__ == "__main__":
    main()
