"""Rows of the batch that meet other rows: a contrastive loss with in-batch negatives.

A dual encoder's logits ``tf.matmul(queries, documents, transpose_b=True)`` compare every
query of the batch with every document of the batch. Each replica computes them over its
own shard, so every query meets R times fewer negatives than on one device, and the step
is not one device's (1.32 apart in the loss after three steps at 2 replicas, below). The
rewrite cannot give a replica the other replicas' rows (it would need them in the
forward pass and their gradients sent back), so it says so: the analysis lists the
product, and the plan's notes, the log and ``graph-rewrite inspect`` name it
(docs/semantics.md, "Rows that meet other rows").
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROW_PRODUCTS_START
from graph_rewriter.testing import real_models
from graph_rewriter.testing.tf1_scripts import dual_encoder, transformer_block, word2vec

tf1 = tf.compat.v1
READS = {"wq": "wq/Read/ReadVariableOp:0", "wd": "wd/Read/ReadVariableOp:0"}


def _batches(steps=3, rows=8):
    rng = np.random.RandomState(0)
    return [{"q:0": rng.randn(rows, 6).astype(np.float32), "d:0": rng.randn(rows, 6).astype(np.float32)}
            for _ in range(steps)]


def _train(session, feeds):
    with session as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return np.array(losses), sess.run(READS)


def _one_device(graph_def, feeds):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds)


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROW_PRODUCTS_START)]


@pytest.mark.parametrize("graph_def, found", [
    (lambda: dual_encoder("in_batch"), ["similarity"]),
    (lambda: dual_encoder("sampled"), []),
    (lambda: word2vec(8)[0], []),                       # nce_loss: sampled classes' weights, not rows
    (lambda: transformer_block()[0], []),               # attention: a batched product per sequence
    (lambda: real_models.build("bert")[0].graph_def, []),
], ids=["in_batch", "sampled", "word2vec", "transformer", "bert"])
def test_the_analysis_finds_products_of_rows_with_rows(graph_def, found):
    assert analyze(graph_io.load_graph(graph_def())).row_products == found


def test_the_plan_names_the_product_and_the_step_differs_from_one_device():
    """The note is what happens: 2 replicas train the in-batch-negatives encoder away
    from one device (each query meets 4 of the 8 documents), and the plan says so."""
    graph_def, feeds = dual_encoder("in_batch"), _batches()
    want = _one_device(graph_def, feeds)
    lines = []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", log=lines.append)
    [note] = _notes(result)
    assert "'similarity'" in note and "1/2" in note
    assert any(note in line for line in lines)
    got = _train(gr.Session(result), feeds)
    assert np.max(np.abs(got[0] - want[0])) > 1e-2


def test_negatives_of_the_row_itself_train_as_one_device_with_no_note():
    """The control: each query against its own documents only (no row meets another)
    trains as one device, and the plan has no note."""
    graph_def, feeds = dual_encoder("sampled"), _batches()
    want = _one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not _notes(result)
    got = _train(gr.Session(result), feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name in READS:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-6)


def test_one_replica_has_no_note_and_inspect_prints_it(tmp_path, capsys):
    assert not _notes(gr.rewrite(dual_encoder("in_batch"), devices_per_worker=1, device_type="CPU"))
    path = gr.rewrite(dual_encoder("in_batch"), devices_per_worker=2, device_type="CPU").save(str(tmp_path / "d.pb"))
    from graph_rewriter.cli import main
    assert main(["inspect", path]) == 0
    assert ROW_PRODUCTS_START + " in 'similarity'" in capsys.readouterr().out
