"""Tiny training graphs and structural queries for the tests of one pass at a time.

Each builder returns a fresh GraphItem of a one-layer model, small enough to draw:

    dense:   x --> MatMul(w) --> + b --> loss (mean squared error vs y)
             backward: d loss/d w --> ApplyGradientDescent(w), d loss/d b --> ApplyGradientDescent(b)
    sparse:  ids --> Gather(table) --> Sum --> loss;  d loss/d table is IndexedSlices
             (rows + ids) --> ResourceScatterAdd-style sparse update of table
    masked:  x --> MatMul(w) --> squared error e, masked twice: loss = sum(e * m1) / sum(m1)
             + sum(e * m2) / sum(m2) (two means over the rows each mask keeps)
    normalized: x --> MatMul(w) --> BatchNorm in training mode (fused, or tf.nn.moments)
             --> squared error vs y

Queries find nodes by their role (op type, what they read, what reaches what), never by
the names a pass generates or by input positions, so a test states structure that
survives a renaming.
"""

import tensorflow as tf

from graph_rewriter import graph_io
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.context import RewriteContext
from graph_rewriter.options import Options
from graph_rewriter.traversal import descendants

PS2_WORKERS2 = {"ps": ["p0:2222", "p1:2222"], "worker": ["w0:2222", "w1:2222"]}
WORKERS2 = {"worker": ["w0:2222", "w1:2222"]}


def _optimizer(name, lr=0.1):
    return {"sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(lr),
            "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(lr, 0.9),
            "adam": lambda: tf.compat.v1.train.AdamOptimizer(lr)}[name]()


def dense(optimizer="sgd", summary=False, global_step=False):
    """x [None, 3], y [None, 1]; variables w [3, 1], b [1]; "loss", "train_op"."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer(), use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y), name="loss")
        if summary:
            tf.compat.v1.summary.scalar("loss", loss)
        step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
        _optimizer(optimizer).minimize(loss, global_step=step, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def sparse(optimizer="sgd", rows=10):
    """ids [None] (int64) into table [rows, 2]; "loss", "train_op"."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        table = tf.compat.v1.get_variable("table", [rows, 2], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), name="loss")
        _optimizer(optimizer).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def masked():
    """x [None, 3], y [None, 1], masks m1, m2 [None, 1] (float); variable w [3, 1]; the
    loss divides by the sums of both masks; "loss", "train_op"."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        m1 = tf.compat.v1.placeholder(tf.float32, [None, 1], name="m1")
        m2 = tf.compat.v1.placeholder(tf.float32, [None, 1], name="m2")
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        e = tf.square(tf.matmul(x, w) - y)
        loss = tf.add(tf.reduce_sum(e * m1) / tf.reduce_sum(m1), tf.reduce_sum(e * m2) / tf.reduce_sum(m2),
                      name="loss")
        _optimizer("sgd").minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def normalized(kind="fused"):
    """x [None, 3], y [None, 4]; variables w [3, 4], gamma, beta [4]; a BatchNorm in
    training mode of x w: a FusedBatchNormV3 "bn" of it as [N, 1, 1, 4] images
    (``fused``), or tf.nn.moments' "bn/mean" and "bn/variance" (``moments``); "loss",
    "train_op"."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 4], name="y")
        w = tf.compat.v1.get_variable("w", [3, 4], use_resource=True)
        gamma = tf.compat.v1.get_variable("gamma", [4], initializer=tf.compat.v1.ones_initializer(), use_resource=True)
        beta = tf.compat.v1.get_variable("beta", [4], initializer=tf.compat.v1.zeros_initializer(), use_resource=True)
        h = tf.matmul(x, w)
        if kind == "fused":
            out, _, _ = tf.compat.v1.nn.fused_batch_norm(tf.reshape(h, [-1, 1, 1, 4]), gamma, beta, name="bn")
            out = tf.reshape(out, [-1, 4])
        else:
            with tf.name_scope("bn"):
                mean = tf.reduce_mean(h, [0], keepdims=True, name="mean")
                variance = tf.reduce_mean(tf.math.squared_difference(h, tf.stop_gradient(mean)), [0],
                                          keepdims=True, name="variance")
            out = tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        _optimizer("sgd").minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def context(cluster=None, task=None, **options):
    """A RewriteContext as rewrite() would make it (CPU replicas unless told)."""
    options.setdefault("device_type", "CPU")
    return RewriteContext(options=Options(**options).validate(), cluster=parse_cluster(cluster, task))


def ops(graph, *types):
    """The nodes of these op types, in graph order."""
    return [n for n in graph if n.op in types]


def reads(node):
    """The nodes ``node`` reads, by data edge."""
    return [t.node for t in node.inputs]


def reaches(a, b):
    """Whether a path of data or control edges leads from node ``a`` to node ``b``."""
    return b in descendants([a])


def replica_of(ctx, graph, node):
    """The replica a node belongs to (None: global), from the rewrite's ReplicaMap."""
    return ctx.replicas.replica_of(graph, node.name)


# the variable updates the tiny graphs' optimizers make (dense and sparse)
UPDATE_OPS = ("ResourceApplyGradientDescent", "ResourceApplyMomentum", "ResourceApplyAdam",
              "ResourceScatterAdd", "ResourceSparseApplyMomentum")


def update_of(graph, ctx, variable, replica):
    """Replica ``replica``'s update of ``variable`` (an original name): the first update
    op reading its copy of the variable."""
    handle = ctx.replicas.node(graph, replica, variable)
    return next(c for c, _ in handle.consumers() if c.op in UPDATE_OPS)


def gradient_of(update):
    """What a dense update reads besides its variable and its learning rate."""
    (g,) = [p for p in reads(update) if p.op not in ("VarHandleOp", "Const")]
    return g


def collective_keys(node):
    """The scalar int32 Consts a collective reads, sorted: its group size, group key and
    instance key (fewer when a key is computed at run time)."""
    import numpy as np
    values = [tf.make_ndarray(p.attr["value"].tensor) for p in reads(node) if p.op == "Const"]
    return sorted(int(v) for v in values if np.shape(v) == () and v.dtype == np.int32)


def runs(nodes, root):
    """The names of every node that running ``root`` runs, in a GraphDef given as
    {name: NodeDef}: its inputs, data and control, transitively (``root`` too)."""
    seen, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(i.lstrip("^").split(":")[0] for i in nodes[name].input)
    return seen
