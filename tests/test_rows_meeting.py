"""Rows of the batch that meet other rows: each replica computes with its own rows.

A forward op in which a row of the batch meets other rows of the batch computes, on
each replica, with that replica's shard only, and no rewrite that keeps the forward pass
per replica can give it one device's value: a dual encoder's in-batch negatives
``tf.matmul(queries, documents, transpose_b=True)`` where its head is left to each replica
(1.32 apart in the loss after three steps at 2 replicas, below; by default every replica
computes it over every replica's rows: tests/test_product_heads.py), mixup's reversed or
shuffled hidden features (the inputs' are moved over every replica's rows:
tests/test_row_moves.py; a top_k of the rows' losses is ranked over them:
tests/test_product_heads.py), rows taken by their position in the batch (its halves by ``tf.split(h, 2,
0)``, ``h[:n]``: before, not noted, and 0.22 from one device in the loss at 2 replicas; now computed
over every replica's rows where their head can be: tests/test_positioned_rows.py),
statistics over the batch's rows used other than linearly (BatchNorm in training mode, a
center loss), a mean over the rows a condition on the batch selects (``tf.boolean_mask``)
where no collective can sync its count (tests/test_selected_means.py makes it exact where
one can). The rewrite says so: the analysis lists each, and the plan's notes, the log and ``graph-rewrite
inspect`` name them (docs/semantics.md, "Rows that meet other rows"). Each note is shown
true (the step differs from one device's), and the controls, where rows stay apart or
meet only linearly (a mean by hand, a normaliser the rewrite syncs), train as one device
with no note.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import real_models
from graph_rewriter.testing.tf1_scripts import (ROWS_APART, ROWS_MEETING, dropout_batches, dual_encoder,
                                                rows_meeting_mlp, transformer_block, word2vec)

tf1 = tf.compat.v1
READS = {"wq": "wq/Read/ReadVariableOp:0", "wd": "wd/Read/ReadVariableOp:0"}


def _batches(steps=3, rows=8):
    rng = np.random.RandomState(0)
    return [{"q:0": rng.randn(rows, 6).astype(np.float32), "d:0": rng.randn(rows, 6).astype(np.float32)}
            for _ in range(steps)]


def _train(session, feeds, reads=READS):
    with session as sess:
        sess.run("init")
        losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
        return np.array(losses), sess.run(reads)


def _one_device(graph_def, feeds, reads=READS):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds, reads)


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("graph_def, found", [
    (lambda: dual_encoder("in_batch"), ["similarity"]),
    (lambda: dual_encoder("sampled"), []),
    (lambda: word2vec(8)[0], []),                       # nce_loss: sampled classes' weights, not rows
    (lambda: transformer_block()[0], []),               # attention: a batched product per sequence
    (lambda: real_models.build("bert")[0].graph_def, []),
], ids=["in_batch", "sampled", "word2vec", "transformer", "bert"])
def test_the_analysis_finds_products_of_rows_with_rows(graph_def, found):
    assert analyze(graph_io.load_graph(graph_def())).row_products == found


FIELDS = ("row_products", "moved_rows", "positioned_rows", "batch_statistics", "selected_means")


def _found(graph_def):
    analysis = analyze(graph_io.load_graph(graph_def))
    return {field: getattr(analysis, field) for field in FIELDS}


@pytest.mark.parametrize("kind", sorted(ROWS_MEETING))
def test_the_analysis_finds_rows_that_meet(kind):
    field, names = ROWS_MEETING[kind]
    assert _found(rows_meeting_mlp(kind)) == {f: names if f == field else [] for f in FIELDS}


@pytest.mark.parametrize("kind", ROWS_APART)
def test_the_analysis_finds_nothing_where_rows_stay_apart(kind):
    assert _found(rows_meeting_mlp(kind)) == {f: [] for f in FIELDS}


# the words each kind of note says what it found with
NOTE_WORDS = {"moved_rows": "rows moved or ranked within the batch", "batch_statistics": "statistics over the batch's rows",
              "positioned_rows": "rows taken by their position in the batch",
              "selected_means": "a mean over the rows a condition on the batch selects"}
MLP_READS = {"w1": "w1/Read/ReadVariableOp:0", "w2": "w2/Read/ReadVariableOp:0"}


@pytest.mark.parametrize("kind", ["mixup_hidden", "center_loss",
                                  "mean_features", "cross_correlation", "fused_batch_norm"])
def test_each_note_names_what_it_found_and_is_true(kind):
    """The note names the ops and says why, the log carries it, and it is true: 2
    replicas train away from one device on the same batches."""
    field, names = ROWS_MEETING[kind]
    graph_def, feeds = rows_meeting_mlp(kind), dropout_batches(3, 16)
    lines = []
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", log=lines.append)
    [note] = _notes(result)
    moved = (result.plan.row_moves or {}).get("moves", ())   # (manifold mixup's labels: moved as one device)
    assert NOTE_WORDS[field] in note and all(f"'{n}'" in note for n in names if n not in moved)
    assert any(note in line for line in lines)
    want, got = _one_device(graph_def, feeds, MLP_READS), _train(gr.Session(result), feeds, MLP_READS)
    assert np.max(np.abs(got[0] - want[0])) > 1e-3


@pytest.mark.parametrize("kind", ROWS_APART)
def test_rows_that_stay_apart_train_as_one_device_with_no_note(kind):
    graph_def, feeds = rows_meeting_mlp(kind), dropout_batches(3, 16)
    want = _one_device(graph_def, feeds, MLP_READS)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    assert not _notes(result)
    got = _train(gr.Session(result), feeds, MLP_READS)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name in MLP_READS:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-6)


def test_batch_norm_of_a_real_model_is_named_in_short():
    """ResNet's twelve moments (a mean and a variance per BatchNorm): the note names
    four and counts the rest, under every strategy."""
    graph_def = real_models.build("resnet")[0].graph_def
    found = _found(graph_def)["batch_statistics"]
    assert len(found) == 12 and found[:2] == ["resnet/stem_bn/moments/mean", "resnet/stem_bn/moments/variance"]
    for strategy in ("allreduce", "ps", "hybrid"):
        [note] = _notes(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy))
        assert NOTE_WORDS["batch_statistics"] in note
        assert "'resnet/stem_bn/moments/mean', 'resnet/stem_bn/moments/variance'" in note and "and 8 more" in note


def _own_rows_meeting(graph_def, **options):
    """A plan that leaves each replica's rows meeting its own (``"product_head": {}``):
    by default every replica computes an in-batch product's head over every replica's
    rows (tests/test_product_heads.py)."""
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.product_head = {}
    return gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan, **options)


def test_the_plan_names_the_product_and_the_step_differs_from_one_device():
    """The note is what happens when the product's head is left to each replica: 2
    replicas train the in-batch-negatives encoder away from one device (each query
    meets 4 of the 8 documents), and the plan says so."""
    graph_def, feeds = dual_encoder("in_batch"), _batches()
    want = _one_device(graph_def, feeds)
    lines = []
    result = _own_rows_meeting(graph_def, log=lines.append)
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
    path = _own_rows_meeting(dual_encoder("in_batch")).save(str(tmp_path / "d.pb"))
    from graph_rewriter.cli import main
    assert main(["inspect", path]) == 0
    assert ROWS_MEET_START + " in 'similarity'" in capsys.readouterr().out


@pytest.mark.parametrize("rank, found", [
    (2, ["batch_normalization/moments/mean", "batch_normalization/moments/variance"]),
    (4, [r"batch_normalization/cond:batch_normalization_cond_true_\d+:FusedBatchNormV3"]),
], ids=["dense", "conv"])
def test_keras_batch_norm_is_found_behind_its_learning_phase(rank, found):
    """tf_keras' BatchNormalization in a TF1 graph: after a Dense layer its moments in the
    graph; after a Conv2D a FusedBatchNorm in the training branch of the learning
    phase's v2 cond, named call:function:node."""
    import re
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        inp = tf_keras.Input(shape=(4, 4, 2) if rank == 4 else (4,))
        h = tf_keras.layers.Conv2D(3, 2)(inp) if rank == 4 else tf_keras.layers.Dense(8)(inp)
        h = tf_keras.layers.Flatten()(tf_keras.layers.BatchNormalization()(h))
        model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(h))
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        loss = tf.reduce_mean(tf.square(model.output - y))
        opt = tf_keras.optimizers.legacy.SGD(0.1)
        tf.group(*opt.get_updates(loss, model.trainable_weights), *model.updates, name="train_op")
    names = _found(g.as_graph_def())["batch_statistics"]
    assert len(names) == len(found) and all(re.fullmatch(f, n) for f, n in zip(found, names))
