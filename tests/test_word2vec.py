"""TensorFlow's basic word2vec tutorial (graph_rewriter.testing.tf1_scripts.word2vec):
an embedding lookup and tf.nn.nce_loss, whose weights and biases are gathered by the
same ids (the labels and the sampled candidates), so three variables get sparse
gradients, two of them with indices from one tensor. The rewrite once gave both of
those to the weights ("receives two different gradients") and refused the graph.

The sampler is a random op: every replica's clone keeps its seeds, so at each step each
replica draws the candidates one device draws, and R replicas of batch B compute what
one device computes on the R x B rows, exactly (the reference is bit-for-bit
deterministic): every variable, the loss and the similarity fetch are compared.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing.tf1_scripts import word2vec, word2vec_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 6, 8
RTOL, ATOL = 1e-5, 1e-6
STRATEGIES = ("allreduce", "ps", "hybrid")


def _reads(names):
    return {name: f"{name}/Read/ReadVariableOp:0" for name in names}


def _one_device(steps=STEPS, batch=2 * BATCH):
    """(losses, {variable: value}, similarity) of the tutorial's graph on one device."""
    graph_def, names = word2vec(batch)
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in word2vec_batches(steps, batch)]
        values = sess.run(_reads(names))
        similarity = sess.run("similarity:0")
    return losses, values, similarity


def test_the_reference_trains_and_is_deterministic():
    losses, values, _ = _one_device()
    again, values_again, _ = _one_device()
    assert losses == again
    for name in values:
        np.testing.assert_array_equal(values[name], values_again[name], err_msg=name)
    _, start, _ = _one_device(steps=0)
    for name in ("embeddings", "nce_weights", "nce_biases"):
        assert np.max(np.abs(values[name] - start[name])) > 1e-3, f"{name} did not move"
    assert values["global_step"] == STEPS


def test_weights_and_biases_gathered_by_the_same_ids_each_get_their_own_gradient():
    graph_def, _ = word2vec(BATCH)
    cuts = {c.variable: c for c in analyze(graph_io.load_graph(graph_def)).cuts if c.role == "gradient"}
    assert sorted(cuts) == ["embeddings", "nce_biases", "nce_weights"]
    assert {c.kind for c in cuts.values()} == {"sparse"}
    # the weights' and the biases' gradient rows are indexed by the same ids
    assert cuts["nce_weights"].values != cuts["nce_biases"].values


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_replicas_train_as_one_device_on_their_rows(strategy):
    want_losses, want, want_similarity = _one_device()
    graph_def, names = word2vec(BATCH)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    with gr.Session(result) as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in word2vec_batches(STEPS, 2 * BATCH)]
        got = sess.run(_reads(names))
        similarity = sess.run("similarity:0")
        summary = tf1.Summary.FromString(sess.run("summaries/summaries:0", word2vec_batches(1, 2 * BATCH)[0]))
    assert [v.tag for v in summary.value] == ["loss_1"]   # (TensorFlow's tag: the op "loss" exists)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    for name in names:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")
    np.testing.assert_allclose(similarity, want_similarity, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_workers_train_as_one_device_on_loopback_servers(strategy, pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica (+ 1 ps for ps and hybrid), each its own
    client process fed its half of each global batch."""
    _, want, _ = _one_device()
    graph_def, names = word2vec(BATCH)
    reads = _reads(names)
    feeds = word2vec_batches(STEPS, 2 * BATCH)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, reads.values(), feeds)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=f"{strategy}: {name}")
