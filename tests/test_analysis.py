"""The analysis on plain GraphDefs (no collections, no names relied upon): variables,
gradient cuts for every optimizer (dense and sparse, ref and resource), roles, step
counters, batch inputs, init op, saver, BatchNorm state, hints and errors."""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.testing import models

tf1 = tf.compat.v1

# Fused-op optimizers: one dense cut per trainable variable, found on the op's grad arg.
V1 = models.OPTIMIZERS_V1
KERAS = models.OPTIMIZERS_KERAS


def _analyze(example):
    return analyze(graph_io.load_graph(example.graph_def))


def _trainable_names(example):
    return {n for n in example.variables if n != "global_step" and "iterations" not in n}


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("optimizer", V1)
def test_v1_optimizers_dense(optimizer, resource):
    ex = models.build("mlp", optimizer, resource=resource)
    a = _analyze(ex)
    trainable = {v.name for v in a.variables.values() if v.role == "trainable"}
    assert trainable == _trainable_names(ex) - _slot_like(a)
    for name in trainable:
        cut = a.cut_of(name)
        assert cut is not None and cut.kind == "dense", name
        assert cut.source == "fused-op"
        assert cut.values.node.name.startswith("gradients"), cut.values  # backprop's output
    for v in a.variables.values():
        if v.role == "slot":
            assert v.slot_of in trainable
    assert a.step_counters == ["global_step"]
    assert {t.name for t in a.batch_inputs} == {"x:0", "y:0"}
    assert [n.name for n in a.init_ops] == ["init"]
    assert any(n.op == "SaveV2" for n in a.saver_nodes)
    assert all(v.initializer is not None for v in a.variables.values())


def _slot_like(a):
    return {v.name for v in a.variables.values() if v.role in ("slot", "other", "step")}


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("optimizer", V1)
def test_v1_optimizers_sparse(optimizer, resource):
    ex = models.build("embedding", optimizer, resource=resource)
    a = _analyze(ex)
    emb = [v for v in a.variables.values() if v.shape and v.shape[0] == models.EMBED_ROWS]
    assert len(emb) >= 1
    table = next(v for v in emb if v.role == "trainable")
    cut = a.cut_of(table.name)
    assert cut.kind == "sparse" and cut.indices is not None
    if optimizer == "sgd":
        # GradientDescent scatters lr-scaled rows without deduplicating: a linear update.
        assert cut.linear and not cut.deduplicated
    else:
        # Every other optimizer sums duplicate ids (Unique + UnsortedSegmentSum) first.
        assert cut.deduplicated
        assert cut.values.node.op == "UnsortedSegmentSum"
        assert cut.indices.node.op in ("Unique", "UniqueV2")
    assert "ids:0" in {t.name for t in a.batch_inputs}


@pytest.mark.parametrize("optimizer", KERAS)
def test_keras_legacy_optimizers(optimizer):
    ex = models.build("keras", optimizer)
    a = _analyze(ex)
    trainable = [v for v in a.variables.values() if v.role == "trainable"]
    assert len(trainable) >= 2
    for v in trainable:
        assert a.cut_of(v.name).kind == "dense"
    # The Keras iterations counter (an int64 bumped by AssignAddVariableOp) is a step counter.
    assert len(a.step_counters) == 1
    assert a.variables[a.step_counters[0]].dtype == tf.int64.as_datatype_enum


@pytest.mark.parametrize("optimizer", ["keras_sgd", "keras_adam", "keras_adagrad", "keras_nadam"])
def test_keras_legacy_optimizers_sparse(optimizer):
    ex = models.build("keras_embedding", optimizer)
    a = _analyze(ex)
    sparse = [c for c in a.cuts if c.kind == "sparse"]
    assert len(sparse) == 1


def test_batchnorm_moving_statistics_are_state_not_trainable():
    ex = models.build("batchnorm", "sgd")
    a = _analyze(ex)
    state = sorted(v.name for v in a.variables.values() if v.role == "state")
    assert len(state) == 2 and all("moving" in n for n in state)
    for name in state:
        cut = a.cut_of(name)
        assert cut is not None and cut.role == "state" and cut.source == "assign-walk"


def test_replica_variant_nodes_include_loss_but_not_variables():
    ex = models.build("mlp", "adam")
    a = _analyze(ex)
    names = {n.name for n in a.variant}
    assert "loss" in names
    assert not names & set(a.variables)
    # With the gradients averaged, the optimizer's updates no longer depend on the batch.
    assert not any(n.op.startswith("ResourceApply") for n in a.variant)


def test_iterator_outputs_are_batch_inputs_and_the_pipeline_is_found():
    ex = models.build("iterator", "sgd")
    a = _analyze(ex)
    assert a.batch_inputs and all(t.node.op.startswith("IteratorGetNext") for t in a.batch_inputs)
    assert any("Dataset" in n.op for n in a.input_pipeline)


def _custom_scatter_update_graph():
    """A hand-written sparse optimizer: var[ids] = var[ids] - lr * g, via ScatterUpdate
    (not a linear scatter, no deduplication): the analysis cannot know the gradient."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        emb = tf1.get_variable("emb", [10, 2], use_resource=True)
        rows = tf.gather(emb, ids)
        loss = tf.identity(tf.reduce_mean(tf.square(rows)), name="loss")
        grad = tf.gradients(loss, [emb])[0]
        values = tf.identity(grad.values, name="grad_values")
        indices = tf.identity(grad.indices, name="grad_indices")
        new_rows = tf.gather(emb, indices) - 0.1 * values
        tf.group(tf1.raw_ops.ResourceScatterUpdate(resource=emb.handle, indices=indices,
                                                   updates=new_rows), name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def test_unknown_update_is_an_error_naming_the_variable():
    item = graph_io.load_graph(_custom_scatter_update_graph())
    with pytest.raises(GraphRewriteError, match="'emb'") as e:
        analyze(item)
    assert "gradients=" in str(e.value)


def test_a_hint_names_the_gradient_of_a_custom_optimizer():
    item = graph_io.load_graph(_custom_scatter_update_graph())
    a = analyze(item, {"emb": ("grad_values:0", "grad_indices:0")})
    cut = a.cut_of("emb")
    assert cut.kind == "sparse" and cut.source == "hint"
    assert cut.values.name == "grad_values:0" and cut.indices.name == "grad_indices:0"


def test_hint_through_a_meta_graph_collection():
    g = tf.Graph()
    with g.as_default():
        tf1.import_graph_def(_custom_scatter_update_graph(), name="")
        tf1.add_to_collection("graph_rewriter_gradients", b"emb=grad_values:0,grad_indices:0")
        meta = tf1.train.export_meta_graph(graph=g)
    a = analyze(graph_io.load_graph(meta))
    assert a.cut_of("emb").source == "hint"


def test_hint_for_unknown_variable_is_an_error():
    item = graph_io.load_graph(_custom_scatter_update_graph())
    with pytest.raises(GraphRewriteError, match="nope"):
        analyze(item, {"nope": "grad_values:0"})


def test_two_optimizers_on_one_variable_give_it_two_gradient_cuts():
    """Each gradient is a cut of its own, the later one named apart (once refused as
    "receives two different gradients"; tests/test_multi_task.py trains such graphs)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", [2, 1], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w))
        a = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        b = tf1.train.AdamOptimizer(0.1).minimize(loss)
        tf.group(a, b, name="train_op")
    cuts = analyze(graph_io.load_graph(g.as_graph_def())).cuts
    assert [(c.variable, c.key, c.role) for c in cuts] == [("w", "w", "gradient"), ("w", "w/update_1", "gradient")]
    assert cuts[0].values != cuts[1].values


def test_analysis_does_not_use_names():
    """Renaming every node (no 'gradients/', 'Adam', 'global_step' left) changes nothing."""
    ex = models.build("embedding", "adam")
    gd = ex.graph_def
    rename = {n.name: f"n{i}" for i, n in enumerate(gd.node)}
    renamed = tf1.GraphDef()
    renamed.CopyFrom(gd)
    for n in renamed.node:
        n.name = rename[n.name]
        for k, s in enumerate(n.input):
            ctrl = s.startswith("^")
            base, _, idx = s.lstrip("^").partition(":")
            n.input[k] = ("^" if ctrl else "") + rename[base] + (f":{idx}" if idx else "")
        if "_class" in n.attr:
            locs = [b"loc:@" + rename[s.decode()[5:]].encode() for s in n.attr["_class"].list.s]
            del n.attr["_class"].list.s[:]
            n.attr["_class"].list.s.extend(locs)
    a1, a2 = _analyze(ex), analyze(graph_io.load_graph(renamed))
    summary = lambda a, f: sorted((f(c.variable), c.kind, f(c.values.node.name), c.deduplicated) for c in a.cuts)  # noqa: E731
    assert summary(a1, lambda s: rename[s]) == summary(a2, lambda s: s)
    assert sorted(rename[v] for v in a1.step_counters) == sorted(a2.step_counters)
    roles1 = sorted((rename[v.name], v.role) for v in a1.variables.values())
    roles2 = sorted((v.name, v.role) for v in a2.variables.values())
    assert roles1 == roles2


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_a_moving_averages_shadow_variable_is_initialized_by_the_assign_the_init_op_runs(resource):
    """ExponentialMovingAverage initializes its shadow variable from the averaged one's
    initialized_value() (a cond on that variable being initialized): no pure initial
    value, but the init op runs the assign. Without an initializer the assign counted as
    an update of a shared variable: under between-graph ps the chief re-ran it every
    step (resetting the average) and another worker lost its init op."""
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        w = tf1.get_variable("w", [3], initializer=tf1.ones_initializer(), use_resource=resource)
        ema = tf1.train.ExponentialMovingAverage(0.9)
        update = ema.apply([w])
        tf.group(update, name="train_op")
        tf1.global_variables_initializer()
    a = analyze(graph_io.load_graph(graph.as_graph_def()))
    shadow = a.variables["w/ExponentialMovingAverage"]
    assert shadow.initializer is not None and shadow.initializer.name == "w/ExponentialMovingAverage/Assign"
    assert any(shadow.initializer in op.control_inputs for op in a.init_ops)
