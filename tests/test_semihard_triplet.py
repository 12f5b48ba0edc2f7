"""FaceNet's semi-hard triplet loss (graph_rewriter.testing.tf1_scripts.semihard_triplet,
as tf.contrib.losses.metric_learning's triplet_semihard_loss computes it) over every
replica's rows.

Its pairwise distances add the rows' squared norms as a column to the same norms of the
transposed embeddings as a row, ``reduce_sum(square(transpose(e)), [0], keepdims=True)``;
its pairs of one class compare the labels with their transpose. The head found only the
``e @ e^T`` product, and gathered the sum of the norms, [n, n], along its rows as if its
columns were not rows too; it gathered the boolean pairs too, which CollectiveGatherV2
does not gather: the emitted graph could not even be imported ("Value for attr 'T' of
bool is not in the list of allowed values"). Now row_axes follows the rows through a
reduction over other axes and an element-wise op of one operand, and sees comparisons
meet rows; static_rank knows a reshape to ``[tf.shape(labels)[0], 1]``; the count of
positive pairs the loss divides by, computed in the head, may be read by the head's
backward; and a boolean the head reads (a mask of the labelled rows) travels cast to
int32. R replicas train as one device.

A comparison of the rows alone meets them too: a loss that weighs each row by its
class's count in the batch, ``reduce_sum(tf.equal(labels[:, None], labels[None, :]),
1)`` (tf1_scripts.same_class_weighted), was neither found nor noted, and trained 0.43
from one device in the loss at 2 replicas (0.15 weighing by the count of pairs). Its
comparison now starts a head, and it trains as one device.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze, static_rank
from graph_rewriter.collectives import all_gather
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.row_axes import meets_rows, rows_axis
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import _tf, contrastive_batches, same_class_weighted, semihard_triplet

STEPS, BATCH = 4, 8
RTOL, ATOL = 1e-5, 1e-6
PRODUCTS = ["add", "MatMul_2", "Equal"]


def _feeds(valid_rows):
    feeds = contrastive_batches("triplet", STEPS, BATCH)
    if valid_rows:   # every third row unlabelled
        for feed in feeds:
            feed["labels:0"][::3] = -1
    return feeds


@pytest.mark.parametrize("valid_rows", [False, True])
def test_the_head_holds_the_distances_and_the_pairs(valid_rows):
    found = analyze(graph_io.load_graph(semihard_triplet(valid_rows)))
    assert found.row_products == PRODUCTS
    head = found.product_head
    assert head is not None and head.products == PRODUCTS
    gathered = [t for t, _ in head.gathered]
    assert gathered == ["l2_normalize:0", "Sum:0", "Reshape:0"] + (["GreaterEqual:0"] if valid_rows else [])
    assert found.normalizers == []   # (the count of positive pairs is the head's: the whole batch's)


@pytest.mark.parametrize("valid_rows", [False, True], ids=["plain", "valid_rows"])
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2), ("hybrid", 2)])
def test_semihard_triplets_train_as_one_device(valid_rows, strategy, replicas):
    graph_def, feeds = semihard_triplet(valid_rows), _feeds(valid_rows)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    harness.assert_trained_alike(f"{strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds),
                                 want, RTOL, ATOL)


def _without_head(graph_def):
    """The rewrite at 2 replicas of a plan given back with ``"product_head": {}``:
    each replica's rows meet its own only."""
    plan = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU").plan
    plan.product_head = {}
    return gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=plan)


def test_each_replicas_own_triplets_would_be_caught():
    """The control: each replica's rows alone (the plan's ``"product_head": {}``) are
    noted and train away from one device."""
    graph_def, feeds = semihard_triplet(), _feeds(False)
    _, want = harness.trained_on_one_device(graph_def, feeds)
    result = _without_head(graph_def)
    assert any(n.startswith(ROWS_MEET_START) and "'add', 'MatMul_2', 'Equal'" in n for n in result.plan.notes)
    _, got = harness.trained_rewritten(result, graph_def, feeds)
    assert max(float(np.max(np.abs(got[k] - want[k]))) for k in want) > 1e-3


def test_a_boolean_travels_as_int32_and_back():
    """The labelled rows' mask, gathered: Cast to int32, CollectiveGatherV2, Cast back."""
    result = gr.rewrite(semihard_triplet(valid_rows=True), devices_per_worker=2, device_type="CPU")
    nodes = {n.name: n for n in result.graph_def.node}
    gathers = [n for n in nodes.values() if n.op == "CollectiveGatherV2" and n.input[0].split(":")[0] in nodes
               and nodes[n.input[0].split(":")[0]].op == "Cast"]
    assert gathers, "no gather of a cast value"
    for g in gathers:
        assert g.attr["T"].type == 3   # int32
        back = [n for n in nodes.values() if n.op == "Cast" and n.input and n.input[0] == g.name]
        assert len(back) == 1 and back[0].attr["DstT"].type == 10   # bool


def _graph(build):
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        build(tf, tf1)
    return graph_io.load_graph(g.as_graph_def())


def test_a_string_gather_is_refused_by_name():
    graph = _graph(lambda tf, tf1: tf1.placeholder(tf.string, [None], name="words"))
    with pytest.raises(GraphRewriteError, match="'words:0' \\(string\\).*CollectiveGatherV2"):
        all_gather(graph, "words/every_replica", graph.node("words").output(0), 2, 1, 1, "/device:CPU:0")


def test_row_axes_follow_reductions_unary_ops_and_comparisons():
    def build(tf, tf1):
        e = tf1.placeholder(tf.float32, [None, 4], name="e")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        tf.reduce_sum(tf.square(tf.transpose(e)), [0], keepdims=True, name="row_norms")
        tf.reduce_sum(tf.transpose(e), [0], name="dropped")
        tf.reduce_sum(e, [0], keepdims=True, name="over_rows")
        column = tf.reshape(labels, [tf.shape(labels)[0], 1], name="column")
        tf.logical_not(tf.equal(column, tf.transpose(column)), name="other")
    graph = _graph(build)
    seeds = {graph.node("e"), graph.node("labels")}

    def holds(t):
        return t.node in seeds or t.node.name == "column"
    assert rows_axis(graph.node("row_norms").output(0), holds) == 1
    assert rows_axis(graph.node("dropped").output(0), holds) == 0
    assert rows_axis(graph.node("over_rows").output(0), holds) is None
    assert static_rank(graph.node("column").output(0)) == 2
    assert meets_rows(graph.node("Equal"), holds)
    assert rows_axis(graph.node("other").output(0), holds, elementwise=True) is None   # (rows on two axes)


def _labelled_batches(steps, batch, seed=0):
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, 4).astype(np.float32), "labels:0": rng.randint(0, 3, batch).astype(np.int32)}
            for _ in range(steps)]


@pytest.mark.parametrize("kind", ["inverse_frequency", "pair_weighted"])
@pytest.mark.parametrize("strategy, replicas", [("allreduce", 2), ("allreduce", 4), ("ps", 2)])
def test_rows_weighed_by_their_class_count_train_as_one_device(kind, strategy, replicas):
    graph_def, feeds = same_class_weighted(kind), _labelled_batches(STEPS, BATCH)
    found = analyze(graph_io.load_graph(graph_def))
    assert found.row_products == ["Equal"] and found.product_head.products == ["Equal"]
    want = harness.trained_on_one_device(graph_def, feeds)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy)
    assert not result.plan.notes
    harness.assert_trained_alike(f"{kind}, {strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds),
                                 want, RTOL, ATOL)


def test_each_replicas_own_class_counts_would_be_caught():
    graph_def, feeds = same_class_weighted(), _labelled_batches(STEPS, BATCH)
    want_losses, _ = harness.trained_on_one_device(graph_def, feeds)
    result = _without_head(graph_def)
    assert any(n.startswith(ROWS_MEET_START) and "'Equal'" in n for n in result.plan.notes)
    losses, _ = harness.trained_rewritten(result, graph_def, feeds)
    assert np.max(np.abs(np.array(losses) - want_losses)) > 1e-2
