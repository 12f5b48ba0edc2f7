"""The soak run's short version (issue 17): tools/soak.py on a real loopback cluster.

What is held (docs/reliability.md, "Soak"): a between-graph run of 1000 steps per
strategy (ps, then allreduce; 1 ps + 2 workers, one client process per worker) ends
with the soak tool's exit status 0, and the figures it writes say why: every client's
step time at the end within twice the start (a gross bound: the other test worker
runs beside it), divided by the machine speed probe's ratio over the same windows (with --load-tolerant: the soak's CPU per step, so divided,
when other processes on the machine disturbed the wall time), no
process's RSS grown by more than the bound after warm-up, nothing left on the servers
(ps: empty token and init queues, empty accumulators, the step counter at the steps run;
both: the workers agree, and one more step from fresh sessions equals one device), and
no server replaced. The checks can fail: with --inject-fault the tool leaves a token in
a queue (ps) or nudges one worker's copy of a variable (allreduce) after the run, and
must then report exactly that and exit 1.

Cost: about 80 s on two cores (a cluster start, two client processes and the steps, per
strategy and per test). The tool runs in a subprocess with a deadline; it ends every
process it starts by its id.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOAK = os.path.join(REPO, "tools", "soak.py")
TOOL_TIMEOUT = 400.0
# The step-time bound of this short run, on the step time divided by the machine speed
# probe's ratio (docs/reliability.md, "Soak"): 1000 steps give windows of about a second,
# and on these 2-core virtual machines the windows' judged ratio moved between 0.92 and
# 1.13 over a dozen runs (the raw ratio between 0.80 and 1.33). The tool's own default,
# 1.10, is for its long runs. In the suite the other test worker runs beside the soak:
# two CI runs of 2026-11-29 saw 0.4-0.8 cores of other load, and under it the soak's own
# CPU per step moved by 1.27 (allreduce) between windows with nothing changed. So the
# suite bounds the judged ratio at 2.0, a gross regression (a step that doubles as the
# steps go on); the 1.25 bound is held by the tool run on a quiet machine
# (docs/reliability.md, "Soak").
MAX_STEP_RATIO, MAX_GROWTH_MIB = 2.0, 16.0
PS_LEFT_BEHIND = {"queue graph_rewriter/tokens/worker_0", "queue graph_rewriter/tokens/worker_1",
                  "queue graph_rewriter/init_done", "step counter graph_rewriter/sync_step"}


def _soak(tmp_path, *args):
    """Runs tools/soak.py with ``args``; returns (exit status, figures, its output: the
    report on stdout, then stderr)."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    try:
        proc = subprocess.run([sys.executable, SOAK, *args, "--json", str(out),
                               "--work-dir", str(tmp_path / "work")],
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tools/soak.py {' '.join(args)} still running after {TOOL_TIMEOUT:.0f} s\n"
                    f"{e.stdout}", pytrace=False)
    output = proc.stdout + proc.stderr
    if not out.exists():
        pytest.fail(f"tools/soak.py exited with status {proc.returncode} and wrote no figures\n{output}",
                    pytrace=False)
    return proc.returncode, json.loads(out.read_text()), output


def test_soak_short_run_keeps_memory_and_step_time_and_leaves_nothing_behind(tmp_path):
    status, figures, output = _soak(tmp_path, "--steps", "1000", "--warmup", "200", "--window", "200",
                                    "--sample-every", "100", "--load-tolerant",
                                    "--max-step-ratio", str(MAX_STEP_RATIO))
    assert status == 0 and figures["ok"], output
    assert "\nPASS\n" in output, output
    runs = {f["strategy"]: f for f in figures["strategies"]}
    assert sorted(runs) == ["allreduce", "ps"], output
    for strategy, run in runs.items():
        assert "error" not in run, f"{strategy}: {run.get('error')}"
        assert run["steps"] == 1000
        assert all(c["probe_ms"] for c in run["cpu"]), f"{strategy}: no speed probe sample: {run['cpu']}"
        for who, t in run["step_time"].items():
            wall = t["judged_by"] == "wall time"
            ratio = t["ratio"] if wall else run["cpu_ratio"]
            # (judged by CPU per step, a machine that seems faster is no slowdown of the soak's)
            speed = run["speed_ratio"] if wall else max(run["speed_ratio"], 1.0)
            assert t["judged_ratio"] == pytest.approx(ratio / speed)
            assert t["judged_ratio"] <= MAX_STEP_RATIO, \
                f"{strategy} {who}: step time ratio {ratio:.3f}, judged {t['judged_ratio']:.3f}\n{output}"
            assert t["first"]["steps"] == [200, 400] and t["last"]["steps"] == [800, 1000]
        # every process: both clients, each server's serve parent and TensorFlow child
        assert len(run["memory"]) == 2 + 3 * 2, sorted(run["memory"])
        for who, m in run["memory"].items():
            assert m["growth_mib"] <= MAX_GROWTH_MIB, f"{strategy} {who}: RSS grew {m['growth_mib']:.1f} MiB"
        checks = run["left_behind"]
        assert all(c["ok"] for c in checks.values()), f"{strategy}: {json.dumps(checks, indent=1)}"
        assert {"workers' variables agree", "one more step equals one device",
                "no server replaced"} <= set(checks)
        if strategy == "ps":
            assert PS_LEFT_BEHIND <= set(checks), sorted(checks)
            assert any(name.startswith("accumulator ") for name in checks), sorted(checks)
            assert checks["step counter graph_rewriter/sync_step"]["holds"] == 1000


def test_soak_fails_when_something_is_left_behind(tmp_path):
    status, figures, output = _soak(tmp_path, "--steps", "300", "--warmup", "100", "--window", "100",
                                    "--sample-every", "100", "--inject-fault", "--load-tolerant")
    assert status == 1 and not figures["ok"], output
    assert "\nFAIL\n" in output, output   # the report's verdict
    runs = {f["strategy"]: f for f in figures["strategies"]}
    failed = {s: sorted(name for name, c in run["left_behind"].items() if not c["ok"])
              for s, run in runs.items()}
    assert failed["ps"] == ["queue graph_rewriter/tokens/worker_1"], output
    assert runs["ps"]["left_behind"]["queue graph_rewriter/tokens/worker_1"]["holds"] == 1
    assert failed["allreduce"] == ["one more step equals one device", "workers' variables agree"], output
