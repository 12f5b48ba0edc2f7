"""`graph-rewrite demo`: the whole path on this machine, with nothing to prepare.

1. Builds a small single-device training graph (an embedding table and a dense layer,
   Adagrad) and trains it on one device for a few dozen steps.
2. Starts a local cluster: one parameter server and two worker servers, each its own
   process on loopback (the `graph-rewrite serve` a real deployment runs per machine),
   every worker with two CPU devices.
3. Rewrites the graph once per worker (between-graph, strategy ps by default): four
   replicas in all, the variables on the ps, gradients averaged by its accumulators.
4. Runs both workers' clients side by side, each on its half of every batch, and prints
   the distributed loss beside the one-device loss of the same global batch.
5. Compares the final variables with the one-device run, shuts every process down, and
   exits 0 when they agree.
"""

import threading
import time

import numpy as np

STEPS = 30
BATCH = 16            # global batch: 4 rows per replica on 2 workers x 2 devices
WORKERS = 2
DEVICES_PER_WORKER = 2
CALL_TIMEOUT = 60.0   # any one session call: a dead peer becomes an error, not a hang
TOLERANCE = 1e-4


def run_demo(log=print, steps=STEPS, batch_size=BATCH, strategy="ps"):
    """Returns 0 when the cluster trained like one device, 1 otherwise."""
    import tensorflow as tf

    import graph_rewriter as gr
    from graph_rewriter.local_cluster import LocalCluster

    tf.compat.v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")   # TensorFlow's deprecation notes are not the demo's
    started = time.perf_counter()
    example = build_model()
    batches = [example.batch(step, batch_size) for step in range(steps)]
    log(f"1. built a single-device training graph (embedding, adagrad): {len(example.graph_def.node)} "
        f"nodes, {len(example.variables)} variables; training it on one device ...")
    one_losses, one_values = _train_one_device(example, batches)
    log(f"   {steps} steps on batches of {batch_size}: loss {one_losses[0]:.4f} -> {one_losses[-1]:.4f}")

    log(f"2. starting a local cluster: 1 ps + {WORKERS} workers x {DEVICES_PER_WORKER} CPU devices, "
        "one server process each on loopback ...")
    with LocalCluster(workers=WORKERS, ps=1, device_type="CPU",
                      devices_per_worker=DEVICES_PER_WORKER) as cluster:
        for job, i in cluster.tasks():
            log(f"   {job}:{i}  {cluster.spec[job][i]}  (pid {cluster.processes[f'{job}:{i}'].pid})")
        results = [gr.rewrite(example.graph_def, cluster.spec, strategy=strategy, task=f"worker:{k}",
                              devices_per_worker=DEVICES_PER_WORKER, device_type="CPU",
                              timeout_seconds=CALL_TIMEOUT) for k in range(WORKERS)]
        log(f"3. rewrote it per worker (strategy {strategy}, between-graph): "
            f"{results[0].num_replicas} replicas, {results[0].num_nodes} nodes in worker 0's graph")
        for line in results[0].summary().splitlines()[1:3]:
            log(f"     {line}")
        log(f"4. training: each worker's client feeds its half of every batch of {batch_size}")
        log(f"     {'step':>4}  {'one device':>12}  {'cluster':>12}  {'difference':>10}")
        clients = [_Client(example, results[k], cluster.target("worker", k),
                           [_shard(b, results[k], k) for b in batches]) for k in range(WORKERS)]
        for c in clients:
            c.start()
        worst = 0.0
        for step in range(steps):
            losses = [c.loss(step) for c in clients]
            if any(loss is None for loss in losses):
                break
            loss = float(np.mean(losses))   # equal shards: the mean of means is the batch mean
            worst = max(worst, abs(loss - one_losses[step]))
            if step % 5 == 0 or step == steps - 1:
                log(f"     {step:>4}  {one_losses[step]:>12.6f}  {loss:>12.6f}  "
                    f"{abs(loss - one_losses[step]):>10.2e}")
        for c in clients:
            c.join(CALL_TIMEOUT * 2)
        errors = [f"worker {k}: {c.error}" for k, c in enumerate(clients) if c.error]
        log("5. stopping the cluster's processes")
    if errors:
        for e in errors:
            log(f"   {e}")
        log("demo failed: a worker's client did not finish")
        return 1
    values = clients[0].values
    diff = max(float(np.max(np.abs(values[k] - one_values[k]))) for k in one_values)
    ok = worst <= TOLERANCE and diff <= TOLERANCE
    log(f"   largest loss difference {worst:.2e}, largest variable difference {diff:.2e}: "
        + (f"the same training, on {results[0].num_replicas} replicas in {WORKERS} processes"
           if ok else "MISMATCH")
        + f" ({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


# ----- the model ----------------------------------------------------------------------------
# The zoo's "embedding" model with Adagrad, seed 0 (graph_rewriter.testing.models), written
# out here so that the demo needs nothing but the library: the same GraphDef, byte for byte,
# and the same batches.

FEATURES = 4          # dense x columns next to the embedding
HIDDEN = 8
EMBED_ROWS = 20
EMBED_DIM = 4
ID_RANGE = 6          # batches only touch rows 0..5 (duplicates within and across shards)
LEARNING_RATE = 0.1


class DemoModel:
    """The built graph and the names the demo drives it by."""

    loss, train_op, init = "loss:0", "train_op", "init"

    def __init__(self, graph_def, variables):
        self.graph_def = graph_def
        self.variables = variables   # variable node -> read tensor

    @staticmethod
    def batch(step, size=8, seed=0):
        """Step ``step``'s feed dict of ``size`` rows, seeded by (seed, step): ids repeat
        within every quarter and across quarters (one id in all four; at odd steps each
        quarter holds a single id)."""
        rng = np.random.default_rng([seed, step, 7919])
        x = rng.normal(size=(size, FEATURES))
        y = np.sin(x.sum(axis=1))[:, None] + 0.1 * rng.normal(size=(size, 1))
        ids = rng.integers(0, ID_RANGE, size=size).astype(np.int32)
        if size >= 4:
            quarter = size // 4
            for k in range(4):
                ids[k * quarter] = ids[0]
            if quarter >= 2:
                ids[1] = ids[0]
        elif size >= 2:
            ids[1] = ids[0]
        if step % 2 and size >= 4:
            quarter = size // 4
            other = (int(ids[0]) + 1 + int(rng.integers(0, ID_RANGE - 1))) % ID_RANGE
            ids[:] = ids[0]
            ids[2 * quarter:3 * quarter] = other
        return {"x:0": x.astype(np.float32), "y:0": y.astype(np.float32), "ids:0": ids}


def build_model(seed=0):
    """An embedding table looked up by "ids" next to dense features "x", a tanh hidden layer
    and a linear output, mean squared error against "y", Adagrad with a global_step;
    resource variables, seeded, an "init" op and a Saver."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    seeds = iter(range(seed * 1000 + 1, seed * 1000 + 100))

    def variable(name, shape, initializer):
        return tf1.get_variable(name, shape, tf.float32, initializer=initializer)

    def dense(inputs, units, name):
        with tf1.variable_scope(name):
            w = variable("kernel", [inputs.shape[-1], units], tf1.glorot_uniform_initializer(seed=next(seeds)))
            b = variable("bias", [units], tf1.random_uniform_initializer(-0.1, 0.1, seed=next(seeds)))
        return tf.nn.bias_add(tf.matmul(inputs, w), b)

    with graph.as_default():
        tf1.set_random_seed(seed)
        with tf1.variable_scope(tf1.get_variable_scope(), use_resource=True):
            global_step = tf1.train.get_or_create_global_step()
            ids = tf1.placeholder(tf.int32, [None], name="ids")
            x = tf1.placeholder(tf.float32, [None, FEATURES], name="x")
            y = tf1.placeholder(tf.float32, [None, 1], name="y")
            table = variable("embedding", [EMBED_ROWS, EMBED_DIM],
                             tf1.random_normal_initializer(stddev=0.5, seed=next(seeds)))
            rows = tf.nn.embedding_lookup(table, ids)
            h = tf.tanh(dense(tf.concat([rows, x], axis=1), HIDDEN, "hidden"))
            loss = tf.identity(tf.reduce_mean(tf.square(dense(h, 1, "output") - y)), name="loss")
            tf1.train.AdagradOptimizer(LEARNING_RATE).minimize(loss, global_step=global_step, name="train_op")
            tf1.variables_initializer(tf1.global_variables(), name="init")
        variables = tf1.global_variables()
        tf1.train.Saver(var_list=variables)
    # a resource variable built in graph mode keeps the read it made at creation
    reads = {v.op.name: v._graph_element.name for v in variables}
    return DemoModel(graph.as_graph_def(), reads)


# ----- running -------------------------------------------------------------------------------

def _train_one_device(example, batches):
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(example.graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(example.init)
        losses = [float(sess.run([example.loss, example.train_op], feed_dict=b)[0]) for b in batches]
        names = list(example.variables)
        values = dict(zip(names, sess.run([example.variables[n] for n in names])))
    return losses, {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}


def _shard(feed, result, k):
    """Worker k's rows of a global batch (batch inputs split evenly; others whole)."""
    split = set(result.plan.batch_inputs)
    out = {}
    for name, value in feed.items():
        if name in split:
            rows = len(value) // WORKERS
            value = value[k * rows:(k + 1) * rows]
        out[name] = value
    return out


class _Client(threading.Thread):
    """One worker's client: init, then a step per batch; losses as they come."""

    def __init__(self, example, result, target, feeds):
        super().__init__(daemon=True)
        self.example, self.result, self.target, self.feeds = example, result, target, feeds
        self.losses, self.values, self.error = [], None, None
        self._progress = threading.Condition()

    def run(self):
        import tensorflow as tf

        import graph_rewriter as gr
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(CALL_TIMEOUT * 1000))
        try:
            with gr.Session(self.result, target=self.target) as sess:
                sess.run(self.example.init, options=options)
                for feed in self.feeds:
                    loss, _ = sess.run([self.example.loss, self.example.train_op], feed_dict=feed,
                                       options=options)
                    with self._progress:
                        self.losses.append(float(loss))
                        self._progress.notify_all()
                names = list(self.example.variables)
                vals = sess.run([self.example.variables[n] for n in names], options=options)
                self.values = {n: np.asarray(v, dtype=np.float64) for n, v in zip(names, vals)}
        except Exception as e:  # reported by the demo, which then exits 1
            self.error = f"{type(e).__name__}: {' '.join(str(e).split())[:1500]}"
        finally:
            with self._progress:
                self._progress.notify_all()

    def loss(self, step):
        """This worker's loss at ``step``, waiting for it (bounded); None if it failed."""
        with self._progress:
            self._progress.wait_for(lambda: len(self.losses) > step or self.error or not self.is_alive(),
                                    timeout=CALL_TIMEOUT * 2)
            return self.losses[step] if len(self.losses) > step else None
