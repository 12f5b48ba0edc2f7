"""In-batch products train as one device: every replica computes their head over every
replica's rows (graph_rewriter/product_heads.py, passes/product_heads.py).

A dual encoder's ``tf.matmul(q, d, transpose_b=True)``, CLIP's symmetric loss with a
learned temperature, SimCLR's NT-Xent and a batch-hard triplet loss (its mask of equal
labels computed again from every replica's labels) meet every row of the batch with
every other.
Before, each replica met its own shard's rows and the plan said so in a note (1.32 from
one device in the loss after three steps at 2 replicas: the control below); SimCLR as its
own code writes it (both views through one encoder, ``tf.concat([v1, v2], 0)``, and back
apart by ``tf.split(h, 2, 0)``) was not even noted, and trained 1.42 from one device in
the loss, silently: the analysis did not follow rows through the split. Now each
replica gathers the rows the head reads, computes one device's loss, and keeps R times
its own rows' gradients; where the head holds what the rewrite cannot gather (a random
op, a statistic another pass rewrites) or the rows cannot be gathered (micro-batches), the
note stays and the log says why.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io, inspect_report
from graph_rewriter.analysis import analyze
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import (LISTWISE_FORMS, PRODUCT_FORMS, contrastive, contrastive_batches,
                                                dropout_batches, dual_encoder, listwise_softmax, pairwise_ranking,
                                                rows_meeting_mlp)

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 2e-6


def _graph(kind):
    if kind.startswith("hardest"):
        return rows_meeting_mlp(kind)
    if kind == "ranknet":
        return pairwise_ranking()
    if kind in LISTWISE_FORMS:
        return listwise_softmax(kind)
    if kind.startswith("dual_encoder:"):
        return dual_encoder("in_batch", kind.partition(":")[2])
    return dual_encoder("in_batch") if kind == "dual_encoder" else contrastive(kind)


def _batches(kind, steps=STEPS):
    if kind.startswith("hardest") or kind == "ranknet" or kind in LISTWISE_FORMS:
        return dropout_batches(steps, 16)
    if kind.startswith("dual_encoder"):
        rng = np.random.RandomState(0)
        return [{"q:0": rng.randn(BATCH, 6).astype(np.float32), "d:0": rng.randn(BATCH, 6).astype(np.float32)}
                for _ in range(steps)]
    return contrastive_batches(kind, steps, BATCH)


_REFERENCES = {}


def _reference(kind):
    if kind not in _REFERENCES:
        graph_def = _graph(kind)
        with harness.one_device_session(graph_def) as sess:
            _REFERENCES[kind] = graph_def, harness.train_and_read(sess, graph_def, _batches(kind))
    return _REFERENCES[kind]


def _notes(result):
    return [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]


@pytest.mark.parametrize("kind, products, gathered, gradients", [
    ("dual_encoder", ["similarity"], ["l2_normalize:0", "l2_normalize_1:0"], 2),
    ("clip", ["similarity"], ["l2_normalize:0", "l2_normalize_1:0"], 2),
    ("simclr", ["MatMul_4", "MatMul_5", "MatMul_6", "MatMul_7"], ["l2_normalize:0", "l2_normalize_1:0"], 8),
    ("simclr_stacked", ["MatMul_2", "MatMul_3", "MatMul_4", "MatMul_5"], ["split_1:0", "split_1:1"], 8),
    # (its mask of equal labels, ``tf.equal(labels[:, None], labels[None, :])``, meets the rows too)
    ("triplet", ["similarity", "Equal"], ["labels:0", "MatMul:0"], 2),
    # (so does its squared norms' sum of a column and a row vector)
    ("triplet_norms", ["similarity", "sub", "Equal"], ["labels:0", "MatMul:0", "Sum:0"], 4),
])
def test_the_analysis_finds_the_head(kind, products, gathered, gradients):
    """The products, the rows the head reads (the normalised embeddings, the triplet
    loss's labels), the count of rows its labels or mask come from
    (``tf.range(tf.shape(x)[0])``, ``tf.eye``), and one gradient of rows per product
    operand, each read by the encoder's backward."""
    head = analyze(graph_io.load_graph(_graph(kind))).product_head
    assert head.products == products
    assert [t for t, _ in head.gathered] == gathered
    assert head.count_leaves == ["Shape"]
    assert ("eye/diag" if kind.startswith("triplet") else "range") in head.copied_ops
    assert len(head.gradients) == gradients
    assert all("l2_normalize" in reader or "split_1_grad" in reader or "/AddN" in reader   # (or their sum)
               or "MatMul_grad" in reader
               for _, readers in head.gradients for reader, _ in readers)
    assert "loss" in head.head


@pytest.mark.parametrize("form, product", [
    ("transpose", "similarity"), ("einsum", "similarity/Einsum"), ("tensordot", "similarity/MatMul"),
    ("broadcast", "similarity"), ("distances", "similarity")])
def test_the_analysis_finds_a_product_however_it_is_written(form, product):
    """``tf.matmul(q, tf.transpose(d))``, tf.einsum, tf.tensordot, ``q[:, None] *
    d[None]`` and pairwise distances by expand_dims put the queries' rows and the
    documents' on two axes of their output, as ``transpose_b=True`` does. Before, only
    that form was found: the others trained 1.32 (2.47 the distances) from one device in
    the loss at 2 replicas, with no note."""
    found = analyze(graph_io.load_graph(_graph(f"dual_encoder:{form}")))
    assert found.row_products == [product] and found.product_head.products == [product]
    assert [t for t, _ in found.product_head.gathered] == ["l2_normalize:0", "l2_normalize_1:0"]


def test_a_normaliser_the_head_computes_is_the_whole_batchs():
    """RankNet's pairs (``s[:, None] - s[None, :]``, s a column of the scores) meet every
    row with every other, and its loss divides by the count of ordered pairs, a sum over
    the batch: the head computes that count again from every replica's relevance, so it
    is one device's there and no normaliser for the replicas to average. Before, the
    pairs were not found (``s`` is a slice ``[:, 0]``) and RankNet trained 0.058 from one
    device in the loss at 2 replicas, 0.57 at 4, with no note."""
    found = analyze(graph_io.load_graph(_graph("ranknet")))
    # (its ordered pairs, a comparison of the relevances' column and row, meet the rows
    # too: the count is computed in the head itself)
    assert found.row_products == ["pairs", "Greater"] and found.product_head.products == ["pairs", "Greater"]
    assert found.normalizers == [] and "Maximum" in found.product_head.head
    assert [t for t, _ in found.product_head.gathered] == ["y:0", "MatMul_1:0"]   # (relevance, scores)


@pytest.mark.parametrize("kind, ranked", [
    ("listnet", ["Softmax", "LogSoftmax"]), ("softmax_axis0", ["Softmax", "LogSoftmax"]),
    ("attention_pooling", ["Softmax"])])
def test_a_softmax_over_the_rows_starts_a_head(kind, ranked):
    """A softmax over the batch's rows (of a [rows] value, or of the rows moved to the
    last axis by tf.nn.softmax(axis=0)'s transpose) normalises them together: ListNet's
    list, attention pooling's bag. It starts a head, as a ranking does; the loss's sum
    and the bag's sum over the rows in the head are the whole batch's there, neither a
    loss sum to scale nor a statistic to note. Before, the first two trained 0.75 and
    0.86 from one device in the loss at 2 replicas with no note, and the third was noted."""
    found = analyze(graph_io.load_graph(_graph(kind)))
    assert found.ranked_rows == ranked and found.product_head.products == ranked
    assert found.loss_sums == [] and found.batch_statistics == []
    assert "loss" in found.product_head.head


@pytest.mark.parametrize("kind, head, gathered, count_leaves", [
    ("hardest_rows", ["hardest", "Mean", "loss"], ["Reshape:0"], ["Shape"]),
    ("hardest_gathered", ["hardest", "GatherV2", "Mean_1", "mul_2", "add", "loss"],
     ["Square:0"], []),   # (k's Size: of the copied err[:, 0], which reads the gathered rows)
    ("hardest_entries", ["hardest", "Mean", "loss"], ["Reshape:0"], []),
])
def test_the_analysis_finds_the_head_of_a_ranking(kind, head, gathered, count_leaves):
    """Online hard example mining, ``tf.nn.top_k`` of the rows' losses (by its values or
    by a gather of its indices, k a quarter of a count of the rows or a constant, over
    the rows or every entry of them): the ranking is a head's start as a product is.
    Every replica ranks every replica's rows, k counted over them; the mean of every
    row's loss that the second adds reads the gathered rows too."""
    found = analyze(graph_io.load_graph(_graph(kind)))
    assert found.ranked_rows == ["hardest"] and found.moved_rows == ["hardest"]
    assert found.product_head.products == ["hardest"] and found.product_head.head == head
    assert sorted(t for t, _ in found.product_head.gathered) == sorted(gathered)
    assert found.product_head.count_leaves == count_leaves


@pytest.mark.parametrize("kind, strategy, replicas", [
    ("dual_encoder", "allreduce", 2),
    ("clip", "allreduce", 2), ("clip", "allreduce", 4), ("clip", "ps", 2), ("clip", "hybrid", 2),
    ("simclr", "allreduce", 2), ("simclr", "allreduce", 4), ("simclr", "ps", 4),
    ("simclr_stacked", "allreduce", 2), ("simclr_stacked", "allreduce", 4), ("simclr_stacked", "hybrid", 2),
    ("triplet", "allreduce", 2), ("triplet", "allreduce", 4), ("triplet", "ps", 2),
    ("triplet_norms", "allreduce", 2), ("triplet_norms", "allreduce", 4),
    ("hardest_rows", "allreduce", 2), ("hardest_rows", "allreduce", 4), ("hardest_rows", "ps", 2),
    ("hardest_gathered", "allreduce", 2), ("hardest_gathered", "hybrid", 2),
    ("hardest_entries", "allreduce", 2), ("hardest_entries", "allreduce", 4),
    *((f"dual_encoder:{form}", "allreduce", 2) for form in PRODUCT_FORMS[1:]),
    ("dual_encoder:einsum", "allreduce", 4), ("dual_encoder:broadcast", "hybrid", 2),
    ("dual_encoder:distances", "allreduce", 4),
    ("ranknet", "allreduce", 2), ("ranknet", "allreduce", 4), ("ranknet", "ps", 2),
    ("listnet", "allreduce", 2), ("listnet", "allreduce", 4), ("listnet", "ps", 2),
    ("softmax_axis0", "allreduce", 2), ("softmax_axis0", "hybrid", 2),
    ("attention_pooling", "allreduce", 2), ("attention_pooling", "allreduce", 4), ("attention_pooling", "ps", 2),
])
def test_trains_as_one_device(kind, strategy, replicas):
    """Losses at every step and every variable (Adam's and momentum's slots, CLIP's
    learned temperature) after STEPS steps, with no note."""
    graph_def, want = _reference(kind)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not _notes(result)
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, _batches(kind))
    harness.assert_trained_alike(f"{kind}, {strategy}, {replicas} replicas", got, want, RTOL, ATOL)


@pytest.mark.parametrize("kind", ["dual_encoder", "simclr", "simclr_stacked", "triplet", "triplet_norms",
                                  "hardest_rows", "hardest_gathered", "hardest_entries",
                                  *(f"dual_encoder:{form}" for form in PRODUCT_FORMS[1:]), "ranknet",
                                  *LISTWISE_FORMS])
def test_each_replicas_own_rows_would_be_caught(kind):
    """The control: a given plan with ``"product_head": {}`` leaves each replica's rows
    meeting its own; the note comes back and the losses differ from the first step on,
    so the test above can fail."""
    graph_def, want = _reference(kind)
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.product_head = {}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)
    assert _notes(result)
    with gr.Session(result) as sess:
        losses, _ = harness.train_and_read(sess, graph_def, _batches(kind))
    assert max(abs(a - b) for a, b in zip(losses, want[0])) > 1e-2, (losses, want[0])


def test_values_of_the_head_are_fetched_as_one_devices():
    """The logits and the rows' losses are the whole batch's on every replica: fetched
    by their names, they are one device's (replica 0's, not the replicas' concatenated)."""
    graph_def = dual_encoder("in_batch")
    feed = _batches("dual_encoder", 1)[0]
    fetches = ["similarity:0", "SparseSoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits:0", "loss:0"]
    with harness.one_device_session(graph_def) as sess:
        sess.run("init")
        want = sess.run(fetches, feed)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    with gr.Session(result) as sess:
        sess.run("init")
        got = sess.run(fetches, feed)
    for w, g in zip(want, got):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_the_graph_gathers_per_replica_with_keys_of_its_own():
    """Each replica gathers the two embeddings one after the other, with instance keys
    of their own (distinct from every other collective's); the plan lists the head and
    `graph-rewrite inspect` says so."""
    result = gr.rewrite(contrastive("clip"), devices_per_worker=2, device_type="CPU")
    gathers = [n for n in result.graph_def.node if n.op == "CollectiveGatherV2"]
    assert len(gathers) == 4
    nodes = {n.name: n for n in result.graph_def.node}

    def key(n):
        return nodes[n.input[3].split(":")[0]].attr["value"].tensor.int_val[0]   # (instance_key)

    collectives = [n for n in result.graph_def.node if n.op.startswith("Collective")]
    keys = [(key(n), n.name.startswith("replica_1/")) for n in collectives]
    assert len(set(keys)) == len(keys)
    for prefix in ("", "replica_1/"):   # the second gather runs after the first
        second = nodes[prefix + "l2_normalize_1/every_replica/all_gather"]
        assert "^" + prefix + "l2_normalize/every_replica/all_gather" in second.input
    plan = result.metadata["plan"]
    assert plan["product_head"]["products"] == ["similarity"]
    text = inspect_report.format_report(inspect_report.report(result))
    assert "in-batch products and rankings computed over every replica's rows" in text and "similarity" in text


def _dropout_on_logits():
    g = tf.Graph()
    with g.as_default():
        q = tf1.placeholder(tf.float32, [None, 6], name="q")
        d = tf1.placeholder(tf.float32, [None, 6], name="d")
        w = tf1.get_variable("w", [6, 5], initializer=tf1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(tf.matmul(q, w), tf.matmul(d, w), transpose_b=True, name="similarity")
        logits = tf1.nn.dropout(logits, rate=0.1, seed=3)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.range(tf.shape(q)[0]), logits=logits), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    return g.as_graph_def()


def _batch_normalized_encoders():
    """A dual encoder whose encoder normalises by the batch's moments (tf.nn.moments),
    as SimCLR's ResNet does with its global BatchNorm, and in-batch negatives."""
    g = tf.Graph()
    with g.as_default():
        q = tf1.placeholder(tf.float32, [None, 6], name="q")
        d = tf1.placeholder(tf.float32, [None, 6], name="d")
        w = tf1.get_variable("w", [6, 5], initializer=tf1.glorot_uniform_initializer(seed=2))

        def encoder(x, name):
            h = tf.matmul(x, w)
            mean, variance = tf.nn.moments(h, [0], name=name)
            return tf.math.l2_normalize((h - mean) / tf.sqrt(variance + 1e-3), 1)
        logits = 5.0 * tf.matmul(encoder(q, "bn_q"), encoder(d, "bn_d"), transpose_b=True, name="similarity")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.range(tf.shape(q)[0]), logits=logits), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def test_a_head_beside_synced_batch_statistics_takes_keys_of_its_own():
    """With sync_batch_statistics, the encoders' statistics and the head's gathers each
    take instance keys of their own, and the step is one device's. Before, the head's
    gathers took the keys after one per synced statistic, while a statistic takes several
    (forward and backward): the rewrite stopped with "collectives
    'l2_normalize/every_replica/all_gather' and 'bn_q/variance' share group ..., instance
    ..."."""
    graph_def = _batch_normalized_encoders()
    feeds = _batches("dual_encoder", 3)
    with harness.one_device_session(graph_def) as sess:
        want = harness.train_and_read(sess, graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", sync_batch_statistics=True)
    assert result.plan.product_head and len(result.plan.sync_batch_statistics) == 4 and not result.plan.notes
    with gr.Session(result) as sess:
        got = harness.train_and_read(sess, graph_def, feeds)
    harness.assert_trained_alike("synced statistics and a head", got, want, RTOL, ATOL)


@pytest.mark.parametrize("case", ["dropout", "micro_batches", "ranked_micro_batches"])
def test_a_head_the_rewrite_cannot_gather_keeps_the_note(case):
    """A head holding a random op, or micro-batches (each would meet its own
    micro-batch's rows): the note stays, and the log says why for the first."""
    lines = []
    if case == "dropout":
        graph_def = _dropout_on_logits()
        assert analyze(graph_io.load_graph(graph_def)).product_head is None
        result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", log=lines.append)
        assert any("cannot be computed over every replica's rows" in line and "random" in line for line in lines), lines
    else:
        graph_def = rows_meeting_mlp("hardest_rows") if case.startswith("ranked") else dual_encoder("in_batch")
        result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", accumulation_steps=2)
    assert result.plan.product_head is None
    [note] = _notes(result)
    assert ("'hardest'" if case.startswith("ranked") else "'similarity'") in note


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["clip", "triplet"])
def test_between_graph_on_servers(kind, pool, procs, tmp_path):  # noqa: F811
    """2 workers x 2 replicas on loopback TensorFlow servers, each worker's client fed its
    half of every batch: the rows are gathered across the workers' processes, each
    worker keeps its replicas' rows' gradients (ranks 2 and 3 on worker 1), and the
    variables equal one device's after STEPS steps."""
    graph_def, (_, want) = _reference(kind)
    reads = harness.resource_reads(graph_def)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(),
                              _batches(kind), dpw=2)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_gather_of_the_ranked_rows_alone_is_noted_not_computed():
    """``reduce_mean(tf.gather(rows, top_k(rows, k).indices))`` with no other use of the
    rows' losses: the gather's gradient reaches the rows' backward as an IndexedSlices
    (its values, indices and dense shape), whose indices and shape hold no rows to hand
    each replica its own of. The head was formed anyway, and the rewritten step failed
    at run time ("slice index 0 of dimension 0 out of bounds" in the shape of the sum's
    gradient); now the head is refused, the ranking noted, and the step runs."""
    graph_def, want = _reference("hardest_gathered_alone")
    found = analyze(graph_io.load_graph(graph_def))
    assert found.product_head is None and "no gradient of rows" in found.product_head_obstacle
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")
    [note] = _notes(result)
    assert "'hardest'" in note
    with gr.Session(result) as sess:
        losses, _ = harness.train_and_read(sess, graph_def, _batches("hardest_gathered_alone"))
    assert max(abs(a - b) for a, b in zip(losses, want[0])) > 1e-2
