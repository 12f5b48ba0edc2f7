"""tf_keras' BatchNormalization in a TF1 graph, the ways scripts call it, synchronised.

A Keras model built in graph mode and trained by a legacy optimizer's ``get_updates``
(the TF1 Keras training loop's own call): a BatchNormalization after a Conv2D (a fused
BatchNorm) or after a Dense layer on flattened images (``tf.nn.moments``: the MNIST
MLP), called with ``training=True`` or behind the Keras learning phase (fed True: a v2
cond, which lower_conds lowers). Two faults hid here, both fixed:

- Flatten's Reshape hid the Dense layer's rows from the analysis, so its moments were
  neither noted nor synchronised;
- the legacy optimizers call tf.gradients inside their own ``gradients`` scope
  (``SGD/gradients/gradients/...``), and the search for the moments' backward passes
  found none, so the option synchronised their forward pass only: a step that was
  neither one device's nor plain data-parallel training's.

With sync_batch_statistics 2 replicas now train as one device (every variable, the
momentum slots and the moving averages, rtol 1e-5); without it the plan's note names
the statistics and the step differs (the control). The scope fault also hid a loss
summed over the rows from the loss_sums pass (the last test).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.planner import ROWS_MEET_START
from graph_rewriter.testing.tf1_scripts import cnn_batches
from test_sync_batch_statistics import STEPS, BATCH, _assert_one_device, _gaps, _one_device, _train

tf1 = tf.compat.v1
CASES = [("conv", True), ("conv", None), ("dense", True), ("dense", None)]
IDS = ["conv-training", "conv-learning_phase", "dense-training", "dense-learning_phase"]
SYNCED = {("conv", True): ["batch_normalization/FusedBatchNormV3"],
          ("conv", None): ["batch_normalization/cond/then/FusedBatchNormV3"],
          ("dense", True): ["batch_normalization/moments/mean", "batch_normalization/moments/variance"],
          ("dense", None): ["batch_normalization/moments/mean", "batch_normalization/moments/variance"]}


def keras_model(layer, training):
    """x [None, 6, 6, 2] -> Conv2D 3x3 (4, no bias) or Flatten -> Dense 4 ->
    BatchNormalization (momentum 0.9; ``training`` True, or None for the learning
    phase) -> relu -> Flatten -> Dense 1; squared error; legacy SGD 0.1 with momentum
    0.9 through get_updates, the model's updates (the moving averages) grouped into
    train_op. Returns (GraphDef, {variable: tensor to read}, every global variable)."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        inp = tf_keras.Input(shape=(6, 6, 2), name="x")
        if layer == "conv":
            h = tf_keras.layers.Conv2D(4, 3, use_bias=False)(inp)
        else:
            h = tf_keras.layers.Dense(4)(tf_keras.layers.Flatten()(inp))
        bn = tf_keras.layers.BatchNormalization(momentum=0.9)
        h = tf.nn.relu(bn(h) if training is None else bn(h, training=training))
        model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(tf_keras.layers.Flatten()(h)))
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        loss = tf.identity(tf.reduce_mean(tf.square(model.output - y)), name="loss")
        opt = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
        tf.group(*opt.get_updates(loss, model.trainable_weights), *model.updates, name="train_op")
        variables = tf1.global_variables()   # the optimizer's hyperparameters and iterations too
        tf1.variables_initializer(variables, name="init")
        reads = {v.name: tf1.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype).name for v in variables}
    return g.as_graph_def(), reads


def _feeds(training):
    phase = {"keras_learning_phase:0": True} if training is None else {}
    return [dict({"x:0": f["x:0"], "y:0": f["y:0"]}, **phase) for f in cnn_batches(STEPS, BATCH)]


def _rewrite(graph_def, **options):
    return gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", **options)


@pytest.mark.parametrize("layer, training", CASES, ids=IDS)
def test_it_trains_as_one_device_with_the_option(layer, training):
    graph_def, reads = keras_model(layer, training)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    assert result.plan.sync_batch_statistics == SYNCED[(layer, training)]
    got, want = _train(gr.Session(result), _feeds(training), reads), _one_device(graph_def, _feeds(training), reads)
    assert any("moving_mean" in name for name in want[1]) and any("momentum" in name for name in want[1])
    _assert_one_device(got, want)


@pytest.mark.parametrize("layer, training", CASES, ids=IDS)
def test_without_the_option_the_note_names_them_and_the_step_differs(layer, training):
    graph_def, reads = keras_model(layer, training)
    result = _rewrite(graph_def)
    [note] = [n for n in result.plan.notes or [] if n.startswith(ROWS_MEET_START)]
    assert "'batch_normalization/" in note
    loss_gap, gaps = _gaps(_train(gr.Session(result), _feeds(training), reads),
                           _one_device(graph_def, _feeds(training), reads))
    assert loss_gap > 1e-3 and max(gaps.values()) > 1e-3


def test_the_moments_backward_is_found_under_the_optimizers_gradients_scope():
    """The fault itself: a legacy optimizer's backward ops are named
    SGD/gradients/gradients/<op>_grad/..., and each synced Mean's gradient is
    all-reduced where it enters that backward pass (one all-reduce forward and one
    backward per moment, and the count's)."""
    graph_def, _ = keras_model("dense", True)
    assert any(n.name.startswith("SGD/gradients/gradients/batch_normalization/moments/mean_grad/")
               for n in graph_def.node)
    result = _rewrite(graph_def, sync_batch_statistics=True)
    reduces = [n.name for n in result.graph_def.node if n.op == "CollectiveReduceV2"
               and not n.name.startswith("replica_") and "/sync/" in n.name]
    backward = [n for n in reduces if n.startswith("SGD/gradients/gradients/")]
    assert len(backward) == 2 and len(reduces) - len(backward) >= 2, reduces


def test_a_summed_loss_under_the_optimizers_gradients_scope_trains_as_one_device():
    """The same scope fault cost losses summed over the rows (docs/semantics.md,
    "Gradients"): a Keras MLP with ``tf.reduce_sum`` of squared errors, trained by
    legacy SGD's get_updates, had no loss sum found, so 2 replicas averaged their sums'
    gradients (17.8 in the loss and 0.52 in the weights after three steps). Now the sum
    is scaled where its gradient enters the backward pass, and the step is one device's."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        inp = tf_keras.Input(shape=(6, 6, 2), name="x")
        hidden = tf_keras.layers.Dense(8, activation="relu")(tf_keras.layers.Flatten()(inp))
        model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(hidden))
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        loss = tf.identity(tf.reduce_sum(tf.square(model.output - y)), name="loss")
        opt = tf_keras.optimizers.legacy.SGD(0.01, momentum=0.9)
        tf.group(*opt.get_updates(loss, model.trainable_weights), name="train_op")
        variables = tf1.global_variables()
        tf1.variables_initializer(variables, name="init")
        reads = {v.name: tf1.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype).name for v in variables}
    graph_def, feeds = g.as_graph_def(), _feeds(True)
    result = _rewrite(graph_def)
    assert result.plan.loss_sums == ["Sum"]
    got, want = _train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-5)
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=2e-5, atol=1e-5, err_msg=name)
