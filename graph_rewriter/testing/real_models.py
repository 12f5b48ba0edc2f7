"""Real-model training graphs for tests/test_real_models.py (issue 15, item 4) and
tools/compare_outputs.py.

Each builder makes a seeded, single-device tf.compat.v1 training graph in the style of a
well-known training script, written here from the public descriptions of those models
with hand-written layers from raw ops (no Keras), and returns ``(example, feed)``:

- ``example``: a graph_rewriter.testing.models.Example (graph_def; the batch placeholders in
  ``feeds``; loss "loss:0"; train op "train_op"; init op "init"; ``variables`` maps EVERY
  variable of the graph, weights, optimizer slots, step counters and loss scales alike,
  to its read tensor; ``step_counter``; named inner tensors in ``tensors``);
- ``feed``: step -> feed dict, deterministic numpy seeded by (data seed, step).

The models (everything seeded: the graph seed and every op seed; ref variables,
``use_resource=False``):

- ``build_bert``: a 2-layer, 2-head BERT-style encoder (vocab 100, hidden 16, sequence 8)
  with a classifier on the pooled first token (no attention key bias: see the builder),
  trained by a hand-written copy of the
  usual BERT recipe: linear warmup then polynomial decay of the learning rate read from
  global_step, tf.gradients, tf.clip_by_global_norm(1.0) (the embedding gradient is
  IndexedSlices: the lookup is tf.gather), AdamW in plain ops (m and v slot variables,
  no decay on LayerNorm and bias variables), then global_step += 1 after the updates.
  ``shards=k, per_shard_clipping=True`` builds the CONTROL variant: the batch is cut
  into k equal shards, each shard's gradient is clipped by its own global norm and the
  clipped gradients are averaged, i.e. per-replica clipping computed on one device.
  ``build_bert_accumulate``: the same with NVIDIA DeepLearningExamples' gradient
  accumulation by hand over 2 steps (accumulators assigned or added in a v1 cond on a
  local step counter, AdamW applying the sums in another cond; resource variables, v1
  control flow).
- ``build_loss_scale``: an MLP trained with dynamic loss scaling in plain ops (loss scale
  and good-step counter variables, scaled loss, unscaled gradients, an all-finite check,
  clip_by_global_norm, a v1 tf.cond around AdamOptimizer.apply_gradients and the
  scale's growth; shrink on overflow), global_step bumped every step. Built with v1
  control flow (Switch/Merge); ``build_loss_scale_v2`` is the same model with a v2 cond
  (an If op over functions) and resource variables. At step OVERFLOW_STEP the last row
  of the batch has a huge sample weight, so the scaled gradients overflow and the step
  must be skipped.
- ``build_resnet``: a small ResNet (8x8x3 images, stem + two residual blocks) with
  hand-written batch norm (tf.nn.moments in training mode, moving averages updated by
  assign ops in UPDATE_OPS; ``batch_norm=False`` leaves it out), L2 weight decay in the
  loss, MomentumOptimizer with global_step, fed by a tf.data pipeline batched with
  drop_remainder=True (a STATIC batch) through an initializable iterator.
- ``build_lstm_lm``: an LSTM language model (vocab 50, embedding 8 by tf.gather, hidden
  16, 6 steps unrolled in Python), per-tensor tf.clip_by_norm of every gradient from
  compute_gradients (the embedding's is IndexedSlices), AdagradOptimizer.apply_gradients
  with global_step.
- ``build_wide_deep``: Wide & Deep: a linear part (a [vocab, 1] weight gathered by ids,
  plus a bias) trained by FtrlOptimizer and a deep part (embedding + 2 dense layers)
  trained by AdagradOptimizer (each computes its own part's gradients), both applies
  grouped in one train op, neither given global_step; global_step bumped once by an
  assign_add under control dependencies on both updates (the Estimator's
  DNNLinearCombined pattern).
- ``build_vae``: a variational autoencoder whose reparameterisation draws one Gaussian
  per row (``tf.random_normal(tf.shape(mu))``) and whose loss, the negative ELBO, is
  summed over the batch (reconstruction cross entropy plus KL, each a ``tf.reduce_sum``
  over every axis), AdamOptimizer with global_step; resource variables.
- ``build_barlow_twins``: Barlow Twins, two views through one encoder and a projector
  with a BatchNorm by hand, each embedding normalised over the batch, the loss on their
  cross-correlation ``z_a^T z_b / tf.shape(z_a)[0]``, trained by a hand-written LARS
  (per-matrix trust ratios from the norms of each weight and its gradient, momentum,
  weight decay; biases and BatchNorm apart); resource variables. Its statistics over
  the rows are one device's only with ``sync_batch_statistics``.

Every single-device run is deterministic to within float rounding (bit for bit but
for wide_deep, whose two optimizers' backward passes Grappler merges: a few ulps apart
in about 1 run of 60; tests/test_real_models.py, REPEAT_RTOL). With ref variables that
takes care: a read of a ref variable aliases the buffer that an optimizer's apply op
updates in place, so an update that nothing orders after the gradients that read the same
variable races with them (tf.gradients + per-variable applies, e.g. per-tensor clipping
or two optimizers). Where a global norm orders every update after every gradient (BERT,
loss scaling) tf.gradients is safe; elsewhere the gradients come from the optimizers'
compute_gradients, whose default GATE_OP gating prevents the race.
"""

import contextlib
import math

import numpy as np

from graph_rewriter.testing import models

# ----- shared pieces ------------------------------------------------------------------------


def _seeds(seed):
    """Distinct op-level seeds, one per call."""
    k = 0
    while True:
        k += 1
        yield seed * 1000 + k


@contextlib.contextmanager
def _graph(seed, control_flow=None, resource=False):
    """A new graph, seeded, whose variables are ref variables (resource variables with
    ``resource``); v1/v2 control flow switched for the build when asked (the flag is
    process-wide: it is restored after)."""
    import tensorflow as tf
    graph = tf.Graph()
    before = tf.compat.v1.control_flow_v2_enabled()
    if control_flow == "v1":
        tf.compat.v1.disable_control_flow_v2()
    elif control_flow == "v2":
        tf.compat.v1.enable_control_flow_v2()
    try:
        with graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), use_resource=resource):
                yield graph
    finally:
        if before:
            tf.compat.v1.enable_control_flow_v2()
        else:
            tf.compat.v1.disable_control_flow_v2()


def _finish(graph, model, optimizer, feeds, seed, tensors=None, extra_init=(), batch_size=None,
            resource=False):
    """Adds the init op and a Saver to ``graph`` (its default graph must be active) and
    returns the Example."""
    import tensorflow as tf
    variables = tf.compat.v1.global_variables()
    if extra_init:
        tf.group(tf.compat.v1.variables_initializer(variables, name="init_variables"),
                 *extra_init, name="init")
    else:
        tf.compat.v1.variables_initializer(variables, name="init")
    tf.compat.v1.train.Saver(var_list=variables)
    reads = {v.op.name: models._read_tensor_name(v) for v in variables}
    step = tf.compat.v1.train.get_global_step()
    return models.Example(
        graph_def=models.canonical_function_names(graph.as_graph_def()), model=model,
        optimizer=optimizer, resource=resource, feeds=list(feeds), variables=reads,
        step_counter=reads[step.op.name] if step is not None else None,
        tensors=dict(tensors or {}), seed=seed, batch_size=batch_size)


def _rng(seed, step, tag):
    return np.random.default_rng([seed, step, tag])


# ----- 1. BERT-style encoder with clip_by_global_norm and a hand-written AdamW -------------

BERT_VOCAB = 100
BERT_HIDDEN = 16
BERT_SEQ = 8
BERT_HEADS = 2
BERT_LAYERS = 2
BERT_FFN = 32
BERT_CLASSES = 2
BERT_BATCH = 8
BERT_INIT_RANGE = 0.2      # truncated normal stddev of every weight (BERT's is 0.02: this
                           # one makes the global gradient norm exceed the clip norm)
BERT_LR = 0.01
BERT_WARMUP = 3
BERT_DECAY_STEPS = 30
BERT_WEIGHT_DECAY = 0.01
BERT_CLIP_NORM = 1.0
BERT_LABEL_NOISE = 0.1
BERT_KEY_TOKENS = 10       # the first token (the class's evidence) is drawn below this


def build_bert(seed=0, data_seed=0, shards=1, per_shard_clipping=False, batch_size=BERT_BATCH, dropout=0.0,
               accumulation_steps=1, layers=BERT_LAYERS):
    """The BERT-style classifier. ``dropout`` > 0: BERT's dropouts at that rate (its
    hidden_dropout_prob and attention_probs_dropout_prob, 0.1 in the public configs): on
    the embeddings after their layer norm, on the attention probabilities, and on the
    attention output's and the feed-forward output's dense layer before their residual
    (seeded by the graph's seed, as tf.nn.dropout without a seed of its own is).
    ``accumulation_steps`` = k > 1: NVIDIA's BERT gradient accumulation by hand (the
    clipped gradients summed into accumulator variables under a v1 cond on a local step
    counter, AdamW applying the sums at every k-th step under another; global_step
    counts the applies). ``layers``: the encoder's depth (tools/bench_rewrite.py's
    bert24 measures the rewrite on a deep graph).

    ``shards`` = k > 1 builds a control variant of the same model (same variables, same
    initial values): the batch is cut into k equal shards and each shard's gradient is
    taken separately. With ``per_shard_clipping`` each shard's gradient is clipped by its
    own global norm and the clipped gradients are averaged (what k replicas that clip
    before averaging compute); without it the shards' gradients are averaged and then
    clipped (mathematically the original model: its differences from the original are
    float rounding of a different summation order, a noise floor for the tolerance).
    """
    import tensorflow as tf
    seeds = _seeds(seed)
    H, S, NH = BERT_HIDDEN, BERT_SEQ, BERT_HEADS
    HD = H // NH

    def weight(name, shape):
        init = tf.compat.v1.truncated_normal_initializer(stddev=BERT_INIT_RANGE, seed=next(seeds))
        return tf.compat.v1.get_variable(name, shape, tf.float32, initializer=init)

    def dense(x, units, name, activation=None, bias=True):
        with tf.compat.v1.variable_scope(name):
            y = tf.matmul(x, weight("kernel", [int(x.shape[-1]), units]))
            if bias:
                y += tf.compat.v1.get_variable("bias", [units], tf.float32,
                                               initializer=tf.compat.v1.zeros_initializer())
        return activation(y) if activation is not None else y

    def layer_norm(x, name="LayerNorm"):
        with tf.compat.v1.variable_scope(name):
            gamma = tf.compat.v1.get_variable("gamma", [H], tf.float32,
                                              initializer=tf.compat.v1.ones_initializer())
            beta = tf.compat.v1.get_variable("beta", [H], tf.float32,
                                             initializer=tf.compat.v1.zeros_initializer())
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(variance + 1e-12) * gamma + beta

    def gelu(x):  # the tanh approximation
        return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * tf.pow(x, 3))))

    def drop(t):
        return tf.nn.dropout(t, rate=dropout) if dropout else t

    def heads(t):  # [B*S, H] -> [B, NH, S, HD]
        return tf.transpose(tf.reshape(t, [-1, S, NH, HD]), [0, 2, 1, 3])

    with _graph(seed, control_flow="v1" if accumulation_steps > 1 else None, resource=accumulation_steps > 1) as graph:
        input_ids = tf.compat.v1.placeholder(tf.int32, [None, S], name="input_ids")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        with tf.compat.v1.variable_scope("bert"):
            with tf.compat.v1.variable_scope("embeddings"):
                word = weight("word_embeddings", [BERT_VOCAB, H])
                position = weight("position_embeddings", [S, H])
                x = tf.gather(word, input_ids) + tf.reshape(position, [1, S, H])
                x = drop(layer_norm(tf.reshape(x, [-1, H])))            # [B*S, H]
            with tf.compat.v1.variable_scope("encoder"):
                for i in range(layers):
                    with tf.compat.v1.variable_scope(f"layer_{i}"):
                        with tf.compat.v1.variable_scope("attention"):
                            with tf.compat.v1.variable_scope("self"):
                                q = heads(dense(x, H, "query"))
                                # no key bias: it adds q.b to every score of a query, which
                                # softmax ignores, so its exact gradient is zero and AdamW
                                # would turn the rounding noise left in it into full steps
                                k = heads(dense(x, H, "key", bias=False))
                                v = heads(dense(x, H, "value"))
                                scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(HD))
                                context = tf.matmul(drop(tf.nn.softmax(scores)), v)   # [B, NH, S, HD]
                                context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, H])
                            with tf.compat.v1.variable_scope("output"):
                                attended = layer_norm(drop(dense(context, H, "dense")) + x)
                        with tf.compat.v1.variable_scope("intermediate"):
                            inner = dense(attended, BERT_FFN, "dense", gelu)
                        with tf.compat.v1.variable_scope("output"):
                            x = layer_norm(drop(dense(inner, H, "dense")) + attended)
            with tf.compat.v1.variable_scope("pooler"):
                first = tf.reshape(x, [-1, S, H])[:, 0, :]
                pooled = dense(first, H, "dense", tf.tanh)
        output_weights = weight("output_weights", [BERT_CLASSES, H])
        output_bias = tf.compat.v1.get_variable("output_bias", [BERT_CLASSES], tf.float32,
                                                initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(pooled, output_weights, transpose_b=True) + output_bias
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.reduce_mean(per_example, name="loss")

        # -- the optimizer (create_optimizer's structure)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        learning_rate = tf.compat.v1.train.polynomial_decay(
            tf.constant(BERT_LR, tf.float32), global_step, BERT_DECAY_STEPS,
            end_learning_rate=0.0, power=1.0, cycle=False)
        step_int = tf.cast(global_step, tf.int32)
        warmup_int = tf.constant(BERT_WARMUP, tf.int32)
        warmup_lr = BERT_LR * (tf.cast(step_int, tf.float32) / tf.cast(warmup_int, tf.float32))
        is_warmup = tf.cast(step_int < warmup_int, tf.float32)
        learning_rate = tf.identity((1.0 - is_warmup) * learning_rate + is_warmup * warmup_lr,
                                    name="learning_rate")
        tvars = tf.compat.v1.trainable_variables()
        if shards == 1:
            grads = tf.gradients(loss, tvars)
            grads, global_norm = tf.clip_by_global_norm(grads, clip_norm=BERT_CLIP_NORM)
        else:
            per_shard = []
            for shard in tf.split(per_example, shards):
                shard_grads = tf.gradients(tf.reduce_mean(shard), tvars)
                if per_shard_clipping:
                    shard_grads, _ = tf.clip_by_global_norm(shard_grads, clip_norm=BERT_CLIP_NORM)
                per_shard.append(shard_grads)
            # The mean of the shards' gradients. An IndexedSlices (the embedding's) stays one:
            # the shards' rows concatenated in order, divided by k, are the rows of the whole
            # batch's gradient, and clip_by_global_norm measures an IndexedSlices by its rows
            # (repeated ids count once per row), so densifying it would change the norm.
            grads = []
            for gs in zip(*per_shard):
                if isinstance(gs[0], tf.IndexedSlices):
                    grads.append(tf.IndexedSlices(tf.concat([g.values for g in gs], 0) / float(shards),
                                                  tf.concat([g.indices for g in gs], 0), gs[0].dense_shape))
                else:
                    grads.append(tf.add_n(list(gs)) / float(shards))
            if per_shard_clipping:
                global_norm = tf.linalg.global_norm(grads)
            else:
                grads, global_norm = tf.clip_by_global_norm(grads, clip_norm=BERT_CLIP_NORM)
        global_norm = tf.identity(global_norm, name="global_norm")

        # -- AdamW in plain ops
        beta1, beta2, epsilon = 0.9, 0.999, 1e-6
        slots = {}
        for param in tvars:
            slots[param] = [tf.compat.v1.get_variable(param.op.name + suffix, param.shape.as_list(), tf.float32,
                                                      trainable=False, initializer=tf.compat.v1.zeros_initializer())
                            for suffix in ("/adam_m", "/adam_v")]

        def adamw(grads):
            assignments = []
            for param, grad in zip(tvars, grads):
                name = param.op.name
                m, v = slots[param]
                next_m = tf.multiply(beta1, m) + tf.multiply(1.0 - beta1, grad)
                next_v = tf.multiply(beta2, v) + tf.multiply(1.0 - beta2, tf.square(grad))
                update = next_m / (tf.sqrt(next_v) + epsilon)
                if not any(word_ in name for word_ in ("LayerNorm", "layer_norm", "bias")):
                    update += BERT_WEIGHT_DECAY * param
                next_param = param - learning_rate * update
                assignments += [tf.compat.v1.assign(param, next_param), tf.compat.v1.assign(m, next_m),
                                tf.compat.v1.assign(v, next_v)]
            return tf.group(*assignments, name="adamw_update")

        if accumulation_steps == 1:
            update_op = adamw(grads)
            with tf.control_dependencies([update_op]):
                bump = tf.compat.v1.assign_add(global_step, 1, name="increment_global_step")
            tf.group(update_op, bump, name="train_op")
        else:
            # NVIDIA DeepLearningExamples' BERT (its TF1 optimization.py): each step's
            # clipped gradients are summed into accumulators, reset at every k-th step, and
            # AdamW applies the sums (undivided) at every k-th step, under v1 conds on a
            # local step counter; global_step counts the applies.
            k = accumulation_steps
            local_step = tf.compat.v1.get_variable("local_step", [], tf.int32, trainable=False,
                                                   initializer=tf.compat.v1.zeros_initializer())
            accums = [tf.compat.v1.get_variable(param.op.name + "/accum", param.shape.as_list(), tf.float32,
                                                trainable=False, initializer=tf.compat.v1.zeros_initializer())
                      for param in tvars]
            reset_step = tf.math.equal(local_step % k, 0)
            local_step = tf.cond(reset_step, lambda: tf.compat.v1.assign(local_step, tf.ones_like(local_step)),
                                 lambda: tf.compat.v1.assign_add(local_step, 1))
            accums = tf.cond(reset_step, lambda: [tf.compat.v1.assign(a, g) for a, g in zip(accums, grads)],
                             lambda: [tf.compat.v1.assign_add(a, g) for a, g in zip(accums, grads)])
            update_step = tf.identity(tf.math.equal(local_step % k, 0), name="update_step")
            update_op = tf.cond(update_step, lambda: adamw(accums), tf.no_op)
            # (NVIDIA's assigns the new global step beside the update, unordered: the
            # update's learning rate could read the step before or after the assign)
            with tf.control_dependencies([update_op]):
                new_step = tf.cond(update_step, lambda: global_step + 1, lambda: tf.identity(global_step))
                bump = tf.compat.v1.assign(global_step, new_step)
            tf.group(update_op, bump, name="train_op")
        ex = _finish(graph, "bert", "adamw", [input_ids.name, labels.name], seed,
                     tensors={"global_norm": global_norm.name, "learning_rate": learning_rate.name})

    def feed(step):
        rng = _rng(data_seed, step, 101)
        ids = rng.integers(2, BERT_VOCAB, size=(batch_size, S)).astype(np.int32)
        # the class is the parity of the first token, drawn from a small range so that a
        # few steps of 8 rows learn it (the other tokens are noise to attend past)
        ids[:, 0] = rng.integers(2, BERT_KEY_TOKENS, size=batch_size)
        ids[::3, 2] = ids[::3, 1]                           # repeated ids within rows
        label = (ids[:, 0] % 2).astype(np.int32)
        flip = rng.random(batch_size) < BERT_LABEL_NOISE
        label[flip] = 1 - label[flip]
        return {"input_ids:0": ids, "labels:0": label}

    return ex, feed


# ----- 2. dynamic loss scaling around a v1 cond ---------------------------------------------

LS_FEATURES = 6
LS_HIDDEN = 16
LS_BATCH = 8
LS_INITIAL_SCALE = 2.0 ** 10
LS_GROWTH_INTERVAL = 3     # good steps in a row before the scale doubles
LS_LR = 0.01
LS_CLIP_NORM = 1.0
OVERFLOW_STEP = 4          # the step whose batch makes the scaled gradients overflow
OVERFLOW_WEIGHT = 1e36     # the sample weight of that batch's last row (its label is 10):
                           # the loss stays finite, d(scaled loss)/d(prediction) is ~1e39


def build_loss_scale(seed=0, data_seed=0, batch_size=LS_BATCH, control_flow="v1"):
    """``control_flow="v2"`` builds the cond as an If op over functions; assigning a ref
    variable inside a function is not possible, so that variant uses resource variables."""
    import tensorflow as tf
    seeds = _seeds(seed)

    def dense(x, units, name, activation=None):
        with tf.compat.v1.variable_scope(name):
            w = tf.compat.v1.get_variable(
                "kernel", [int(x.shape[-1]), units], tf.float32,
                initializer=tf.compat.v1.glorot_uniform_initializer(seed=next(seeds)))
            b = tf.compat.v1.get_variable(
                "bias", [units], tf.float32,
                initializer=tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=next(seeds)))
        y = tf.matmul(x, w) + b
        return activation(y) if activation is not None else y

    resource = control_flow == "v2"
    with _graph(seed, control_flow, resource=resource) as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, LS_FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        weights = tf.compat.v1.placeholder(tf.float32, [None], name="weights")
        h = dense(x, LS_HIDDEN, "hidden_1", tf.nn.relu)
        h = dense(h, LS_HIDDEN, "hidden_2", tf.nn.relu)
        pred = tf.squeeze(dense(h, 1, "output"), axis=1)
        loss = tf.reduce_mean(weights * tf.square(pred - y), name="loss")
        tvars = tf.compat.v1.trainable_variables()

        global_step = tf.compat.v1.train.get_or_create_global_step()
        loss_scale = tf.compat.v1.get_variable(
            "loss_scale", [], tf.float32, trainable=False,
            initializer=tf.compat.v1.constant_initializer(LS_INITIAL_SCALE))
        good_steps = tf.compat.v1.get_variable(
            "good_steps", [], tf.int64, trainable=False, initializer=tf.compat.v1.zeros_initializer())
        scaled_loss = tf.multiply(loss, loss_scale, name="scaled_loss")
        grads = tf.gradients(scaled_loss, tvars)
        unscaled = [g / loss_scale for g in grads]
        all_finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in unscaled],
                                   name="all_finite")
        clipped, global_norm = tf.clip_by_global_norm(unscaled, LS_CLIP_NORM)
        optimizer = tf.compat.v1.train.AdamOptimizer(LS_LR)

        def apply_and_grow():
            update = optimizer.apply_gradients(list(zip(clipped, tvars)))
            with tf.control_dependencies([update]):
                count = good_steps + 1
                grow = count >= LS_GROWTH_INTERVAL
                new_scale = tf.compat.v1.assign(loss_scale, tf.where(grow, loss_scale * 2.0, loss_scale))
                new_count = tf.compat.v1.assign(good_steps, tf.where(grow, tf.zeros_like(count), count))
            with tf.control_dependencies([new_count]):
                return tf.identity(new_scale)

        def skip_and_shrink():
            new_scale = tf.compat.v1.assign(loss_scale, tf.maximum(loss_scale / 2.0, 1.0))
            new_count = tf.compat.v1.assign(good_steps, tf.zeros_like(good_steps.value()))
            with tf.control_dependencies([new_count]):
                return tf.identity(new_scale)

        scale_after = tf.compat.v1.cond(all_finite, apply_and_grow, skip_and_shrink,
                                        name="apply_if_finite")
        with tf.control_dependencies([scale_after]):
            bump = tf.compat.v1.assign_add(global_step, 1, name="increment_global_step")
        tf.group(bump, name="train_op")
        ex = _finish(graph, "loss_scale", "adam", [x.name, y.name, weights.name], seed,
                     tensors={"all_finite": all_finite.name, "global_norm": global_norm.name,
                              "scaled_loss": scaled_loss.name}, resource=resource)

    teacher = 0.5 * _rng(data_seed, 0, 223).normal(size=LS_FEATURES)

    def feed(step):
        rng = _rng(data_seed, step, 211)
        xs = rng.normal(size=(batch_size, LS_FEATURES)).astype(np.float32)
        ys = (np.tanh(xs @ teacher) + 0.05 * rng.normal(size=batch_size)).astype(np.float32)
        ws = np.ones(batch_size, np.float32)
        if step == OVERFLOW_STEP:
            ws[-1], ys[-1] = OVERFLOW_WEIGHT, 10.0     # in the LAST replica's shard
        return {"x:0": xs, "y:0": ys, "weights:0": ws}

    return ex, feed


# ----- 3. a small ResNet with batch norm, fed by a static-batch tf.data pipeline -----------

RESNET_ROWS = 64           # images in the in-graph dataset (divisible by every batch used)
RESNET_CLASSES = 4
RESNET_BATCH = 4           # per-replica batch of the rewritten model
RESNET_WEIGHT_DECAY = 1e-4
RESNET_BN_MOMENTUM = 0.9
RESNET_LR = 0.05


def resnet_data(data_seed=0):
    """The dataset's (images, labels): seeded numpy, labels a function of the image."""
    rng = _rng(data_seed, 0, 307)
    images = rng.normal(size=(RESNET_ROWS, 8, 8, 3)).astype(np.float32)
    score_a = images[:, :4, :, 0].mean(axis=(1, 2)) - images[:, 4:, :, 0].mean(axis=(1, 2))
    score_b = images[:, :, :, 1].mean(axis=(1, 2)) - images[:, :, :, 2].mean(axis=(1, 2))
    labels = ((score_a > 0).astype(np.int32) * 2 + (score_b > 0).astype(np.int32))
    return images, labels


def build_resnet(seed=0, data_seed=0, batch_size=RESNET_BATCH, batch_norm=True):
    import tensorflow as tf
    seeds = _seeds(seed)
    kernels = []

    def conv(x, filters, name, stride=1, size=3):
        fan_in = size * size * int(x.shape[-1])
        with tf.compat.v1.variable_scope(name):
            k = tf.compat.v1.get_variable(
                "kernel", [size, size, int(x.shape[-1]), filters], tf.float32,
                initializer=tf.compat.v1.truncated_normal_initializer(
                    stddev=math.sqrt(2.0 / fan_in), seed=next(seeds)))
            kernels.append(k)
            y = tf.nn.conv2d(x, k, strides=[1, stride, stride, 1], padding="SAME")
            if not batch_norm:
                b = tf.compat.v1.get_variable("bias", [filters], tf.float32,
                                              initializer=tf.compat.v1.zeros_initializer())
                y = tf.nn.bias_add(y, b)
        return y

    def bn(x, name):
        if not batch_norm:
            return x
        c = int(x.shape[-1])
        with tf.compat.v1.variable_scope(name):
            gamma = tf.compat.v1.get_variable("gamma", [c], initializer=tf.compat.v1.ones_initializer())
            beta = tf.compat.v1.get_variable("beta", [c], initializer=tf.compat.v1.zeros_initializer())
            moving_mean = tf.compat.v1.get_variable(
                "moving_mean", [c], trainable=False, initializer=tf.compat.v1.zeros_initializer())
            moving_variance = tf.compat.v1.get_variable(
                "moving_variance", [c], trainable=False, initializer=tf.compat.v1.ones_initializer())
            mean, variance = tf.nn.moments(x, axes=[0, 1, 2])
            decay = 1.0 - RESNET_BN_MOMENTUM
            for moving, value in ((moving_mean, mean), (moving_variance, variance)):
                tf.compat.v1.add_to_collection(
                    tf.compat.v1.GraphKeys.UPDATE_OPS,
                    tf.compat.v1.assign_sub(moving, (moving - value) * decay))
            return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)

    with _graph(seed) as graph:
        images, labels = resnet_data(data_seed)
        ds = tf.data.Dataset.from_tensor_slices((images, labels))
        ds = ds.batch(batch_size, drop_remainder=True).repeat()
        iterator = tf.compat.v1.data.make_initializable_iterator(ds)
        x, y = iterator.get_next()
        with tf.compat.v1.variable_scope("resnet"):
            stem = conv(x, 8, "stem")
            h = tf.nn.relu(bn(stem, "stem_bn"))
            with tf.compat.v1.variable_scope("block_1"):
                r = tf.nn.relu(bn(conv(h, 8, "conv_1"), "bn_1"))
                r = bn(conv(r, 8, "conv_2"), "bn_2")
                h = tf.nn.relu(h + r)
            with tf.compat.v1.variable_scope("block_2"):
                r = tf.nn.relu(bn(conv(h, 16, "conv_1", stride=2), "bn_1"))
                r = bn(conv(r, 16, "conv_2"), "bn_2")
                shortcut = bn(conv(h, 16, "shortcut", stride=2, size=1), "shortcut_bn")
                h = tf.nn.relu(shortcut + r)
            pooled = tf.reduce_mean(h, axis=[1, 2])
            with tf.compat.v1.variable_scope("dense"):
                w = tf.compat.v1.get_variable(
                    "kernel", [16, RESNET_CLASSES], tf.float32,
                    initializer=tf.compat.v1.glorot_uniform_initializer(seed=next(seeds)))
                b = tf.compat.v1.get_variable("bias", [RESNET_CLASSES], tf.float32,
                                              initializer=tf.compat.v1.zeros_initializer())
            logits = tf.matmul(pooled, w) + b
        cross_entropy = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        l2 = RESNET_WEIGHT_DECAY * tf.add_n([tf.nn.l2_loss(k) for k in kernels])
        loss = tf.identity(cross_entropy + l2, name="loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.MomentumOptimizer(RESNET_LR, momentum=0.9)
        minimize = optimizer.minimize(loss, global_step=global_step)
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        tf.group(minimize, *update_ops, name="train_op")
        ex = _finish(graph, "resnet", "momentum", [], seed, extra_init=[iterator.initializer],
                     tensors={"stem": stem.name, "images": x.name}, batch_size=batch_size)
    return ex, lambda step: {}


# ----- 4. LSTM language model, per-tensor clip_by_norm, Adagrad ------------------------------

LM_VOCAB = 50
LM_EMBED = 8
LM_HIDDEN = 16
LM_SEQ = 6
LM_BATCH = 8
LM_CLIP_NORM = 0.02       # fires for every tensor in most steps, the embedding's in about half
LM_LR = 2.0


def build_lstm_lm(seed=0, data_seed=0, batch_size=LM_BATCH):
    import tensorflow as tf
    seeds = _seeds(seed)

    def uniform(name, shape, scale=0.1):
        return tf.compat.v1.get_variable(
            name, shape, tf.float32,
            initializer=tf.compat.v1.random_uniform_initializer(-scale, scale, seed=next(seeds)))

    with _graph(seed) as graph:
        tokens = tf.compat.v1.placeholder(tf.int32, [None, LM_SEQ], name="tokens")
        targets = tf.compat.v1.placeholder(tf.int32, [None, LM_SEQ], name="targets")
        with tf.compat.v1.variable_scope("lm"):
            embedding = uniform("embedding", [LM_VOCAB, LM_EMBED], 0.5)
            with tf.compat.v1.variable_scope("lstm_cell"):
                kernel = uniform("kernel", [LM_EMBED + LM_HIDDEN, 4 * LM_HIDDEN], 0.3)
                bias = tf.compat.v1.get_variable("bias", [4 * LM_HIDDEN], tf.float32,
                                                 initializer=tf.compat.v1.zeros_initializer())
            softmax_w = uniform("softmax_w", [LM_HIDDEN, LM_VOCAB], 0.3)
            softmax_b = tf.compat.v1.get_variable("softmax_b", [LM_VOCAB], tf.float32,
                                                  initializer=tf.compat.v1.zeros_initializer())
        inputs = tf.gather(embedding, tokens)                          # [B, T, E]
        zeros = tf.zeros(tf.stack([tf.shape(tokens)[0], LM_HIDDEN]))
        h, c, outputs = zeros, zeros, []
        for t in range(LM_SEQ):
            z = tf.matmul(tf.concat([inputs[:, t, :], h], axis=1), kernel) + bias
            i, j, f, o = tf.split(z, 4, axis=1)
            c = c * tf.sigmoid(f + 1.0) + tf.sigmoid(i) * tf.tanh(j)
            h = tf.sigmoid(o) * tf.tanh(c)
            outputs.append(h)
        out = tf.reshape(tf.stack(outputs, axis=1), [-1, LM_HIDDEN])
        logits = tf.matmul(out, softmax_w) + softmax_b
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(targets, [-1]), logits=logits), name="loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = tf.compat.v1.train.AdagradOptimizer(LM_LR)
        tvars = tf.compat.v1.trainable_variables()
        # compute_gradients, not tf.gradients: its default gate_gradients=GATE_OP computes
        # every input gradient of an op before that op's weight gradient can be used. With
        # ref variables (reads alias the buffer an apply updates in place) and per-tensor
        # updates that nothing else orders, ungated gradients race with the updates: a
        # weight's apply may run before a later gradient reads the weight, and even one
        # device gives different numbers from run to run.
        grads = [g for g, _ in optimizer.compute_gradients(loss, tvars)]
        clipped = [tf.clip_by_norm(g, LM_CLIP_NORM) for g in grads]
        # the norms clip_by_norm compares with the clip norm (an IndexedSlices' is its values')
        norms = {v.op.name: tf.linalg.global_norm([g]).name for g, v in zip(grads, tvars)}
        optimizer.apply_gradients(list(zip(clipped, tvars)), global_step=global_step,
                                  name="train_op")
        ex = _finish(graph, "lstm_lm", "adagrad", [tokens.name, targets.name], seed,
                     tensors={"grad_norm/" + k: v for k, v in norms.items()})

    def feed(step):
        rng = _rng(data_seed, step, 401)
        seq = np.empty((batch_size, LM_SEQ + 1), np.int64)
        seq[:, 0] = rng.integers(0, LM_VOCAB, size=batch_size)
        for t in range(1, LM_SEQ + 1):      # mostly a fixed successor, sometimes noise
            follow = (seq[:, t - 1] * 7 + 3) % LM_VOCAB
            noise = rng.integers(0, LM_VOCAB, size=batch_size)
            seq[:, t] = np.where(rng.random(batch_size) < 0.8, follow, noise)
        seq = seq.astype(np.int32)
        return {"tokens:0": seq[:, :-1], "targets:0": seq[:, 1:]}

    return ex, feed


# ----- 5. Wide & Deep: Ftrl on the linear part, Adagrad on the deep part ---------------------

WD_CROSS_A = 5
WD_CROSS_B = 6
WD_WIDE_VOCAB = WD_CROSS_A * WD_CROSS_B   # crossed feature ids
WD_DEEP_VOCAB = 20
WD_EMBED = 4
WD_DENSE = 4
WD_BATCH = 16
WD_FTRL_LR = 0.2
WD_ADAGRAD_LR = 0.05


def build_wide_deep(seed=0, data_seed=0, batch_size=WD_BATCH):
    import tensorflow as tf
    seeds = _seeds(seed)

    with _graph(seed) as graph:
        wide_ids = tf.compat.v1.placeholder(tf.int32, [None], name="wide_ids")
        deep_ids = tf.compat.v1.placeholder(tf.int32, [None], name="deep_ids")
        x = tf.compat.v1.placeholder(tf.float32, [None, WD_DENSE], name="x")
        labels = tf.compat.v1.placeholder(tf.float32, [None], name="labels")
        with tf.compat.v1.variable_scope("linear"):
            linear_w = tf.compat.v1.get_variable("weights", [WD_WIDE_VOCAB, 1], tf.float32,
                                                 initializer=tf.compat.v1.zeros_initializer())
            linear_b = tf.compat.v1.get_variable("bias", [1], tf.float32,
                                                 initializer=tf.compat.v1.zeros_initializer())
            wide_logit = tf.gather(linear_w, wide_ids) + linear_b          # [B, 1]
        with tf.compat.v1.variable_scope("dnn"):
            embedding = tf.compat.v1.get_variable(
                "embedding", [WD_DEEP_VOCAB, WD_EMBED], tf.float32,
                initializer=tf.compat.v1.random_normal_initializer(stddev=0.3, seed=next(seeds)))
            h = tf.concat([tf.gather(embedding, deep_ids), x], axis=1)
            for name, units in (("hidden_1", 16), ("hidden_2", 8), ("logits", 1)):
                with tf.compat.v1.variable_scope(name):
                    w = tf.compat.v1.get_variable(
                        "kernel", [int(h.shape[-1]), units], tf.float32,
                        initializer=tf.compat.v1.glorot_uniform_initializer(seed=next(seeds)))
                    b = tf.compat.v1.get_variable("bias", [units], tf.float32,
                                                  initializer=tf.compat.v1.zeros_initializer())
                h = tf.matmul(h, w) + b
                if name != "logits":
                    h = tf.nn.relu(h)
            deep_logit = h
        logits = tf.squeeze(wide_logit + deep_logit, axis=1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        linear_vars = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES, "linear")
        dnn_vars = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES, "dnn")
        ftrl = tf.compat.v1.train.FtrlOptimizer(WD_FTRL_LR, l1_regularization_strength=0.001,
                                                l2_regularization_strength=0.001)
        adagrad = tf.compat.v1.train.AdagradOptimizer(WD_ADAGRAD_LR)
        # Each optimizer computes its own part's gradients (gated: see build_lstm_lm).
        updates = [
            ftrl.apply_gradients(ftrl.compute_gradients(loss, linear_vars), name="linear_update"),
            adagrad.apply_gradients(adagrad.compute_gradients(loss, dnn_vars), name="dnn_update")]
        with tf.control_dependencies(updates):
            bump = tf.compat.v1.assign_add(global_step, 1, name="increment_global_step")
        tf.group(*updates, bump, name="train_op")
        ex = _finish(graph, "wide_deep", "ftrl+adagrad",
                     [wide_ids.name, deep_ids.name, x.name, labels.name], seed)

    cross_score = _rng(data_seed, 0, 503).normal(size=(WD_CROSS_A, WD_CROSS_B))

    def feed(step):
        rng = _rng(data_seed, step, 509)
        a = rng.integers(0, WD_CROSS_A, size=batch_size)
        b = rng.integers(0, WD_CROSS_B, size=batch_size)
        xs = rng.normal(size=(batch_size, WD_DENSE)).astype(np.float32)
        deep = (a * 4 + rng.integers(0, 4, size=batch_size)) % WD_DEEP_VOCAB
        score = cross_score[a, b] + 0.5 * xs[:, 0] - 0.5 * xs[:, 1]
        return {"wide_ids:0": (a * WD_CROSS_B + b).astype(np.int32),
                "deep_ids:0": deep.astype(np.int32), "x:0": xs,
                "labels:0": (score > 0).astype(np.float32)}

    return ex, feed


# ----- 6. A variational autoencoder with a loss summed over the batch -----------------------

VAE_PIXELS = 16
VAE_HIDDEN = 12
VAE_LATENT = 3
VAE_BATCH = 8
VAE_LR = 0.01


def build_vae(seed=0, data_seed=0, batch_size=VAE_BATCH):
    """A VAE (Kingma and Welling's, in the shape of the TF1 scripts that train it on
    binarised MNIST): an MLP encoder to the mean and log variance of a Gaussian latent,
    the reparameterisation z = mu + exp(log_var / 2) * eps with eps a seeded
    ``tf.random_normal(tf.shape(mu))`` (one draw per row), an MLP decoder to Bernoulli
    logits, and the negative ELBO summed over the batch (the reconstruction cross
    entropy and the KL divergence, each ``tf.reduce_sum`` over every axis, as PyTorch's
    VAE example and its TF ports sum them), trained by AdamOptimizer with global_step.
    Resource variables."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    seeds = _seeds(seed)

    def dense(name, x, n_in, n_out, activation=None):
        with tf1.variable_scope(name):
            w = tf1.get_variable("kernel", [n_in, n_out], tf.float32,
                                 initializer=tf1.glorot_uniform_initializer(seed=next(seeds)))
            b = tf1.get_variable("bias", [n_out], tf.float32, initializer=tf1.zeros_initializer())
        y = tf.matmul(x, w) + b
        return activation(y) if activation is not None else y

    with _graph(seed, resource=True) as graph:
        x = tf1.placeholder(tf.float32, [None, VAE_PIXELS], name="x")
        with tf1.variable_scope("encoder"):
            h = dense("hidden", x, VAE_PIXELS, VAE_HIDDEN, tf.nn.relu)
            mu = dense("mu", h, VAE_HIDDEN, VAE_LATENT)
            log_var = dense("log_var", h, VAE_HIDDEN, VAE_LATENT)
        eps = tf1.random_normal(tf.shape(mu), seed=next(seeds), name="eps")
        z = mu + tf.exp(0.5 * log_var) * eps
        with tf1.variable_scope("decoder"):
            logits = dense("logits", dense("hidden", z, VAE_LATENT, VAE_HIDDEN, tf.nn.relu),
                           VAE_HIDDEN, VAE_PIXELS)
        reconstruction = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=logits),
                                       name="reconstruction")
        kl = tf.identity(-0.5 * tf.reduce_sum(1.0 + log_var - tf.square(mu) - tf.exp(log_var)), name="kl")
        loss = tf.add(reconstruction, kl, name="loss")
        global_step = tf1.train.get_or_create_global_step()
        tf1.train.AdamOptimizer(VAE_LR).minimize(loss, global_step=global_step, name="train_op")
        ex = _finish(graph, "vae", "adam", [x.name], seed, resource=True,
                     tensors={"eps": eps.name, "reconstruction": reconstruction.name, "kl": kl.name})

    def feed(step):
        rng = _rng(data_seed, step, 601)
        # two prototypes, each pixel flipped with probability 0.1
        proto = np.array([[1, 0] * (VAE_PIXELS // 2), [0, 1] * (VAE_PIXELS // 2)], np.float32)
        rows = proto[rng.integers(0, 2, size=batch_size)]
        flip = rng.random((batch_size, VAE_PIXELS)) < 0.1
        return {"x:0": np.where(flip, 1.0 - rows, rows).astype(np.float32)}

    return ex, feed


# ----- 7. Barlow Twins: a cross-correlation over the batch, trained by a hand-written LARS -----

BT_FEATURES = 8
BT_HIDDEN = 16
BT_EMBED = 8
BT_BATCH = 16
BT_LAMBDA = 0.05            # the off-diagonal terms' weight (the paper's 5e-3 is for 8192 features)
BT_LR = 0.2                 # LARS: the weights' learning rate; biases and BatchNorm's take BT_LR_BIAS
BT_LR_BIAS = 0.0048
BT_MOMENTUM = 0.9
BT_WEIGHT_DECAY = 1.5e-6
BT_ETA = 0.001 * 50         # LARS' trust coefficient (scaled up: 12 steps must move the weights)
BT_EPSILON = 1e-5


def build_barlow_twins(seed=0, data_seed=0, batch_size=BT_BATCH):
    """Barlow Twins (Zbontar et al., 2021, in the shape of its TF ports): two views of each
    example (``x_a``, ``x_b``: the same rows with their own noise, as the input
    pipeline's augmentations make them) through one encoder (dense 8 -> 16 relu -> 16)
    and a projector (dense without bias, a BatchNorm by hand in training mode:
    ``tf.nn.moments`` over the rows, scale and offset, relu, dense to 8); each view's
    embedding normalised over the batch (``tf.nn.moments``, mean 0 and variance 1 per
    feature); the cross-correlation C = z_a^T z_b / n with n = ``tf.shape(z_a)[0]``, the
    loss Σ_i (1 - C_ii)^2 + λ Σ_{i≠j} C_ij^2. Trained by LARS written in plain ops, as
    the paper does: per weight matrix the gradient plus weight decay, scaled by the
    trust ratio η ||w|| / ||g|| (1 if either norm is 0), into a momentum slot; biases and
    BatchNorm's scale and offset take neither decay nor trust ratio and a smaller
    learning rate. Every update waits for every gradient, then global_step += 1.
    Resource variables. Every statistic over the rows here (the BatchNorm's and the
    normalisation's moments, C itself) is one device's only with
    ``sync_batch_statistics``."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    seeds = _seeds(seed)
    weights, plain = [], []

    def variable(name, shape, initializer, trained_plainly=False):
        v = tf1.get_variable(name, shape, tf.float32, initializer=initializer)
        if all(v is not known for known in weights + plain):   # (the second view reuses it)
            (plain if trained_plainly else weights).append(v)
        return v

    def dense(name, x, n_in, n_out, bias=True):
        with tf1.variable_scope(name, reuse=tf1.AUTO_REUSE):
            w = variable("kernel", [n_in, n_out], tf1.glorot_uniform_initializer(seed=next(seeds)))
            y = tf.matmul(x, w)
            if bias:
                y += variable("bias", [n_out], tf1.zeros_initializer(), trained_plainly=True)
        return y

    def batch_norm(name, h, n):
        with tf1.variable_scope(name, reuse=tf1.AUTO_REUSE):
            gamma = variable("gamma", [n], tf1.ones_initializer(), trained_plainly=True)
            beta = variable("beta", [n], tf1.zeros_initializer(), trained_plainly=True)
        mean, var = tf.nn.moments(h, [0])
        return gamma * (h - mean) * tf.math.rsqrt(var + BT_EPSILON) + beta

    def embed(x, view):
        with tf.name_scope(view):
            h = tf.nn.relu(dense("encoder/hidden", x, BT_FEATURES, BT_HIDDEN))
            h = dense("encoder/out", h, BT_HIDDEN, BT_HIDDEN)
            h = tf.nn.relu(batch_norm("projector/bn", dense("projector/hidden", h, BT_HIDDEN, BT_HIDDEN,
                                                            bias=False), BT_HIDDEN))
            z = dense("projector/out", h, BT_HIDDEN, BT_EMBED)
            mean, var = tf.nn.moments(z, [0], name="normalise")
            return (z - mean) * tf.math.rsqrt(var + BT_EPSILON)

    with _graph(seed, resource=True) as graph:
        x_a = tf1.placeholder(tf.float32, [None, BT_FEATURES], name="x_a")
        x_b = tf1.placeholder(tf.float32, [None, BT_FEATURES], name="x_b")
        z_a, z_b = embed(x_a, "view_a"), embed(x_b, "view_b")
        rows = tf.cast(tf.shape(z_a)[0], tf.float32)
        c = tf.matmul(z_a, z_b, transpose_a=True, name="cross_correlation") / rows
        diagonal = tf.linalg.diag_part(c)
        on = tf.reduce_sum(tf.square(1.0 - diagonal))
        off = tf.reduce_sum(tf.square(c)) - tf.reduce_sum(tf.square(diagonal))
        loss = tf.add(on, BT_LAMBDA * off, name="loss")
        global_step = tf1.train.get_or_create_global_step()
        variables = weights + plain
        grads = tf.gradients(loss, variables)
        updates = []
        with tf.control_dependencies(grads), tf.name_scope("lars"):
            for v, g in zip(variables, grads):
                name = v.op.name
                momentum = tf1.get_variable(f"{name}/momentum", v.shape, tf.float32,
                                            initializer=tf1.zeros_initializer(), trainable=False)
                if v in plain:
                    step = BT_LR_BIAS * g
                else:
                    g = g + BT_WEIGHT_DECAY * v
                    w_norm, g_norm = tf.norm(v), tf.norm(g)
                    trust = tf1.where(w_norm > 0.0, tf1.where(g_norm > 0.0, BT_ETA * w_norm / g_norm, 1.0), 1.0)
                    step = BT_LR * trust * g
                velocity = BT_MOMENTUM * momentum + step
                updates += [tf1.assign(v, v - velocity), tf1.assign(momentum, velocity)]
        with tf.control_dependencies(updates):
            train_op = global_step.assign_add(1)
        tf.group(train_op, name="train_op")
        ex = _finish(graph, "barlow_twins", "lars", [x_a.name, x_b.name], seed, resource=True,
                     tensors={"cross_correlation": c.name})

    def feed(step):
        rng = _rng(data_seed, step, 701)
        base = rng.normal(size=(batch_size, BT_FEATURES))
        view = lambda: (base + 0.3 * rng.normal(size=base.shape)).astype(np.float32)   # noqa: E731
        return {"x_a:0": view(), "x_b:0": view()}

    return ex, feed


def build_loss_scale_v2(**kw):
    """build_loss_scale with v2 control flow (If) and resource variables."""
    return build_loss_scale(control_flow="v2", **kw)


def build_bert_accumulate(**kw):
    """The BERT-style classifier with NVIDIA's gradient accumulation by hand over 2 steps."""
    return build_bert(accumulation_steps=2, **kw)


def build_bert_dropout(**kw):
    """The BERT-style classifier with BERT's dropouts at 0.1."""
    return build_bert(dropout=0.1, **kw)


BUILDERS = {
    "bert": build_bert,
    "bert_dropout": build_bert_dropout,
    "bert_accumulate": build_bert_accumulate,
    "loss_scale": build_loss_scale,
    "loss_scale_v2": build_loss_scale_v2,
    "resnet": build_resnet,
    "lstm_lm": build_lstm_lm,
    "wide_deep": build_wide_deep,
    "vae": build_vae,
    "barlow_twins": build_barlow_twins,
}

BATCHES = {"bert": BERT_BATCH, "bert_dropout": BERT_BATCH, "bert_accumulate": BERT_BATCH, "loss_scale": LS_BATCH, "loss_scale_v2": LS_BATCH,
           "lstm_lm": LM_BATCH,
           "wide_deep": WD_BATCH, "vae": VAE_BATCH, "barlow_twins": BT_BATCH}


def build(model, **kw):
    """(example, feed) of one of BUILDERS."""
    return BUILDERS[model](**kw)
