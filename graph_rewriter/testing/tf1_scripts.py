"""Single-device training graphs in the style of TF1 scripts that drive their data and
their steps themselves: TF1 queue input (tf.train.batch over input producers and
readers), TensorFlow's CIFAR-10 tutorial, a GAN with two train ops, TensorFlow's basic
word2vec tutorial, a script's counts of its batches, a sequence model's masked loss, a
Transformer block, dropout, losses summed over the batch, BatchNorm written five ways and
applied twice, a multi-task model whose two train ops share an encoder, Wide & Deep
models over SparseTensor features (by hand, and with tf.compat.v1.feature_column), a
speech model's CTC loss over SparseTensor transcripts, a BiLSTM tagger, MoCo's queue of keys,
a decoder trained with scheduled sampling, inputs augmented per row in a tf.map_fn, weight
normalization's data-dependent init, a prototypical network.
Written here from the scripts' public descriptions; used by tests/test_queue_inputs.py,
tests/test_two_train_ops.py, tests/test_multi_task.py, tests/test_word2vec.py, tests/test_batch_counts.py,
tests/test_normalizers.py, tests/test_random_draws.py, tests/test_loss_sums.py,
tests/test_sparse_inputs.py and tools/compare_outputs.py.
"""

import numpy as np

ROWS, FEATURES = 48, 3             # queue_regression's in-graph rows
IMAGE, CROP, CLASSES = 12, 8, 10   # the CIFAR-10 tutorial's 32, 24 and 10, scaled down


def _tf():
    import tensorflow as tf
    return tf, tf.compat.v1


def _dense(x, units, name, activation=None):
    """A TF1 script's dense layer: variables "<name>/kernel" (the default initializer) and
    "<name>/bias" (zeros), x @ kernel + bias, then ``activation``."""
    tf, tf1 = _tf()
    with tf1.variable_scope(name):
        w = tf1.get_variable("kernel", [int(x.shape[1]), units])
        b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
        y = tf.matmul(x, w) + b
        return activation(y) if activation else y


def queue_regression(batch, batcher="batch", shuffle_producer=False, smaller_final=False, num_epochs=None):
    """A linear regression trained by SGD (global step, Saver) on ROWS in-graph rows
    read through queues: slice_input_producer (in order unless ``shuffle_producer``;
    ``num_epochs``: then the queues close, and the step raises OutOfRangeError),
    then tf.train.batch (one thread: the order stays) or tf.train.shuffle_batch.
    Returns the MetaGraphDef, with its QueueRunners."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(0)
        xs = rng.randn(ROWS, FEATURES).astype(np.float32)
        ys = (xs @ np.array([[1.0], [2.0], [-1.0]], np.float32) + 0.1).astype(np.float32)
        x1, y1 = tf1.train.slice_input_producer([tf.constant(xs), tf.constant(ys)], shuffle=shuffle_producer,
                                                seed=1, num_epochs=num_epochs)
        if batcher == "shuffle_batch":
            x, y = tf1.train.shuffle_batch([x1, y1], batch_size=batch, capacity=32, min_after_dequeue=8, seed=2)
        else:
            x, y = tf1.train.batch([x1, y1], batch_size=batch, allow_smaller_final_batch=smaller_final)
        return _linear_regression(x, y)


def _linear_regression(x, y):
    """The model both scripts train on their batches (x, y), exported with its Saver."""
    tf, tf1 = _tf()
    w = tf1.get_variable("w", [FEATURES, 1], initializer=tf1.zeros_initializer(), use_resource=True)
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y), name="loss")
    step = tf1.train.get_or_create_global_step()
    tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
    tf1.global_variables_initializer()
    return tf1.train.Saver().export_meta_graph()


def tfrecord_regression(files, batch):
    """The classic TF1 file pipeline: string_input_producer over TFRecord files (in
    order), a TFRecordReader, parse_single_example, tf.train.batch; the model of
    ``queue_regression``."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        names = tf1.train.string_input_producer(files, shuffle=False)
        _, record = tf1.TFRecordReader().read(names)
        parsed = tf1.parse_single_example(record, {"x": tf1.FixedLenFeature([FEATURES], tf.float32),
                                                   "y": tf1.FixedLenFeature([1], tf.float32)})
        x, y = tf1.train.batch([parsed["x"], parsed["y"]], batch_size=batch)
        return _linear_regression(x, y)


def write_records(folder, files=2, per_file=16):
    """``files`` TFRecord files of ``per_file`` tf.train.Examples (x: FEATURES floats,
    y: their sum) in ``folder``; returns their paths, for tfrecord_regression."""
    tf = _tf()[0]
    rng = np.random.RandomState(5)
    paths = []
    for f in range(files):
        path = str(folder / f"part{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(per_file):
                x = rng.randn(FEATURES).astype(np.float32)
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[float(x.sum())]))}))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def write_cifar_files(folder, files=2, per_file=32):
    """CIFAR-10's binary format: records of one label byte and the image's bytes, depth
    major (3 x IMAGE x IMAGE)."""
    rng = np.random.RandomState(9)
    paths = []
    for f in range(files):
        labels = rng.randint(0, CLASSES, size=(per_file, 1)).astype(np.uint8)
        images = rng.randint(0, 256, size=(per_file, 3 * IMAGE * IMAGE)).astype(np.uint8)
        path = str(folder / f"data_batch_{f + 1}.bin")
        with open(path, "wb") as out:
            out.write(np.concatenate([labels, images], axis=1).tobytes())
        paths.append(path)
    return paths


def cifar10_tutorial(files, batch, distort=False):
    """TensorFlow's CIFAR-10 tutorial (cifar10_input.py, cifar10.py and cifar10_train.py,
    from their public description), scaled down: a FixedLengthRecordReader over the
    binary files, decode_raw, the image transposed to height x width x depth, cropped
    (``distort``: a random crop and flip, random brightness and contrast, then
    shuffle_batch; else the centre and tf.train.batch with one thread, so the order is
    the files'), per_image_standardization; conv, max pool, LRN, conv, LRN, max pool,
    two locally connected layers with L2 weight decay added to the "losses" collection,
    a linear softmax layer; the total loss is the sum of that collection; an
    ExponentialMovingAverage of the losses runs before the gradients, the learning rate
    decays exponentially with global_step, and after the update an
    ExponentialMovingAverage of every trainable variable (the train op)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(11)
        names = tf1.train.string_input_producer(files, shuffle=distort, seed=3)
        reader = tf1.FixedLengthRecordReader(record_bytes=1 + 3 * IMAGE * IMAGE)
        _, value = reader.read(names)
        record = tf1.decode_raw(value, tf.uint8)
        label = tf.cast(tf.strided_slice(record, [0], [1]), tf.int32)
        depth_major = tf.reshape(tf.strided_slice(record, [1], [1 + 3 * IMAGE * IMAGE]), [3, IMAGE, IMAGE])
        image = tf.cast(tf.transpose(depth_major, [1, 2, 0]), tf.float32)
        if distort:
            image = tf1.random_crop(image, [CROP, CROP, 3], seed=4)
            image = tf.image.random_flip_left_right(image, seed=5)
            image = tf.image.random_brightness(image, max_delta=63, seed=6)
            image = tf.image.random_contrast(image, lower=0.2, upper=1.8, seed=7)
        else:
            image = tf.image.resize_with_crop_or_pad(image, CROP, CROP)
        image = tf.image.per_image_standardization(image)
        image.set_shape([CROP, CROP, 3])
        label.set_shape([1])
        if distort:
            images, labels = tf1.train.shuffle_batch([image, label], batch_size=batch, num_threads=2,
                                                     capacity=40 + 3 * batch, min_after_dequeue=40, seed=8)
        else:
            images, labels = tf1.train.batch([image, label], batch_size=batch, num_threads=1)
        labels = tf.reshape(labels, [batch])

        def weight(name, shape, stddev, wd):
            var = tf1.get_variable(name, shape, initializer=tf1.truncated_normal_initializer(stddev=stddev))
            if wd:
                tf1.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(var), wd, name="weight_loss"))
            return var

        def bias(name, size, value):
            return tf1.get_variable(name, [size], initializer=tf1.constant_initializer(value))

        with tf1.variable_scope("conv1"):
            h = tf.nn.relu(tf.nn.conv2d(images, weight("weights", [5, 5, 3, 8], 5e-2, 0.0), [1, 1, 1, 1], "SAME")
                           + bias("biases", 8, 0.0))
        h = tf.nn.max_pool2d(h, 3, 2, "SAME", name="pool1")
        h = tf.nn.lrn(h, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm1")
        with tf1.variable_scope("conv2"):
            h = tf.nn.relu(tf.nn.conv2d(h, weight("weights", [5, 5, 8, 8], 5e-2, 0.0), [1, 1, 1, 1], "SAME")
                           + bias("biases", 8, 0.1))
        h = tf.nn.lrn(h, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm2")
        h = tf.nn.max_pool2d(h, 3, 2, "SAME", name="pool2")
        h = tf.reshape(h, [batch, -1])
        for scope, units in (("local3", 32), ("local4", 16)):
            with tf1.variable_scope(scope):
                w = weight("weights", [int(h.shape[1]), units], 0.04, 0.004)
                h = tf.nn.relu(tf.matmul(h, w) + bias("biases", units, 0.1))
        with tf1.variable_scope("softmax_linear"):
            logits = tf.matmul(h, weight("weights", [16, CLASSES], 1 / 16.0, 0.0)) + bias("biases", CLASSES, 0.0)
        xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="cross_entropy")
        tf1.add_to_collection("losses", xent)
        total = tf.add_n(tf1.get_collection("losses"), name="total_loss")
        loss = tf.identity(total, name="loss")
        step = tf1.train.get_or_create_global_step()
        loss_averages = tf1.train.ExponentialMovingAverage(0.9, name="avg")
        loss_averages_op = loss_averages.apply(tf1.get_collection("losses") + [total])
        lr = tf1.train.exponential_decay(0.1, step, 3, 0.5, staircase=True)
        with tf.control_dependencies([loss_averages_op]):
            opt = tf1.train.GradientDescentOptimizer(lr)
            grads = opt.compute_gradients(total)
        apply_op = opt.apply_gradients(grads, global_step=step)
        averages = tf1.train.ExponentialMovingAverage(0.9999, step)
        with tf.control_dependencies([apply_op]):
            averages_op = averages.apply(tf1.trainable_variables())
        tf.group(averages_op, name="train_op")
        tf1.global_variables_initializer()
        return tf1.train.Saver().export_meta_graph()


def gan():
    """G: z [., 2] -> dense 8 relu -> dense 4; D: x [., 4] -> dense 8 relu -> dense 1;
    D's loss on real and generated rows, G's on generated ones; an Adam each
    ("d_train", then "g_train", which also bumps global_step)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        real = tf1.placeholder(tf.float32, [None, 4], name="real")
        z = tf1.placeholder(tf.float32, [None, 2], name="z")

        def generator(v):
            with tf1.variable_scope("G", reuse=tf1.AUTO_REUSE):
                return _dense(_dense(v, 8, "h", tf.nn.relu), 4, "out")

        def discriminator(v):
            with tf1.variable_scope("D", reuse=tf1.AUTO_REUSE):
                return _dense(_dense(v, 8, "h", tf.nn.relu), 1, "out")

        on_real, on_fake = discriminator(real), discriminator(generator(z))
        xent = tf.nn.sigmoid_cross_entropy_with_logits
        d_loss = tf.identity(tf.reduce_mean(xent(labels=tf.ones_like(on_real), logits=on_real))
                             + tf.reduce_mean(xent(labels=tf.zeros_like(on_fake), logits=on_fake)), name="d_loss")
        g_loss = tf.identity(tf.reduce_mean(xent(labels=tf.ones_like(on_fake), logits=on_fake)), name="g_loss")
        d_vars = [v for v in tf1.trainable_variables() if v.name.startswith("D/")]
        g_vars = [v for v in tf1.trainable_variables() if v.name.startswith("G/")]
        step = tf1.train.get_or_create_global_step()
        tf1.train.AdamOptimizer(0.01, name="d_adam").minimize(d_loss, var_list=d_vars, name="d_train")
        tf1.train.AdamOptimizer(0.01, name="g_adam").minimize(g_loss, var_list=g_vars, global_step=step,
                                                             name="g_train")
        tf1.global_variables_initializer()
        names = [v.op.name for v in tf1.global_variables()]
    return g.as_graph_def(), names


WORD2VEC_VOCAB, WORD2VEC_DIM, WORD2VEC_SAMPLED = 60, 8, 6   # the tutorial's 50000, 128, 64


def word2vec(batch):
    """TensorFlow's basic word2vec tutorial (word2vec_basic.py), from its public
    description, scaled down: skip-gram pairs fed in batches of a static size
    (``x`` [batch] int32 centre words, ``y`` [batch, 1] int64 context words), an
    embedding lookup, tf.nn.nce_loss (its weights and biases gathered by the same ids:
    the labels and the sampled candidates), SGD with learning rate 1.0, global_step,
    the cosine similarity of a few validation words to the whole vocabulary (a fetch of
    its own), a loss summary and a Saver. Returns (GraphDef, variable names)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        x = tf1.placeholder(tf.int32, [batch], name="x")
        y = tf1.placeholder(tf.int64, [batch, 1], name="y")
        valid = tf.constant([1, 3, 7], tf.int32, name="valid_words")
        embeddings = tf1.get_variable("embeddings", [WORD2VEC_VOCAB, WORD2VEC_DIM],
                                      initializer=tf1.random_uniform_initializer(-1.0, 1.0))
        embed = tf.nn.embedding_lookup(embeddings, x)
        nce_weights = tf1.get_variable("nce_weights", [WORD2VEC_VOCAB, WORD2VEC_DIM],
                                       initializer=tf1.truncated_normal_initializer(stddev=WORD2VEC_DIM ** -0.5))
        nce_biases = tf1.get_variable("nce_biases", [WORD2VEC_VOCAB], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.nn.nce_loss(weights=nce_weights, biases=nce_biases, labels=y, inputs=embed,
                                             num_sampled=WORD2VEC_SAMPLED, num_classes=WORD2VEC_VOCAB),
                              name="loss")
        tf1.summary.scalar("loss", loss)
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(1.0).minimize(loss, global_step=step, name="train_op")
        norm = tf.sqrt(tf.reduce_sum(tf.square(embeddings), 1, keepdims=True))
        normalized = embeddings / norm
        tf.matmul(tf.nn.embedding_lookup(normalized, valid), normalized, transpose_b=True, name="similarity")
        tf1.summary.merge_all(name="summaries")
        tf1.global_variables_initializer()
        tf1.train.Saver()
        names = [v.op.name for v in tf1.global_variables()]
    return g.as_graph_def(), names


def word2vec_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` skip-gram pairs drawn from a small random corpus."""
    rng = np.random.RandomState(seed)
    corpus = rng.zipf(1.5, size=4000) % WORD2VEC_VOCAB
    out = []
    for _ in range(steps):
        at = rng.randint(1, len(corpus) - 1, size=batch)
        context = at + rng.choice([-1, 1], size=batch)
        out.append({"x:0": corpus[at].astype(np.int32), "y:0": corpus[context].astype(np.int64)[:, None]})
    return out


def counts_script():
    """Counts a TF1 training script keeps of its batches: the examples seen (assign_add
    of tf.shape(x)[0], int32), the correct predictions (int64), a running sum of the mean
    loss, and tf.compat.v1.metrics.accuracy (its running total and count, local
    variables: run "init_1" too); a softmax classifier on x [None, 3], y [None] (4
    classes) trained by SGD. Returns the GraphDef."""
    tf, tf1 = _tf()
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        w = tf1.get_variable("w", [3, 4])
        logits = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        predictions = tf.argmax(logits, 1)

        def counter(name, dtype):
            return tf1.get_variable(name, [], dtype, initializer=tf1.zeros_initializer(), trainable=False)

        seen = counter("examples_seen", tf.int32).assign_add(tf.shape(x)[0])
        correct = counter("correct_seen", tf.int64).assign_add(
            tf.reduce_sum(tf.cast(tf.equal(predictions, y), tf.int64)))
        loss_sum = counter("loss_sum", tf.float32).assign_add(loss)
        accuracy, accuracy_update = tf1.metrics.accuracy(y, predictions, name="accuracy")
        tf.identity(accuracy, name="accuracy_value")
        step = tf1.train.get_or_create_global_step()
        minimize = tf1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
        tf.group(minimize, seen, correct, loss_sum, accuracy_update, name="train_op")
        tf1.global_variables_initializer()
        tf1.local_variables_initializer()
    return graph.as_graph_def()


# stored_totals_classifier's totals: sums over the batch's rows in forms other than
# tf.reduce_sum, each stored by an assign_add of a non-trainable variable
STORED_TOTALS = ("matmul", "segment_sum", "bincount", "confusion_matrix", "mean_iou")


def stored_totals_classifier(total):
    """A softmax classifier on x [None, 4], y [None] (int32, 3 classes), trained by SGD,
    whose step also adds a sum over the batch's rows to a non-trainable variable
    ``total`` (or, for "mean_iou", tf.compat.v1.metrics.mean_iou's running
    confusion matrix, a local variable): "matmul", the features summed per predicted
    class, ``tf.matmul(x, one_hot(pred), transpose_a=True)`` (VQ-VAE's codebook sums);
    "segment_sum", the same by ``tf.math.unsorted_segment_sum(x, pred, 3)``, transposed;
    "bincount", the labels' counts by ``tf.math.bincount`` of a fixed size;
    "confusion_matrix", ``tf.math.confusion_matrix(y, pred, 3)`` (a ScatterNd of ones);
    "mean_outer", no total: the outer product of the batch's mean features with itself
    (``matmul(m, m, transpose_a=True)``, m [1, 4]), a statistic over the rows;
    "broadcast_mean", no total: a moving mean by hand, ``total.assign(0.9 * total + 0.1
    * tf.reduce_mean(x, 0))``, the [4] mean broadcast into a [1, 4] variable. Run "init" (it initialises the local variables too). Returns the GraphDef."""
    tf, tf1 = _tf()
    classes = 3
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        w = tf1.get_variable("w", [4, classes], initializer=tf1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(x, w)
        pred = tf.argmax(logits, 1, output_type=tf.int32)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        shape = {"bincount": [classes], "confusion_matrix": [classes, classes], "mean_outer": [4, 4],
                 "broadcast_mean": [1, 4]}.get(total, [4, classes])
        mean = tf.reduce_mean(x, 0, keepdims=True)
        if total == "mean_iou":
            _, update = tf1.metrics.mean_iou(y, pred, classes)
        elif total == "broadcast_mean":
            state = tf1.get_variable("total", shape, initializer=tf1.zeros_initializer(), trainable=False)
            update = state.assign(0.9 * state + 0.1 * tf.reduce_mean(x, 0))
        else:
            value = {
                "matmul": lambda: tf.matmul(x, tf.one_hot(pred, classes), transpose_a=True),
                "segment_sum": lambda: tf.transpose(tf.math.unsorted_segment_sum(x, pred, classes)),
                "bincount": lambda: tf.math.bincount(y, minlength=classes, maxlength=classes),
                "confusion_matrix": lambda: tf.math.confusion_matrix(y, pred, classes),
                "mean_outer": lambda: tf.matmul(mean, mean, transpose_a=True),
            }[total]()
            update = tf1.get_variable("total", shape, initializer=tf1.zeros_initializer(), trainable=False).assign_add(
                tf.cast(value, tf.float32))
        minimize = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf.group(minimize, update, name="train_op")
        tf1.variables_initializer(tf1.global_variables() + tf1.local_variables(), name="init")
    return graph.as_graph_def()


def labelled_batches(steps, batch, features=4, classes=3, seed=0, labels="y:0"):
    """``steps`` feeds of ``batch`` rows: x [batch, features] float32, ``labels`` [batch]
    int32 below ``classes`` (stored_totals_classifier, center_loss_batches)."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, features).astype(np.float32),
             labels: rng.randint(0, classes, batch).astype(np.int32)} for _ in range(steps)]


def feature_batches(steps, batch, features, seed=0):
    """``steps`` feeds of ``batch`` rows x [batch, features] float32 alone."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, features).astype(np.float32)} for _ in range(steps)]


def vq_vae_ema(zero_debias=True):
    """A VQ-VAE whose codebook learns by exponential moving averages, as sonnet v1's
    VectorQuantizerEMA (van den Oord et al., 2017, appendix A.1) computes it: an encoder
    x [None, 6] -> z [rows, 4], each row's nearest of 6 codes, the straight-through
    quantised z decoded back, loss = reconstruction MSE + 0.25 x commitment. The step
    moves ``vq/ema_cluster_size`` towards the codes' counts in the batch
    (``reduce_sum(one_hot(code), 0)``) and ``vq/ema_dw`` towards the rows summed per code
    (``matmul(z, one_hot(code), transpose_a=True)``) by assign_moving_average
    (``zero_debias`` as sonnet passes it, TF1's default), then assigns the codebook
    their Laplace-smoothed ratio before the loss is computed. Adam on the encoder and
    decoder. Returns the GraphDef."""
    tf, tf1 = _tf()
    from tensorflow.python.training import moving_averages
    dim, codes, decay, eps = 4, 6, 0.9, 1e-5
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        encoder = tf1.get_variable("enc", [6, dim], initializer=tf1.glorot_uniform_initializer(seed=2))
        decoder = tf1.get_variable("dec", [dim, 6], initializer=tf1.glorot_uniform_initializer(seed=3))
        z = tf.matmul(x, encoder)
        with tf1.variable_scope("vq"):
            codebook = tf1.get_variable("embedding", [dim, codes], initializer=tf1.random_normal_initializer(seed=4),
                                        trainable=False)
            cluster_size = tf1.get_variable("ema_cluster_size", [codes], initializer=tf1.zeros_initializer(),
                                            trainable=False)
            dw = tf1.get_variable("ema_dw", [dim, codes], initializer=tf1.random_normal_initializer(seed=4),
                                  trainable=False)
        distances = (tf.reduce_sum(z ** 2, 1, keepdims=True) - 2 * tf.matmul(z, codebook)
                     + tf.reduce_sum(codebook ** 2, 0, keepdims=True))
        code = tf.argmax(-distances, 1)
        encodings = tf.one_hot(code, codes)
        quantized = tf.nn.embedding_lookup(tf.transpose(codebook), code)
        commitment = tf.reduce_mean((tf.stop_gradient(quantized) - z) ** 2)
        new_size = moving_averages.assign_moving_average(
            cluster_size, tf.reduce_sum(encodings, 0), decay, zero_debias=zero_debias)
        new_dw = moving_averages.assign_moving_average(
            dw, tf.matmul(z, encodings, transpose_a=True), decay, zero_debias=zero_debias)
        n = tf.reduce_sum(new_size)
        smoothed = (new_size + eps) / (n + codes * eps) * n
        with tf.control_dependencies([commitment]):
            with tf.control_dependencies([codebook.assign(new_dw / tf.reshape(smoothed, [1, -1]))]):
                vq_loss = 0.25 * commitment
        decoded = tf.matmul(z + tf.stop_gradient(quantized - z), decoder)
        loss = tf.identity(tf.reduce_mean(tf.square(decoded - x)) + vq_loss, name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return graph.as_graph_def()


def vq_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` rows x [batch, 6] for vq_vae_ema."""
    return feature_batches(steps, batch, 6, seed)


DANN_BATCH = 8


def dann(flip="override", control_flow="v2", slicing="slice", evaluation="rows"):
    """Domain-adversarial training (Ganin et al., 2016) as pumpikano/tf-dann's MNIST model
    writes it: one batch x [None, 4] whose first DANN_BATCH // 2 rows are source and
    the rest target examples, labels y [None, 3] (one-hot) and domains [None, 2]; a
    feature layer, a label predictor on the source rows only, taken behind
    ``tf.cond(train, lambda: tf.slice(feature, [0, 0], [DANN_BATCH // 2, -1]), lambda:
    feature)`` (``slicing`` "strided": ``feature[:DANN_BATCH // 2]``; "whole": every row,
    no label loss on the source rows alone: a control; "flatten": every row, reshaped as
    Keras' Flatten does, ``tf.reshape(t, [tf.shape(t)[0], -1])``) with ``train`` a
    placeholder_with_default(True), and a domain classifier on every row through a
    gradient reversal layer (``flip`` "override": ``gradient_override_map`` of an
    Identity, as the repository does; "custom": ``tf.custom_gradient``). loss = label
    loss + domain loss; Momentum. ``control_flow`` "v1" or "v2" builds the conds so
    (TF1's Switch and Merge, or an If). ``evaluation`` "rows": the other branch gives
    every row as it is; "normalised": their features l2-normalised (an op of that branch
    reading what the slice reads: lowered, one Switch for both). Returns the GraphDef
    (init, train_op, loss:0; dann_batches)."""
    tf, tf1 = _tf()
    from graph_rewriter.testing.models import ControlFlow
    half = DANN_BATCH // 2
    graph = tf.Graph()
    gradient_name = f"DannFlip{flip}"

    def reversed_gradient(x):
        if flip == "custom":
            @tf.custom_gradient
            def reverse(v):
                return tf.identity(v), lambda dy: -0.5 * dy
            return reverse(x)
        with graph.gradient_override_map({"Identity": gradient_name}):
            return tf.identity(x)

    if flip == "override":
        try:
            tf.RegisterGradient(gradient_name)(lambda op, grad: [-0.5 * grad])
        except KeyError:
            pass   # (registered by an earlier build in this process)
    with graph.as_default(), ControlFlow(control_flow):
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 3], name="y")
        domain = tf1.placeholder(tf.float32, [None, 2], name="domain")
        train = tf1.placeholder_with_default(True, [], name="train")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        feature = tf.nn.relu(tf.matmul(x, w1))

        def source(t):
            if slicing == "flatten":
                return tf.reshape(t, [tf.shape(t)[0], -1])
            if slicing == "whole":
                return tf.identity(t)
            return tf.slice(t, [0, 0], [half, -1]) if slicing == "slice" else t[:half]

        every = (lambda: feature) if evaluation == "rows" else (lambda: tf.math.l2_normalize(feature, 1))
        features = tf.cond(train, lambda: source(feature), every)
        labels = tf.cond(train, lambda: source(y), lambda: y)
        wl = tf1.get_variable("wl", [16, 3], initializer=tf1.glorot_uniform_initializer(seed=3))
        label_loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(features, wl)))
        wd = tf1.get_variable("wd", [16, 2], initializer=tf1.glorot_uniform_initializer(seed=4))
        domain_loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
            labels=domain, logits=tf.matmul(reversed_gradient(feature), wd)))
        loss = tf.identity(label_loss + domain_loss, name="loss")
        tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return graph.as_graph_def()


def dann_batches(steps, seed=0):
    """``steps`` feeds for dann: DANN_BATCH rows, source then target (shifted by 1)."""
    rng = np.random.RandomState(seed)
    half = DANN_BATCH // 2
    domains = np.vstack([np.tile([1.0, 0.0], [half, 1]), np.tile([0.0, 1.0], [half, 1])]).astype(np.float32)
    return [{"x:0": np.vstack([rng.randn(half, 4), rng.randn(half, 4) + 1]).astype(np.float32),
             "y:0": np.eye(3)[rng.randint(0, 3, DANN_BATCH)].astype(np.float32), "domain:0": domains}
            for _ in range(steps)]


SEQ_STEPS, SEQ_VOCAB = 5, 7


def _padded_sequences(steps):
    """The feeds of a sequence model's padded batches, in the default graph: token ids
    x and targets y [None, steps] (int32), and each sequence's length [None]."""
    tf, tf1 = _tf()
    return (tf1.placeholder(tf.int32, [None, steps], name="x"), tf1.placeholder(tf.int32, [None, steps], name="y"),
            tf1.placeholder(tf.int32, [None], name="lengths"))


def masked_sequence_model(loss="masked"):
    """A sequence model's loss over padded batches: x, y [None, SEQ_STEPS] int32 token
    ids, lengths [None] int32; an embedding, a dense layer to the vocabulary at every step,
    sparse softmax cross-entropy; the padding masked out by tf.sequence_mask(lengths).
    ``loss``: "masked", reduce_sum(xent * mask) / reduce_sum(mask) (the tokens' mean);
    "losses", tf.compat.v1.losses.sparse_softmax_cross_entropy(weights=mask) (divides by
    the count of non-zero weights); "clamped", the sum divided by
    tf.maximum(reduce_sum(mask), 1.0); "shifted", by reduce_sum(mask) + 1e-5 (BERT's masked
    LM); "per_sequence", each sequence's mean over its own
    tokens, then the mean over the batch (nothing to synchronise); "time_major", the same
    computed on [steps, batch] tensors (a sum over axis 0, the time axis); "example_weights",
    the first step's prediction only, tf.compat.v1.losses with per-example weights [batch]
    that are zero for sequences of one token (divides by the count of non-zero weights).
    SGD, global_step. Returns the GraphDef."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(4)
        x, y, lengths = _padded_sequences(SEQ_STEPS)
        embedding = tf1.get_variable("embedding", [SEQ_VOCAB, 4])
        w = tf1.get_variable("softmax/kernel", [4, SEQ_VOCAB])
        h = tf.nn.embedding_lookup(embedding, x)
        logits = tf.reshape(tf.matmul(tf.reshape(h, [-1, 4]), w), [-1, SEQ_STEPS, SEQ_VOCAB])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        mask = tf.sequence_mask(lengths, SEQ_STEPS, dtype=tf.float32)
        if loss == "masked":
            value = tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)
        elif loss == "losses":
            value = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=mask)
        elif loss == "clamped":
            value = tf.reduce_sum(xent * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
        elif loss == "shifted":
            value = tf.reduce_sum(xent * mask) / (tf.reduce_sum(mask) + 1e-5)
        elif loss == "time_major":
            value = tf.reduce_mean(tf.reduce_sum(tf.transpose(xent * mask), 0) / tf.reduce_sum(tf.transpose(mask), 0))
        elif loss == "example_weights":
            weights = tf.cast(tf.greater(lengths, 1), tf.float32)
            value = tf1.losses.sparse_softmax_cross_entropy(y[:, 0], logits[:, 0, :], weights=weights)
        else:
            value = tf.reduce_mean(tf.reduce_sum(xent * mask, axis=1) / tf.cast(lengths, tf.float32))
        tf.identity(value, name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.5).minimize(value, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def masked_sequence_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` padded sequences: the first half long (every step a
    token), the second short (one or two), so two halves count very different tokens."""
    rng = np.random.RandomState(seed)
    lengths = np.array([SEQ_STEPS] * (batch // 2) + [1 + k % 2 for k in range(batch - batch // 2)], np.int32)
    return [{"x:0": rng.randint(0, SEQ_VOCAB, (batch, SEQ_STEPS)).astype(np.int32),
             "y:0": rng.randint(0, SEQ_VOCAB, (batch, SEQ_STEPS)).astype(np.int32),
             "lengths:0": lengths} for _ in range(steps)]


def transformer_block(steps=6, vocab=11, width=8, dropout=0.0):
    """A Transformer encoder block as tensor2tensor-style TF1 scripts write it, from its
    public description, scaled down: x, y [None, steps] token ids and lengths [None];
    embeddings scaled by sqrt(width), one masked self-attention layer (padding keys at
    -1e9) with a residual and layer norm, the output projection tied to the embedding,
    with ``dropout`` > 0 dropout at that rate on the embeddings (one mask per sequence,
    broadcast over its positions: noise_shape [batch, 1, width]), the attention
    probabilities and the attention's output (seeded by the graph's seed),
    tf.compat.v1.losses.softmax_cross_entropy with label smoothing 0.1 and the padding
    mask as weights, the inverse-square-root learning rate with warm-up from global_step,
    clip_by_global_norm(1.0) and Adam(0.9, 0.98, 1e-9). Returns (GraphDef, variable names)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        x, y, lengths = _padded_sequences(steps)
        embedding = tf1.get_variable("embedding", [vocab, width])
        h = tf.nn.embedding_lookup(embedding, x) * (width ** 0.5)
        if dropout:
            h = tf.nn.dropout(h, rate=dropout, noise_shape=[tf.shape(h)[0], 1, width])
        flat = tf.reshape(h, [-1, width])

        def project(name):
            return tf.reshape(tf.matmul(flat, tf1.get_variable(name, [width, width])), [-1, steps, width])

        mask = tf.sequence_mask(lengths, steps, dtype=tf.float32)
        scores = (tf.matmul(project("attention/q"), project("attention/k"), transpose_b=True) / (width ** 0.5)
                  + (1.0 - mask[:, None, :]) * -1e9)
        probs = tf.nn.softmax(scores)
        if dropout:
            probs = tf.nn.dropout(probs, rate=dropout)
        attention = tf.matmul(probs, project("attention/v"))
        if dropout:
            attention = tf.nn.dropout(attention, rate=dropout)
        attended = attention + h
        mean, variance = tf.nn.moments(attended, [-1], keepdims=True)
        gamma = tf1.get_variable("layer_norm/gamma", [width], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("layer_norm/beta", [width], initializer=tf1.zeros_initializer())
        normed = (attended - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta
        logits = tf.reshape(tf.matmul(tf.reshape(normed, [-1, width]), embedding, transpose_b=True),
                            [-1, steps, vocab])
        loss = tf1.losses.softmax_cross_entropy(tf.one_hot(y, vocab), logits, weights=mask, label_smoothing=0.1)
        tf.identity(loss, name="loss")
        step = tf1.train.get_or_create_global_step()
        s = tf.cast(step, tf.float32) + 1.0
        rate = (width ** -0.5) * tf.minimum(tf.math.rsqrt(s), s * 4.0 ** -1.5)
        optimizer = tf1.train.AdamOptimizer(rate, beta1=0.9, beta2=0.98, epsilon=1e-9)
        grads, variables = zip(*optimizer.compute_gradients(loss))
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        optimizer.apply_gradients(zip(grads, variables), global_step=step, name="train_op")
        tf1.global_variables_initializer()
        names = [v.op.name for v in tf1.global_variables()]
    return g.as_graph_def(), names


def dropout_mlp(kind="dropout", batch=None, control_flow=None):
    """x [batch, 4] (None: dynamic) -> dense 16 relu -> a random op per ``kind`` -> dense 1,
    squared error, SGD 0.1 with a global step; graph seed 1 unless said otherwise. Kinds:
    "dropout" (tf.nn.dropout, rate 0.5), "keep_prob" (tf.compat.v1.nn.dropout), "per_row"
    (noise_shape [rows, 1]: one mask value per row), "noise" (Gaussian noise of the
    activations' shape), "stateless" (a stateless uniform of the activations' shape with a
    fixed seed), "unseeded" (tf.nn.dropout with no graph seed), "per_unit" (noise [16]
    shared by the rows: not a draw per row), "beta_per_row" (each row scaled by a Beta
    sample, ``tf.compat.v1.distributions.Beta(2, 2).sample(tf.shape(h)[0])``: two
    RandomGamma draws whose shape packs the product of the sample shape), "normal_sample"
    (``tf.compat.v1.distributions.Normal(loc=h, scale=...).sample()``, a VAE's
    reparameterisation: a draw of [1, rows, 16]; "normal_learned_scale": its scale a
    learned [16] vector, the batch shape a broadcast of [rows, 16] and [16]), "in_loop" (dropout in a tf.while_loop body),
    "cond" (dropout when a ``training`` flag, default True, says so: tf.cond, as
    tf.layers.dropout(training=flag) builds it), "cond_in_loop" (that cond, v2, in a v1
    while loop's body). ``control_flow`` "v1" or "v2" builds
    tf.cond and tf.while_loop with that control flow (default: TensorFlow's current).
    Returns the GraphDef (variables w1, w2, global_step; fetch loss:0, run train_op, init)."""
    from graph_rewriter.testing.models import ControlFlow
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        if kind != "unseeded":
            tf1.set_random_seed(1)
        x, y, w1, w2 = _mlp_inputs(batch)
        h = tf.nn.relu(tf.matmul(x, w1))
        if kind in ("dropout", "unseeded"):
            h = tf.nn.dropout(h, rate=0.5)
        elif kind == "keep_prob":
            h = tf1.nn.dropout(h, keep_prob=0.5)
        elif kind == "per_row":
            h = tf.nn.dropout(h, rate=0.5, noise_shape=[tf.shape(h)[0], 1])
        elif kind == "noise":
            h = h + tf1.random_normal(tf.shape(h), stddev=0.5)
        elif kind == "stateless":
            h = h * tf.cast(tf.random.stateless_uniform(tf.shape(h), seed=[3, 4]) > 0.5, tf.float32) * 2.0
        elif kind == "per_unit":
            h = h * (1.0 + tf1.random_normal([16], stddev=0.5))
        elif kind == "beta_per_row":   # a distribution sampled once per row (mixup's per-example lam)
            h = h * tf.reshape(tf1.distributions.Beta(2.0, 2.0).sample(tf.shape(h)[0], seed=4), [-1, 1])
        elif kind == "normal_sample":   # a VAE's reparameterisation by tf.distributions: loc and scale per row
            h = tf1.distributions.Normal(loc=h, scale=0.5 * tf.sigmoid(h)).sample(seed=4)
        elif kind == "normal_learned_scale":   # its scale a learned vector, broadcast over the rows
            scale = tf1.get_variable("scale", [16], initializer=tf1.constant_initializer(-1.0))
            h = tf1.distributions.Normal(loc=h, scale=tf.nn.softplus(scale)).sample(seed=4)
        elif kind == "cond":
            training = tf1.placeholder_with_default(True, [], name="training")
            h = tf1.cond(training, lambda: tf.nn.dropout(h, rate=0.5), lambda: h)
        elif kind == "cond_in_loop":   # a v1 loop whose body holds a v2 cond
            training = tf1.placeholder_with_default(True, [], name="training")

            def body(i, a):
                with ControlFlow("v2"):
                    a = tf1.cond(training, lambda: tf.nn.dropout(a, rate=0.25), lambda: a)
                return i + 1, a
            with ControlFlow("v1"):
                _, h = tf1.while_loop(lambda i, a: i < 2, body, [tf.constant(0), h])
        elif kind == "in_loop":
            _, h = tf1.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.nn.dropout(a, rate=0.25)),
                                  [tf.constant(0), h])
        elif kind != "none":
            raise ValueError(f"dropout_mlp: unknown kind {kind!r}")
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _mlp_inputs(batch):
    """The placeholders x [batch, 4] and y [batch, 1] and the weights w1 [4, 16] and
    w2 [16, 1] (seeds 2 and 3) of dropout_mlp and summed_loss_mlp."""
    tf, tf1 = _tf()
    x = tf1.placeholder(tf.float32, [batch, 4], name="x")
    y = tf1.placeholder(tf.float32, [batch, 1], name="y")
    return (x, y) + _mlp_weights(tf1)


def _mlp_weights(tf1, outputs=1):
    """The MLPs' weights w1 [4, 16] and w2 [16, ``outputs``] (Glorot, seeds 2 and 3)."""
    return (tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2)),
            tf1.get_variable("w2", [16, outputs], initializer=tf1.glorot_uniform_initializer(seed=3)))


def dropout_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` rows for dropout_mlp, summed_loss_mlp and
    warm_started_mlp."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, 4).astype(np.float32), "y:0": rng.randn(batch, 1).astype(np.float32)}
            for _ in range(steps)]


# summed_loss_mlp's kinds: the losses a sum over the batch's rows makes undivided (the
# analysis lists their sum), and the ones that divide it by a count of the rows
SUMMED_LOSSES = ("sum", "l2_loss", "losses_sum", "xent_sum", "sum_over_batch", "sum_plus_decay",
                 "loss_scaled", "learned_weight", "counted", "sum_of_row_sums")
MEAN_LOSSES = ("mean", "sum_over_rows", "mean_of_row_sums", "keras_mse", "losses_default", "mean_features")


def summed_loss_mlp(kind="sum", batch=None, optimizer="sgd"):
    """x [batch, 4] (None: dynamic) -> dense 16 relu -> dense 1, trained by SGD 0.01 (or
    "momentum", or "adam" by hand: assign ops on m, v and the weights) on a loss per
    ``kind``. Summed over the rows: "sum" (tf.reduce_sum of squared errors), "l2_loss"
    (tf.nn.l2_loss of the errors), "losses_sum" (tf.compat.v1.losses.mean_squared_error
    with reduction SUM), "xent_sum" (-reduce_sum(labels * log(p)), the early MNIST
    tutorial's cross entropy), "sum_over_batch" (a sum divided by the static batch
    ``batch``, a mean; with a dynamic batch by 16.0, a constant that is no count of the
    rows: a sum), "sum_plus_decay" (a sum plus 1e-2 x the
    weights' l2_loss), "loss_scaled" (the sum times a loss scale of 128, the gradients
    divided by it), "learned_weight" (exp(-c) x sum + c, c a trainable weight, read once),
    "counted" (the sum, also added up in a non-trainable ``loss_total``),
    "sum_of_row_sums" (a sum over the rows of each row's sum over its columns). A mean: "mean"
    (tf.reduce_mean), "sum_over_rows" (divided by tf.shape(x)[0]), "mean_of_row_sums",
    "keras_mse" (tf.keras' MeanSquaredError), "losses_default"
    (tf.compat.v1.losses.mean_squared_error), "mean_features" (a mean loss plus the squared
    distance to 0.5 of the prediction from the batch's mean hidden units, summed: a sum,
    but not over the rows). Returns the GraphDef (variables w1, w2,
    global_step; fetch loss:0, run train_op, init)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, y, w1, w2 = _mlp_inputs(batch)
        hidden = tf.nn.relu(tf.matmul(x, w1))
        p = tf.matmul(hidden, w2)
        err = tf.square(p - y)
        if kind in ("sum", "counted"):
            loss = tf.reduce_sum(err)
        elif kind == "l2_loss":
            loss = tf.nn.l2_loss(p - y)
        elif kind == "losses_sum":
            loss = tf1.losses.mean_squared_error(y, p, reduction=tf1.losses.Reduction.SUM)
        elif kind == "xent_sum":
            labels = tf.cast(y > 0, tf.float32)
            prob = tf.sigmoid(p)
            loss = -tf.reduce_sum(labels * tf.math.log(prob + 1e-6) + (1 - labels) * tf.math.log(1 - prob + 1e-6))
        elif kind == "sum_plus_decay":
            loss = tf.reduce_sum(err) + 1e-2 * tf.add_n([tf.nn.l2_loss(w1), tf.nn.l2_loss(w2)])
        elif kind == "learned_weight":
            c = tf.identity(tf1.get_variable("c", [], initializer=tf1.constant_initializer(0.5)))
            loss = tf.exp(-c) * tf.reduce_sum(err) + c
        elif kind == "loss_scaled":
            loss = tf.reduce_sum(err)
        elif kind == "sum_of_row_sums":
            loss = tf.reduce_sum(tf.reduce_sum(err, axis=1), name="total")
        elif kind == "mean":
            loss = tf.reduce_mean(err)
        elif kind == "sum_over_rows":
            loss = tf.reduce_sum(err) / tf.cast(tf.shape(x)[0], tf.float32)
        elif kind == "mean_of_row_sums":
            loss = tf.reduce_mean(tf.reduce_sum(err, axis=1))
        elif kind == "keras_mse":
            loss = tf.keras.losses.MeanSquaredError()(y, p)
        elif kind == "losses_default":
            loss = tf1.losses.mean_squared_error(y, p)
        elif kind == "mean_features":
            mean_p = tf.matmul(tf.reduce_mean(hidden, axis=0, keepdims=True), w2)
            loss = tf.reduce_mean(err) + 0.1 * tf.reduce_sum(tf.square(mean_p - 0.5))
        elif kind == "sum_over_batch":
            loss = tf.reduce_sum(err) / float(batch or 16)
        else:
            raise ValueError(f"summed_loss_mlp: unknown kind {kind!r}")
        loss = tf.identity(loss, name="loss")
        step = tf1.train.get_or_create_global_step()
        updates = []
        if kind == "counted":
            total = tf1.get_variable("loss_total", [], initializer=tf1.zeros_initializer(), trainable=False)
            updates.append(total.assign_add(loss.op.inputs[0]))
        train_vars = tf1.trainable_variables()
        if kind == "loss_scaled":
            grads = tf.gradients(loss * 128.0, train_vars)
            pairs = [(gr / 128.0, v) for gr, v in zip(grads, train_vars)]
        else:
            pairs = list(zip(tf.gradients(loss, train_vars), train_vars))
        if optimizer == "adam":
            apply = _hand_written_adam(pairs, step)
        else:
            opt = (tf1.train.MomentumOptimizer(0.01, 0.9) if optimizer == "momentum"
                   else tf1.train.GradientDescentOptimizer(0.01))
            apply = opt.apply_gradients(pairs, global_step=step)
        tf.group(apply, *updates, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _hand_written_adam(pairs, step, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """Adam as a script writes it with assign ops (no fused optimizer op); returns the
    op that runs the updates and bumps ``step``."""
    tf, tf1 = _tf()
    updates = []
    t = tf.cast(step, tf.float32) + 1.0
    for grad, var in pairs:
        name = var.op.name
        m = tf1.get_variable(f"{name}/adam_m", var.shape, initializer=tf1.zeros_initializer(), trainable=False)
        v = tf1.get_variable(f"{name}/adam_v", var.shape, initializer=tf1.zeros_initializer(), trainable=False)
        m_new = m.assign(b1 * m + (1 - b1) * grad)
        v_new = v.assign(b2 * v + (1 - b2) * tf.square(grad))
        rate = lr * tf.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        updates.append(var.assign_sub(rate * m_new / (tf.sqrt(v_new) + eps)))
    with tf.control_dependencies(updates):
        return step.assign_add(1).op


# dual_encoder's in-batch logits, as scripts write them
PRODUCT_FORMS = ("matmul", "transpose", "einsum", "tensordot", "broadcast", "distances")


def dual_encoder(negatives="in_batch", form="matmul"):
    """A dual encoder trained with a contrastive loss, as retrieval and sentence-embedding
    scripts train one: queries q [batch, 6] and documents d [batch, 6] each through a
    tanh layer and normalised; with ``negatives`` "in_batch" the logits are every query
    against every document of the batch (``tf.matmul(q, d, transpose_b=True)``, the
    matching document on the diagonal); with "sampled", each query against its own
    document and one fixed random document per row (no row meets another row). Softmax
    cross entropy, mean over the rows, SGD 0.1. ``form`` writes the in-batch logits
    otherwise (the same values): "transpose" ``tf.matmul(q, tf.transpose(d))``, "einsum"
    ``tf.einsum("id,jd->ij", q, d)``, "tensordot" ``tf.tensordot(q, d, [[1], [1]])``,
    "broadcast" ``tf.reduce_sum(q[:, None, :] * d[None, :, :], -1)``, "distances" minus
    half the squared distances by expand_dims (the same softmax: the norms are 1), each
    named "similarity". Returns the GraphDef (loss:0, train_op, init; variables wq, wd)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        q = tf1.placeholder(tf.float32, [None, 6], name="q")
        d = tf1.placeholder(tf.float32, [None, 6], name="d")
        wq = tf1.get_variable("wq", [6, 5], initializer=tf1.glorot_uniform_initializer(seed=2))
        wd = tf1.get_variable("wd", [6, 5], initializer=tf1.glorot_uniform_initializer(seed=3))
        eq = tf.math.l2_normalize(tf.tanh(tf.matmul(q, wq)), axis=1)
        ed = tf.math.l2_normalize(tf.tanh(tf.matmul(d, wd)), axis=1)
        if negatives == "in_batch":
            logits = _in_batch_logits(tf, eq, ed, form) * 5.0
            labels = tf.range(tf.shape(q)[0])
        else:
            other = tf.math.l2_normalize(tf.tanh(tf.matmul(tf.reverse(d, [1]), wd)), axis=1)
            logits = tf.stack([tf.reduce_sum(eq * ed, 1), tf.reduce_sum(eq * other, 1)], axis=1) * 5.0
            labels = tf.zeros_like(tf.shape(q)[0:1])[0] + tf.zeros([tf.shape(q)[0]], tf.int32)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _in_batch_logits(tf, eq, ed, form):
    """[rows, rows]: every query against every document, as ``form`` writes it."""
    if form == "matmul":
        return tf.matmul(eq, ed, transpose_b=True, name="similarity")
    if form == "transpose":
        return tf.matmul(eq, tf.transpose(ed), name="similarity")
    if form == "einsum":
        return tf.einsum("id,jd->ij", eq, ed, name="similarity")
    if form == "tensordot":
        return tf.tensordot(eq, ed, [[1], [1]], name="similarity")
    if form == "broadcast":
        return tf.reduce_sum(tf.multiply(eq[:, None, :], ed[None, :, :], name="similarity"), -1)
    if form == "distances":
        return -0.5 * tf.reduce_sum(tf.square(tf.subtract(tf.expand_dims(eq, 1), tf.expand_dims(ed, 0),
                                                          name="similarity")), -1)
    raise ValueError(f"dual_encoder: unknown form {form!r}")


def contrastive(kind="clip"):
    """Two contrastive models as their public TF1 code writes them, small: every row of
    the batch meets every other row in the logits.

    "clip": an image and a text tower (x, t [batch, 6], each a tanh layer, normalised),
    logits ``exp(logit_scale) * img @ txt^T`` with a learned ``logit_scale`` (log 1/0.07),
    the symmetric loss (cross entropy of the logits and of their transpose, the labels
    ``tf.range`` of the batch), weight decay added to the loss, Adam on gradients clipped
    to global norm 1.

    "simclr": two views a, b [batch, 6] through one encoder and projection head (relu
    layer, linear layer, normalised); SimCLR's NT-Xent at temperature 0.5: for each view
    the logits against the other view's rows and against its own view's other rows (the
    diagonal masked by ``tf.one_hot(tf.range(n), n) * 1e9``), labels ``tf.one_hot(tf.range(n),
    2 n)``, ``tf.compat.v1.losses.softmax_cross_entropy``; momentum 0.9 on the loss plus
    weight decay. "simclr_stacked": the same as SimCLR's own code builds it, the two views
    stacked on the features of one input x [batch, 12], split and concatenated along the
    batch (``tf.concat(tf.split(x, 2, -1), 0)``) for one pass through the encoder, its
    output split back into the views (``tf.split(h, 2, 0)``). "triplet": an embedding x
    [batch, 6] -> [batch, 4] trained by the batch-hard triplet loss (each row's farthest
    row of its label, integer labels [batch], and nearest row of another, from the
    pairwise distances of ``tf.matmul(e, e, transpose_b=True)``, margin 0.5), SGD; the
    squared norms from its diagonal; "triplet_norms": from ``tf.reduce_sum(tf.square(e),
    1)``, outside the head.

    Returns the GraphDef (loss:0, train_op, init); the feeds: ``contrastive_batches``."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        init = tf1.glorot_uniform_initializer
        if kind in ("triplet", "triplet_norms"):   # batch-hard triplet loss, FaceNet's margin 0.5
            x = tf1.placeholder(tf.float32, [None, 6], name="x")
            labels = tf1.placeholder(tf.int32, [None], name="labels")
            w = tf1.get_variable("w", [6, 4], initializer=init(seed=2))
            e = tf.matmul(x, w)
            dot = tf.matmul(e, e, transpose_b=True, name="similarity")
            sq = tf.linalg.diag_part(dot) if kind == "triplet" else tf.reduce_sum(tf.square(e), 1)
            dist = tf.maximum(tf.expand_dims(sq, 0) - 2.0 * dot + tf.expand_dims(sq, 1), 0.0)
            same = tf.equal(tf.expand_dims(labels, 0), tf.expand_dims(labels, 1))
            others = tf.logical_not(tf.cast(tf.eye(tf.shape(labels)[0]), tf.bool))
            positive = tf.reduce_max(tf.cast(tf.logical_and(same, others), tf.float32) * dist, 1, keepdims=True)
            farthest = tf.reduce_max(dist, 1, keepdims=True)
            negative = tf.reduce_min(dist + farthest * tf.cast(same, tf.float32), 1, keepdims=True)
            loss = tf.reduce_mean(tf.maximum(positive - negative + 0.5, 0.0), name="loss")
            tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        elif kind == "clip":
            x = tf1.placeholder(tf.float32, [None, 6], name="x")
            t = tf1.placeholder(tf.float32, [None, 6], name="t")
            wi = tf1.get_variable("image/w", [6, 5], initializer=init(seed=2))
            wt = tf1.get_variable("text/w", [6, 5], initializer=init(seed=3))
            scale = tf1.get_variable("logit_scale", [], initializer=tf1.constant_initializer(np.log(1 / 0.07)))
            img = tf.math.l2_normalize(tf.tanh(tf.matmul(x, wi)), axis=1)
            txt = tf.math.l2_normalize(tf.tanh(tf.matmul(t, wt)), axis=1)
            logits = tf.exp(scale) * tf.matmul(img, txt, transpose_b=True, name="similarity")
            labels = tf.range(tf.shape(x)[0])
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits
            loss = tf.add((tf.reduce_mean(ce(labels=labels, logits=logits))
                           + tf.reduce_mean(ce(labels=labels, logits=tf.transpose(logits)))) / 2,
                          1e-3 * tf.add_n([tf.nn.l2_loss(wi), tf.nn.l2_loss(wt)]), name="loss")
            opt = tf1.train.AdamOptimizer(0.05)
            grads, variables = zip(*opt.compute_gradients(loss))
            clipped, _ = tf.clip_by_global_norm(grads, 1.0)
            opt.apply_gradients(zip(clipped, variables), name="train_op")
        else:
            w1 = tf1.get_variable("encoder/w", [6, 8], initializer=init(seed=2))
            w2 = tf1.get_variable("projection/w", [8, 5], initializer=init(seed=3))

            def embed(v):
                return tf.math.l2_normalize(tf.matmul(tf.nn.relu(tf.matmul(v, w1)), w2), axis=1)

            if kind == "simclr_stacked":   # SimCLR's own code: one encoder pass over both views
                x = tf1.placeholder(tf.float32, [None, 12], name="x")
                ha, hb = tf.split(embed(tf.concat(tf.split(x, 2, -1), 0)), 2, 0)
            else:
                ha = embed(tf1.placeholder(tf.float32, [None, 6], name="a"))
                hb = embed(tf1.placeholder(tf.float32, [None, 6], name="b"))
            n = tf.shape(ha)[0]
            labels = tf.one_hot(tf.range(n), n * 2)
            masks = tf.one_hot(tf.range(n), n)
            aa = tf.matmul(ha, ha, transpose_b=True) / 0.5 - masks * 1e9
            bb = tf.matmul(hb, hb, transpose_b=True) / 0.5 - masks * 1e9
            ab = tf.matmul(ha, hb, transpose_b=True) / 0.5
            ba = tf.matmul(hb, ha, transpose_b=True) / 0.5
            xent = tf1.losses.softmax_cross_entropy
            contrast = xent(labels, tf.concat([ab, aa], 1)) + xent(labels, tf.concat([ba, bb], 1))
            loss = tf.add(contrast, 1e-3 * tf.add_n([tf.nn.l2_loss(w1), tf.nn.l2_loss(w2)]), name="loss")
            tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def _labelled_network(tf, tf1, features, outputs):
    """(labels, outputs): x [None, features] -> relu 16 (w1) -> ``outputs`` (w2), with
    integer labels [None] fed beside; semihard_triplet's and same_class_weighted's."""
    x = tf1.placeholder(tf.float32, [None, features], name="x")
    labels = tf1.placeholder(tf.int32, [None], name="labels")
    w1 = tf1.get_variable("w1", [features, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
    w2 = tf1.get_variable("w2", [16, outputs], initializer=tf1.glorot_uniform_initializer(seed=3))
    return labels, tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)


def semihard_triplet(valid_rows=False):
    """FaceNet's semi-hard triplet loss as tf.contrib.losses.metric_learning's
    triplet_semihard_loss computes it (margin 1): an embedding x [batch, 6] -> relu 16 ->
    8, L2-normalised; integer labels [batch]. The squared pairwise distances from the
    rows' squared norms as a column plus the same of the transposed embeddings as a row,
    less twice ``e @ e^T``, clamped at 0, the diagonal zeroed; the pairs of one class
    ``tf.equal(labels, tf.transpose(labels))`` (labels reshaped to ``[tf.shape(labels)[0],
    1]``); for each pair (a, p) the nearest negative farther than p, found over the
    distances tiled ``[batch, 1]`` times, else the farthest negative; the mean of
    ``max(d(a, p) - d(a, n) + margin, 0)`` over the positive pairs, divided by their
    count. ``valid_rows``: the hinge of a row whose label is negative (unlabelled) is
    dropped by ``tf.where`` on a boolean per row, as a loss mask. Momentum 0.1, 0.9.
    Returns the GraphDef (loss:0, train_op, init; feeds ``contrastive_batches("triplet",
    ...)``)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        labels, outputs = _labelled_network(tf, tf1, 6, 8)
        e = tf.nn.l2_normalize(outputs, 1)
        distances = (tf.reduce_sum(tf.square(e), [1], keepdims=True)
                     + tf.reduce_sum(tf.square(tf.transpose(e)), [0], keepdims=True)
                     - 2.0 * tf.matmul(e, tf.transpose(e)))
        distances = tf.maximum(distances, 0.0)
        distances *= tf.cast(tf.logical_not(tf.less_equal(distances, 0.0)), tf.float32)
        n = tf.shape(e)[0]
        distances *= tf.ones_like(distances) - tf.linalg.diag(tf.ones([n]))
        column = tf.reshape(labels, [tf.shape(labels)[0], 1])
        same = tf.equal(column, tf.transpose(column))
        other = tf.logical_not(same)
        size = tf.size(column)
        tiled = tf.tile(distances, [size, 1])
        farther = tf.logical_and(tf.tile(other, [size, 1]),
                                 tf.greater(tiled, tf.reshape(tf.transpose(distances), [-1, 1])))
        any_farther = tf.transpose(tf.reshape(
            tf.greater(tf.reduce_sum(tf.cast(farther, tf.float32), 1, keepdims=True), 0.0), [size, size]))
        farther = tf.cast(farther, tf.float32)
        top = tf.reduce_max(tiled, 1, keepdims=True)
        nearest_farther = tf.transpose(tf.reshape(
            tf.reduce_min((tiled - top) * farther, 1, keepdims=True) + top, [size, size]))
        other = tf.cast(other, tf.float32)
        bottom = tf.reduce_min(distances, 1, keepdims=True)
        farthest = tf.tile(tf.reduce_max((distances - bottom) * other, 1, keepdims=True) + bottom, [1, size])
        hinge = 1.0 + distances - tf.where(any_farther, nearest_farther, farthest)
        positives = tf.cast(same, tf.float32) - tf.linalg.diag(tf.ones([size]))
        pairs = tf.maximum(hinge * positives, 0.0)
        if valid_rows:
            pairs = tf.where(labels >= 0, tf.reduce_sum(pairs, 1), tf.zeros([size]))
        loss = tf.truediv(tf.reduce_sum(pairs), tf.reduce_sum(positives), name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def same_class_weighted(kind="inverse_frequency"):
    """A classifier whose loss weighs each row by its class's rows in the batch, counted
    by comparing the labels with every other row's, ``tf.equal(labels[:, None],
    labels[None, :])`` (no embedding product at all): x [None, 4] -> relu 16 -> 3
    logits, integer labels [None]; ``kind`` "inverse_frequency": the mean of each row's
    cross entropy over its class's count in the batch; "pair_weighted": the sum of each
    row's cross entropy times that count, over the count of same-class pairs. SGD 0.1.
    Returns the GraphDef (loss:0, train_op, init; feeds of x and labels:0)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        labels, logits = _labelled_network(tf, tf1, 4, 3)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        same = tf.cast(tf.equal(labels[:, None], labels[None, :]), tf.float32)
        if kind == "inverse_frequency":
            loss = tf.reduce_mean(xent / tf.reduce_sum(same, 1), name="loss")
        else:
            loss = tf.truediv(tf.reduce_sum(xent * tf.reduce_sum(same, 1)), tf.reduce_sum(same), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def contrastive_batches(kind, steps, batch, seed=0):
    """Feeds for ``contrastive(kind)``: two related views per row (the second the first
    plus noise), so the matching pairs are learnable."""
    rng = np.random.RandomState(seed)
    names = ("x:0", "t:0") if kind == "clip" else ("a:0", "b:0")
    out = []
    for _ in range(steps):
        first = rng.randn(batch, 6).astype(np.float32)
        second = (first + 0.3 * rng.randn(batch, 6)).astype(np.float32)
        if kind.startswith("triplet"):
            out.append({"x:0": first, "labels:0": rng.randint(0, 3, batch).astype(np.int32)})
        else:
            out.append({"x:0": np.concatenate([first, second], 1)} if kind == "simclr_stacked"
                       else {names[0]: first, names[1]: second})
    return out


def warm_started_mlp(checkpoint_dir, resource=True):
    """BERT fine-tuning's warm start (``tf.compat.v1.train.init_from_checkpoint``), in
    small: writes a "pre-trained" checkpoint of an encoder ``bert/w1`` [4, 16] (all 0.3)
    into ``checkpoint_dir``, then builds the fine-tuning graph, that encoder and a new head
    ``head/w2`` [16, 1], whose init op loads ``bert/`` from the checkpoint (the variable's
    initializer reads it) and initialises the head from its seed; squared error, Adam with
    a global step. Returns (GraphDef, the checkpoint's path)."""
    import os
    tf, tf1 = _tf()

    def body():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        with tf1.variable_scope("bert", use_resource=resource):
            w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        with tf1.variable_scope("head", use_resource=resource):
            w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y), name="loss")
        return w1

    path = os.path.join(checkpoint_dir, "pretrained.ckpt")
    g = tf.Graph()
    with g.as_default():
        w1 = body()
        with tf1.Session() as sess:
            sess.run(w1.assign(tf.fill([4, 16], 0.3)))
            tf1.train.Saver([w1]).save(sess, path)
    g = tf.Graph()
    with g.as_default():
        body()
        tf1.train.init_from_checkpoint(path, {"bert/": "bert/"})
        step = tf1.train.get_or_create_global_step()
        tf1.train.AdamOptimizer(0.01).minimize(g.get_tensor_by_name("loss:0"), global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def(), path


def _classifier_inputs(labelled=True):
    """The placeholders x [None, 4] and (``labelled``) labels [None] int32, and the weights
    w1 [4, 8] and w2 [8, 3] (seeds 2 and 3) of the 3-class classifiers below."""
    tf, tf1 = _tf()
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    labels = tf1.placeholder(tf.int32, [None], name="labels") if labelled else None
    w1 = tf1.get_variable("w1", [4, 8], initializer=tf1.glorot_uniform_initializer(seed=2))
    w2 = tf1.get_variable("w2", [8, 3], initializer=tf1.glorot_uniform_initializer(seed=3))
    return x, labels, w1, w2


def center_loss_classifier():
    """A classifier with a center loss as FaceNet's code trains one: features x [None, 4]
    -> dense 8 relu, logits by dense 3, labels [None] int32 (3 classes); the loss is the
    cross entropy plus 0.1 times the features' mean squared distance to their class's
    center, and the centers (a non-trainable [3, 8] variable) move towards the batch's
    features by ``tf.compat.v1.scatter_sub(centers, labels, 0.5 * diff)``, each row's
    step divided by 1 + the count of its label in the batch
    (``tf.unique_with_counts``), before SGD 0.1. Returns the GraphDef (loss:0, train_op,
    init; variables w1, w2, centers)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, labels, w1, w2 = _classifier_inputs()
        centers = tf1.get_variable("centers", [3, 8], initializer=tf1.zeros_initializer(), trainable=False)
        features = tf.nn.relu(tf.matmul(x, w1))
        xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(features, w2)))
        centers_batch = tf.gather(centers, labels)
        loss = tf.identity(xent + 0.1 * tf.reduce_mean(tf.square(features - centers_batch)), name="loss")
        _, index, count = tf.unique_with_counts(labels)
        appearances = tf.reshape(tf.gather(count, index), [-1, 1])
        diff = (centers_batch - features) / tf.cast(1 + appearances, tf.float32)
        update = tf1.scatter_sub(centers, labels, 0.5 * diff, name="update_centers")
        with tf.control_dependencies([update]):
            train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf.group(train, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


CLASS_COUNTS = ("one_hot", "segment_sum", "bincount", "bincount_open", "unique")


def class_balanced_classifier(counts="one_hot"):
    """A classifier whose loss weights each row by the inverse of its class's count in
    the batch, as class-balanced losses for long-tailed data do: features x [None, 4]
    -> dense 8 relu -> logits [None, 3], labels [None] int32; the weight of a row is
    1 / max(count of its label, 1), the loss the sum of the weighted cross entropies over
    3 (one device's mean over the classes present), SGD 0.5. ``counts``: how the batch's
    counts of labels are taken: "one_hot", tf.reduce_sum(tf.one_hot(labels, 3), 0);
    "segment_sum", tf.math.unsorted_segment_sum(tf.ones_like(labels, tf.float32),
    labels, 3); "bincount", tf.math.bincount(labels, minlength=3, maxlength=3,
    dtype=tf.float32); "bincount_open", the same without maxlength (its size is the
    batch's largest label + 1, clamped below by 3); "unique", tf.unique_with_counts
    (the count of each row's own label). Returns the GraphDef (loss:0, train_op, init;
    variables w1, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, labels, w1, w2 = _classifier_inputs()
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        if counts == "unique":
            _, index, count = tf.unique_with_counts(labels)
            weights = 1.0 / tf.cast(tf.gather(count, index), tf.float32)
        else:
            if counts == "one_hot":
                per_class = tf.reduce_sum(tf.one_hot(labels, 3), 0)
            elif counts == "segment_sum":
                per_class = tf.math.unsorted_segment_sum(tf.ones_like(labels, tf.float32), labels, 3)
            else:
                per_class = tf.math.bincount(labels, minlength=3, maxlength=3 if counts == "bincount" else None,
                                             dtype=tf.float32)
            weights = tf.gather(1.0 / tf.maximum(per_class, 1.0), labels)
        loss = tf.identity(tf.reduce_sum(weights * xent) / 3.0, name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def center_loss_batches(steps, batch, seed=0):
    return labelled_batches(steps, batch, seed=seed, labels="labels:0")


def pairwise_ranking():
    """RankNet over the batch's pairs, as learning-to-rank scripts write it: items x
    [None, 4] with relevance y [None, 1] (dropout_batches' feeds), a score per item
    (dense 16 relu, dense 1, ``s = h[:, 0]``), every pair's score difference ``s[:, None] -
    s[None, :]`` and the mask of pairs whose first item is more relevant, the loss
    ``sum(mask * softplus(-diff)) / max(sum(mask), 1)``, SGD 0.1. Returns the GraphDef
    (loss:0, train_op, init; variables w1, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, y, w1, w2 = _mlp_inputs(None)
        s = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)[:, 0]
        relevance = y[:, 0]
        diff = tf.subtract(s[:, None], s[None, :], name="pairs")
        mask = tf.cast(relevance[:, None] > relevance[None, :], tf.float32)
        loss = tf.reduce_sum(mask * tf.nn.softplus(-diff)) / tf.maximum(tf.reduce_sum(mask), 1.0)
        loss = tf.identity(loss, name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


LISTWISE_FORMS = ("listnet", "softmax_axis0", "attention_pooling")


def listwise_softmax(form="listnet"):
    """A softmax over the batch's rows, the batch as one list or bag, on items x [None, 4]
    with relevance y [None, 1] (dropout_batches' feeds) and a score per item (dense 16
    relu, dense 1). ``form``: "listnet", ListNet's top-one cross entropy
    ``-sum(softmax(y[:, 0]) * log_softmax(s[:, 0]))``; "softmax_axis0", the same on the
    [rows, 1] columns with ``axis=0`` (tf.nn.softmax transposes the rows to the last
    axis); "attention_pooling", attention-based multiple-instance learning's bag
    embedding ``z = sum(softmax(s, axis=0) * h, 0)`` of the hidden units h, the loss
    ``sum(square(z - 0.5))``. SGD 0.1. Returns the GraphDef (loss:0, train_op, init;
    variables w1, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, y, w1, w2 = _mlp_inputs(None)
        h = tf.nn.relu(tf.matmul(x, w1))
        s = tf.matmul(h, w2)
        if form == "listnet":
            loss = -tf.reduce_sum(tf.nn.softmax(y[:, 0]) * tf.nn.log_softmax(s[:, 0]))
        elif form == "softmax_axis0":
            loss = -tf.reduce_sum(tf.nn.softmax(y, axis=0) * tf.nn.log_softmax(s, axis=0))
        else:
            bag = tf.reduce_sum(tf.nn.softmax(s, axis=0) * h, 0)
            loss = tf.reduce_sum(tf.square(bag - 0.5))
        loss = tf.identity(loss, name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def batch_assignments(kind="sinkhorn"):
    """Self-labelling over the batch's class assignments: features x [None, 4] -> dense 8
    relu -> logits [None, 3]. ``kind`` "sinkhorn": SwAV's codes, the Sinkhorn-Knopp
    equipartition of ``exp(stop_gradient(logits) / 0.5)`` transposed to [classes, rows],
    divided by its total, then three times by its sums over the rows (axis 1) and over
    the classes (axis 0), with SwAV's ``/ K`` and ``/ B`` (B = tf.shape(q)[1]), the codes
    the targets of a cross entropy with the logits; "marginal": the mean entropy of the
    rows' predictions minus the entropy of the batch's mean prediction (an information-
    maximising clustering loss); "logsumexp": a log partition over the batch's rows,
    ``tf.reduce_logsumexp(logits[:, 0])`` (its Max under tf.stop_gradient), minus their
    mean. SGD 0.5. Returns the GraphDef (loss:0, train_op, init;
    variables w1, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x, _, w1, w2 = _classifier_inputs(labelled=False)
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        if kind == "sinkhorn":
            q = tf.transpose(tf.exp(tf.stop_gradient(logits) / 0.5))
            q /= tf.reduce_sum(q)
            classes, rows = 3.0, tf.cast(tf.shape(q)[1], tf.float32)
            for _ in range(3):
                q /= tf.reduce_sum(q, axis=1, keepdims=True)
                q /= classes
                q /= tf.reduce_sum(q, axis=0, keepdims=True)
                q /= rows
            codes = tf.transpose(q * rows)
            loss = -tf.reduce_mean(tf.reduce_sum(codes * tf.nn.log_softmax(logits), 1))
        elif kind == "logsumexp":
            loss = tf.reduce_logsumexp(logits[:, 0]) - tf.reduce_mean(logits[:, 0])
        else:
            p = tf.nn.softmax(logits)
            mean = tf.reduce_mean(p, 0)
            loss = (-tf.reduce_mean(tf.reduce_sum(p * tf.math.log(p + 1e-8), 1))
                    + tf.reduce_sum(mean * tf.math.log(mean + 1e-8)))
        tf.identity(loss, name="loss")
        tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def assignment_batches(steps, batch, seed=0):
    return feature_batches(steps, batch, 4, seed)


def policy_gradient(kind="categorical"):
    """REINFORCE on a batch of states x [None, 4] with rewards y [None, 1] (dropout_batches'
    feeds): a policy x -> dense 16 relu -> 3 action logits; actions drawn per row by
    ``kind`` "categorical" (``tf.random.categorical(logits, 1, seed=5)``, graph seed 1),
    "stateless" (``tf.random.stateless_categorical(logits, 1, seed=[5, 6])``) or
    "unseeded" (no seed at all); loss ``-mean(log pi(a|x) * (r - mean r))``, Adam 0.01.
    Returns the GraphDef (fetch loss:0 and actions:0, run train_op, init; variables w1,
    w_pi and Adam's slots)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        if kind != "unseeded":
            tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        w_pi = tf1.get_variable("w_pi", [16, 3], initializer=tf1.glorot_uniform_initializer(seed=3))
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w_pi)
        if kind == "categorical":
            drawn = tf.random.categorical(logits, 1, seed=5)
        elif kind == "stateless":
            drawn = tf.random.stateless_categorical(logits, 1, seed=[5, 6])
        elif kind == "unseeded":
            drawn = tf.random.categorical(logits, 1)
        else:
            raise ValueError(f"policy_gradient: unknown kind {kind!r}")
        actions = tf.identity(drawn[:, 0], name="actions")
        log_pi = -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=actions, logits=logits)
        advantage = y[:, 0] - tf.reduce_mean(y)
        loss = tf.identity(-tf.reduce_mean(log_pi * advantage), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


# augmented_mlp's kinds: each draws in a tf.map_fn over the batch's rows, at every step
LOOPED_AUGMENTATIONS = ("flip", "crop", "noise", "coin")


def augmented_mlp(kind="flip", control_flow=None, parallel_iterations=1, seeded=True, batch=None):
    """dropout_mlp's regression (x [None, 4], y [None, 1], w1, w2; SGD 0.1 with a global
    step) on inputs augmented per row in a ``tf.map_fn`` over the batch, as TF1 scripts
    augment images in the graph: x is read as 2x2 one-channel images and ``kind``
    "flip" (``tf.image.random_flip_left_right``), "crop" (``tf.image.random_crop`` of the
    image padded by one pixel), "noise" (Gaussian noise per row) or "coin" (a reversed
    row when a uniform draw is below 0.5, in a tf.cond) draws once per row, graph seed 1
    (none unless ``seeded``). "hidden_noise" adds the noise to the hidden layer instead,
    rows computed from w1; "bounded_noise" adds noise per unit to it at every step of a
    tf.while_loop whose maximum_iterations is a Max over the rows (a loop bound, not a
    loop over the rows). ``parallel_iterations`` 1 runs the loop's steps, and so its
    draws, in order (more make one device's own draws vary from run to run);
    ``control_flow`` "v1" or "v2" builds tf.map_fn's loop so; ``batch`` a static batch
    size (None: dynamic). Returns the GraphDef (fetch loss:0 and augmented:0, run
    train_op, init)."""
    from graph_rewriter.testing.models import ControlFlow
    tf, tf1 = _tf()
    g = tf.Graph()

    def each_row(fn, rows):
        return tf.map_fn(fn, rows, parallel_iterations=parallel_iterations)

    with g.as_default(), ControlFlow(control_flow):
        if seeded:
            tf1.set_random_seed(1)
        x, y, w1, w2 = _mlp_inputs(batch)
        images = tf.reshape(x, [-1, 2, 2, 1])
        if kind == "flip":
            images = each_row(tf.image.random_flip_left_right, images)
        elif kind == "crop":
            images = each_row(lambda im: tf.image.random_crop(tf.pad(im, [[1, 1], [1, 1], [0, 0]]), [2, 2, 1]),
                              images)
        elif kind == "noise":
            images = each_row(lambda im: im + tf1.random_normal([2, 2, 1], stddev=0.5), images)
        elif kind == "coin":
            images = each_row(lambda im: tf1.cond(tf1.random_uniform([]) < 0.5, lambda: tf.reverse(im, [0]),
                                                  lambda: im), images)
        elif kind not in ("hidden_noise", "bounded_noise"):
            raise ValueError(f"augmented_mlp: unknown kind {kind!r}")
        augmented = tf.reshape(images, [-1, 4], name="augmented")
        h = tf.nn.relu(tf.matmul(augmented, w1))
        if kind == "hidden_noise":
            h = each_row(lambda row: row + tf1.random_normal([16], stddev=0.5), h)
        elif kind == "bounded_noise":   # a loop a Max over the rows bounds, drawing noise per unit per step
            bound = tf.reduce_max(tf.cast(tf.abs(x[:, 0]) * 2.0 + 1.0, tf.int32))
            _, h = tf1.while_loop(lambda i, a: i < 8, lambda i, a: (i + 1, a + tf1.random_normal([16], stddev=0.1)),
                                  (tf.constant(0), h), maximum_iterations=bound, parallel_iterations=1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def weight_norm_mlp():
    """A weight-normalised dense layer (Salimans and Kingma, 2016; OpenAI's weightnorm
    code): x [None, 4] -> relu(g * (x @ v / ||v||) + b), 16 units -> dense 1 (w2),
    squared error with y, SGD 0.05. ``data_init``, run once on a batch before training,
    assigns g = 1 / sqrt(var + 1e-10) and b = -mean * g from the moments of the
    pre-activations ``x @ v / ||v||`` over the batch. Returns the GraphDef (run init,
    data_init, train_op; fetch loss:0; variables v, g, b, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        v = tf1.get_variable("v", [4, 16], initializer=tf1.random_normal_initializer(0.0, 0.05, seed=2))
        gain = tf1.get_variable("g", [16], initializer=tf1.ones_initializer())
        bias = tf1.get_variable("b", [16], initializer=tf1.zeros_initializer())
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        t = tf.matmul(x, tf.nn.l2_normalize(v, 0))
        mean, variance = tf.nn.moments(t, [0])
        scale = 1.0 / tf.sqrt(variance + 1e-10)
        tf.group(tf1.assign(gain, scale), tf1.assign(bias, -mean * scale), name="data_init")
        h = tf.nn.relu(gain * t + bias)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.05).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def spectral_norm_mlp(resource=True):
    """Spectral normalization (Miyato et al., 2018) as SNGAN's TF1 code writes it: each
    weight matrix W of x [None, 4] -> relu 16 (w1) -> 1 (w2) is divided by its largest
    singular value, estimated by one power iteration a step from a non-trainable vector
    "<w>_u" [1, columns] (seeded normal): ``v = normalize(u @ W^T)``, ``u' =
    normalize(v @ W)`` (both under stop_gradient), ``sigma = v @ W @ u'^T``, and the step
    assigns u' to u before reading ``W / sigma`` (a control dependency). Squared error
    with y, Adam 0.01. ``resource``: resource or ref variables. Returns the GraphDef
    (init, train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")

        def normalized(w, name):
            u = tf1.get_variable(f"{name}_u", [1, w.shape[-1]], trainable=False, use_resource=resource,
                                 initializer=tf1.random_normal_initializer(seed=7))
            v = tf.stop_gradient(tf.nn.l2_normalize(tf.matmul(u, tf.transpose(w)), 1))
            u_next = tf.stop_gradient(tf.nn.l2_normalize(tf.matmul(v, w), 1))
            sigma = tf.matmul(tf.matmul(v, w), tf.transpose(u_next))
            with tf.control_dependencies([tf1.assign(u, u_next)]):
                return w / sigma

        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2), use_resource=resource)
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3), use_resource=resource)
        out = tf.matmul(tf.nn.relu(tf.matmul(x, normalized(w1, "w1"))), normalized(w2, "w2"))
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


# gradient_surgery_mtl's forms: how the per-task gradients are computed and combined
SURGERY_FORMS = ("per_task", "vectorized", "summed")


def gradient_surgery_mtl(form="per_task"):
    """PCGrad (Yu et al., 2020, "Gradient Surgery for Multi-Task Learning") as its TF1
    code writes it: two tasks over a shared layer, x [None, 4] -> relu 16 (w1) -> a
    squared error head (wa) and an absolute error head (wb) against y. Each task's
    gradients over [w1, wa, wb] are flattened into one vector; each vector is projected
    on the normal plane of every other where their dot product is negative, ``g_i -=
    min(g_i . g_k / |g_k|^2, 0) g_k``; the projections are summed, unflattened and applied
    by Adam 0.01. ``form``: "per_task" (one tf.gradients call per task, its None
    gradients zeros), "vectorized" (the authors' code: tf.vectorized_map over the
    stacked losses, both for the gradients and for the projection) or "summed" (the task
    vectors summed without projection: a linear join). Returns the GraphDef (init,
    train_op, loss:0 the tasks' sum; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2), use_resource=True)
        wa = tf1.get_variable("wa", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3), use_resource=True)
        wb = tf1.get_variable("wb", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=4), use_resource=True)
        h = tf.nn.relu(tf.matmul(x, w1))
        losses = [tf.reduce_mean(tf.square(tf.matmul(h, wa) - y)), tf.reduce_mean(tf.abs(tf.matmul(h, wb) + y))]
        tf.identity(losses[0] + losses[1], name="loss")
        variables = [w1, wa, wb]

        def flat(grads):
            return tf.concat([tf.reshape(d if d is not None else tf.zeros_like(v), [-1])
                              for d, v in zip(grads, variables)], 0)

        if form == "vectorized":
            tasks = tf.vectorized_map(lambda loss: tf.concat(
                [tf.reshape(d, [-1]) for d in tf.gradients(loss, variables) if d is not None], 0), tf.stack(losses))
        else:
            tasks = tf.stack([flat(tf.gradients(loss, variables)) for loss in losses])

        def project(task):
            for k in range(len(losses)):
                inner = tf.reduce_sum(task * tasks[k])
                task = task - tf.minimum(inner / tf.reduce_sum(tasks[k] * tasks[k]), 0.0) * tasks[k]
            return task

        if form == "summed":
            total = tf.reduce_sum(tasks, 0)
        elif form == "vectorized":
            total = tf.reduce_sum(tf.vectorized_map(project, tasks), 0)
        else:
            total = tf.reduce_sum(tf.stack([project(tasks[i]) for i in range(len(losses))]), 0)
        grads, start = [], 0
        for v in variables:
            size = int(v.shape.num_elements())
            grads.append(tf.reshape(total[start:start + size], v.shape))
            start += size
        tf1.train.AdamOptimizer(0.01).apply_gradients(zip(grads, variables), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


# differentiated_gradient_mlp's kinds: a gradient of the batch's loss that the step
# differentiates again (each replica's own: noted), and gradients it need not note
REGRADIENT_KINDS = ("gradnorm", "gradnorm_conv", "maml_batch")
PER_ROW_GRADIENT_KINDS = ("maml_tasks", "input_penalty_sum", "input_penalty", "input_penalty_counted")
# ... and the input gradients of a mean over the rows, whose scale the step uses: each
# replica's is R times one device's per row (noted)
SCALED_ROW_GRADIENT_KINDS = ("input_penalty_mean",)


def differentiated_gradient_mlp(kind="gradnorm"):
    """A step whose loss is computed from a gradient, over x [None, 4] -> relu 16 (w1) ->
    1 (w2) (and two heads wa, wb for gradnorm), Adam 0.01. ``kind``:

    - "gradnorm" (Chen et al., 2018): task weights [2] trained so the tasks' gradient
      norms at w1, ``|d(t_i L_i)/dw1|``, approach their mean times the tasks' relative
      inverse training rates to the power 1.5 (a target under stop_gradient), by the
      L1 distance; the weights renormalised to sum to 2 after the step.
      "gradnorm_conv": the same with a 2x2 convolution of 16 filters (w1 [2, 2, 1, 16])
      over x as a 2x2 image for the shared layer, heads [64, 1], as the paper's
      SegNet shares convolutions.
    - "maml_batch": MAML's inner step on the whole batch (one task per batch): fast
      weights ``w - 0.1 dL/dw``, the outer loss at them on the inputs halved.
    - "maml_tasks": the same per task, ``tf.map_fn`` over the rows of x [None, 5, 4] (a
      row is a task of 5 examples), as cbfinn/maml writes it.
    - "input_penalty_sum": a gradient penalty on the inputs, ``(|dD/dx_i| - 1)^2``
      averaged over the rows, the input gradient taken of ``tf.reduce_sum(D(x))`` (a
      sum over the rows that is no loss); "input_penalty": of ``D(x)`` itself;
      "input_penalty_mean": of ``tf.reduce_mean(D(x))``, whose gradient per row is
      1/N of the sum's; "input_penalty_counted": that gradient times
      ``tf.shape(x)[0]``, the sum's again.

    Returns the GraphDef (init, train_op, loss:0; dropout_batches, or
    task_batches for maml_tasks)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        rows = [None, 5] if kind == "maml_tasks" else [None]
        x = tf1.placeholder(tf.float32, rows + [4], name="x")
        y = tf1.placeholder(tf.float32, rows + [1], name="y")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2), use_resource=True)
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3), use_resource=True)

        def net(inputs, a, b):
            return tf.matmul(tf.nn.relu(tf.matmul(inputs, a)), b)

        def maml(inputs, labels):
            inner = tf.reduce_mean(tf.square(net(inputs, w1, w2) - labels))
            d1, d2 = tf.gradients(inner, [w1, w2])
            return tf.reduce_mean(tf.square(net(inputs * 0.5, w1 - 0.1 * d1, w2 - 0.1 * d2) - labels))

        if kind in ("gradnorm", "gradnorm_conv"):
            units = 64 if kind == "gradnorm_conv" else 16
            if kind == "gradnorm_conv":
                w1 = tf1.get_variable("conv", [2, 2, 1, 16], initializer=tf1.glorot_uniform_initializer(seed=5),
                                      use_resource=True)
                w2 = tf1.get_variable("wa", [units, 1], initializer=tf1.glorot_uniform_initializer(seed=6),
                                      use_resource=True)
                h = tf.reshape(tf.nn.relu(tf.nn.conv2d(tf.reshape(x, [-1, 2, 2, 1]), w1, 1, "SAME")), [-1, units])
            else:
                h = tf.nn.relu(tf.matmul(x, w1))
            wb = tf1.get_variable("wb", [units, 1], initializer=tf1.glorot_uniform_initializer(seed=4), use_resource=True)
            weights = tf1.get_variable("task_weights", [2], initializer=tf1.ones_initializer(), use_resource=True)
            first = tf1.get_variable("initial_losses", [2], initializer=tf1.ones_initializer(), trainable=False,
                                     use_resource=True)
            losses = tf.stack([tf.reduce_mean(tf.square(tf.matmul(h, w2) - y)),
                               tf.reduce_mean(tf.abs(tf.matmul(h, wb) + y))])
            weighted = weights * losses
            loss = tf.reduce_sum(weighted, name="loss")
            norms = tf.stack([tf.norm(tf.gradients(weighted[i], w1)[0]) for i in range(2)])
            rates = losses / first
            target = tf.stop_gradient(tf.reduce_mean(norms) * (rates / tf.reduce_mean(rates)) ** 1.5)
            balance = tf.reduce_sum(tf.abs(norms - target))
            model = [w1, w2, wb]
            step = tf1.train.AdamOptimizer(0.01).apply_gradients(
                list(zip(tf.gradients(loss, model), model)) + [(tf.gradients(balance, weights)[0], weights)])
            with tf.control_dependencies([step]):
                tf.group(weights.assign(2.0 * weights / tf.reduce_sum(weights)), name="train_op")
        else:
            if kind == "maml_batch":
                loss = tf.identity(maml(x, y), name="loss")
            elif kind == "maml_tasks":
                loss = tf.reduce_mean(tf.map_fn(lambda a: maml(*a), (x, y), dtype=tf.float32), name="loss")
            else:
                out = net(x, w1, w2)
                ys = (tf.reduce_sum(out) if kind == "input_penalty_sum"
                      else tf.reduce_mean(out) if kind in ("input_penalty_mean", "input_penalty_counted") else out)
                dx = tf.gradients(ys, x)[0]
                if kind == "input_penalty_counted":
                    dx = dx * tf.cast(tf.shape(x)[0], tf.float32)
                penalty = tf.reduce_mean(tf.square(tf.norm(dx, axis=1) - 1.0))
                loss = tf.identity(tf.reduce_mean(tf.square(out - y)) + 0.1 * penalty, name="loss")
            tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


# kfac_mlp's normalizers: those that make each replica's factors one device's, and the
# constant batch size, whose output-gradient factor is R times one device's (noted)
KFAC_NORMALIZERS = ("count", "sampled")
KFAC_NOTED_NORMALIZERS = ("constant",)


def kfac_mlp(normalizer="count"):
    """K-FAC (Martens and Grosse, 2015) written by hand as TF1 scripts write it, after
    tensorflow/kfac's fully connected layers: x [None, 4] -> dense 16 (w1) relu ->
    dense 1 (w2), each layer's input with a homogeneous coordinate
    (``tf.concat([a, tf.ones_like(a[:, :1])], -1)``, the bias as the weights' last row),
    squared error. Each step moves two non-trainable Kronecker factors per layer
    towards the batch's (EMA 0.9, zeros at first): the input factor ``a^T a / n`` and
    the output-gradient factor ``g^T g / n``, g the gradient of the loss with respect
    to the layer's pre-activations; Momentum 0.05, 0.9 (with a global step) applies
    ``(A + I)^-1 dW (G + I)^-1``, the factors read after their update. ``normalizer``:
    "count", n = ``tf.shape(x)[0]`` and g the mean loss's gradient times n (the
    per-row gradients); "sampled", as tensorflow/kfac estimates the Fisher, g the
    gradient of ``0.5 * sum((s - t)^2)`` for targets t drawn from the model (``s +
    N(0, 1)``, seeded); "constant", n = 8.0, the batch size a script's flag gives
    (dropout_batches(steps, 8)). Returns the GraphDef (init, train_op, loss:0)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1 = tf1.get_variable("w1", [5, 16], initializer=tf1.glorot_uniform_initializer(seed=2), use_resource=True)
        w2 = tf1.get_variable("w2", [17, 1], initializer=tf1.glorot_uniform_initializer(seed=3), use_resource=True)

        def homogeneous(a):
            return tf.concat([a, tf.ones_like(a[:, :1])], -1)
        a0 = homogeneous(x)
        s1 = tf.matmul(a0, w1)
        a1 = homogeneous(tf.nn.relu(s1))
        s2 = tf.matmul(a1, w2)
        loss = tf.reduce_mean(tf.square(s2 - y), name="loss")
        dw1, dw2, ds1, ds2 = tf.gradients(loss, [w1, w2, s1, s2])
        n = 8.0 if normalizer == "constant" else tf.cast(tf.shape(x)[0], tf.float32)
        if normalizer == "sampled":
            targets = tf.stop_gradient(s2 + tf1.random_normal(tf.shape(s2), seed=5))
            ds1, ds2 = tf.gradients(0.5 * tf.reduce_sum(tf.square(s2 - targets)), [s1, s2])
        elif normalizer not in ("count", "constant"):
            raise ValueError(f"kfac_mlp: unknown normalizer {normalizer!r}")
        else:
            ds1, ds2 = ds1 * n, ds2 * n
        directions = []
        for name, a, ds, dw in (("layer1", a0, ds1, dw1), ("layer2", a1, ds2, dw2)):
            factors = []
            for side, t in (("input", a), ("output", ds)):
                size = t.shape[1]
                cov = tf1.get_variable(f"{name}/{side}_factor", [size, size], initializer=tf1.zeros_initializer(),
                                       trainable=False, use_resource=True)
                new = cov.assign(0.9 * cov + 0.1 * tf.matmul(t, t, transpose_a=True) / n)
                factors.append(tf.linalg.inv(new + tf.eye(size)))
            directions.append(tf.matmul(tf.matmul(factors[0], dw), factors[1]))
        step = tf1.train.get_or_create_global_step()
        tf1.train.MomentumOptimizer(0.05, 0.9).apply_gradients(zip(directions, [w1, w2]), global_step=step,
                                                               name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


# adversarial_mlp's kinds: perturbations whose scale is none of the step's business (one
# device's), and one normalised over the whole batch (noted)
ADVERSARIAL_KINDS = ("fgsm", "fgm_rows")
ADVERSARIAL_NOTED_KINDS = ("fgm_batch",)


def adversarial_mlp(kind="fgsm"):
    """Adversarial training in one TF1 step (Goodfellow et al., 2015; cleverhans' fgm):
    the gradient of the clean mean loss with respect to x, a perturbation of x by it
    (under stop_gradient), and the loss as the mean of the clean and the perturbed
    losses, Adam 0.01. x [None, 4] -> dense 16 (w1) tanh -> dense 1 (w2), squared
    error. ``kind``: "fgsm", ``0.1 * sign(g)``; "fgm_rows", ``0.1 * g / |g_i|`` per row
    (``tf.nn.l2_normalize(g, 1)``); "fgm_batch", ``0.1 * g / |g|`` over the batch.
    Returns the GraphDef (init, train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1, w2 = _mlp_weights(tf1)

        def loss_at(inputs):
            return tf.reduce_mean(tf.square(tf.matmul(tf.nn.tanh(tf.matmul(inputs, w1)), w2) - y))
        clean = loss_at(x)
        dx = tf.gradients(clean, x)[0]
        if kind == "fgsm":
            step = tf.sign(dx)
        elif kind == "fgm_rows":
            step = tf.nn.l2_normalize(dx, 1)
        elif kind == "fgm_batch":
            step = dx / (tf.norm(dx) + 1e-12)
        else:
            raise ValueError(f"adversarial_mlp: unknown kind {kind!r}")
        perturbed = loss_at(x + tf.stop_gradient(0.1 * step))
        loss = tf.identity(0.5 * (clean + perturbed), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def task_batches(steps, tasks, seed=0):
    """``steps`` feeds of ``tasks`` rows of 5 examples each (x [tasks, 5, 4], y [tasks,
    5, 1]) for differentiated_gradient_mlp("maml_tasks")."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(tasks, 5, 4).astype(np.float32), "y:0": rng.randn(tasks, 5, 1).astype(np.float32)}
            for _ in range(steps)]


def sharpness_aware_mlp(norm="global"):
    """SAM (Foret et al., 2021, "Sharpness-Aware Minimization") in a TF1 step: the
    gradient g of the loss, an ascent to ``w + rho g / |g|`` (assign_add, rho 0.5; the norm
    ``norm`` "global" over every gradient, or "per_tensor"), the loss and its gradient
    again at the perturbed weights (read after the ascent), the ascent undone
    (assign_sub, after that gradient) and Momentum 0.1, 0.9 applying the second gradient.
    x [None, 4] -> relu 16 (w1) -> 1 (w2), squared error; loss:0 is the first loss.
    Returns the GraphDef (init, train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1, w2 = (tf1.get_variable(name, shape, initializer=tf1.glorot_uniform_initializer(seed=seed), use_resource=True)
                  for name, shape, seed in (("w1", [4, 16], 2), ("w2", [16, 1], 3)))
        variables = [w1, w2]

        def loss_at(reads):
            return tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, reads[0])), reads[1]) - y))

        loss = tf.identity(loss_at([v.read_value() for v in variables]), name="loss")
        grads = tf.gradients(loss, variables)
        if norm == "global":
            scale = 0.5 / (tf.linalg.global_norm(grads) + 1e-12)
            ascents = [scale * d for d in grads]
        else:
            ascents = [0.5 * d / (tf.norm(d) + 1e-12) for d in grads]
        ascend = [v.assign_add(e) for v, e in zip(variables, ascents)]
        with tf.control_dependencies(ascend):
            perturbed = [v.read_value() for v in variables]
        sharp = tf.gradients(loss_at(perturbed), variables)
        with tf.control_dependencies(sharp):
            descend = [v.assign_sub(e) for v, e in zip(variables, ascents)]
        with tf.control_dependencies(descend):
            tf1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(zip(sharp, variables), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def _per_example_errors(tf, tf1):
    """(w1, w2, each row's squared error): x [None, 4] -> dense 16 (w1), relu, dense 1
    (w2) against y [None, 1], the network of dp_sgd_mlp and positioned_loss_mlp."""
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    y = tf1.placeholder(tf.float32, [None, 1], name="y")
    w1, w2 = _mlp_weights(tf1)
    return w1, w2, tf.reduce_sum(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y), 1)


def self_paced_mlp():
    """Self-paced learning by the batch's own losses: each step trains on the rows whose
    squared error is below the batch's mean error, ``keep = cast(loss_i < mean(loss))``
    (under stop_gradient), ``loss = sum(loss_i * keep) / max(sum(keep), 1)``. x [None,
    4] -> dense 16 (w1), relu, dense 1 (w2); Adam 0.01. Returns the GraphDef (init,
    train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        _, _, per_example = _per_example_errors(tf, tf1)
        keep = tf.stop_gradient(tf.cast(per_example < tf.reduce_mean(per_example), tf.float32))
        loss = tf.divide(tf.reduce_sum(per_example * keep), tf.maximum(tf.reduce_sum(keep), 1.0), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def conditional_update_mlp(condition="gradients_finite", control_flow="v2"):
    """A step that skips its update under a condition, in a tf.cond around
    ``apply_gradients`` (``control_flow`` "v1": Switch and Merge; "v2": an If):
    ``gradients_finite`` when the global norm of the gradients is not finite (a step
    that overflows, as loss scaling skips it); ``loss_finite`` when the batch's loss is
    not; ``loss_below`` unless the loss is below 3 (a spike). x [None, 4] -> dense 16
    (w1), relu, dense 1 (w2), mean squared error, SGD 0.05. Returns the GraphDef (init,
    train_op, loss:0; conditional_update_batches)."""
    tf, tf1 = _tf()
    from graph_rewriter.testing.models import ControlFlow
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        w1, w2, per_example = _per_example_errors(tf, tf1)
        loss = tf.reduce_mean(per_example, name="loss")
        opt = tf1.train.GradientDescentOptimizer(0.05)
        pairs = opt.compute_gradients(loss, [w1, w2])
        predicate = {"gradients_finite": lambda: tf.math.is_finite(tf.linalg.global_norm([g_ for g_, _ in pairs])),
                     "loss_finite": lambda: tf.math.is_finite(loss),
                     "loss_below": lambda: loss < 3.0}[condition]()
        tf.group(tf.cond(predicate, lambda: opt.apply_gradients(pairs), tf.no_op, name="update"), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def batch_scaled_lr_mlp(kind="momentum"):
    """The linear scaling rule (Goyal et al., 2017) written in the graph: the learning
    rate ``0.05 * tf.cast(tf.shape(x)[0], tf.float32) / 8`` ("momentum", 0.9), or Adam's
    ``0.01 * sqrt(n / 8)`` ("adam"); or ("warmup") a counter of the examples seen,
    ``assign_add(examples_seen, n)``, and Momentum's rate warmed up over the first 16
    examples from its value after the step's count. x [None, 4] -> dense 16 (w1), relu,
    dense 1 (w2), mean squared error. Returns the GraphDef (init, train_op, loss:0;
    dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        w1, w2, per_example = _per_example_errors(tf, tf1)
        loss = tf.reduce_mean(per_example, name="loss")
        n = tf.cast(tf.shape(g.get_tensor_by_name("x:0"))[0], tf.float32)
        if kind == "warmup":
            seen = tf1.get_variable("examples_seen", [], initializer=tf1.zeros_initializer(), trainable=False)
            with tf.control_dependencies([tf1.assign_add(seen, n)]):
                rate = 0.05 * tf.minimum(1.0, (seen.read_value() + 1.0) / 16.0)
                tf1.train.MomentumOptimizer(rate, 0.9).minimize(loss, name="train_op")
        else:
            opt = (tf1.train.MomentumOptimizer(0.05 * n / 8.0, 0.9) if kind == "momentum"
                   else tf1.train.AdamOptimizer(0.01 * tf.sqrt(n / 8.0)))
            opt.minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def conditional_update_batches(steps, batch, seed=0):
    """dropout_batches with, at the second step, the last row's target 1e20: its squared
    error overflows float32, and the batch's loss and gradients are not finite (one
    device skips that step; the row is in the last replica's shard)."""
    feeds = dropout_batches(steps, batch, seed)
    feeds[1]["y:0"][-1] = 1e20
    return feeds


def cox_survival_mlp(kind="pipeline"):
    """DeepSurv's loss (Katzman et al., 2018), the negative Cox partial log-likelihood:
    x [None, 4] -> dense 16 (w1), relu, dense 1 (w2), each row's risk ``h[:, 0]``; with
    the rows sorted by time, latest first, row i's risk set is the rows up to i, so
    ``loss = -sum((risk - log(cumsum(exp(risk)))) * event) / sum(event)``. ``kind``
    "pipeline": the input pipeline sorted the batch (a Cumsum); "stable": the same by
    ``tf.math.cumulative_logsumexp(risk)``; "graph": the graph sorts the rows by
    ``tf.argsort(time, direction="DESCENDING")`` first; "feature_axis": a control whose
    running sum runs along each row's two scores (``cumsum(h, axis=1)``), not the rows,
    and whose loss is the events' squared error of the time on the scores' sum;
    "linear": the mean of the rows' running sums of their squared errors (over 8), which
    training only differentiates through (the backward of a Cumsum is a Cumsum of its
    gradient, reading none of its values).
    Adam 0.01. Returns the GraphDef (init, train_op, loss:0; feeds x, time, event:
    cox_survival_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        time = tf1.placeholder(tf.float32, [None], name="time")
        event = tf1.placeholder(tf.float32, [None], name="event")
        w1, w2 = _mlp_weights(tf1, 2 if kind == "feature_axis" else 1)
        h = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        if kind == "linear":   # the mean of the rows' running sums of their errors
            errors = tf.square(h[:, 0] - time)
            tf.identity(tf.reduce_mean(tf.cumsum(errors)) / 8.0, name="loss")
        elif kind == "feature_axis":   # a regression of the events' times on the scores' sums
            risk = tf.reduce_sum(tf.cumsum(h, axis=1), 1)
            log_risk_set = risk - tf.square(risk - time)
        else:
            risk = h[:, 0]
            if kind == "graph":
                order = tf.argsort(time, direction="DESCENDING")
                risk, event = tf.gather(risk, order), tf.gather(event, order)
            log_risk_set = (tf.math.cumulative_logsumexp(risk) if kind == "stable"
                            else tf.math.log(tf.cumsum(tf.exp(risk))))
        if kind != "linear":
            tf.identity(-tf.reduce_sum((risk - log_risk_set) * event) / tf.reduce_sum(event), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(g.get_tensor_by_name("loss:0"), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def cox_survival_batches(steps, batch, sort=True, seed=0):
    """``steps`` feeds for cox_survival_mlp: x, exponential times (sorted latest first,
    as its "pipeline" and "stable" kinds need, unless not ``sort``) and events (1 with
    probability 0.7, at least one per replica's shard of up to 4)."""
    rng = np.random.RandomState(seed)
    feeds = []
    for _ in range(steps):
        time = rng.exponential(size=batch).astype(np.float32)
        event = (rng.rand(batch) < 0.7).astype(np.float32)
        event[::2] = 1.0
        feeds.append({"x:0": rng.randn(batch, 4).astype(np.float32),
                      "time:0": -np.sort(-time) if sort else time, "event:0": event})
    return feeds


def hardest_row_mlp():
    """Hard example mining by the hardest row: the mean squared error plus the largest
    row's error, ``losses[argmax(losses)]`` (an ArgMax along the rows, a gather by it).
    x [None, 4] -> dense 16 (w1), relu, dense 1 (w2); Adam 0.01. Returns the GraphDef
    (init, train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        _, _, per_example = _per_example_errors(tf, tf1)
        loss = tf.add(tf.reduce_mean(per_example), tf.gather(per_example, tf.argmax(per_example)), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


SEGMENT_POOLINGS = ("segment_sum", "segment_mean", "segment_max", "unsorted_sum", "unsorted_mean", "unsorted_max")
GRAPHS_PER_BATCH = 4   # segment_pooling_mlp's graphs (segments) in every batch


def segment_pooling_mlp(kind="segment_sum"):
    """A graph network's readout (DeepChem's GraphGather, tf2_gnn's graph-level pooling)
    or a multiple-instance model's bags: the batch's rows are the nodes of
    GRAPHS_PER_BATCH graphs, ``graph`` [None] each node's graph (sorted), pooled
    after x [None, 4] -> dense 16 (w1), relu by ``kind``: ``segment_*``
    (tf.math.segment_sum / mean / max, as many segments as the largest id plus one) or
    ``unsorted_*`` (tf.math.unsorted_segment_*, GRAPHS_PER_BATCH segments); each graph's
    score (dense 1, w2) against its label ``y`` [GRAPHS_PER_BATCH] (static: fed whole to
    every replica), sigmoid cross entropy, Adam 0.01. Returns the GraphDef (init,
    train_op, loss:0; segment_pooling_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        graph = tf1.placeholder(tf.int32, [None], name="graph")
        y = tf1.placeholder(tf.float32, [GRAPHS_PER_BATCH], name="y")
        w1, w2 = _mlp_weights(tf1)
        h = tf.nn.relu(tf.matmul(x, w1))
        form, reduction = kind.split("_")
        if form == "segment":
            pooled = getattr(tf.math, f"segment_{reduction}")(h, graph)
        else:
            pooled = getattr(tf.math, f"unsorted_segment_{reduction}")(h, graph, GRAPHS_PER_BATCH)
        logits = tf.matmul(pooled, w2)[:, 0]
        tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(g.get_tensor_by_name("loss:0"), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    if kind not in SEGMENT_POOLINGS:
        raise ValueError(f"segment_pooling_mlp: unknown kind {kind!r}")
    return g.as_graph_def()


def segment_pooling_batches(steps, batch=8, seed=0):
    """``steps`` feeds for segment_pooling_mlp: ``batch`` nodes in GRAPHS_PER_BATCH graphs
    of 3, 2, 2 and 1 nodes at 8 (a graph may span two replicas' shards), labels 0 or 1."""
    rng = np.random.RandomState(seed)
    graph = np.repeat(np.arange(GRAPHS_PER_BATCH), [3, 2, 2, 1]).astype(np.int32)
    return [{"x:0": rng.randn(batch, 4).astype(np.float32), "graph:0": graph,
             "y:0": (rng.rand(GRAPHS_PER_BATCH) < 0.5).astype(np.float32)} for _ in range(steps)]


DP_MICROBATCHES, DP_CLIP = 4, 0.5   # dp_sgd_mlp's microbatches and clipping norm


def dp_sgd_mlp(loop="unrolled", noise=0.0):
    """DP-SGD as tensorflow_privacy's DPGradientDescentOptimizer computes it without
    vectorising: x [None, 4] -> dense 16 (w1), relu, dense 1 (w2); the per-example
    squared errors are grouped into DP_MICROBATCHES microbatches by position,
    ``tf.reshape(losses, [M, -1])`` ("Reshape"); each microbatch's mean loss is
    differentiated alone (``tf.gradients`` of ``reduce_mean(gather(losses, [i]))``,
    ``loop`` "unrolled": M calls, as its unroll_microbatches does; "while": one in a
    tf.while_loop), its gradients clipped to the global norm DP_CLIP and summed; the
    sums get Gaussian noise of stddev DP_CLIP * ``noise`` (seeded) and are divided by
    M; plain SGD 0.1 applies them. loss:0 is the batch's mean loss. Returns the
    GraphDef (init, train_op; batches of dropout_batches, of a multiple of M rows)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        w1, w2, per_example = _per_example_errors(tf, tf1)
        tf.reduce_mean(per_example, name="loss")
        microbatches = tf.reshape(per_example, [DP_MICROBATCHES, -1])

        def add_microbatch(i, sums):
            grads = tf.gradients(tf.reduce_mean(tf.gather(microbatches, [i])), [w1, w2])
            clipped, _ = tf.clip_by_global_norm(grads, DP_CLIP)
            return [total + c for total, c in zip(sums, clipped)]

        sums = [tf.zeros_like(w1), tf.zeros_like(w2)]
        if loop == "unrolled":
            for i in range(DP_MICROBATCHES):
                sums = add_microbatch(i, sums)
        else:
            _, sums = tf.while_loop(lambda i, _: i < DP_MICROBATCHES, lambda i, s: [i + 1, add_microbatch(i, s)],
                                    [tf.constant(0), sums])
        noised = [total + tf.random.normal(tf.shape(total), stddev=DP_CLIP * noise, seed=5 + k)
                  for k, total in enumerate(sums)]
        grads = [total / float(DP_MICROBATCHES) for total in noised]
        tf1.train.GradientDescentOptimizer(0.1).apply_gradients(list(zip(grads, [w1, w2])), name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def minibatch_stddev_mlp(group_size=4):
    """A discriminator with ProGAN's and StyleGAN's minibatch standard deviation layer
    (Karras et al., 2018; their public TF1 code's ``minibatch_stddev_layer``, on an MLP's
    features): the rows in groups of ``tf.minimum(group_size, tf.shape(h)[0])`` taken
    by position (``tf.reshape(h, [G, -1, 16])``: row i with rows i + M, i + 2M, ...), each
    group's standard deviation per feature averaged into one feature, tiled back to
    every row of the group and concatenated; then a linear output, MSE to y; Adam. x
    [None, 4], y [None, 1] (dropout_batches). Returns the GraphDef."""
    tf, tf1 = _tf()
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        h = tf.nn.relu(tf.matmul(x, w1))
        with tf.name_scope("minibatch_stddev"):
            groups = tf.minimum(group_size, tf.shape(h)[0])
            grouped = tf.reshape(h, [groups, -1, 16], name="grouped")
            centred = grouped - tf.reduce_mean(grouped, axis=0, keepdims=True)
            stddev = tf.sqrt(tf.reduce_mean(tf.square(centred), axis=0) + 1e-8)
            feature = tf.tile(tf.reduce_mean(stddev, axis=1, keepdims=True), [groups, 1])
            h = tf.concat([h, feature], 1)
        w2 = tf1.get_variable("w2", [17, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return graph.as_graph_def()


def positioned_loss_mlp(kind):
    """x [None, 4] -> dense 16 (w1), relu, dense 1 (w2), per-example squared errors;
    the loss takes some of them by position, as a semi-supervised batch's labelled rows
    first: ``kind`` "mean", none (the batch's mean, the control); "first", the mean of
    the first 4 rows' ("strided_slice"); "halves", the first half's mean plus half the
    second's (``tf.split(losses, 2, 0)``, "split").
    SGD 0.1. Returns the GraphDef (init, train_op, loss:0; dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        w1, w2, per_example = _per_example_errors(tf, tf1)
        if kind == "mean":
            loss = tf.reduce_mean(per_example, name="loss")
        elif kind == "first":
            loss = tf.reduce_mean(per_example[:4], name="loss")
        else:
            first, second = tf.split(per_example, 2, 0)
            loss = tf.add(tf.reduce_mean(first), 0.5 * tf.reduce_mean(second), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


REFERENCE_ROWS = 6   # reference_batch_norm_mlp's reference batch


def reference_batch_norm_mlp(static_reference=True):
    """Virtual batch normalization's reference batch (Salimans et al., 2016, improved
    GAN): x [None, 4] -> dense 16 (w1), normalised by the moments of a reference batch
    ``ref`` [REFERENCE_ROWS, 4] (or [None, 4] where not ``static_reference``) through
    the same layer, ``(h - mean) * rsqrt(var + 1e-5)``, relu -> dense 1 (w2), squared
    error with y, Adam 0.01. The reference batch is fed whole at every step. Returns the
    GraphDef (init, train_op, loss:0; feeds x, y, ref)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        ref = tf1.placeholder(tf.float32, [REFERENCE_ROWS if static_reference else None, 4], name="ref")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        mean, variance = tf.nn.moments(tf.matmul(ref, w1), [0])
        h = tf.nn.relu((tf.matmul(x, w1) - mean) * tf.math.rsqrt(variance + 1e-5))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        tf1.train.AdamOptimizer(0.01).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


QUANT_DECAY = 0.9   # quantized_mlp's moving ranges' decay


def quantized_mlp(resource=True, per_channel=False, delay=False):
    """Quantization-aware training as tf.contrib.quantize's create_training_graph builds
    it (MovingAvgQuantize): x [None, 4] -> dense 16 (w1, its weights fake-quantised by
    their own min and max), relu, the activations fake-quantised to 8 bits by a moving
    range "act/min", "act/max" (non-trainable): each step takes the batch's minimum and
    maximum of the activations (per unit with ``per_channel``), clamped to include 0,
    and moves the range towards them, ``v -= (v - batch) * (1 - QUANT_DECAY)``; the fake
    quantisation reads the updated range. -> dense 1 (w2), squared error with y,
    momentum 0.1, 0.9, global_step counted. ``resource``: the ranges are resource
    variables (the quantisation reads them after the update, through its control edge)
    or ref variables (it reads the assign's output). ``delay``: the activations are
    quantised only from step 1 (contrib's quant_delay, a tf.cond on the global step).
    Returns the GraphDef (run init, train_op; fetch loss:0; batches of dropout_batches)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        step = tf1.train.get_or_create_global_step()
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2))
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        weights = tf.quantization.fake_quant_with_min_max_vars(w1, tf.reduce_min(w1), tf.reduce_max(w1))
        h = tf.nn.relu(tf.matmul(x, weights))
        with tf1.variable_scope("act"):
            shape = [16] if per_channel else []
            ranges = [tf1.get_variable(name, shape, initializer=tf1.constant_initializer(init), trainable=False,
                                       use_resource=resource) for name, init in (("min", -6.0), ("max", 6.0))]
            axes = [0] if per_channel else None
            batch_range = (tf.minimum(tf.reduce_min(h, axes), 0.0), tf.maximum(tf.reduce_max(h, axes), 0.0))
            low, high = (tf1.assign_sub(v, (v - b) * (1.0 - QUANT_DECAY)) for v, b in zip(ranges, batch_range))
            quantize = (tf.quantization.fake_quant_with_min_max_vars_per_channel if per_channel
                        else tf.quantization.fake_quant_with_min_max_vars)
            quantized = quantize(h, low, high, num_bits=8)
            if delay:
                quantized = tf1.cond(step >= 1, lambda: quantized, lambda: h)
        loss = tf.reduce_mean(tf.square(tf.matmul(quantized, w2) - y), name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


PROTO_WAY, PROTO_SHOT, PROTO_QUERY = 4, 2, 2   # a prototypical network's episode


def prototypical_network():
    """A prototypical network (Snell et al., 2017) trained on episodes: ``support``
    [None, 4] holds PROTO_SHOT examples of each of PROTO_WAY classes, class by class,
    ``query`` [None, 4] and ``labels`` [None] (int32) the queries and their classes. A
    shared encoder (dense 8, relu: w1); each class's prototype is the mean of its
    support embeddings, grouped by position, ``tf.reshape(h, [PROTO_WAY, -1, 8])``
    ("prototypes/grouped"); the logits are minus the squared distances of each query to
    each prototype; mean cross entropy, SGD 0.1. Returns the GraphDef (fetch loss:0,
    run train_op, init)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        support = tf1.placeholder(tf.float32, [None, 4], name="support")
        query = tf1.placeholder(tf.float32, [None, 4], name="query")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        w1 = tf1.get_variable("w1", [4, 8], initializer=tf1.glorot_uniform_initializer(seed=2))
        encoded_support, encoded_query = (tf.nn.relu(tf.matmul(x, w1)) for x in (support, query))
        with tf.name_scope("prototypes"):
            prototypes = tf.reduce_mean(tf.reshape(encoded_support, [PROTO_WAY, -1, 8], name="grouped"), 1)
        distances = tf.reduce_sum(tf.square(tf.expand_dims(encoded_query, 1) - tf.expand_dims(prototypes, 0)), 2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=-distances),
                              name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.global_variables_initializer(), name="init")
    return g.as_graph_def()


def prototypical_episodes(steps, seed=0):
    """``steps`` episodes for prototypical_network: each class's examples drawn around a
    mean of its own, the support class by class, the queries likewise."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        means = rng.randn(PROTO_WAY, 4)

        def around(count):
            return (np.repeat(means, count, 0) + 0.5 * rng.randn(PROTO_WAY * count, 4)).astype(np.float32)
        out.append({"support:0": around(PROTO_SHOT), "query:0": around(PROTO_QUERY),
                    "labels:0": np.repeat(np.arange(PROTO_WAY), PROTO_QUERY).astype(np.int32)})
    return out


# rows_meeting_mlp's kinds, by what the analysis finds in them: (field, the ops' names)
ROWS_MEETING = {
    "mixup": ("moved_rows", ["mixed_x", "mixed_y"]),
    "mixup_sliced": ("moved_rows", ["mixed_x/strided_slice", "mixed_y/strided_slice"]),
    "mixup_shuffled": ("moved_rows", ["mixed_x", "mixed_y"]),
    "roll": ("moved_rows", ["mixed_x", "mixed_y"]),
    "mixup_beta": ("moved_rows", ["mixed_x", "mixed_y"]),
    "mixup_per_row": ("moved_rows", ["mixed_x", "mixed_y"]),
    "mixup_hidden": ("moved_rows", ["mixed_h", "mixed_y"]),
    "hardest_rows": ("moved_rows", ["hardest"]),
    "hardest_gathered": ("moved_rows", ["hardest"]),
    "hardest_gathered_alone": ("moved_rows", ["hardest"]),
    "hardest_entries": ("moved_rows", ["hardest"]),
    "center_loss": ("batch_statistics", ["center"]),
    "mean_features": ("batch_statistics", ["center"]),
    "batch_max": ("batch_statistics", ["center"]),
    "cross_correlation": ("batch_statistics", ["center"]),
    "covariance": ("batch_statistics", ["center_mean", "center"]),
    "center_by_hand": ("batch_statistics", ["center"]),
    "mixed_count": ("batch_statistics", ["center"]),
    "reshaped_count": ("batch_statistics", ["center"]),
    "size_count": ("batch_statistics", ["center"]),
    "fused_batch_norm": ("batch_statistics", ["bn"]),
    "labelled_rows": ("selected_means", ["loss_of_labelled"]),
    "partitioned_rows": ("selected_means", ["loss_of_labelled"]),
    "halves": ("positioned_rows", ["halves"]),
    "first_rows": ("positioned_rows", ["first/strided_slice_1"]),   # (strided_slice: the shape's [0])
}
# kinds where no row meets another: each trains as one device
ROWS_APART = ("plain", "reversed_features", "mean_by_hand", "perplexity", "inference_batch_norm",
              "normalised_by_count")


def rows_meeting_mlp(kind="plain"):
    """dropout_mlp's network (x [None, 4] -> dense 16 relu -> dense 1, squared error, SGD
    0.1 with a global step) with a forward op in which, per ``kind``, rows of the batch
    meet other rows (ROWS_MEETING: mixup by ``tf.reverse(x, [0])``, by ``x[::-1]``, by a gather of
    ``tf.random.shuffle(tf.range(n))`` or by ``tf.roll``; a center loss ``h -
    reduce_mean(h, 0)``, a loss on the batch's mean features, on the largest output of
    the batch, on the features' cross-correlation over the batch divided by
    ``tf.shape(h)[0]`` (or by the first axis of a reshape of h to [2, -1], not its
    rows, or by ``tf.size(h) / 16``), on their covariance (VICReg: divided by ``n - 1``), a center loss by hand ``h - reduce_sum(h, 0) / n`` with
    the distances' mean by hand too, a sum over the rows and the square of a sum over
    them divided by one count; the mean loss of the quarter of the rows with the largest loss (tf.nn.top_k);
    a fused BatchNorm in training mode; the mean loss of the rows with
    ``x[:, 0] > 0`` by tf.boolean_mask or tf.dynamic_partition; the batch's halves
    pulled together, ``tf.split(h, 2, 0)``, as for two views an input pipeline put in
    them; a loss on the first half of the rows, ``h[:n // 2]``) or none does
    (ROWS_APART: features reversed, a mean by hand ``reduce_sum / tf.shape(x)[0]``, a
    perplexity only fetched, a fused BatchNorm in inference mode, the labelled rows'
    loss summed and divided by their count, a normaliser the rewrite syncs). Returns the
    GraphDef (fetch loss:0, run train_op, init; variables w1, w2)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x, y, w1, w2 = _mlp_inputs(None)
        if kind in ("mixup_beta", "mixup_per_row"):   # mixup as its paper draws it: lam ~ Beta(0.2, 0.2)
            beta = tf1.distributions.Beta(0.2, 0.2)
            if kind == "mixup_beta":   # one lam per batch, a seeded shuffle of the rows
                lam = beta.sample(seed=7)
                order = tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=5)
                move = lambda t, name: tf.gather(t, order, name=name)   # noqa: E731
            else:   # one lam per row, the batch reversed
                lam = tf.reshape(beta.sample(tf.shape(x)[0], seed=7), [-1, 1])
                move = lambda t, name: tf.reverse(t, [0], name=name)   # noqa: E731
            x, y = lam * x + (1.0 - lam) * move(x, "mixed_x"), lam * y + (1.0 - lam) * move(y, "mixed_y")
        elif kind in ("mixup", "mixup_sliced", "mixup_shuffled", "roll"):
            if kind == "mixup":
                move = lambda t, name: tf.reverse(t, [0], name=name)   # noqa: E731
            elif kind == "mixup_sliced":
                def move(t, name):
                    with tf.name_scope(name):
                        return t[::-1]
            elif kind == "roll":
                move = lambda t, name: tf.roll(t, 1, 0, name=name)   # noqa: E731
            else:
                order = tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=5)
                move = lambda t, name: tf.gather(t, order, name=name)   # noqa: E731
            x, y = 0.7 * x + 0.3 * move(x, "mixed_x"), 0.7 * y + 0.3 * move(y, "mixed_y")
        elif kind == "reversed_features":
            x = x + 0.5 * tf.reverse(x, [1])
        labelled = x[:, 0] > 0.0
        if kind == "labelled_rows":
            x, y = tf.boolean_mask(x, labelled), tf.boolean_mask(y, labelled)
        elif kind == "partitioned_rows":
            part = tf.cast(labelled, tf.int32)
            x, y = tf.dynamic_partition(x, part, 2)[1], tf.dynamic_partition(y, part, 2)[1]
        h = tf.matmul(x, w1)
        if kind in ("fused_batch_norm", "inference_batch_norm"):
            training = kind == "fused_batch_norm"
            stats = {} if training else {"mean": tf.zeros([16]), "variance": tf.ones([16])}
            h4, _, _ = tf1.nn.fused_batch_norm(tf.reshape(h, [-1, 1, 1, 16]), tf.ones([16]), tf.zeros([16]),
                                               is_training=training, name="bn", **stats)
            h = tf.reshape(h4, [-1, 16])
        h = tf.nn.relu(h)
        if kind == "mixup_hidden":   # manifold mixup: the hidden features mixed, their gradients cross rows
            h = 0.7 * h + 0.3 * tf.reverse(h, [0], name="mixed_h")
            y = 0.7 * y + 0.3 * tf.reverse(y, [0], name="mixed_y")
        err = tf.square(tf.matmul(h, w2) - y)
        if kind in ("labelled_rows", "partitioned_rows"):
            loss = tf.reduce_mean(err, name="loss_of_labelled")
        elif kind == "hardest_rows":   # online hard example mining: the quarter of the rows with the largest loss
            rows = tf.reshape(err, [-1])
            loss = tf.reduce_mean(tf.nn.top_k(rows, k=tf.shape(rows)[0] // 4, name="hardest").values)
        elif kind == "hardest_gathered":   # the same by the indices, k a fraction of a float count, plus all rows'
            rows = err[:, 0]
            k = tf.cast(0.25 * tf.cast(tf.size(rows), tf.float32), tf.int32)
            hardest = tf.gather(rows, tf.nn.top_k(rows, k=k, name="hardest").indices)
            loss = 0.5 * tf.reduce_mean(err) + 0.5 * tf.reduce_mean(hardest)
        elif kind == "hardest_gathered_alone":   # the same of row sums alone: the gather's gradient stays sparse
            rows = tf.reduce_sum(err, 1)
            k = tf.cast(0.25 * tf.cast(tf.size(rows), tf.float32), tf.int32)
            loss = tf.reduce_mean(tf.gather(rows, tf.nn.top_k(rows, k=k, name="hardest").indices))
        elif kind == "hardest_entries":   # a segmentation's: the 8 largest of every row's every entry's loss
            entries = tf.reshape(tf.square(tf.matmul(h, w2) - y) + 0.01 * tf.square(h), [-1])
            loss = tf.reduce_mean(tf.nn.top_k(entries, k=8, sorted=False, name="hardest").values)
        elif kind == "mean_by_hand":
            loss = tf.reduce_sum(err) / tf.cast(tf.shape(x)[0], tf.float32)
        elif kind == "normalised_by_count":
            mask = tf.cast(labelled, tf.float32)
            loss = tf.reduce_sum(err[:, 0] * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
        else:
            loss = tf.reduce_mean(err)
        if kind == "center_loss":
            loss += 0.5 * tf.reduce_mean(tf.square(h - tf.reduce_mean(h, 0, name="center")))
        elif kind == "mean_features":
            loss += 0.5 * tf.reduce_sum(tf.square(tf.reduce_mean(h, 0, name="center") - 0.5))
        elif kind == "batch_max":
            loss += 0.1 * tf.reduce_max(tf.abs(h), name="center")
        elif kind in ("cross_correlation", "reshaped_count", "size_count"):
            # Barlow Twins' redundancy reduction: C = h^T h / n, off-diagonal to 0
            if kind == "size_count":   # n as the count of h's elements over its 16 features
                rows = tf.cast(tf.size(h), tf.float32) / 16.0
            else:
                rows = tf.cast(tf.shape(h if kind == "cross_correlation" else tf.reshape(h, [2, -1]))[0],
                               tf.float32)
            c = tf.matmul(h, h, transpose_a=True, name="center") / rows
            loss += 0.01 * tf.reduce_sum(tf.square(c - tf.linalg.diag(tf.linalg.diag_part(c))))
        elif kind == "covariance":   # VICReg's covariance term: the centred features' C = h_c^T h_c / (n - 1)
            centred = h - tf.reduce_mean(h, 0, name="center_mean")
            c = tf.matmul(centred, centred, transpose_a=True, name="center") / (
                tf.cast(tf.shape(h)[0], tf.float32) - 1.0)
            loss += 0.01 * tf.reduce_sum(tf.square(c - tf.linalg.diag(tf.linalg.diag_part(c))))
        elif kind in ("center_by_hand", "mixed_count"):   # a sum over the rows divided by their count
            n = tf.cast(tf.shape(h)[0], tf.float32)
            total = tf.reduce_sum(h, 0, name="center")
            if kind == "center_by_hand":   # the center n's whole batch's, the distances' mean n's replica's
                loss += 0.5 * tf.reduce_sum(tf.square(h - total / n)) / n
            else:   # one count for a sum over the replica's rows and a value of the whole batch's sum
                loss += 0.1 * (tf.reduce_sum(tf.square(h)) + tf.reduce_sum(tf.square(total))) / n
        elif kind == "halves":
            first, second = tf.split(h, 2, 0, name="halves")
            loss += 0.5 * tf.reduce_mean(tf.square(first - second))
        elif kind == "first_rows":
            with tf.name_scope("first"):
                loss += 0.5 * tf.reduce_mean(tf.square(h[:tf.shape(h)[0] // 2]))
        elif kind == "perplexity":
            tf.exp(loss, name="perplexity")
        elif kind not in ROWS_MEETING and kind not in ROWS_APART:
            raise ValueError(f"rows_meeting_mlp: unknown kind {kind!r}")
        loss = tf.identity(loss, name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


# batch_norm_cnn's kinds: how its two BatchNorms are written
BATCH_NORMS = ("layers", "layers_cond", "moments", "fused_average", "nchw")
V2_COND_BATCH_NORMS = ("layers_cond_v2",)   # statistics in a v2 cond's function
RENORMS = ("renorm", "renorm_cond", "renorm_cond_v2")   # batch renormalization, as the layers kinds
RENORM_CLIPPING = {"rmax": 1.5, "rmin": 0.7, "dmax": 0.5}


def batch_norm_cnn(kind="layers"):
    """A small CNN with two BatchNorms in training mode, in the way TF1 scripts write them
    (BATCH_NORMS): ``layers`` is tf.compat.v1.layers.batch_normalization(training=True)
    (a fused BatchNorm on 4-D input; moving averages in UPDATE_OPS, grouped into the
    train op as its documentation says); ``layers_cond`` the same behind a v1 tf.cond on
    a ``training`` placeholder (default True); ``layers_cond_v2`` the same behind a v2
    cond (TensorFlow 2's control flow, which tf.compat.v1 graphs get unless the script
    disables it: the BatchNorm is in the cond's branch function, V2_COND_BATCH_NORMS);
    ``renorm``, ``renorm_cond`` and ``renorm_cond_v2`` the layers kinds with batch
    renormalization (Ioffe, 2017: ``renorm=True``, RENORM_CLIPPING, renorm_momentum
    0.9; not fused: the layer moves renorm_mean and moving_mean towards the one batch
    mean, renorm_stddev and moving_stddev towards its deviation, and scales the
    normalised rows by r and d, clipped ratios of the batch's moments to the renorm
    averages, under stop_gradient); ``moments`` tf.nn.moments and
    tf.nn.batch_normalization by hand; ``fused_average`` tf.nn.fused_batch_norm keeping
    its moving averages itself (exponential_avg_factor 0.1, what tf_keras' fused path
    does eagerly); ``nchw`` fused BatchNorms of channels-first tensors. x [None, 6, 6, 2]
    -> conv 3x3 (4) -> BN -> relu -> conv 3x3 stride 2 (4) -> BN -> relu -> mean over
    the image -> dense 1, squared error, Momentum 0.1 / 0.9 with a global step. Returns
    (GraphDef, {variable: tensor to read} of every variable, slots and moving averages
    included): fetch loss:0, run train_op, init."""
    tf, tf1 = _tf()
    from graph_rewriter.testing.models import _batch_normalization
    g = tf.Graph()
    before = tf1.control_flow_v2_enabled()
    renorm = kind.startswith("renorm")
    if kind in ("layers_cond", "renorm_cond"):
        tf1.disable_control_flow_v2()    # a TF1 script's tf.cond: Switch and Merge (restored below)
    elif kind in ("layers_cond_v2", "renorm_cond_v2"):
        tf1.enable_control_flow_v2()     # an If op and its branch functions (restored below)
    try:
        with g.as_default():
            tf1.set_random_seed(1)
            x = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="x")
            y = tf1.placeholder(tf.float32, [None, 1], name="y")
            training = tf1.placeholder_with_default(True, [], name="training") if "_cond" in kind else True

            def variable(name, shape, init, trainable=True):
                return tf1.get_variable(name, shape, initializer=init, trainable=trainable)

            def batch_norm(h, name):
                if kind.startswith("layers") or renorm:
                    extra = dict(renorm=True, renorm_clipping=RENORM_CLIPPING, renorm_momentum=0.9) if renorm else {}
                    return _batch_normalization()(h, training=training, momentum=0.9, name=name, **extra)
                gamma = variable(f"{name}/gamma", [4], tf1.ones_initializer())
                beta = variable(f"{name}/beta", [4], tf1.zeros_initializer())
                moving_mean = variable(f"{name}/moving_mean", [4], tf1.zeros_initializer(), trainable=False)
                moving_var = variable(f"{name}/moving_variance", [4], tf1.ones_initializer(), trainable=False)
                if kind == "moments":
                    mean, var = tf.nn.moments(h, [0, 1, 2], name=f"{name}/moments")
                    for moving, value in ((moving_mean, mean), (moving_var, var)):
                        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                                              tf1.assign_sub(moving, 0.1 * (moving - value)))
                    return tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
                nchw = kind == "nchw"
                if nchw:
                    h = tf.transpose(h, [0, 3, 1, 2])
                out, mean, var = tf1.nn.fused_batch_norm(
                    h, gamma, beta, mean=moving_mean, variance=moving_var, epsilon=1e-3, is_training=True,
                    data_format="NCHW" if nchw else "NHWC", name=name,
                    exponential_avg_factor=0.1 if kind == "fused_average" else 1.0)
                decay = 1.0 if kind == "fused_average" else 0.1   # the kernel averaged already
                for moving, value in ((moving_mean, mean), (moving_var, var)):
                    tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                                          tf1.assign_sub(moving, decay * (moving - value)))
                return tf.transpose(out, [0, 2, 3, 1]) if nchw else out

            k1 = variable("conv1", [3, 3, 2, 4], tf1.glorot_uniform_initializer(seed=2))
            h = tf.nn.relu(batch_norm(tf.nn.conv2d(x, k1, 1, "SAME"), "bn1"))
            k2 = variable("conv2", [3, 3, 4, 4], tf1.glorot_uniform_initializer(seed=3))
            h = tf.nn.relu(batch_norm(tf.nn.conv2d(h, k2, 2, "SAME"), "bn2"))
            w = variable("dense", [4, 1], tf1.glorot_uniform_initializer(seed=4))
            loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(tf.reduce_mean(h, [1, 2]), w) - y)), name="loss")
            step = tf1.train.get_or_create_global_step()
            minimize = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
            tf.group(minimize, *tf1.get_collection(tf1.GraphKeys.UPDATE_OPS), name="train_op")
            tf1.global_variables_initializer()
            reads = {v.op.name: f"{v.op.name}/Read/ReadVariableOp:0" if v.op.type == "VarHandleOp" else v.name
                     for v in tf1.global_variables()}
    finally:
        (tf1.enable_control_flow_v2 if before else tf1.disable_control_flow_v2)()
    if kind not in BATCH_NORMS + V2_COND_BATCH_NORMS + RENORMS:
        raise ValueError(f"batch_norm_cnn: unknown kind {kind!r}")
    return g.as_graph_def(), reads


def cnn_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` images for batch_norm_cnn."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, 6, 6, 2).astype(np.float32), "y:0": rng.randn(batch, 1).astype(np.float32)}
            for _ in range(steps)]


def batch_norm_twice(kind="discriminator"):
    """One BatchNorm's variables updated by two of its applications: ``discriminator``, a
    GAN discriminator's step (conv 3x3 -> tf.compat.v1.layers.batch_normalization -> relu
    -> mean -> dense 1, reused on real images x and fake ones z; least-squares loss, SGD
    0.1; the moving averages updated by both applications through UPDATE_OPS, the fake
    images' application built under a control dependency on the real ones' updates);
    ``keras_call``, a tf_keras functional model (Conv2D without a bias,
    BatchNormalization, Flatten, Dense; seeded) built on its own Input and called on x with training=True, whose updates for x
    the train op runs (Momentum 0.1 / 0.9). The batch norm's moving averages then have
    two updates in the graph. Returns (GraphDef, {variable: tensor to read}): fetch
    loss:0, run train_op, init; feeds x (and z) [None, 6, 6, 2], y [None, 1]."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="x")
        if kind == "discriminator":
            from graph_rewriter.testing.models import _batch_normalization
            z = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="z")

            def discriminator(images, reuse):
                with tf1.variable_scope("d", reuse=reuse):
                    k = tf1.get_variable("conv", [3, 3, 2, 4], initializer=tf1.glorot_uniform_initializer(seed=2))
                    w = tf1.get_variable("dense", [4, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
                    h = _batch_normalization()(tf.nn.conv2d(images, k, 1, "SAME"), training=True, momentum=0.9,
                                               name="bn")
                    return tf.matmul(tf.reduce_mean(tf.nn.relu(h), [1, 2]), w)

            on_real = discriminator(x, False)
            # The fake images' application after the real ones' updates, as a careful script
            # orders them: each update of a moving average reads it before its AssignSub,
            # so unordered, one device too ends now and then with the other order's averages.
            with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
                on_fake = discriminator(z, True)
            loss = tf.reduce_mean(tf.square(on_real - 1.0)) + tf.reduce_mean(tf.square(on_fake))
            updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
            optimizer = tf1.train.GradientDescentOptimizer(0.1)
        elif kind == "keras_call":
            from graph_rewriter.testing.models import import_tf_keras
            keras = import_tf_keras("batch_norm_twice('keras_call')")
            y = tf1.placeholder(tf.float32, [None, 1], name="y")
            inp = keras.Input(shape=(6, 6, 2))
            # seeded (tf_keras seeds unseeded initialisers at random per process); no bias
            # before the BatchNorm (its gradient would be zero, rounding noise alone)
            conv = keras.layers.Conv2D(4, 3, use_bias=False, name="conv",
                                       kernel_initializer=keras.initializers.GlorotUniform(seed=2))
            dense = keras.layers.Dense(1, name="dense", kernel_initializer=keras.initializers.GlorotUniform(seed=3))
            h = keras.layers.BatchNormalization(name="bn")(conv(inp))
            model = keras.Model(inp, dense(keras.layers.Flatten()(h)))
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            updates = model.get_updates_for(x)
            optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
        else:
            raise ValueError(f"batch_norm_twice: unknown kind {kind!r}")
        loss = tf.identity(loss, name="loss")
        step = tf1.train.get_or_create_global_step()
        tf.group(optimizer.minimize(loss, global_step=step), *updates, name="train_op")
        tf1.global_variables_initializer()
        reads = {v.op.name: f"{v.op.name}/Read/ReadVariableOp:0" if v.op.type == "VarHandleOp" else v.name
                 for v in tf1.global_variables()}
    return g.as_graph_def(), reads


def gan_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` real (x) and fake (z) images for batch_norm_twice."""
    rng = np.random.RandomState(seed)
    return [{"x:0": rng.randn(batch, 6, 6, 2).astype(np.float32) + 0.5,
             "z:0": rng.randn(batch, 6, 6, 2).astype(np.float32)} for _ in range(steps)]


MULTI_TASK_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "rmsprop")


def multi_task(optimizer="adam", shared_optimizer=False, embedding=False, clip=False):
    """Two tasks over one encoder, trained in turns: ids [., 3] -> a mean of their
    embeddings (``embedding``: a variable [20, 4] gathered, so its gradients are sparse)
    or features x [., 4] -> dense 8 relu (the shared encoder) -> a head of one output per
    task; task A's mean squared error minimized by "train_a", task B's by "train_b" (which
    bumps global_step), each over the encoder and its own head. With ``shared_optimizer``
    one optimizer object builds both (its slots shared: one Adam moment per variable), else
    one each; with ``clip`` each task's gradients are clipped to a global norm of 0.5 before
    they are applied. Every shared variable receives two gradients, one per train op."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        if embedding:
            ids = tf1.placeholder(tf.int32, [None, 3], name="ids")
            table = tf1.get_variable("embedding", [20, 4])
            features = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
        else:
            features = tf1.placeholder(tf.float32, [None, 4], name="x")
        targets = {task: tf1.placeholder(tf.float32, [None, 1], name=f"y_{task}") for task in "ab"}

        shared = _dense(features, 8, "encoder", tf.nn.relu)
        losses = {task: tf.reduce_mean(tf.square(_dense(shared, 1, f"head_{task}") - targets[task]),
                                       name=f"loss_{task}") for task in "ab"}
        make = {"sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
                "momentum": lambda: tf1.train.MomentumOptimizer(0.05, 0.9),
                "adam": lambda: tf1.train.AdamOptimizer(0.01),
                "adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
                "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.01)}[optimizer]
        first = make()
        second = first if shared_optimizer else make()
        step = tf1.train.get_or_create_global_step()
        for task, optimizer_, bump in (("a", first, None), ("b", second, step)):
            pairs = optimizer_.compute_gradients(losses[task])
            if clip:
                grads, _ = tf.clip_by_global_norm([g for g, _ in pairs], 0.5)
                pairs = [(g, v) for g, (_, v) in zip(grads, pairs)]
            optimizer_.apply_gradients(pairs, global_step=bump, name=f"train_{task}")
        tf.group(tf1.global_variables_initializer(), name="init")
        reads = {v.op.name: f"{v.op.name}/Read/ReadVariableOp:0" for v in tf1.global_variables()}
    return g.as_graph_def(), reads


def multi_task_batches(steps, batch, embedding=False, seed=0):
    """``steps`` feeds of ``batch`` rows for multi_task: inputs and both tasks' targets."""
    rng = np.random.RandomState(seed)
    feeds = []
    for _ in range(steps):
        feed = {"y_a:0": rng.randn(batch, 1).astype(np.float32),
                "y_b:0": rng.randn(batch, 1).astype(np.float32)}
        if embedding:
            feed["ids:0"] = rng.randint(0, 20, size=(batch, 3)).astype(np.int32)
        else:
            feed["x:0"] = rng.randn(batch, 4).astype(np.float32)
        feeds.append(feed)
    return feeds


SPARSE_VOCAB = 12


def sparse_features_model(source="placeholder", batch=8, drop_remainder=False, records=None, partitions=None):
    """A Wide & Deep click model over a variable-length sparse feature, as TF1 CTR scripts
    feed one: ``ids``, a SparseTensor [batch, None] of int64 ids (some rows have none),
    ``x`` [batch, 3] dense features, ``y`` [batch, 1] clicks. Wide: the ids' weights
    summed (safe_embedding_lookup_sparse with combiner "sum", as a linear feature
    column does), FTRL; deep: the ids' mean embedding (an empty row's is zero) with x,
    a hidden layer, Adagrad; sigmoid cross-entropy; both updates in train_op.

    ``source``: "placeholder", tf.compat.v1.sparse_placeholder(name="ids") and
    placeholders x, y (fed by sparse_feature_batches); "dataset", tf.data over
    ``records`` (sparse_feature_records: serialized tf.train.Examples) parsed with
    tf.io.VarLenFeature, batched by ``batch`` (``drop_remainder``) behind an
    initializable iterator (its initializer runs in "init"); "queue", TF1 queues over
    ``records`` (an input producer in order, tf.parse_single_example, tf.train.batch of
    ``batch`` with one thread: the SparseTensor goes through the batch's queue as a
    handle into a SparseTensorsMap). ``partitions``: the deep embedding a
    PartitionedVariable of that many parts (tf.compat.v1.fixed_size_partitioner, as TF1
    scripts split a large embedding: deep/embedding/part_0, ...). Returns the GraphDef
    (for "queue" the MetaGraphDef, which holds the QueueRunners)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        if source == "placeholder":
            ids = tf1.sparse_placeholder(tf.int64, shape=[None, None], name="ids")
            x = tf1.placeholder(tf.float32, [None, 3], name="x")
            y = tf1.placeholder(tf.float32, [None, 1], name="y")
            iterators = []
        elif source == "queue":
            spec = {"ids": tf.io.VarLenFeature(tf.int64), "x": tf.io.FixedLenFeature([3], tf.float32),
                    "y": tf.io.FixedLenFeature([1], tf.float32)}
            record = tf1.train.input_producer(tf.constant(records), shuffle=False).dequeue()
            features = tf1.train.batch(tf1.parse_single_example(record, spec), batch_size=batch, num_threads=1)
            ids, x, y = features["ids"], features["x"], features["y"]
            iterators = []
        else:
            spec = {"ids": tf.io.VarLenFeature(tf.int64), "x": tf.io.FixedLenFeature([3], tf.float32),
                    "y": tf.io.FixedLenFeature([1], tf.float32)}
            ds = tf.data.Dataset.from_tensor_slices(records).batch(batch, drop_remainder=drop_remainder)
            iterator = tf1.data.make_initializable_iterator(ds.map(lambda s: tf.io.parse_example(s, spec)))
            features = iterator.get_next()
            ids, x, y = features["ids"], features["x"], features["y"]
            iterators = [iterator.initializer]
        wide_w = tf1.get_variable("wide/weights", [SPARSE_VOCAB, 1], initializer=tf1.zeros_initializer())
        embedding = tf1.get_variable("deep/embedding", [SPARSE_VOCAB, 4], partitioner=partitions and
                                     tf1.fixed_size_partitioner(partitions))
        wide = tf1.nn.safe_embedding_lookup_sparse([wide_w], ids, combiner="sum")
        deep = tf1.nn.safe_embedding_lookup_sparse(list(embedding) if partitions else [embedding], ids,
                                                   combiner="mean")
        h = _dense(tf.concat([deep, x], 1), 8, "deep/hidden", tf.nn.relu)
        logits = _dense(h, 1, "deep/out") + wide
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        wide_vars = [wide_w]
        deep_vars = [v for v in tf1.trainable_variables() if v not in wide_vars]
        tf.group(tf1.train.FtrlOptimizer(0.2).minimize(loss, var_list=wide_vars),
                 tf1.train.AdagradOptimizer(0.1).minimize(loss, var_list=deep_vars), name="train_op")
        tf.group(tf1.variables_initializer(tf1.global_variables(), name="init_variables"), *iterators, name="init")
        if source == "queue":
            return tf1.train.export_meta_graph()
    return g.as_graph_def()


def _sparse_rows(rng, batch):
    """``batch`` rows of 0 to 3 ids each, the first row's and every fifth one's none."""
    return [[] if r % 5 == 0 else list(rng.randint(0, SPARSE_VOCAB, size=1 + rng.randint(3)))
            for r in range(batch)]


def sparse_feature_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` rows for sparse_features_model("placeholder"): the
    SparseTensor's three placeholders by name ("ids/indices:0", "ids/values:0",
    "ids/shape:0", entries in row order), x and y."""
    rng = np.random.RandomState(seed)
    feeds = []
    for _ in range(steps):
        rows = _sparse_rows(rng, batch)
        indices = [[r, k] for r, row in enumerate(rows) for k in range(len(row))]
        feeds.append({"ids/indices:0": np.array(indices, np.int64).reshape(-1, 2),
                      "ids/values:0": np.array(sum(rows, []), np.int64),
                      "ids/shape:0": np.array([batch, max(map(len, rows))], np.int64),
                      "x:0": rng.randn(batch, 3).astype(np.float32),
                      "y:0": (rng.rand(batch, 1) < 0.3).astype(np.float32)})
    return feeds


def sparse_feature_records(count, seed=0):
    """``count`` serialized tf.train.Examples for sparse_features_model("dataset")."""
    tf, _ = _tf()
    rng = np.random.RandomState(seed)
    out = []
    for row in _sparse_rows(rng, count):
        feature = {"ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row)),
                   "x": tf.train.Feature(float_list=tf.train.FloatList(value=list(rng.randn(3)))),
                   "y": tf.train.Feature(float_list=tf.train.FloatList(value=[float(rng.rand() < 0.3)]))}
        out.append(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return out


FC_WORDS = [b"news", b"sports", b"music", b"games", b"travel", b"food"]


def feature_column_records(count, seed=0):
    """``count`` serialized tf.train.Examples for feature_column_model: "tags" (0 to 3
    words, none in every fifth row), "city" (one word), "age" (a float), "y" (a click)."""
    tf, _ = _tf()
    rng = np.random.RandomState(seed)
    out = []
    for r in range(count):
        n = 0 if r % 5 == 0 else 1 + rng.randint(3)
        feature = {
            "tags": tf.train.Feature(bytes_list=tf.train.BytesList(value=[FC_WORDS[i] for i in rng.randint(6, size=n)])),
            "city": tf.train.Feature(bytes_list=tf.train.BytesList(value=[FC_WORDS[rng.randint(6)]])),
            "age": tf.train.Feature(float_list=tf.train.FloatList(value=[rng.rand()])),
            "y": tf.train.Feature(float_list=tf.train.FloatList(value=[float(rng.rand() < 0.3)]))}
        out.append(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return out


def feature_column_model(records, batch=8):
    """A TF1 Wide & Deep estimator's graph written with tf.compat.v1.feature_column, over
    ``records`` (feature_column_records) read by tf.data: the features parsed with the
    columns' own parse spec (tags, a tf.io.VarLenFeature of strings: a SparseTensor of
    the batch), a hashed column, a vocabulary list (a lookup table, initialized by
    "init" with the variables and the iterator), a crossed column; deep: input_layer of
    tags' mean embedding, city's one-hot and age, a hidden layer; wide: linear_model of
    tags, city and their cross; sigmoid cross-entropy, Adagrad. Returns the GraphDef."""
    tf, tf1 = _tf()
    fc = tf1.feature_column
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(6)
        tags = fc.categorical_column_with_hash_bucket("tags", 20)
        city = fc.categorical_column_with_vocabulary_list("city", FC_WORDS)
        age = fc.numeric_column("age")
        spec = fc.make_parse_example_spec([tags, city, age])
        spec["y"] = tf.io.FixedLenFeature([1], tf.float32)
        ds = tf.data.Dataset.from_tensor_slices(records).batch(batch).map(lambda s: tf.io.parse_example(s, spec))
        iterator = tf1.data.make_initializable_iterator(ds)
        features = iterator.get_next()
        y = features.pop("y")
        deep = fc.input_layer(features, [fc.embedding_column(tags, 4, combiner="mean"), fc.indicator_column(city), age])
        logits = (_dense(_dense(deep, 8, "hidden", tf.nn.relu), 1, "out")
                  + fc.linear_model(features, [tags, city, fc.crossed_column(["tags", city], 30)]))
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        tf1.train.AdagradOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.variables_initializer(tf1.global_variables(), name="init_variables"), tf1.tables_initializer(),
                 iterator.initializer, name="init")
    return g.as_graph_def()


CTC_STEPS, CTC_FEATURES, CTC_CLASSES = 10, 5, 6


def ctc_model(named=True):
    """A speech model's CTC loss as TF1 scripts write it (DeepSpeech-style, scaled down):
    x [None, CTC_STEPS, CTC_FEATURES] frames, lengths [None] frames per utterance, the
    transcripts a tf.compat.v1.sparse_placeholder(tf.int32, name="labels") (labels per
    utterance vary; unnamed unless ``named``, as many scripts leave it); a per-frame
    linear layer, tf.compat.v1.nn.ctc_loss on its time-major logits, the batch mean,
    Momentum. Returns the GraphDef."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(7)
        x = tf1.placeholder(tf.float32, [None, CTC_STEPS, CTC_FEATURES], name="x")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        labels = tf1.sparse_placeholder(tf.int32, name="labels" if named else None)
        w = tf1.get_variable("w", [CTC_FEATURES, CTC_CLASSES])
        b = tf1.get_variable("b", [CTC_CLASSES], initializer=tf1.zeros_initializer())
        logits = tf.reshape(tf.matmul(tf.reshape(x, [-1, CTC_FEATURES]), w) + b, [-1, CTC_STEPS, CTC_CLASSES])
        loss = tf.reduce_mean(tf1.nn.ctc_loss(labels, tf.transpose(logits, [1, 0, 2]), lengths), name="loss")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def ctc_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` utterances for ctc_model: 1 to 4 labels each, the
    frames per utterance from CTC_STEPS - 2 to CTC_STEPS."""
    rng = np.random.RandomState(seed)
    feeds = []
    for _ in range(steps):
        counts = 1 + rng.randint(4, size=batch)
        indices = [[r, k] for r in range(batch) for k in range(counts[r])]
        feeds.append({"x:0": rng.randn(batch, CTC_STEPS, CTC_FEATURES).astype(np.float32),
                      "lengths:0": (CTC_STEPS - rng.randint(3, size=batch)).astype(np.int32),
                      "labels/indices:0": np.array(indices, np.int64),
                      "labels/values:0": rng.randint(0, CTC_CLASSES - 1, size=len(indices)).astype(np.int32),
                      "labels/shape:0": np.array([batch, counts.max()], np.int64)})
    return feeds


TAG_STEPS, TAG_VOCAB, TAG_EMBED, TAG_HIDDEN, TAG_CLASSES = 7, 13, 6, 5, 4
TAG_SENTENCES = 48   # the dataset source's sentences


class _LSTMCell:
    """The LSTM cell a TF1 script hands tf.compat.v1.nn.dynamic_rnn
    (tf.compat.v1.nn.rnn_cell.LSTMCell's arithmetic, forget bias 1.0), written out:
    under Keras 3 TensorFlow no longer ships the rnn_cell classes, and dynamic_rnn asks
    only for state_size, output_size, zero_state and a call. Variables "kernel" [inputs
    + hidden, 4 * hidden] and "bias" under ``scope`` in dynamic_rnn's own scope
    ("bidirectional_rnn/fw/fw/kernel"). ``dropout``: the rate of a dropout on the step's
    input (what a DropoutWrapper's input_keep_prob does), seeded, drawn at every step.
    ``hidden`` units, ``forget_bias`` (BasicLSTMCell's 0.0 in TensorFlow's PTB tutorial).
    ``zeros``: how zero_state builds the state: "stack" one ``tf.zeros(tf.stack([batch,
    hidden]))`` for c and h; "cell" as rnn_cell's zero_state does, a Fill each for c and
    h of ``concat([expand_dims(batch, 0), [hidden]])`` (of two constants for a Python
    int batch); "zeros" ``tf.zeros([batch, hidden])`` each (a Const for an int batch)."""

    def __init__(self, scope, dropout=0.0, hidden=TAG_HIDDEN, forget_bias=1.0, zeros="stack"):
        self.scope, self.dropout, self.hidden, self.forget_bias, self.zeros = (
            scope, dropout, hidden, forget_bias, zeros)

    @property
    def state_size(self):
        return self.hidden, self.hidden

    @property
    def output_size(self):
        return self.hidden

    def zero_state(self, batch_size, dtype, name=None):
        tf, _ = _tf()
        if self.zeros == "stack":
            zeros = tf.zeros(tf.stack([batch_size, self.hidden]), dtype)
            return zeros, zeros
        if self.zeros == "cell":
            rows = tf.constant([batch_size]) if isinstance(batch_size, int) else tf.expand_dims(batch_size, 0)
            size = tf.concat([rows, tf.constant([self.hidden])], 0)
        else:
            size = [batch_size, self.hidden]
        names = (f"{name}_c", f"{name}_h") if name else (None, None)
        return tuple(tf.zeros(size, dtype, name=n) for n in names)

    def __call__(self, x, state, scope=None):
        tf, tf1 = _tf()
        c, h = state
        if self.dropout:
            x = tf.nn.dropout(x, rate=self.dropout, seed=5)
        with tf1.variable_scope(self.scope, reuse=tf1.AUTO_REUSE):
            kernel = tf1.get_variable("kernel", [int(x.shape[-1]) + self.hidden, 4 * self.hidden])
            bias = tf1.get_variable("bias", [4 * self.hidden], initializer=tf1.zeros_initializer())
        i, j, f, o = tf.split(tf.matmul(tf.concat([x, h], 1), kernel) + bias, 4, 1)
        c = c * tf.sigmoid(f + self.forget_bias) + tf.sigmoid(i) * tf.tanh(j)
        h = tf.sigmoid(o) * tf.tanh(c)
        return h, (c, h)


def sequence_tagger(source="placeholder", control_flow=None, batch=8, dropout=0.0):
    """A part-of-speech tagger as TF1 scripts write it (a BiLSTM tagger, scaled down):
    token ids, sentence lengths and tags; an embedding; tf.compat.v1.nn.bidirectional_dynamic_rnn
    over the lengths (a tf.while_loop per direction that runs to the batch's longest
    sentence, tf.reverse_sequence for the backward one); a dense layer to the tags at
    every step; cross-entropy averaged over the real tokens (tf.sequence_mask: the
    padding is masked out, and the mean divides by the batch's token count); the
    gradients clipped by their global norm (tf.clip_by_global_norm, 0.1: it fires), Adam
    with a global step. ``source``: "placeholder" (tokens, tags [None, TAG_STEPS],
    lengths [None]; feed sequence_tagger_batches) or "dataset" (TAG_SENTENCES seeded
    sentences of 1 to TAG_STEPS tokens, cut to their lengths, padded_batch(``batch``) to
    the batch's longest, repeated: the time dimension is dynamic too). ``control_flow``
    "v1" or "v2" builds the while loops with that control flow. ``dropout``: the rate
    of a seeded dropout on every step's input, inside the loops (a DropoutWrapper's);
    its loops then run one step at a time (parallel_iterations=1), as a stateful draw
    in a loop is deterministic only so: steps running at once take their draws in any
    order. Returns the GraphDef (fetch loss:0 and grad_norm:0, run train_op, init)."""
    from graph_rewriter.testing.models import ControlFlow
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        tf1.set_random_seed(3)
        if source == "placeholder":
            tokens = tf1.placeholder(tf.int32, [None, TAG_STEPS], name="tokens")
            lengths = tf1.placeholder(tf.int32, [None], name="lengths")
            tags = tf1.placeholder(tf.int32, [None, TAG_STEPS], name="tags")
        elif source == "dataset":
            rng = np.random.RandomState(11)
            sentences = tf.data.Dataset.from_tensor_slices((
                rng.randint(TAG_VOCAB, size=(TAG_SENTENCES, TAG_STEPS)).astype(np.int32),
                rng.randint(1, TAG_STEPS + 1, size=TAG_SENTENCES).astype(np.int32),
                rng.randint(TAG_CLASSES, size=(TAG_SENTENCES, TAG_STEPS)).astype(np.int32)))
            sentences = sentences.map(lambda t, n, y: (t[:n], n, y[:n]))
            batches = sentences.padded_batch(batch, padded_shapes=([None], [], [None])).repeat()
            tokens, lengths, tags = tf1.data.make_one_shot_iterator(batches).get_next()
        else:
            raise ValueError(f"source must be 'placeholder' or 'dataset', got {source!r}")
        embedding = tf1.get_variable("embedding", [TAG_VOCAB, TAG_EMBED])
        x = tf.nn.embedding_lookup(embedding, tokens)
        (forward, backward), _ = tf1.nn.bidirectional_dynamic_rnn(
            _LSTMCell("fw", dropout), _LSTMCell("bw", dropout), x, sequence_length=lengths, dtype=tf.float32,
            **({"parallel_iterations": 1} if dropout else {}))
        h = tf.concat([forward, backward], 2)
        w = tf1.get_variable("tags/kernel", [2 * TAG_HIDDEN, TAG_CLASSES])
        b = tf1.get_variable("tags/bias", [TAG_CLASSES], initializer=tf1.zeros_initializer())
        logits = tf.einsum("btk,kc->btc", h, w) + b
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tags, logits=logits)
        mask = tf.sequence_mask(lengths, tf.shape(tokens)[1], dtype=tf.float32)
        loss = tf.identity(tf.reduce_sum(xent * mask) / tf.reduce_sum(mask), name="loss")
        step = tf1.train.get_or_create_global_step()
        optimizer = tf1.train.AdamOptimizer(0.05)
        grads, variables = zip(*optimizer.compute_gradients(loss))
        clipped, norm = tf.clip_by_global_norm(grads, 0.1)
        tf.identity(norm, name="grad_norm")
        optimizer.apply_gradients(zip(clipped, variables), global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def sequence_tagger_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` sentences for sequence_tagger's placeholders: lengths
    1 to TAG_STEPS (the batch's longest sets how long the while loops run), tokens and
    tags past a sentence's length are padding (random: the mask must hide them)."""
    rng = np.random.RandomState(seed)
    return [{"tokens:0": rng.randint(TAG_VOCAB, size=(batch, TAG_STEPS)).astype(np.int32),
             "lengths:0": rng.randint(1, TAG_STEPS + 1, size=batch).astype(np.int32),
             "tags:0": rng.randint(TAG_CLASSES, size=(batch, TAG_STEPS)).astype(np.int32)}
            for _ in range(steps)]


LM_VOCAB, LM_HIDDEN, LM_STEPS, LM_LAYERS = 29, 8, 5, 2
CARRIED_STATES = ("cell", "zeros", "placeholder", "with_default")   # fed by the script


def carried_state_lm(batch=None, state="cell", rnn="unrolled", control_flow=None):
    """A word language model that carries its LSTM state from step to step through the
    feed, as TensorFlow's PTB tutorial (ptb_word_lm.py) and char-rnn write it, scaled
    down: words x and next words y [batch, LM_STEPS]; an embedding; LM_LAYERS LSTM
    layers (BasicLSTMCell's arithmetic, forget bias 0.0); ``initial_state`` of every
    layer, c and h; a softmax over LM_VOCAB words; the cost PTB's sequence_loss gives
    (averaged over the batch, summed over the steps); the gradients clipped by their
    global norm (0.25: it fires) and SGD at 1.0 with a global step.

    ``batch``: an int builds static placeholders [batch, LM_STEPS] (one batch per
    replica) and the zero state for ``batch`` rows; None dynamic ones, the zero state's
    rows ``tf.shape(x)[0]``. ``state``, the tensors a script feeds with the last step's
    final state (their names: ``carried_state_names``):
    "cell" the zero state as rnn_cell's zero_state builds it (a Fill each);
    "zeros" as ``tf.zeros([batch, hidden])`` (a Const for an int batch);
    "placeholder" a placeholder each ([batch, hidden], [None, hidden]; fed from the
    first step, with zeros);
    "with_default" a placeholder_with_default each over rnn_cell's zero state;
    "variables" (static batches only) a non-trainable variable each, [batch, hidden]
    ("lm/state/layer_k_c"), zeros at first, read as the initial state and assigned the
    final state after the update (a stateful model: the script feeds nothing but the
    words).
    ``rnn``: "unrolled" (a Python loop over the steps, as PTB builds it) or
    "dynamic_rnn" (tf.compat.v1.nn.dynamic_rnn over a MultiRNNCell-like stack, a while
    loop; ``control_flow`` "v1" or "v2"). Returns the GraphDef (fetch loss:0 and the
    final state, run train_op, init)."""
    from graph_rewriter.testing.models import ControlFlow
    tf, tf1 = _tf()
    if state not in CARRIED_STATES + ("variables",) or (state == "variables" and batch is None):
        raise ValueError(f"state must be one of {CARRIED_STATES} or, with an int batch, 'variables'; got {state!r}")
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        tf1.set_random_seed(7)
        x = tf1.placeholder(tf.int32, [batch, LM_STEPS], name="x")
        y = tf1.placeholder(tf.int32, [batch, LM_STEPS], name="y")
        rows = batch if batch is not None else tf.shape(x)[0]
        init = tf1.random_uniform_initializer(-0.5, 0.5, seed=3)
        with tf1.variable_scope("lm", initializer=init):
            embedding = tf1.get_variable("embedding", [LM_VOCAB, LM_HIDDEN])
            inputs = tf.nn.embedding_lookup(embedding, x)
            cells = [_LSTMCell(f"layer_{k}", hidden=LM_HIDDEN, forget_bias=0.0,
                               zeros="zeros" if state == "zeros" else "cell") for k in range(LM_LAYERS)]
            initial, state_variables = [], []
            with tf.name_scope("initial_state"):
                for k, cell in enumerate(cells):
                    if state == "placeholder":
                        pair = tuple(tf1.placeholder(tf.float32, [batch, LM_HIDDEN], name=f"layer_{k}_{p}")
                                     for p in "ch")
                    elif state == "variables":
                        kept = [tf1.get_variable(f"state/layer_{k}_{p}", [batch, LM_HIDDEN], trainable=False,
                                                 initializer=tf1.zeros_initializer()) for p in "ch"]
                        state_variables += kept
                        pair = tuple(tf.identity(v, name=f"layer_{k}_{p}") for v, p in zip(kept, "ch"))
                    elif state == "with_default":
                        zero = cell.zero_state(rows, tf.float32, name=f"layer_{k}_zero")
                        pair = tuple(tf1.placeholder_with_default(z, [batch, LM_HIDDEN], name=f"layer_{k}_{p}")
                                     for z, p in zip(zero, "ch"))
                    else:
                        pair = cell.zero_state(rows, tf.float32, name=f"layer_{k}")
                    initial.append(pair)
            if rnn == "unrolled":
                states, outputs = list(initial), []
                for t in range(LM_STEPS):
                    h = inputs[:, t, :]
                    for k, cell in enumerate(cells):
                        h, states[k] = cell(h, states[k])
                    outputs.append(h)
                output = tf.reshape(tf.concat(outputs, 1), [-1, LM_HIDDEN])
                final = states
            elif rnn == "dynamic_rnn":
                stack = _CellStack(cells)
                output, final = tf1.nn.dynamic_rnn(stack, inputs, initial_state=tuple(initial))
                output = tf.reshape(output, [-1, LM_HIDDEN])
            else:
                raise ValueError(f"rnn must be 'unrolled' or 'dynamic_rnn', got {rnn!r}")
            w = tf1.get_variable("softmax_w", [LM_HIDDEN, LM_VOCAB])
            b = tf1.get_variable("softmax_b", [LM_VOCAB])
            logits = tf.matmul(output, w) + b
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.reshape(y, [-1]), logits=logits)
            # sequence_loss(average_across_timesteps=False, average_across_batch=True), summed
            cost = tf.reduce_sum(tf.reduce_mean(tf.reshape(xent, [-1, LM_STEPS]), 0))
        tf.identity(cost, name="loss")
        with tf.name_scope("final_state"):
            for k, (c, h) in enumerate(final):
                tf.identity(c, name=f"layer_{k}_c")
                tf.identity(h, name=f"layer_{k}_h")
        step = tf1.train.get_or_create_global_step()
        variables = tf1.trainable_variables()
        grads, norm = tf.clip_by_global_norm(tf.gradients(cost, variables), 0.25)
        tf.identity(norm, name="grad_norm")
        if state == "variables":
            update = tf1.train.GradientDescentOptimizer(1.0).apply_gradients(zip(grads, variables), global_step=step)
            with tf.control_dependencies([update]):
                kept = [tf1.assign(v, t) for v, t in zip(state_variables, [t for pair in final for t in pair])]
            tf.group(update, *kept, name="train_op")
        else:
            tf1.train.GradientDescentOptimizer(1.0).apply_gradients(zip(grads, variables), global_step=step,
                                                                    name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def keras_stateful_lm(batch):
    """The language model as a Keras script writes it stateful (tf_keras, graph mode):
    an Embedding, ``LSTM(LM_HIDDEN, stateful=True, return_sequences=True)`` (its state
    two ``[batch, LM_HIDDEN]`` variables the layer assigns after every step, its
    ``updates``), a Dense softmax; the mean cross-entropy (loss:0), the legacy SGD's
    ``get_updates`` with the layer's updates (train_op), seeded initializers; x, y
    [batch, LM_STEPS]. Returns (GraphDef, the state variables' names)."""
    import tf_keras as keras
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.int32, [batch, LM_STEPS], name="x")
        y = tf1.placeholder(tf.int32, [batch, LM_STEPS], name="y")
        embed = keras.layers.Embedding(LM_VOCAB, LM_HIDDEN,
                                       embeddings_initializer=keras.initializers.RandomUniform(-0.5, 0.5, seed=2))
        lstm = keras.layers.LSTM(LM_HIDDEN, stateful=True, return_sequences=True,
                                 kernel_initializer=keras.initializers.GlorotUniform(seed=3),
                                 recurrent_initializer=keras.initializers.Orthogonal(seed=4))
        dense = keras.layers.Dense(LM_VOCAB, kernel_initializer=keras.initializers.GlorotUniform(seed=5))
        logits = dense(lstm(embed(x)))
        loss = tf.identity(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)),
                           name="loss")
        optimizer = keras.optimizers.legacy.SGD(0.5)
        weights = embed.trainable_weights + lstm.trainable_weights + dense.trainable_weights
        tf.group(*optimizer.get_updates(loss, weights), *lstm.updates, name="train_op")
        tf1.variables_initializer(tf1.global_variables() + optimizer.variables(), name="init")
        states = [v.op.name for v in lstm.states]
    return g.as_graph_def(), states


class _CellStack:
    """A MultiRNNCell of _LSTMCells for dynamic_rnn: the state a tuple of (c, h) pairs."""

    def __init__(self, cells):
        self.cells = cells

    @property
    def state_size(self):
        return tuple(c.state_size for c in self.cells)

    @property
    def output_size(self):
        return self.cells[-1].output_size

    def zero_state(self, batch_size, dtype):
        return tuple(c.zero_state(batch_size, dtype) for c in self.cells)

    def __call__(self, x, states, scope=None):
        out = []
        for cell, state in zip(self.cells, states):
            x, state = cell(x, state)
            out.append(state)
        return x, tuple(out)


def carried_state_names():
    """(initial, final): the tensor names of carried_state_lm's initial state (what a
    script feeds) and final state (what it fetches), layer by layer, c then h."""
    initial = [f"lm/initial_state/layer_{k}_{p}:0" for k in range(LM_LAYERS) for p in "ch"]
    final = [f"final_state/layer_{k}_{p}:0" for k in range(LM_LAYERS) for p in "ch"]
    return initial, final


def carried_state_text(rows, steps, seed=0):
    """Word ids [rows, steps * LM_STEPS + 1]: ``rows`` streams of text, as PTB's reader
    lays out its corpus (row r a contiguous stretch of it); step t trains on columns
    t * LM_STEPS .. (t + 1) * LM_STEPS, predicting the next column's words."""
    return np.random.RandomState(seed).randint(LM_VOCAB, size=(rows, steps * LM_STEPS + 1)).astype(np.int32)


MOCO_FEATURES, MOCO_DIM, MOCO_QUEUE = 6, 5, 32


def moco(queue="concat"):
    """Momentum Contrast (MoCo) as its TF1 ports write it, scaled down: two views x1, x2
    [None, MOCO_FEATURES] of the batch; a query encoder (two dense layers, trained) and
    a key encoder of the same shape (not trainable, moved towards the query encoder by
    a momentum of 0.9 after every step); their outputs normalised; the logits of each
    query against its own key and against a queue of the last MOCO_QUEUE keys (a
    variable), over a temperature of 0.2; cross-entropy with the positive first; SGD
    with momentum 0.9 and weight decay 1e-4. After the step the batch's keys enter the
    queue: ``queue`` "concat" writes ``tf.concat([keys, queue], 0)[:K]`` (newest
    first); "pointer" writes them at a pointer, ``scatter_update(queue, ptr +
    tf.range(n), keys)``, and advances it, ``ptr = (ptr + n) % K`` (the official
    implementation's form). Returns the GraphDef (loss:0, train_op, init; keys:0 the
    batch's keys)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        x1 = tf1.placeholder(tf.float32, [None, MOCO_FEATURES], name="x1")
        x2 = tf1.placeholder(tf.float32, [None, MOCO_FEATURES], name="x2")

        def encoder(x, scope, trainable):
            with tf1.variable_scope(scope):
                w1 = tf1.get_variable("w1", [MOCO_FEATURES, 8], trainable=trainable)
                w2 = tf1.get_variable("w2", [8, MOCO_DIM], trainable=trainable)
                return tf.math.l2_normalize(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2), 1), [w1, w2]

        q, query_vars = encoder(x1, "query", True)
        k, key_vars = encoder(x2, "key", False)
        k = tf.stop_gradient(k, name="keys")
        bank = tf1.get_variable("queue", initializer=tf.math.l2_normalize(
            tf1.random_normal([MOCO_QUEUE, MOCO_DIM], seed=1), 1), trainable=False)
        positive = tf.reduce_sum(q * k, 1, keepdims=True)
        negative = tf.matmul(q, bank, transpose_b=True)
        logits = tf.concat([positive, negative], 1) / 0.2
        labels = tf.zeros_like(positive[:, 0], tf.int32)
        xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        loss = tf.identity(xent + 1e-4 * tf.add_n([tf.nn.l2_loss(v) for v in query_vars]), name="loss")
        step = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        if queue == "pointer":
            pointer = tf1.get_variable("queue_ptr", initializer=tf.constant(0, tf.int64), trainable=False)
        with tf.control_dependencies([step]):
            moved = [tf1.assign(wk, 0.9 * wk + 0.1 * wq) for wk, wq in zip(key_vars, query_vars)]
            if queue == "concat":
                enqueued = [tf1.assign(bank, tf.concat([k, bank], 0)[:MOCO_QUEUE])]
            elif queue == "pointer":
                end = pointer + tf.shape(k, out_type=tf.int64)[0]
                rows = tf.range(pointer, end)
                with tf.control_dependencies([rows]):
                    advanced = tf1.assign(pointer, end % MOCO_QUEUE)
                enqueued = [tf1.scatter_update(bank, rows, k), advanced]
            else:
                raise ValueError(f"queue must be 'concat' or 'pointer', got {queue!r}")
        tf.group(*(moved + enqueued), name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def moco_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` rows for moco's two views."""
    rng = np.random.RandomState(seed)
    return [{"x1:0": rng.randn(batch, MOCO_FEATURES).astype(np.float32),
             "x2:0": rng.randn(batch, MOCO_FEATURES).astype(np.float32)} for _ in range(steps)]


DECODE_VOCAB, DECODE_HIDDEN, DECODE_STEPS = 9, 6, 6


def scheduled_sampling_decoder(control_flow=None):
    """A decoder trained with scheduled sampling, as sequence-to-sequence scripts write
    one: a tf.compat.v1.while_loop over the time steps with ``maximum_iterations`` the
    batch's longest target (``tf.reduce_max(lengths)``); at each step a tanh cell reads
    the embedding of the previous token, and a seeded coin per row
    (``random_uniform(tf.shape(prev))``, drawn at every step) feeds the next step the
    gold token or the model's own argmax; the logits gathered in a TensorArray; the
    cross-entropy averaged over the real tokens (the padding masked); Adam. The loop
    runs one step at a time (parallel_iterations=1): a stateful draw in a loop is
    deterministic only so. Feeds tgt [None, DECODE_STEPS] and lengths [None]. Returns
    the GraphDef (loss:0, train_op, init)."""
    from graph_rewriter.testing.models import ControlFlow
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default(), ControlFlow(control_flow):
        tf1.set_random_seed(4)
        targets = tf1.placeholder(tf.int32, [None, DECODE_STEPS], name="tgt")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        embedding = tf1.get_variable("embedding", [DECODE_VOCAB, DECODE_HIDDEN])
        cell = tf1.get_variable("cell", [2 * DECODE_HIDDEN, DECODE_HIDDEN])
        output = tf1.get_variable("output", [DECODE_HIDDEN, DECODE_VOCAB])
        rows = tf.shape(targets)[0]

        def step(t, previous, h, logits_so_far):
            h = tf.tanh(tf.matmul(tf.concat([tf.nn.embedding_lookup(embedding, previous), h], 1), cell))
            logits = tf.matmul(h, output)
            gold = tf1.random_uniform(tf.shape(previous), seed=9) < 0.5
            following = tf.where(gold, targets[:, t], tf.cast(tf.argmax(logits, 1), tf.int32))
            return [t + 1, following, h, logits_so_far.write(t, logits)]

        _, _, _, logits = tf1.while_loop(
            lambda t, *_: t < DECODE_STEPS, step,
            [tf.constant(0), tf.zeros(tf.expand_dims(rows, 0), tf.int32), tf.zeros(tf.stack([rows, DECODE_HIDDEN])),
             tf.TensorArray(tf.float32, size=0, dynamic_size=True)],
            maximum_iterations=tf.reduce_max(lengths), parallel_iterations=1)
        logits = tf.transpose(logits.stack(), [1, 0, 2])
        ran = tf.shape(logits)[1]
        mask = tf.sequence_mask(lengths, ran, dtype=tf.float32)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets[:, :ran], logits=logits)
        loss = tf.identity(tf.reduce_sum(xent * mask) / tf.reduce_sum(mask), name="loss")
        tf1.train.AdamOptimizer(0.05).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def scheduled_sampling_batches(steps, batch, seed=0):
    """``steps`` feeds of ``batch`` targets of 1 to DECODE_STEPS tokens for the decoder."""
    rng = np.random.RandomState(seed)
    return [{"tgt:0": rng.randint(DECODE_VOCAB, size=(batch, DECODE_STEPS)).astype(np.int32),
             "lengths:0": rng.randint(1, DECODE_STEPS + 1, size=batch).astype(np.int32)} for _ in range(steps)]


# minimize_options_mlp's kinds: the keywords of Optimizer.minimize (and gradient
# checkpointing) that change how the backward pass is built, not what it computes
MINIMIZE_OPTIONS = ("colocate", "gate_graph", "gate_none", "accumulate_n", "tree", "recompute", "all")


def minimize_options_mlp(kind="colocate"):
    """dropout_mlp's inputs and weights, w1 read twice (relu(x w1) + tanh(x w1): two
    gradients that the backward pass aggregates), Momentum 0.9 with a global step; per
    ``kind`` minimize gets ``colocate_gradients_with_ops=True`` (tensor2tensor's and
    NMT's default: every gradient op carries a ``_class`` colocation with its forward
    op), ``gate_gradients=GATE_GRAPH`` (the gradients pass through a tuple of control
    dependencies) or ``GATE_NONE``, ``aggregation_method`` EXPERIMENTAL_ACCUMULATE_N
    (AccumulateNV2) or EXPERIMENTAL_TREE, all of colocate, GATE_GRAPH and ACCUMULATE_N,
    or (``recompute``) the first layer is wrapped in ``tf.recompute_grad`` (gradient
    checkpointing: the backward pass recomputes it under a custom gradient)."""
    tf, tf1 = _tf()
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x, y, w1, w2 = _mlp_inputs(None)

        def layer(inputs):
            return tf.nn.relu(tf.matmul(inputs, w1))
        h = tf.recompute_grad(layer)(x) if kind == "recompute" else layer(x)
        h = h + tf.nn.tanh(tf.matmul(x, w1))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y), name="loss")
        step = tf1.train.get_or_create_global_step()
        options = {"colocate": {"colocate_gradients_with_ops": True},
                   "gate_graph": {"gate_gradients": tf1.train.Optimizer.GATE_GRAPH},
                   "gate_none": {"gate_gradients": tf1.train.Optimizer.GATE_NONE},
                   "accumulate_n": {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N},
                   "tree": {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE},
                   "recompute": {},
                   "all": {"colocate_gradients_with_ops": True, "gate_gradients": tf1.train.Optimizer.GATE_GRAPH,
                           "aggregation_method": tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N}}
        if kind not in options:
            raise ValueError(f"minimize_options_mlp: unknown kind {kind!r}")
        tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step, name="train_op", **options[kind])
        tf1.global_variables_initializer()
    return g.as_graph_def()


# weight_decay_mlp's kinds: how public training scripts add weight decay to the loss.
# All but the last two give every weight a gradient term the replicas compute alike
# (graph_rewriter/invariant_terms.py); "noisy" gives w1 none, "fed_rate" none at all.
WEIGHT_DECAYS = ("l2", "ref", "regularizer", "clipped", "scaled", "adam", "noisy", "fed_rate")


def weight_decay_mlp(kind="l2"):
    """dropout_mlp's inputs and weights with a bias, a mean squared error plus an L2
    weight decay of every weight, Momentum 0.9 with a global step, per ``kind``: "l2"
    (``wd * add_n([tf.nn.l2_loss(v) for v in trainable])``, TF-slim's and
    tf_cnn_benchmarks' way), "ref" (the same with ref variables, TensorFlow 1's
    default: a read of one is no snapshot), "regularizer" (``get_variable(regularizer=...)`` and
    ``tf.compat.v1.losses.get_regularization_loss()``, the official models' way),
    "clipped" (compute_gradients, clip_by_global_norm 1.0, apply_gradients: BERT's step),
    "scaled" (a static loss scale of 128 and its unscaling, mixed precision's), "adam"
    (Adam's slots), "noisy" (the decay of a noisy copy of w1, ``w1 + normal(seed)``: a
    stateful draw), "fed_rate" (the decay rate a placeholder_with_default)."""
    tf, tf1 = _tf()
    if kind not in WEIGHT_DECAYS:
        raise ValueError(f"weight_decay_mlp: unknown kind {kind!r}")
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")

        def decay(w):
            return 1e-2 * tf.nn.l2_loss(w)
        kw = {"regularizer": decay if kind == "regularizer" else None, "use_resource": kind != "ref"}
        w1 = tf1.get_variable("w1", [4, 16], initializer=tf1.glorot_uniform_initializer(seed=2), **kw)
        b1 = tf1.get_variable("b1", [16], initializer=tf1.constant_initializer(0.1), **kw)
        w2 = tf1.get_variable("w2", [16, 1], initializer=tf1.glorot_uniform_initializer(seed=3), **kw)
        error = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) - y))
        if kind == "regularizer":
            penalty = tf1.losses.get_regularization_loss()
        elif kind == "noisy":
            penalty = 1e-2 * tf.add_n([tf.nn.l2_loss(w1 + tf1.random_normal([4, 16], stddev=0.1, seed=5)),
                                       tf.nn.l2_loss(b1), tf.nn.l2_loss(w2)])
        elif kind == "fed_rate":
            rate = tf1.placeholder_with_default(1e-2, [], name="decay_rate")
            penalty = rate * tf.add_n([tf.nn.l2_loss(v) for v in (w1, b1, w2)])
        else:
            penalty = 1e-2 * tf.add_n([tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
        loss = tf.identity(error + penalty, name="loss")
        step = tf1.train.get_or_create_global_step()
        optimizer = (tf1.train.AdamOptimizer(0.01) if kind == "adam" else tf1.train.MomentumOptimizer(0.1, 0.9))
        if kind == "clipped":
            grads, variables = zip(*optimizer.compute_gradients(loss))
            grads, _ = tf.clip_by_global_norm(grads, 1.0)
            optimizer.apply_gradients(zip(grads, variables), global_step=step, name="train_op")
        elif kind == "scaled":
            scaled = optimizer.compute_gradients(loss * 128.0)
            optimizer.apply_gradients([(grad / 128.0, v) for grad, v in scaled], global_step=step, name="train_op")
        else:
            optimizer.minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()
