"""TensorFlow's duplicate request ids (docs/reliability.md, "Duplicate request ids"):
gr.Session names the cause when a step meets it, and tools/tf_request_ids.py, which shows
the defect with plain TensorFlow, counts and predicts it correctly."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from graph_rewriter.session import duplicate_request_lead

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "tf_request_ids.py")

REFUSED = ('From /job:worker/replica:0/task:1:\nThe same RunGraph (Worker) request was received '
           'twice. goo.gle/debugonly graph_handle: "0000000000000004" step_id: 49380840354030203')
PEER = ("Collective ops is aborted by: Delete called on non-empty BufRendezvous\nAdditional GRPC "
        "error information from remote target /job:worker/replica:0/task:1 while calling "
        "/tensorflow.WorkerService/RecvBuf")


def _tool():
    spec = importlib.util.spec_from_file_location("tf_request_ids", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lead_names_a_refused_request_and_a_peer_that_met_one():
    refused = duplicate_request_lead(REFUSED)
    assert refused.startswith("graph_rewriter: TensorFlow refused this step's request to a server as a duplicate")
    peer = duplicate_request_lead(PEER)
    assert peer.startswith("graph_rewriter: a collective peer's step ended before this one received from it")
    for lead in (refused, peer):
        assert "Duplicate request ids" in lead and "last checkpoint" in lead
    assert duplicate_request_lead("Collective ops is aborted by: group is cancelled") is None


def test_the_expected_refusals_follow_the_window_and_the_seeds():
    tool = _tool()
    assert tool.expected_refusals(1) == 0
    # while the window fills, run i can repeat any of the i before it
    assert tool.expected_refusals(3, window=10, seeds=100) == pytest.approx((0 + 1 + 2) / 100)
    # once it is full, every run can repeat one of the last `window`
    assert tool.expected_refusals(15, window=10, seeds=100) == pytest.approx((45 + 5 * 10) / 100)
    # the figures docs/reliability.md quotes: about 4.7 in 250,000 runs, one in 43,000 after
    assert tool.expected_refusals(250_000) == pytest.approx(4.66, abs=0.01)
    assert 2 ** 32 / tool.WINDOW == pytest.approx(42_950, abs=1)


def test_the_tool_runs_plain_tensorflow_and_reports_what_it_saw(tmp_path):
    """2,000 runs: a refusal is possible (about 1 in 2,000 such runs), so the test checks
    that the exit status and the figures agree, whatever was seen."""
    out = tmp_path / "ids.json"
    proc = subprocess.run([sys.executable, TOOL, "--runs", "2000", "--report-every", "1000", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    figures = json.loads(out.read_text())
    assert figures["runs"] == 2000 and figures["other_errors"] == 0
    assert figures["refused"] == len(figures["refused_runs"])
    assert proc.returncode == (1 if figures["refused"] else 0), proc.stdout + proc.stderr
    assert "1000 runs in" in proc.stdout
    assert f"refused as duplicate requests: {figures['refused']}" in proc.stdout


def test_the_tool_refuses_bad_arguments():
    proc = subprocess.run([sys.executable, TOOL, "--runs", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--runs must be >= 1" in proc.stderr
