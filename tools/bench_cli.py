"""Wall time of the graph-rewrite command, whole process, as a user feels it.

    python tools/bench_cli.py [--model resnet50] [--replicas 16] [--repeat 5]

Runs, in fresh processes, interleaved round after round (the machine's speed drifts):

- ``graph-rewrite --help`` and ``graph-rewrite --version``;
- ``graph-rewrite MODEL.pb OUT.pb --devices-per-worker R`` (GPU, allreduce), the model
  built once by tools/bench_rewrite.py (cached in its --cache-dir);
- ``python -c "import tensorflow"``, for scale: what the CLI paid before it rewrote
  without TensorFlow.

Prints the median and the spread of each, and whether the rewrite imported TensorFlow.
The figures in docs/performance.md come from this script.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _wall(cmd, env=None):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_cli: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    return elapsed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "graph_rewriter_bench"))
    args = p.parse_args(argv)
    cli = shutil.which("graph-rewrite") or os.path.join(os.path.dirname(sys.executable), "graph-rewrite")
    model = os.path.join(args.cache_dir, f"{args.model}.pb")
    if not os.path.exists(model):
        os.makedirs(args.cache_dir, exist_ok=True)
        subprocess.run([sys.executable, os.path.join(HERE, "bench_rewrite.py"), "--build-model", args.model, model],
                       check=True)
    out = os.path.join(tempfile.mkdtemp(prefix="bench_cli_"), "out.pb")
    probe = ("import sys; from graph_rewriter.cli import main; rc = main(sys.argv[1:]); "
             "print('tensorflow imported:', 'tensorflow' in sys.modules); sys.exit(rc)")
    imported = subprocess.run([sys.executable, "-c", probe, model, out, "--devices-per-worker", str(args.replicas)],
                              capture_output=True, text=True, timeout=600).stdout.strip().splitlines()[-1]
    env_tf = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    cases = {
        "graph-rewrite --help": [cli, "--help"],
        "graph-rewrite --version": [cli, "--version"],
        f"graph-rewrite {args.model}.pb out.pb --devices-per-worker {args.replicas}":
            [cli, model, out, "--devices-per-worker", str(args.replicas)],
        'python -c "import tensorflow"': [sys.executable, "-c", "import tensorflow"],
    }
    times = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, cmd in cases.items():
            times[name].append(_wall(cmd, env_tf))
    print(f"{'command':<58} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, t in times.items():
        print(f"{name:<58} {statistics.median(t):9.2f} {min(t):7.2f} {max(t):7.2f}")
    print(f"({args.repeat} runs each, interleaved; the rewrite: {imported})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
