"""The equivalence harness: trains an example graph on one device and a rewritten copy
through ``graph_rewriter.Session`` with the same batches, and reads every replica's copy
of the variables, so a test (or a user checking their own rewrite) can compare the two:

    ex = models.build("embedding", optimizer="adagrad", resource=False)
    losses, values = run_single(ex, steps=3)               # one device
    result = graph_rewriter.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    losses2, values2 = run_rewritten(result, ex, steps=3)  # must be the same numbers

Works with any ``graph_rewriter.testing.models.Example``, the zoo's or one built by hand.

The equivalence tests rewrite for ``device_type()``: CPU replicas (CPU:0..R-1) unless the
environment variable GRAPH_REWRITER_TEST_DEVICE=GPU puts them on GPU:0..R-1, which is how
tools/gpu_readiness.py runs the same tests on a machine with GPUs.
"""

import os

import numpy as np

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.testing.models import BN_MOMENTUM

# ----- the device the equivalence tests put replicas on ---------------------------------------

DEVICE_ENV = "GRAPH_REWRITER_TEST_DEVICE"
DEVICE_TYPES = ("CPU", "GPU")


def device_type(environ=None):
    """The device type the equivalence tests rewrite for: "CPU" by default (replicas on
    CPU:0..R-1, the virtual CPU devices graph_rewriter.Session creates; runs anywhere),
    "GPU" when the environment variable GRAPH_REWRITER_TEST_DEVICE is "GPU" (replicas on
    GPU:0..R-1; what tools/gpu_readiness.py sets). Read at each call (test_equivalence.py
    reads it once, at import); unset or empty means CPU, case is ignored, another value
    raises GraphRewriteError. ``environ``: a mapping to read instead of os.environ."""
    environ = os.environ if environ is None else environ
    value = environ.get(DEVICE_ENV, "").strip()
    if not value:
        return "CPU"
    if value.upper() not in DEVICE_TYPES:
        raise GraphRewriteError(f"{DEVICE_ENV}={value!r} is not a device type the tests know",
                                hint="set it to GPU (replicas on GPU:0..R-1), or CPU or nothing (CPU replicas)")
    return value.upper()


def exact_float32():
    """Turns TensorFloat-32 off for this process. On Ampere and later GPUs TensorFlow runs
    float32 matmuls and convolutions with a 10-bit mantissa by default, so one device's whole
    batch and the replicas' shards round differently by about 1e-3, far beyond the tests'
    tolerance; with it off they agree as on CPUs. No effect on CPUs."""
    import tensorflow as tf
    tf.config.experimental.enable_tensor_float_32_execution(False)


# ----- running ------------------------------------------------------------------------------

def _feed(example, step, batch_size, feeds):
    if feeds is None:
        return example.batch(step, size=batch_size)
    return feeds(step) if callable(feeds) else feeds[step]


def _train(sess, example, steps, batch_size, feeds):
    sess.run(example.init)
    for op in example.extra_init:
        sess.run(op)
    losses = []
    for step in range(steps):
        loss, _ = sess.run([example.loss, example.train_op],
                           feed_dict=_feed(example, step, batch_size, feeds))
        losses.append(float(loss))
    values = sess.run(dict(example.variables))
    return losses, {name: np.asarray(v) for name, v in values.items()}


class ReplicaCopies:
    """Reads every replica's copy of every variable of an example ({prefix + variable:
    value}; prefix "" is the master, the others the rewritten graph's replica prefixes),
    with the read ops built once, so a test can read after every run.

    Reads through the variable op itself: a replica's copy of the variable's read op
    may not exist (a read that only the Saver uses is not cloned). Works on a plain
    tf.compat.v1.Session and on graph_rewriter.Session alike."""

    def __init__(self, sess, example, prefixes):
        import tensorflow as tf
        self.sess, self.fetches = sess, {}
        with sess.graph.as_default():
            for prefix in prefixes:
                for name in example.variables:
                    try:
                        op = sess.graph.get_operation_by_name(prefix + name)
                    except KeyError:
                        continue
                    if op.type == "VarHandleOp":
                        self.fetches[prefix + name] = tf.raw_ops.ReadVariableOp(
                            resource=op.outputs[0], dtype=op.get_attr("dtype"),
                            name=f"{prefix}{name}/examples_read_copy")
                    else:   # a ref variable: fetching its ref output returns the value
                        self.fetches[prefix + name] = op.outputs[0]

    def __call__(self):
        import tensorflow as tf
        # the plain Session.run: graph_rewriter.Session only knows the rewritten graph's nodes
        values = tf.compat.v1.Session.run(self.sess, self.fetches)
        return {name: np.asarray(v) for name, v in values.items()}


def one_device_session(graph_def):
    """A plain tf.compat.v1.Session on ``graph_def`` imported as it is (no name prefix):
    the one-device run a rewritten graph is compared with."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return tf.compat.v1.Session(graph=graph)


def resource_reads(graph_def):
    """{variable: the tensor its creation reads it by} for every resource variable of
    ``graph_def`` (optimizer slots too): ``<name>/Read/ReadVariableOp:0``."""
    suffix = "/Read/ReadVariableOp"
    return {n.name[:-len(suffix)]: n.name + ":0" for n in graph_def.node
            if n.op == "ReadVariableOp" and n.name.endswith(suffix)}


def train_and_read(sess, graph_def, feeds):
    """([loss:0 per step], {variable: value}): runs init, then train_op once per feed
    (fetching loss:0), then reads every resource variable of ``graph_def``; ``sess`` is
    a one-device session or a rewritten graph's gr.Session."""
    sess.run("init")
    losses = [sess.run(["loss:0", "train_op"], feed)[0] for feed in feeds]
    return losses, sess.run(resource_reads(graph_def))


def trained_on_one_device(graph_def, feeds):
    """train_and_read of ``graph_def`` on one device."""
    with one_device_session(graph_def) as sess:
        return train_and_read(sess, graph_def, feeds)


def trained_rewritten(result, graph_def, feeds):
    """train_and_read of a rewrite ``result`` of ``graph_def`` in its gr.Session."""
    import graph_rewriter as gr
    with gr.Session(result) as sess:
        return train_and_read(sess, graph_def, feeds)


def canonical_nodes(graph_def):
    """{node name: its serialized NodeDef with its control inputs sorted}: TensorFlow
    treats a node's control inputs as a set, and the template export lists a single
    node's control inputs from replicas 1..R-1 where building every replica lists them
    in the order the passes added them (tests/test_template_replicas.py)."""
    out = {}
    for node in graph_def.node:
        copy = type(node)()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend([i for i in node.input if not i.startswith("^")]
                          + sorted(i for i in node.input if i.startswith("^")))
        out[node.name] = copy.SerializeToString(deterministic=True)
    return out


def assert_trained_alike(what, got, want, rtol, atol, first="losses"):
    """Asserts two train_and_read results agree: the per-step values (``first``) and
    every variable, the same variables on both sides; ``what`` names the run."""
    import numpy as np
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol, err_msg=f"{what}: {first}")
    assert sorted(got[1]) == sorted(want[1])
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=rtol, atol=atol, err_msg=f"{what}: {name}")


def assign_ops(graph, values):
    """Ops that set each variable named in ``values`` ({variable node: value}) of ``graph``
    (imported from an example) to its value: to start a run from given weights."""
    import tensorflow as tf
    assigns = []
    with graph.as_default():
        for name, value in values.items():
            op = graph.get_operation_by_name(name)
            if op.type == "VarHandleOp":
                assigns.append(tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value))
            else:
                assigns.append(tf.compat.v1.assign(op.outputs[0], value))
    return assigns


def read_replica_copies(sess, example, prefixes):
    """{prefix + variable: value} for every replica prefix ("" is the master) and every
    variable of ``example`` that the session's graph holds under that prefix (see
    ReplicaCopies)."""
    return ReplicaCopies(sess, example, prefixes)()


def sharded_moving_variance(example, feed, replicas, initial_variance):
    """The "batchnorm" model's moving_variance after one step whose batch ``feed`` is split
    into ``replicas`` equal shards, each updating with its own (biased) batch variance and
    the updates averaged: momentum * v0 + (1 - momentum) * the mean of shard variances."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(example.graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(example.init)
        bn_input = sess.run(example.tensors["bn_input"], feed)   # before any update
    shard_variances = [s.var(axis=0) for s in np.split(bn_input, replicas)]
    return BN_MOMENTUM * initial_variance + (1 - BN_MOMENTUM) * np.mean(shard_variances, axis=0)


def run_single(example, steps=3, batch_size=8, feeds=None):
    """Trains the original graph on one device: (losses per step, final variable values).

    ``feeds``: None (``example.batch(step, batch_size)``), a list of feed dicts indexed by
    step, or a callable step -> feed dict ("iterator" reads its own batches of
    ``example.batch_size`` rows and ignores both). Values are keyed by variable node name
    and include the step counter.
    """
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(example.graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        return _train(sess, example, steps, batch_size, feeds)


def run_rewritten(result, example, steps=3, batch_size=8, feeds=None, config=None,
                  replica_copies=False, target=""):
    """The same training run through ``graph_rewriter.Session`` on a rewritten graph
    (``result``: a RewriteResult or the path of a saved one), with the original names:
    variables are read through the master replica's copy. With ``replica_copies`` the
    values also hold every other replica's copy, keyed "replica_1/<variable>" (the
    rewritten graph's prefix), so a test can check that the replicas stay identical.
    ``target``: a server's (LocalCluster.target); "" runs in this process."""
    from graph_rewriter.session import Session
    with Session(result, target=target, config=config) as sess:
        losses, values = _train(sess, example, steps, batch_size, feeds)
        if replica_copies:
            prefixes = sess.result.metadata["replica_prefixes"][1:]
            values.update(read_replica_copies(sess, example, prefixes))
        return losses, values
