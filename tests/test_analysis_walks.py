"""The analysis' shared walks answer what the per-node walks they replace answer: the
rows filter (_reaching: the nodes a walk back can find a batch input from, found once)
agrees with the limited walk from every node of real models, and static_rank's memo,
kept by the graph, follows the graph's edits."""

import functools

import pytest

from graph_rewriter import analysis, graph_io
from graph_rewriter.ir import Tensor
from graph_rewriter.protos import attr_value_pb2, tensor_shape_pb2
from graph_rewriter.testing import real_models
from graph_rewriter.traversal import topological_order

MODELS = {"bert": real_models.build_bert_dropout, "resnet": real_models.build_resnet,
          "lstm_lm": real_models.build_lstm_lm, "barlow_twins": real_models.build_barlow_twins,
          "wide_deep": real_models.build_wide_deep}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_rows_filter_agrees_with_every_walk(model, strict):
    ex, _ = MODELS[model]()
    graph = graph_io.load_graph(ex.graph_def)
    order = topological_order(graph)
    found = analysis.analyze(graph)
    seeds = {t.node for t in found.batch_inputs}
    follow = functools.cache(analysis._rows_follow(strict, analysis._ROWS_LIMIT))
    reaching = analysis._reaching(order, seeds, follow)
    # (the filter must matter on these graphs, or the test compares nothing)
    assert seeds <= reaching and 0 < len(reaching) < len(order)
    for n in order:
        t = Tensor(n, 0)
        alone = analysis._reaches_rows(t, seeds, strict=strict)
        shared = n in reaching and analysis._reaches_rows(t, seeds, strict=strict, follow=follow)
        assert alone == shared, n.name
        if n not in reaching:
            assert not alone, n.name


def test_static_rank_memo_follows_edits():
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        tf.nn.relu(x * 2.0 + 1.0, name="y")
    graph = graph_io.load_graph(g.as_graph_def())
    y = graph.node("y").output(0)
    assert analysis.static_rank(y) == 2
    assert analysis.static_rank(y) == 2   # (from the memo)
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-1)])
    graph.node("x").set_attr("shape", attr_value_pb2.AttrValue(shape=shape))
    assert analysis.static_rank(y) == 1
