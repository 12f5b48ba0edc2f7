"""Spectral normalization's power iteration under parameter servers
(graph_rewriter.testing.tf1_scripts.spectral_norm_mlp).

Each step assigns a non-trainable vector u its next power iteration from the weights,
``u = normalize(normalize(u @ W^T) @ W)``, before the forward pass reads ``W / sigma``.
The value is the same on every replica, so under allreduce (every variable mirrored)
R replicas trained as one device. Under ps u lived on the parameter server, and every
replica wrote it, each write reading what another's may already have written: R power
iterations a step in any order, and the step differed from one device's with no note
(0.0067 in the loss and 0.022 in the variables after four steps at 4 replicas with
resource variables; 0.0032 already at 2 with ref variables). A variable the forward pass
writes before any gradient is now mirrored under ps, so each replica writes its own
copy once.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dropout_batches, spectral_norm_mlp

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
VECTORS = ["w1_u", "w2_u"]


def _run(sess, graph_def, feeds):
    """([loss per step], {variable: value}): the vectors fetched by their variables'
    tensors too (ref variables have no resource reads)."""
    sess.run("init")
    losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
    return losses, sess.run({**{name: f"{name}:0" for name in VECTORS}, **harness.resource_reads(graph_def)})


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_the_vectors_are_mirrored_under_ps(resource):
    result = gr.rewrite(spectral_norm_mlp(resource), devices_per_worker=2, device_type="CPU", strategy="ps")
    placement = {v.name: v.placement for v in result.plan.variables}
    assert [placement[name] for name in VECTORS] == ["mirrored", "mirrored"]
    assert placement["w1"] == placement["w2"] == placement["beta1_power"] == "ps"


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("strategy, replicas", [("ps", 2), ("ps", 4), ("allreduce", 4), ("hybrid", 2)])
def test_spectral_normalization_trains_as_one_device(resource, strategy, replicas):
    graph_def, feeds = spectral_norm_mlp(resource), dropout_batches(STEPS, BATCH)
    with harness.one_device_session(graph_def) as sess:
        want = _run(sess, graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    with gr.Session(result) as sess:
        got = _run(sess, graph_def, feeds)
    harness.assert_trained_alike(f"{strategy} {replicas}", got, want, RTOL, ATOL)


@pytest.mark.slow
def test_two_workers_with_a_parameter_server_normalize_as_one_device(pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica and a parameter server: each worker writes
    its own copy of the vectors, once a step."""
    graph_def, feeds = spectral_norm_mlp(), dropout_batches(STEPS, BATCH)
    _, want = harness.trained_on_one_device(graph_def, feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "ps", STEPS, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
