"""`graph-rewrite demo`: the whole path on this machine, with nothing to prepare.

Builds a small single-device training graph (an MLP trained with Momentum), rewrites it
for two CPU replicas, trains both the original and the rewritten graph on the same
batches, and prints their losses side by side. The rewritten graph runs each step as two
replicas that each see half of the batch and average their gradients with TensorFlow's
collective all-reduce; the losses and the final weights match the one-device run.
"""

import time

import numpy as np

STEPS = 30
BATCH = 64
REPLICAS = 2


def run_demo(log=print, steps=STEPS, batch_size=BATCH, replicas=REPLICAS):
    """Returns 0 when the rewritten graph trained like the original, 1 otherwise."""
    import tensorflow as tf

    import graph_rewriter as gr
    from graph_rewriter import examples

    tf.compat.v1.disable_eager_execution()
    started = time.perf_counter()
    example = examples.build("mlp", "momentum", seed=0)
    log(f"1. built a single-device training graph: {len(example.graph_def.node)} nodes, "
        f"{len(example.variables)} variables, optimizer Momentum")
    result = gr.rewrite(example.graph_def, devices_per_worker=replicas, device_type="CPU")
    log(f"2. rewrote it for {replicas} CPU replicas: {len(result.graph_def.node)} nodes")
    for line in result.summary().splitlines():
        log(f"     {line}")
    log(f"3. training {steps} steps on batches of {batch_size}, each split across the replicas")
    log(f"     {'step':>4}  {'one device':>12}  {'rewritten':>12}  {'difference':>10}")
    single = _Trainer(example, tf.compat.v1.Session(graph=_import(example.graph_def)))
    rewritten = _Trainer(example, gr.Session(result))
    worst = 0.0
    try:
        for step in range(steps):
            feed = example.batch(step, batch_size)
            a = single.step(feed)
            b = rewritten.step(feed)
            worst = max(worst, abs(a - b))
            if step % 5 == 0 or step == steps - 1:
                log(f"     {step:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>10.2e}")
        diff = max(float(np.max(np.abs(single.values()[k] - rewritten.values()[k])))
                   for k in example.variables)
    finally:
        single.close()
        rewritten.close()
    ok = worst <= 1e-4 and diff <= 1e-4
    log(f"4. largest loss difference {worst:.2e}, largest weight difference {diff:.2e}: "
        f"{'the same training, on ' + str(replicas) + ' replicas' if ok else 'MISMATCH'} "
        f"({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


def _import(graph_def):
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return graph


class _Trainer:
    def __init__(self, example, session):
        self.example, self.session = example, session
        session.run(example.init)

    def step(self, feed):
        loss, _ = self.session.run([self.example.loss, self.example.train_op], feed_dict=feed)
        return float(loss)

    def values(self):
        names = list(self.example.variables)
        vals = self.session.run([self.example.variables[n] for n in names])
        return dict(zip(names, [np.asarray(v, dtype=np.float64) for v in vals]))

    def close(self):
        self.session.close()
