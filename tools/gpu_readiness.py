"""GPU readiness: rewritten graphs checked and timed on this machine's GPUs.

Whether graph_rewriter's rewritten graphs train on this machine's GPUs as they do on
CPUs, and how fast:

    python tools/gpu_readiness.py [--steps 100] [--warmup 20] [--rounds 3] [--step-target 0.75]

Run it, from a checkout installed with ``pip install -e '.[gpu,test]'`` (plus tf-keras,
see README.md), on a machine with NVIDIA GPUs and their driver. It first asks TensorFlow
for GPUs: with none, or with a TensorFlow not built with CUDA (tensorflow-cpu), it prints
one line on stderr saying what is missing and how to get it, and exits 2. Then, with the
N GPUs TensorFlow sees:

1. equivalence suite: pytest runs the in-process equivalence tests (SUITE, ``-m "not
   slow"``) with GRAPH_REWRITER_TEST_DEVICE=GPU, so their replicas are GPU:0..R-1 instead
   of CPU:0..R-1 (graph_rewriter.testing.harness.device_type); a case needing more
   replicas than there are GPUs is skipped. Passed when pytest passes.
2. NCCL and ring: two models (dense "mlp" with Adam, sparse "embedding" with Adagrad)
   rewritten for N GPU replicas with ``communication="nccl"`` and then ``"ring"``, each
   trained on the same batches as one device: every loss, every variable and every
   replica's copy equal one device's within the equivalence tests' tolerance. Needs 2 GPUs
   (one replica has nothing to communicate): with one, both rows are skipped.
3. step time: tools/bench_step.py's MLP and measurement (``run_measure``, each run a
   fresh process) on one GPU, rewritten for N GPUs, and tf.distribute.MirroredStrategy
   over the same N GPUs, global batch 512 for all; the ratio rewritten / MirroredStrategy
   is the median of per-round ratios. Passed when it is at most --step-target (0.75, the
   target of docs/performance.md).

It ends with one table (check, result, figure) and exits 0 when no check failed (a
skipped check, such as NCCL with one GPU, is not a failure), 1 when one did. Each check is
a function of its own, and everything but running them is testable without a GPU
(tests/test_gpu_readiness.py).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import typing

import bench_step   # tools/bench_step.py: this script's folder is on sys.path when it runs

from graph_rewriter.errors import GraphRewriteError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_readiness"
# The equivalence tests that run in this process (no servers), with their replicas on
# harness.device_type()'s devices.
SUITE = ("tests/test_equivalence.py", "tests/test_ps_equivalence.py", "tests/test_real_models.py")
# What the communication check trains, and its tolerance (tests/test_equivalence.py's).
COMMUNICATION_MODELS = (("mlp", "adam"), ("embedding", "adagrad"))
COMMUNICATIONS = ("nccl", "ring")
STEPS = 3
RTOL, ATOL = 1e-4, 1e-6
STEP_TARGET = 0.75   # rewritten / MirroredStrategy, docs/performance.md's target

PASSED, FAILED, SKIPPED = "passed", "FAILED", "skipped"


class Row(typing.NamedTuple):
    """One line of the final table: the check, its result (PASSED, FAILED or SKIPPED) and
    the figure that backs it (counts, differences, times, or why it was skipped)."""
    check: str
    result: str
    figure: str


def error_line(text, limit=160):
    """The line of a failed run's stderr that says what went wrong: the last one that is
    not indented, a TensorFlow node reference ("[[...]]") or empty (a Python exception's
    "Error: ..." line; TensorFlow's message under it)."""
    lines = [line for line in text.splitlines()
             if line.strip() and not line[0].isspace() and not line.startswith(("[[", "Node:"))]
    line = lines[-1] if lines else "no error message"
    return line if len(line) <= limit else line[:limit - 3] + "..."


# ----- 0. GPUs -----------------------------------------------------------------------------

def check_gpus(version, built_with_cuda, gpus):
    """Raises GraphRewriteError saying what is missing unless ``gpus`` (the number of GPUs
    TensorFlow ``version`` sees) is at least one and TensorFlow is built with CUDA."""
    if gpus and built_with_cuda:
        return
    what = f"no GPU visible to TensorFlow {version} (built with CUDA: {'yes' if built_with_cuda else 'no'})"
    if not built_with_cuda:
        raise GraphRewriteError(what, hint="install 'graph-rewriter[gpu]' (tensorflow[and-cuda]) on a machine "
                                           "with NVIDIA GPUs and drivers")
    raise GraphRewriteError(what, hint="check that the NVIDIA driver sees the GPUs (nvidia-smi) and that "
                                       "CUDA_VISIBLE_DEVICES does not hide them")


def visible_gpus():
    """The number of GPUs this process's TensorFlow sees; GraphRewriteError when there are
    none or TensorFlow cannot use them (check_gpus), or when TensorFlow is missing.
    TensorFlow's start-up lines stay off stderr, which holds this script's one line."""
    from graph_rewriter.tf_runtime import import_tensorflow_quietly
    try:
        import_tensorflow_quietly()
        import tensorflow as tf
    except ImportError as e:
        raise GraphRewriteError(f"TensorFlow cannot be imported ({e})",
                                hint="install 'graph-rewriter[gpu]' on a machine with NVIDIA GPUs and drivers") from None
    gpus = len(tf.config.list_physical_devices("GPU"))
    check_gpus(tf.__version__, tf.test.is_built_with_cuda(), gpus)
    return gpus


# ----- 1. the equivalence suite on GPUs ------------------------------------------------------

def pytest_counts(output):
    """{"passed": n, "failed": n, ...} from pytest's summary line (the last line of
    ``output`` that has counts and a duration); {} when there is none."""
    for line in reversed(output.splitlines()):
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if counts and re.search(r" in [\d.]+s", line):
            out = {}
            for n, what in counts:
                what = "error" if what.startswith("error") else what
                out[what] = out.get(what, 0) + int(n)
            return out
    return {}


def suite_row(returncode, counts):
    """The suite's row: passed when pytest exited 0 having passed at least one test."""
    ok = returncode == 0 and counts.get("passed", 0) > 0
    figure = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0) + counts.get('error', 0)} failed, "
              f"{counts.get('skipped', 0)} skipped")
    if not counts:
        figure = f"pytest exited {returncode} with no summary"
    return Row("equivalence suite on GPUs", PASSED if ok else FAILED, figure)


def suite_environment(environ=None):
    """The environment the suite runs in: this one with the tests' device switched to GPU."""
    environ = dict(os.environ if environ is None else environ)
    environ.update(GRAPH_REWRITER_TEST_DEVICE="GPU", TF_CPP_MIN_LOG_LEVEL="3")
    return environ


def run_suite():
    """Runs SUITE under pytest with GPU replicas, its output shown as it comes; its Row."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "not slow", "-rfE", *SUITE]
    print(f"$ GRAPH_REWRITER_TEST_DEVICE=GPU python {shlex.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, env=suite_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    proc.wait()
    return suite_row(proc.returncode, pytest_counts("".join(lines)))


# ----- 2. NCCL and ring ----------------------------------------------------------------------

def differences(reference, got, rtol=RTOL, atol=ATOL):
    """(the names in ``reference`` whose values ``got`` misses or differs from beyond the
    tolerance, the largest absolute difference seen). Both map names to arrays."""
    import numpy as np
    wrong, largest = [], 0.0
    for name, want in reference.items():
        if name not in got:
            wrong.append(f"{name} (missing)")
            continue
        have, want = np.asarray(got[name], np.float64), np.asarray(want, np.float64)
        if have.shape != want.shape:
            wrong.append(f"{name} (shape {have.shape}, want {want.shape})")
            continue
        if have.size:
            largest = max(largest, float(np.max(np.abs(have - want))))
        if not np.allclose(have, want, rtol=rtol, atol=atol):
            wrong.append(name)
    return wrong, largest


def check_communication(communication, replicas, device_type="GPU"):
    """Trains each of COMMUNICATION_MODELS on one device and rewritten for ``replicas``
    replicas of ``device_type`` with ``communication=`` ("nccl", "ring", "auto") on the
    same batches, in this process, as tests/test_equivalence.py does. Returns {"models":
    n, "collectives": the collectives asking for it, "largest": the largest difference,
    "wrong": what differs from one device}: losses per step, every variable, and every
    replica's copy of it, each against one device's value."""
    import graph_rewriter as gr
    from graph_rewriter.testing import harness, models
    harness.exact_float32()
    batch = 4 * replicas
    wrong, largest, collectives = [], 0.0, 0
    for model, optimizer in COMMUNICATION_MODELS:
        ex = models.build(model, optimizer)
        losses, values = harness.run_single(ex, steps=STEPS, batch_size=batch)
        result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type=device_type,
                            communication=communication)
        hinted = [n for n in result.graph_def.node if n.op.startswith("Collective")
                  and n.attr["communication_hint"].s.decode() == communication]
        collectives += len(hinted)
        if not hinted:
            wrong.append(f"{model}: no collective asks for {communication}")
        got_losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=batch, replica_copies=True)
        expected = {f"loss at step {i}": v for i, v in enumerate(losses)}
        expected.update(values)
        for prefix in result.metadata["replica_prefixes"][1:]:
            expected.update({prefix + name: value for name, value in values.items()})
        got = dict(got, **{f"loss at step {i}": v for i, v in enumerate(got_losses)})
        bad, most = differences(expected, got)
        wrong += [f"{model}: {name}" for name in bad]
        largest = max(largest, most)
    return {"models": len(COMMUNICATION_MODELS), "collectives": collectives, "largest": largest, "wrong": wrong}


def communication_row(communication, gpus, found):
    """The row of one communication implementation from check_communication's ``found``
    (None: skipped for want of GPUs)."""
    check = f"{communication} collectives: training equals one device"
    if found is None:
        return Row(check, SKIPPED, f"needs 2 GPUs, this machine has {gpus}: one replica communicates nothing")
    if found["wrong"]:
        shown = ", ".join(found["wrong"][:3]) + (", ..." if len(found["wrong"]) > 3 else "")
        return Row(check, FAILED, f"{len(found['wrong'])} differ: {shown}")
    return Row(check, PASSED, f"{found['models']} models on {gpus} GPUs, {found['collectives']} collectives; "
                              f"largest difference {found['largest']:.1e}")


def run_communication(communication, gpus):
    """check_communication on ``gpus`` GPU replicas in a fresh process (this script with
    --check-communication); its Row. Skipped with fewer than 2 GPUs."""
    if gpus < 2:
        return communication_row(communication, gpus, None)
    cmd = [sys.executable, os.path.abspath(__file__), "--check-communication", communication,
           "--replicas", str(gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        return Row(f"{communication} collectives: training equals one device", FAILED,
                   f"the run failed (exit {proc.returncode}): {error_line(proc.stderr)}")
    return communication_row(communication, gpus, json.loads(proc.stdout.strip().splitlines()[-1]))


# ----- 3. step time against MirroredStrategy -------------------------------------------------

def step_time_row(rounds, gpus, target=STEP_TARGET):
    """The step-time row from ``rounds`` ([{"single": s, "rewritten": s, "mirrored": s}],
    seconds per step): passed when the median per-round ratio rewritten / MirroredStrategy
    is at most ``target``."""
    ratio = statistics.median(r["rewritten"] / r["mirrored"] for r in rounds)
    over_one = statistics.median(r["rewritten"] / r["single"] for r in rounds)

    def ms(kind):
        return statistics.median(r[kind] for r in rounds) * 1000
    figure = (f"{ratio:.2f}x MirroredStrategy (target <= {target:.2f}): rewritten {ms('rewritten'):.1f} ms, "
              f"MirroredStrategy {ms('mirrored'):.1f} ms, one GPU {ms('single'):.1f} ms ({over_one:.2f}x) "
              f"per step, {gpus} GPUs, batch {bench_step.BATCH}")
    return Row("step time vs MirroredStrategy", PASSED if ratio <= target else FAILED, figure)


def run_step_time(gpus, steps, warmup, rounds, target=STEP_TARGET):
    """bench_step's single, rewritten and mirrored runs on GPUs, ``rounds`` times; its Row."""
    measured = []
    for r in range(rounds):
        try:
            times = {kind: bench_step.run_measure(kind, gpus, steps, warmup, device_type="GPU")
                     for kind in ("single", "rewritten", "mirrored")}
        except RuntimeError as e:   # bench_step.run_measure: "<kind> failed:\n<its stderr>"
            sys.stderr.write(f"{e}\n")
            what, _, stderr = str(e).partition("\n")
            return Row("step time vs MirroredStrategy", FAILED, f"{what} {error_line(stderr)}")
        print(f"step time, round {r + 1}: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in times.items()),
              flush=True)
        measured.append(times)
    return step_time_row(measured, gpus, target)


# ----- the table -----------------------------------------------------------------------------

def format_table(rows):
    """The rows as a markdown table (check | result | figure), one line per check."""
    lines = ["| check | result | figure |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.result} | {r.figure} |" for r in rows]
    return "\n".join(lines)


def exit_status(rows):
    """0 when no row failed (skipped rows do not fail), 1 otherwise."""
    return 1 if any(r.result == FAILED for r in rows) else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpu_readiness.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="timed steps per step-time run (bench_step's)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=3, help="step-time rounds; the ratio is their median")
    p.add_argument("--step-target", type=float, default=STEP_TARGET,
                   help="largest rewritten / MirroredStrategy step-time ratio that passes")
    p.add_argument("--check-communication", choices=COMMUNICATIONS, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check_communication:   # the child run_communication starts
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        print(json.dumps(check_communication(args.check_communication, args.replicas)))
        return 0
    try:
        gpus = visible_gpus()
    except GraphRewriteError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: {gpus} GPU(s)", flush=True)
    rows = [run_suite()]
    rows += [run_communication(c, gpus) for c in COMMUNICATIONS]
    rows.append(run_step_time(gpus, args.steps, args.warmup, args.rounds, args.step_target))
    print(format_table(rows))
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
