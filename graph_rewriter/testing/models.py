"""The model zoo: small, seeded, single-device tf.compat.v1 TRAINING graphs.

Tests, tools (benchmarks, tools/compare_outputs.py) and users checking a rewrite all build
their inputs here, so that "the same model" means the same GraphDef everywhere; the
equivalence harness (graph_rewriter.testing.harness) trains them:

    ex = build("embedding", optimizer="adagrad", resource=False)
    losses, values = harness.run_single(ex, steps=3)               # one device
    result = graph_rewriter.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    losses2, values2 = harness.run_rewritten(result, ex, steps=3)  # must be the same numbers

Every graph follows one convention: batch placeholders "x:0", "y:0" (and "ids:0") with an
unknown first dimension, a scalar mean loss "loss:0", a train op "train_op", an init op
"init", a global_step (v1 optimizers) or Keras ``iterations`` counter, and a Saver. The
loss is a MEAN over the batch, so averaging equal shards' gradients is exact.
Everything is seeded (graph seed and op seeds): the same arguments give the same graph
and the same numbers. TensorFlow is imported lazily, like the rest of the package.

The Keras models ("keras", "keras_embedding") and, with Keras 3 installed, "batchnorm"
need tf_keras (see ``import_tf_keras``).
"""

import dataclasses
import typing
import warnings

import numpy as np

OPTIMIZERS_V1 = (
    "sgd", "momentum", "nesterov", "adam", "adagrad", "adagrad_da", "adadelta", "rmsprop",
    "rmsprop_momentum", "rmsprop_centered", "ftrl", "proximal_sgd", "proximal_adagrad")
OPTIMIZERS_KERAS = (
    "keras_sgd", "keras_sgd_momentum", "keras_adam", "keras_adagrad", "keras_rmsprop",
    "keras_adadelta", "keras_adamax", "keras_nadam", "keras_ftrl")
MODELS = (
    "mlp", "embedding", "cond", "lstm_v1", "lstm_v2", "keras", "keras_embedding", "batchnorm",
    "lr_schedule", "iterator")
KERAS_MODELS = ("keras", "keras_embedding")

FEATURES = 6          # x columns of the dense models
HIDDEN = 8
EMBED_ROWS = 20       # embedding table rows ...
EMBED_DIM = 4
EMBED_FEATURES = 4    # dense x columns next to the embedding
ID_RANGE = 6          # ... of which batches only touch rows 0..5 (duplicates guaranteed)
SEQ_LEN = 3           # LSTM time steps
SEQ_FEATURES = 4
ITERATOR_ROWS = 64    # rows of the in-graph dataset of the "iterator" model
BN_MOMENTUM = 0.9


@dataclasses.dataclass
class Example:
    """A built training graph and the names a test needs to drive it."""
    graph_def: typing.Any                 # tf.compat.v1.GraphDef
    model: str
    optimizer: str
    resource: bool
    feeds: list                           # placeholder tensor names that take the batch
    loss: str = "loss:0"
    train_op: str = "train_op"
    init: str = "init"
    variables: dict = dataclasses.field(default_factory=dict)  # variable node -> read tensor
    step_counter: typing.Optional[str] = None                  # read tensor of the counter
    extra_init: list = dataclasses.field(default_factory=list) # ops to run after init, if any
    tensors: dict = dataclasses.field(default_factory=dict)    # named inner tensors (tests)
    seed: int = 0
    batch_size: typing.Optional[int] = None  # fixed batch of the in-graph input pipeline
    queue_runners: list = dataclasses.field(default_factory=list)  # serialized QueueRunnerDefs

    def meta_graph(self):
        """The graph as a MetaGraphDef carrying its QueueRunners (a GraphDef cannot)."""
        from tensorflow.core.protobuf import meta_graph_pb2
        meta = meta_graph_pb2.MetaGraphDef()
        meta.graph_def.CopyFrom(self.graph_def)
        if self.queue_runners:
            meta.collection_def["queue_runners"].bytes_list.value.extend(self.queue_runners)
        return meta

    def batch(self, step, size=8, seed=0):
        """The feed dict of training step ``step``: ``size`` rows, seeded by (seed, step)
        (the data seed is independent of the example's weight seed).

        Embedding ids come from range(ID_RANGE) and repeat within the batch, across its
        halves and across its quarters, so sparse updates see duplicate rows inside one
        replica's shard and between replicas; at odd steps each quarter holds one id, so
        the number of distinct rows per shard changes from step to step. The "cond" model's ``use_branch`` flag is
        not batch data: it alternates with the step. "iterator" reads its own data: {}.
        """
        if self.model == "iterator":
            return {}
        rng = np.random.default_rng([seed, step, 7919])
        feed = {}
        if self.model in ("lstm_v1", "lstm_v2"):
            x = rng.normal(size=(size, SEQ_LEN, SEQ_FEATURES))
            y = np.tanh(x.sum(axis=(1, 2)) / 4.0)[:, None] + 0.1 * rng.normal(size=(size, 1))
        else:
            width = EMBED_FEATURES if self.model in ("embedding", "keras_embedding") else FEATURES
            x = rng.normal(size=(size, width))
            y = np.sin(x.sum(axis=1))[:, None] + 0.1 * rng.normal(size=(size, 1))
        feed["x:0"] = x.astype(np.float32)
        feed["y:0"] = y.astype(np.float32)
        if "ids:0" in self.feeds:
            feed["ids:0"] = _ids(rng, size, step)
        if self.model == "cond":
            feed["use_branch:0"] = np.asarray(step % 2 == 0)
        return feed


def _ids(rng, size, step):
    ids = rng.integers(0, ID_RANGE, size=size).astype(np.int32)
    if size >= 4:
        quarter = size // 4
        shared = ids[0]
        for k in range(4):          # one id in every quarter (so in both halves too)
            ids[k * quarter] = shared
        if quarter >= 2:
            ids[1] = shared         # and twice inside the first quarter
    elif size >= 2:
        ids[1] = ids[0]
    if step % 2 and size >= 4:
        # Odd steps: every quarter holds a single id, [s, s, t, s], so shards have fewer
        # distinct rows than at even steps (sparse row counts vary from step to step)
        # while ids still repeat within quarters and across halves and quarters.
        quarter = size // 4
        other = (int(ids[0]) + 1 + int(rng.integers(0, ID_RANGE - 1))) % ID_RANGE
        ids[:] = ids[0]
        ids[2 * quarter:3 * quarter] = other
    return ids


# ----- building -----------------------------------------------------------------------------

def build(model="mlp", optimizer="sgd", resource=True, seed=0, **kw):
    """Builds one example graph; see the module doc for the names it follows.

    Options: ``control_flow`` ("v1"/"v2") for "cond" (default: TensorFlow's current
    setting, v2 in TF 2.x); ``batch_size`` and ``pipeline`` for "iterator" (default 8, and
    "initializable": a tf.data initializable iterator; "one_shot": a one-shot iterator;
    "queue": TF1 queues, tf.train.batch over slice_input_producer); ``update_ops``
    for "batchnorm": "group" (default: tf.group(minimize, *UPDATE_OPS)) or "control"
    (minimize() built under tf.control_dependencies(UPDATE_OPS)); ``learning_rate``
    to override the optimizer's default. Keras models always use resource variables
    (Keras creates them itself); their optimizer must be one of OPTIMIZERS_KERAS, and the
    other models' one of OPTIMIZERS_V1.
    """
    import tensorflow as tf

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    keras = model in KERAS_MODELS
    allowed = OPTIMIZERS_KERAS if keras else OPTIMIZERS_V1
    if optimizer not in allowed:
        raise ValueError(f"model {model!r} takes an optimizer from {', '.join(allowed)}, "
                         f"got {optimizer!r}")
    unknown = set(kw) - {"control_flow", "batch_size", "pipeline", "learning_rate", "update_ops"}
    if unknown:
        raise TypeError(f"build() got unknown options {sorted(unknown)}")
    if kw.get("update_ops", "group") not in ("group", "control"):
        raise ValueError(f"update_ops must be 'group' or 'control', got {kw['update_ops']!r}")
    if keras:
        resource = True
    graph = tf.Graph()
    flags = ControlFlow(kw.get("control_flow") if model == "cond"
                         else {"lstm_v1": "v1", "lstm_v2": "v2"}.get(model))
    with graph.as_default(), flags:
        tf.compat.v1.set_random_seed(seed)
        scope = tf.compat.v1.get_variable_scope()
        with tf.compat.v1.variable_scope(scope, use_resource=resource):
            builder = _KerasBuilder if keras else _V1Builder
            b = builder(model, optimizer, seed, kw)
            b.build()
        saver_vars = tf.compat.v1.global_variables()
        if keras:
            saver_vars = _unique(saver_vars + b.extra_variables())
        tf.compat.v1.train.Saver(var_list=saver_vars)
        variables = {v.op.name: _read_tensor_name(v) for v in saver_vars}
        step = b.step_variable
    return Example(
        graph_def=canonical_function_names(graph.as_graph_def()), model=model,
        optimizer=optimizer, resource=resource, feeds=list(b.feeds), variables=variables,
        step_counter=variables[step.op.name] if step is not None else None,
        tensors=dict(b.tensors), seed=seed, batch_size=b.batch_size,
        queue_runners=[qr.to_proto().SerializeToString()
                       for qr in graph.get_collection(tf.compat.v1.GraphKeys.QUEUE_RUNNERS)])


class ControlFlow:
    """Switches TensorFlow's v1/v2 control-flow flag while a graph is built and restores
    it after: the flag is process-wide, and tf.while_loop/tf.cond read it when called."""

    def __init__(self, version):
        self.version = version

    def __enter__(self):
        import tensorflow as tf
        self.before = tf.compat.v1.control_flow_v2_enabled()
        if self.version == "v1":
            tf.compat.v1.disable_control_flow_v2()
        elif self.version == "v2":
            tf.compat.v1.enable_control_flow_v2()
        elif self.version is not None:
            raise ValueError(f"control_flow must be 'v1' or 'v2', got {self.version!r}")
        return self

    def __exit__(self, *exc):
        import tensorflow as tf
        if self.before:
            tf.compat.v1.enable_control_flow_v2()
        else:
            tf.compat.v1.disable_control_flow_v2()
        return False


def canonical_function_names(graph_def):
    """The GraphDef with its function library renamed deterministically.

    TensorFlow names the functions of v2 control flow and gradients with a process-wide
    counter ("branch_true_73", "CustomGradient-185"), so building the same model twice
    in one process gives two different GraphDefs. Each function is renamed to its name
    without those numbers plus its rank in first-use order, and every reference (function
    attrs, call ops, attrs holding a function's name, gradient defs) follows.
    """
    import re
    lib = graph_def.library
    known = {f.signature.name: f for f in lib.function}
    if not known and not any("_gradient_op_type" in n.attr for n in graph_def.node):
        return graph_def
    order, seen_grad_types = [], []

    def note(name):
        if name in known and name not in order:
            order.append(name)
            visit_function(known[name])

    def visit_attr(value):
        kind = value.WhichOneof("value")
        if kind == "func":
            note(value.func.name)
            for k in sorted(value.func.attr):
                visit_attr(value.func.attr[k])
        elif kind == "list":
            for f in value.list.func:
                note(f.name)
        elif kind == "s":
            text = value.s.decode("utf-8", "replace")
            if text in known:
                note(text)
            elif re.fullmatch(r"CustomGradient-\d+", text) and text not in seen_grad_types:
                seen_grad_types.append(text)

    def visit_node(node):
        note(node.op)
        for k in sorted(node.attr):
            visit_attr(node.attr[k])

    def visit_function(fn):
        for k in sorted(fn.attr):
            visit_attr(fn.attr[k])
        for node in fn.node_def:
            visit_node(node)

    for node in graph_def.node:
        visit_node(node)
    for name in sorted(known, key=lambda n: (re.sub(r"\d+", "", n), n)):  # unreferenced
        note(name)
    mapping, counts = {}, {}
    for name in order:
        base = re.sub(r"_\d+(?=_|$)", "", name)
        counts[base] = counts.get(base, 0) + 1
        mapping[name] = f"{base}_{counts[base]}"
    for k, text in enumerate(seen_grad_types):
        mapping[text] = f"CustomGradient-{k + 1}"

    def fix_attr(value):
        kind = value.WhichOneof("value")
        if kind == "func":
            value.func.name = mapping.get(value.func.name, value.func.name)
            for k in value.func.attr:
                fix_attr(value.func.attr[k])
        elif kind == "list":
            for f in value.list.func:
                f.name = mapping.get(f.name, f.name)
        elif kind == "s":
            text = value.s.decode("utf-8", "replace")
            if text in mapping:
                value.s = mapping[text].encode()

    def fix_node(node):
        node.op = mapping.get(node.op, node.op)
        for k in node.attr:
            fix_attr(node.attr[k])

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        fix_node(node)
    functions = list(out.library.function)
    for fn in functions:
        _rename_args(fn, mapping)
        fn.signature.name = mapping.get(fn.signature.name, fn.signature.name)
        for k in fn.attr:
            fix_attr(fn.attr[k])
        for node in fn.node_def:
            fix_node(node)
    for grad in out.library.gradient:
        grad.function_name = mapping.get(grad.function_name, grad.function_name)
        grad.gradient_func = mapping.get(grad.gradient_func, grad.gradient_func)
    del out.library.function[:]
    out.library.function.extend(sorted(functions, key=lambda f: f.signature.name))
    return out


def _rename_args(fn, mapping):
    """Arguments named after a function ("cond_39___redundant_placeholder0") follow it."""
    renamed = {}
    longest_first = sorted(mapping.items(), key=lambda item: -len(item[0]))
    for arg in list(fn.signature.input_arg) + list(fn.signature.output_arg):
        for old, new in longest_first:
            if arg.name.startswith(old + "_"):
                renamed[arg.name] = new + arg.name[len(old):]
                arg.name = renamed[arg.name]
                break
    if not renamed:
        return

    def fix(ref):
        control = ref.startswith("^")
        head, sep, tail = ref.lstrip("^").partition(":")
        return ("^" if control else "") + renamed.get(head, head) + sep + tail

    for node in fn.node_def:
        node.input[:] = [fix(r) for r in node.input]
    for key in list(fn.ret):
        value = fix(fn.ret[key])
        del fn.ret[key]
        fn.ret[renamed.get(key, key)] = value


def _unique(variables):
    seen, out = set(), []
    for v in variables:
        if v.op.name not in seen:
            seen.add(v.op.name)
            out.append(v)
    return out


def _read_tensor_name(v):
    """A tensor that reads the variable's current value when fetched.

    A resource variable built in graph mode keeps the read it made at creation
    ("w/Read/ReadVariableOp:0"); ``v.value()`` would add a NEW ReadVariableOp node, so it is
    not used. A ref variable's snapshot is "w/read:0".
    """
    import tensorflow as tf
    element = getattr(v, "_graph_element", None)
    if element is not None and hasattr(element, "name") and not isinstance(element, tf.Operation):
        return element.name
    snapshot = getattr(v, "_snapshot", None)
    if snapshot is not None:
        return snapshot.name
    return tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype,
                                     name=v.op.name + "/example_read").name


def _seeds(seed):
    """Distinct op-level seeds, one per call, derived from the example's seed."""
    k = 0
    while True:
        k += 1
        yield seed * 1000 + k


class _V1Builder:
    """Models trained by a tf.compat.v1.train optimizer with minimize(global_step=...)."""

    def __init__(self, model, optimizer, seed, kw):
        self.model, self.optimizer_name, self.seed, self.kw = model, optimizer, seed, kw
        self.seeds = _seeds(seed)
        self.feeds, self.tensors = [], {}
        self.batch_size = None
        self.step_variable = None

    # -- pieces
    def placeholder(self, name, shape, dtype=None):
        import tensorflow as tf
        t = tf.compat.v1.placeholder(dtype or tf.float32, shape, name=name)
        if shape and shape[0] is None:
            self.feeds.append(t.name)
        return t

    def weight(self, name, shape, stddev=None):
        import tensorflow as tf
        if stddev is None:
            init = tf.compat.v1.glorot_uniform_initializer(seed=next(self.seeds))
        else:
            init = tf.compat.v1.random_normal_initializer(stddev=stddev, seed=next(self.seeds))
        return tf.compat.v1.get_variable(name, shape, tf.float32, initializer=init)

    def bias(self, name, shape):
        import tensorflow as tf
        init = tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=next(self.seeds))
        return tf.compat.v1.get_variable(name, shape, tf.float32, initializer=init)

    def dense(self, inputs, units, name, activation=None):
        import tensorflow as tf
        with tf.compat.v1.variable_scope(name):
            w = self.weight("kernel", [inputs.shape[-1], units])
            b = self.bias("bias", [units])
        out = tf.nn.bias_add(tf.matmul(inputs, w), b)
        return activation(out) if activation is not None else out

    @staticmethod
    def mse(pred, y):
        import tensorflow as tf
        return tf.reduce_mean(tf.square(pred - y))

    # -- models
    def build(self):
        import tensorflow as tf
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        self.step_variable = self.global_step
        raw_loss = getattr(self, "_" + self.model)()
        loss = tf.identity(raw_loss, name="loss")
        learning_rate = self.kw.get("learning_rate")
        if self.model == "lr_schedule":
            base = learning_rate if learning_rate is not None else _V1_RATES[self.optimizer_name]
            learning_rate = tf.compat.v1.train.exponential_decay(
                base, self.global_step, decay_steps=1, decay_rate=0.5, name="learning_rate")
            self.tensors["learning_rate"] = learning_rate.name
        opt = _v1_optimizer(self.optimizer_name, self.global_step, learning_rate)
        update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        if not update_ops:
            opt.minimize(loss, global_step=self.global_step, name="train_op")
        elif self.kw.get("update_ops", "group") == "group":
            minimize = opt.minimize(loss, global_step=self.global_step)
            tf.group(minimize, *update_ops, name="train_op")
        else:
            # The pattern TF1's batch_normalization docs give: every op minimize() makes,
            # the gradients included, gets a control input on the moving-average updates.
            with tf.control_dependencies(update_ops):
                opt.minimize(loss, global_step=self.global_step, name="train_op")
        _init_op(tf.compat.v1.global_variables(),
                 tf.compat.v1.get_collection("example_init_ops"))

    def _mlp(self):
        import tensorflow as tf
        x = self.placeholder("x", [None, FEATURES])
        y = self.placeholder("y", [None, 1])
        h = self.dense(x, HIDDEN, "hidden", tf.tanh)
        return self.mse(self.dense(h, 1, "output"), y)

    _lr_schedule = _mlp

    def _embedding(self):
        import tensorflow as tf
        ids = self.placeholder("ids", [None], tf.int32)
        x = self.placeholder("x", [None, EMBED_FEATURES])
        y = self.placeholder("y", [None, 1])
        table = self.weight("embedding", [EMBED_ROWS, EMBED_DIM], stddev=0.5)
        rows = tf.nn.embedding_lookup(table, ids)
        h = self.dense(tf.concat([rows, x], axis=1), HIDDEN, "hidden", tf.tanh)
        return self.mse(self.dense(h, 1, "output"), y)

    def _cond(self):
        import tensorflow as tf
        x = self.placeholder("x", [None, FEATURES])
        y = self.placeholder("y", [None, 1])
        use_branch = tf.compat.v1.placeholder(tf.bool, [], name="use_branch")
        h = self.dense(x, HIDDEN, "hidden", tf.tanh)
        # Variables are created outside the branches: a v2 cond traces its branches into
        # functions, where creating variables is not allowed.
        with tf.compat.v1.variable_scope("head_a"):
            wa, ba = self.weight("kernel", [HIDDEN, 1]), self.bias("bias", [1])
        with tf.compat.v1.variable_scope("head_b"):
            wb, bb = self.weight("kernel", [HIDDEN, 1]), self.bias("bias", [1])
        return tf.cond(use_branch,
                       lambda: self.mse(tf.matmul(h, wa) + ba, y),
                       lambda: self.mse(tf.tanh(tf.matmul(h, wb) + bb), y),
                       name="branch")

    def _lstm(self):
        import tensorflow as tf
        x = self.placeholder("x", [None, SEQ_LEN, SEQ_FEATURES])
        y = self.placeholder("y", [None, 1])
        with tf.compat.v1.variable_scope("lstm"):
            kernel = self.weight("kernel", [SEQ_FEATURES + HIDDEN, 4 * HIDDEN])
            bias = self.bias("bias", [4 * HIDDEN])
        steps = tf.transpose(x, [1, 0, 2])   # [time, batch, features]
        zeros = tf.zeros(tf.stack([tf.shape(x)[0], HIDDEN]))

        def body(t, h, c):
            z = tf.matmul(tf.concat([tf.gather(steps, t), h], axis=1), kernel) + bias
            i, f, o, g = tf.split(z, 4, axis=1)
            c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(g)
            h = tf.sigmoid(o) * tf.tanh(c)
            return t + 1, h, c

        _, h, _ = tf.while_loop(lambda t, h, c: t < SEQ_LEN, body, [tf.constant(0), zeros, zeros],
                                name="recurrence")
        return self.mse(self.dense(h, 1, "output"), y)

    _lstm_v1 = _lstm
    _lstm_v2 = _lstm

    def _batchnorm(self):
        import tensorflow as tf
        x = self.placeholder("x", [None, FEATURES])
        y = self.placeholder("y", [None, 1])
        h = self.dense(x, HIDDEN, "hidden")
        self.tensors["bn_input"] = h.name
        with warnings.catch_warnings():  # "tf.layers.batch_normalization is deprecated"
            warnings.simplefilter("ignore")
            normed = _batch_normalization()(h, training=True, momentum=BN_MOMENTUM, name="bn")
        return self.mse(self.dense(tf.tanh(normed), 1, "output"), y)

    def _iterator(self):
        import tensorflow as tf
        self.batch_size = self.kw.get("batch_size", 8)
        rng = np.random.default_rng([self.seed, 4099])
        xs = rng.normal(size=(ITERATOR_ROWS, FEATURES)).astype(np.float32)
        ys = (np.sin(xs.sum(axis=1))[:, None] + 0.1 * rng.normal(size=(ITERATOR_ROWS, 1))).astype(np.float32)
        # batch before repeat, without drop_remainder: the batch dimension stays unknown
        # (None) in the iterator's output shapes, which is what marks it as a batch input.
        pipeline = self.kw.get("pipeline", "initializable")
        if pipeline == "queue":
            # TF1 queues: a producer of row indices in order, tf.train.batch's one thread
            # (the rows stay in order), QueueRunners to fill both (Example.queue_runners)
            x1, y1 = tf.compat.v1.train.slice_input_producer([tf.constant(xs), tf.constant(ys)], shuffle=False)
            x, y = tf.compat.v1.train.batch([x1, y1], batch_size=self.batch_size)
        else:
            ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(self.batch_size).repeat()
            if pipeline == "one_shot":   # the pipeline lives in a function the iterator calls
                iterator = tf.compat.v1.data.make_one_shot_iterator(ds)
            else:
                iterator = tf.compat.v1.data.make_initializable_iterator(ds)
                tf.compat.v1.add_to_collection("example_init_ops", iterator.initializer)
            x, y = iterator.get_next()
        self.tensors.update(x=x.name, y=y.name)
        h = self.dense(x, HIDDEN, "hidden", tf.tanh)
        return self.mse(self.dense(h, 1, "output"), y)


def _init_op(variables, extra_ops):
    """The op "init": the variables' initializer itself (what
    tf.compat.v1.global_variables_initializer() names "init"), or, with further ops to run
    (an iterator's initializer, local variables), a group of them all."""
    import tensorflow as tf
    local = tf.compat.v1.local_variables()
    if not extra_ops and not local:
        return tf.compat.v1.variables_initializer(variables, name="init")
    ops = [tf.compat.v1.variables_initializer(variables, name="init_variables")] + list(extra_ops)
    if local:
        ops.append(tf.compat.v1.variables_initializer(local, name="init_local"))
    return tf.group(*ops, name="init")


def _batch_normalization():
    """tf.compat.v1.layers.batch_normalization (TF1's layer function: variables by
    variable scope, moving-average updates in UPDATE_OPS), which "batchnorm" needs.

    With Keras 3 installed (TF >= 2.16) the tf.compat.v1.layers names raise unless
    TF_USE_LEGACY_KERAS=1 was set before TensorFlow routed them; then TensorFlow itself
    takes them from tf_keras's v1 API, ``tf_keras.api._v1.keras.__internal__.legacy.layers``,
    which is where this falls back to. tf_keras's public (v2) API has no equivalent: its
    ``layers.BatchNormalization`` names its variables and collects its updates
    differently, so the graph would change."""
    import tensorflow as tf
    try:
        return tf.compat.v1.layers.batch_normalization
    except (AttributeError, ImportError):
        import_tf_keras('the "batchnorm" example model with Keras 3')
        from tf_keras.api._v1.keras.__internal__.legacy.layers import batch_normalization
        return batch_normalization


def import_tf_keras(what="a Keras example model"):
    """The tf_keras module, or an ImportError that says how to install it: tf-keras is
    installed with ``--no-deps`` (it depends on the ``tensorflow`` distribution, which
    would pull the full TensorFlow wheel next to tensorflow-cpu) and its version must
    match TensorFlow's."""
    try:
        import tf_keras
    except ModuleNotFoundError as e:
        if e.name != "tf_keras":
            raise
        import tensorflow as tf
        release = ".".join(tf.__version__.split(".")[:2])
        raise ImportError(
            f"building {what} needs tf_keras, which is not installed: pip install --no-deps "
            f"'tf-keras=={release}.*' (--no-deps: tf-keras depends on the 'tensorflow' "
            "distribution, which would install the full TensorFlow wheel next to "
            "tensorflow-cpu; its version must match TensorFlow's)", name="tf_keras") from e
    return tf_keras


_V1_RATES = {
    "sgd": 0.1, "momentum": 0.05, "nesterov": 0.05, "adam": 0.01, "adagrad": 0.1,
    "adagrad_da": 0.1, "adadelta": 1.0, "rmsprop": 0.01, "rmsprop_momentum": 0.01,
    "rmsprop_centered": 0.01, "ftrl": 0.1, "proximal_sgd": 0.1, "proximal_adagrad": 0.1}


def _v1_optimizer(name, global_step, learning_rate=None):
    import tensorflow as tf
    t = tf.compat.v1.train
    lr = _V1_RATES[name] if learning_rate is None else learning_rate
    reg = dict(l1_regularization_strength=0.001, l2_regularization_strength=0.001)
    return {
        "sgd": lambda: t.GradientDescentOptimizer(lr),
        "momentum": lambda: t.MomentumOptimizer(lr, 0.9),
        "nesterov": lambda: t.MomentumOptimizer(lr, 0.9, use_nesterov=True),
        "adam": lambda: t.AdamOptimizer(lr),
        "adagrad": lambda: t.AdagradOptimizer(lr),
        "adagrad_da": lambda: t.AdagradDAOptimizer(lr, global_step, **reg),
        "adadelta": lambda: t.AdadeltaOptimizer(lr),
        "rmsprop": lambda: t.RMSPropOptimizer(lr),
        "rmsprop_momentum": lambda: t.RMSPropOptimizer(lr, momentum=0.9),
        "rmsprop_centered": lambda: t.RMSPropOptimizer(lr, momentum=0.5, centered=True),
        "ftrl": lambda: t.FtrlOptimizer(lr, **reg),
        "proximal_sgd": lambda: t.ProximalGradientDescentOptimizer(lr, **reg),
        "proximal_adagrad": lambda: t.ProximalAdagradOptimizer(lr, **reg),
    }[name]()


_KERAS_RATES = {
    "keras_sgd": 0.1, "keras_sgd_momentum": 0.05, "keras_adam": 0.01, "keras_adagrad": 0.1,
    "keras_rmsprop": 0.01, "keras_adadelta": 1.0, "keras_adamax": 0.01, "keras_nadam": 0.01,
    "keras_ftrl": 0.1}


def _keras_optimizer(name, learning_rate=None):
    legacy = import_tf_keras().optimizers.legacy
    lr = _KERAS_RATES[name] if learning_rate is None else learning_rate
    return {
        "keras_sgd": lambda: legacy.SGD(lr),
        "keras_sgd_momentum": lambda: legacy.SGD(lr, momentum=0.9),
        "keras_adam": lambda: legacy.Adam(lr),
        "keras_adagrad": lambda: legacy.Adagrad(lr),
        "keras_rmsprop": lambda: legacy.RMSprop(lr),
        "keras_adadelta": lambda: legacy.Adadelta(lr),
        "keras_adamax": lambda: legacy.Adamax(lr),
        "keras_nadam": lambda: legacy.Nadam(lr),
        "keras_ftrl": lambda: legacy.Ftrl(lr, l1_regularization_strength=0.001,
                                          l2_regularization_strength=0.001),
    }[name]()


class _KerasBuilder:
    """tf_keras layers and a legacy OptimizerV2 in graph mode.

    The legacy optimizer's ``minimize`` wants a callable loss (or a GradientTape) and
    ``get_updates`` refuses None gradients, so gradients come from tf.gradients and go
    to ``apply_gradients``, which in graph mode also bumps ``iterations`` once per run.
    """

    def __init__(self, model, optimizer, seed, kw):
        self.model, self.optimizer_name, self.seed, self.kw = model, optimizer, seed, kw
        self.seeds = _seeds(seed)
        self.feeds, self.tensors = [], {}
        self.batch_size = None
        self.step_variable = None

    def build(self):
        import tensorflow as tf
        tf_keras = import_tf_keras()
        L = tf_keras.layers
        init = tf_keras.initializers

        def dense(units, name, activation=None):
            return L.Dense(units, activation=activation, name=name,
                           kernel_initializer=init.GlorotUniform(seed=next(self.seeds)),
                           bias_initializer=init.RandomUniform(-0.1, 0.1, seed=next(self.seeds)))

        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        if self.model == "keras":
            x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="x")
            # Input(tensor=...) wraps the placeholder itself; a Sequential called on a
            # plain tensor would add a second input placeholder of its own.
            inp = tf_keras.Input(tensor=x)
            out = dense(1, "output")(dense(HIDDEN, "hidden", "tanh")(inp))
            inputs, self.feeds = [inp], ["x:0", "y:0"]
        else:
            ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
            x = tf.compat.v1.placeholder(tf.float32, [None, EMBED_FEATURES], name="x")
            ids_in, x_in = tf_keras.Input(tensor=ids), tf_keras.Input(tensor=x)
            rows = L.Embedding(EMBED_ROWS, EMBED_DIM, name="embedding",
                               embeddings_initializer=init.RandomNormal(
                                   stddev=0.5, seed=next(self.seeds)))(ids_in)
            h = dense(HIDDEN, "hidden", "tanh")(L.Concatenate(axis=1)([rows, x_in]))
            out = dense(1, "output")(h)
            inputs, self.feeds = [ids_in, x_in], ["ids:0", "x:0", "y:0"]
        self.keras_model = tf_keras.Model(inputs, out, name="model")
        loss = tf.identity(tf.reduce_mean(tf.square(out - y)), name="loss")
        opt = _keras_optimizer(self.optimizer_name, self.kw.get("learning_rate"))
        params = self.keras_model.trainable_variables
        grads = tf.gradients(loss, params)
        update = opt.apply_gradients(list(zip(grads, params)))
        tf.group(update, name="train_op")
        self.opt = opt
        self.step_variable = opt.iterations
        variables = _unique(tf.compat.v1.global_variables() + self.extra_variables())
        _init_op(variables, [])

    def extra_variables(self):
        """Keras variables missing from the GLOBAL_VARIABLES collection, if any."""
        return list(self.keras_model.variables) + list(self.opt.variables())
