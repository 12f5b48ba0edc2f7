"""Bytes moved per step, as `graph-rewrite inspect` reports them: the dense gradients'
bytes for all-reduce, the gathered (padded) rows for sparse gradients."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.inspect_report import report

GRAPH_REWRITE = os.path.join(os.path.dirname(sys.executable), "graph-rewrite")


def _embedding_graph(vocab, dim, ids_per_example=1, ids_dtype=tf.int32):
    """A [vocab, dim] embedding looked up by ids [batch, ids_per_example], then a dense layer."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(ids_dtype, [None, ids_per_example], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf.compat.v1.get_variable("emb", [vocab, dim], use_resource=True,
                                        initializer=tf.compat.v1.zeros_initializer())
        w = tf.compat.v1.get_variable("w", [dim, 1], use_resource=True)
        h = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids), axis=1)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(h, w) - y)), name="loss")
        tf.compat.v1.train.AdagradOptimizer(0.1).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return g.as_graph_def()


def test_sparse_path_moves_under_one_percent_of_the_dense_bytes():
    # The case: a 1,000,000 x 64 float32 embedding, 1,000 ids per replica.
    gd = _embedding_graph(1_000_000, 64)
    sparse = report(gr.rewrite(gd, devices_per_worker=2, device_type="GPU"), batch_size=2000)
    dense = report(gr.rewrite(gd, devices_per_worker=2, device_type="GPU", sparse_as_dense=True))
    emb = sparse["bytes_per_step_per_replica"]["sparse"]["emb"]
    assert emb["rows_per_example"] == 1
    # 1,000 rows padded to 1,024, each 64 floats + an int32 index, from both replicas,
    # plus each replica's row count.
    assert emb["bytes"] == 2 * (1024 * (64 * 4 + 4) + 8)
    dense_bytes = dense["bytes_per_step_per_replica"]["dense_payload"]
    assert dense_bytes == (1_000_000 * 64 + 64) * 4      # the embedding's and w's gradients
    assert emb["bytes"] < 0.01 * dense_bytes
    # With the sparse path the dense payload is w's gradient alone.
    assert sparse["bytes_per_step_per_replica"]["dense_payload"] == 64 * 4


@pytest.mark.parametrize("ids_dtype, index_bytes", [(tf.int32, 4), (tf.int64, 8)])
def test_gathered_bytes_follow_ids_per_example_index_dtype_and_replicas(ids_dtype, index_bytes):
    gd = _embedding_graph(1000, 16, ids_per_example=3, ids_dtype=ids_dtype)
    row = 16 * 4 + index_bytes
    for r, batch, padded in ((2, 8, 16), (4, 8, 8), (3, 9, 16)):
        emb = report(gr.rewrite(gd, devices_per_worker=r, device_type="CPU"),
                     batch_size=batch)["bytes_per_step_per_replica"]["sparse"]["emb"]
        assert emb["rows_per_example"] == 3
        assert emb["bytes_per_example"] == 3 * row
        assert emb["bytes"] == r * (padded * row + 8), (r, batch)


def test_inspect_reports_sparse_bytes_per_example_or_per_step(tmp_path):
    out = str(tmp_path / "out.pb")
    gr.rewrite(_embedding_graph(100, 8, ids_per_example=2), devices_per_worker=2, device_type="CPU").save(out)

    def inspect(*extra):
        proc = subprocess.run([GRAPH_REWRITE, "inspect", out, *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "sparse emb: 72 B gathered per example of the global batch (2 row(s) each" in inspect()
    # 16 examples: 8 per replica, 16 rows each (a power of two already), 36 B per row
    assert "sparse emb: 1.1 KiB gathered for a global batch of 16" in inspect("--batch-size", "16")
    rep = json.loads(inspect("--json", "--batch-size", "16"))
    assert rep["bytes_per_step_per_replica"]["sparse"]["emb"]["bytes"] == 2 * (16 * 36 + 8)
    bad = subprocess.run([GRAPH_REWRITE, "inspect", out, "--batch-size", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--batch-size" in bad.stderr and "Traceback" not in bad.stderr


def test_ids_whose_count_does_not_follow_the_batch_are_reported_unknown(tmp_path):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        emb = tf.compat.v1.get_variable("emb", [100, 4], use_resource=True)
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")  # not tied to x's batch
        loss = tf.identity(tf.reduce_sum(tf.nn.embedding_lookup(emb, tf.unique(ids).y)) +
                           tf.reduce_sum(x), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    rep = report(gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="CPU"), batch_size=8)
    assert rep["bytes_per_step_per_replica"]["sparse"]["emb"] == {
        "bytes": None, "bytes_per_example": None, "rows_per_example": None}
