"""The split_inputs pass alone: it gives each replica its slice of the global batch, or
a batch of its own.

    x (global batch, host CPU) ─> Split(num_split=R) ─┬─:0─> replica 0's readers of x
                                                      └─:1─> replica 1's readers of x

A placeholder with a static batch [B, ...] takes the R replicas' batches concatenated
([R*B, ...]); an iterator with a static batch is drawn once per replica (an IdentityN
hands replica k draw k). Between-graph, each worker shards its tf.data pipeline.
"""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import PlanPass, ReplicatePass, SplitInputsPass
from pass_graphs import WORKERS2, context, dense, ops, reaches, replica_of

tf1 = tf.compat.v1


def _model(x, y):
    w = tf1.get_variable("w", [3, 1], use_resource=True)
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y), name="loss")
    tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
    tf1.global_variables_initializer()


def static_dense(batch=4):
    """x [4, 3], y [4, 1] (a static batch) ─> MatMul(w) ─> loss ─> Apply(w)."""
    g = tf.Graph()
    with g.as_default():
        _model(tf1.placeholder(tf.float32, [batch, 3], name="x"),
               tf1.placeholder(tf.float32, [batch, 1], name="y"))
    return graph_io.load_graph(g.as_graph_def())


def iterator_dense(batch=2, one_shot=False):
    """Dataset ─> Batch(2, drop_remainder) ─> MakeIterator ─> IteratorGetNext ─> (x, y)
    ─> MatMul(w) ─> loss; ``one_shot``: a one-shot iterator, whose dataset is built
    inside its dataset_factory function (the graph's dataset nodes are dead copies)."""
    g = tf.Graph()
    with g.as_default():
        data = tf.data.Dataset.from_tensor_slices((tf.ones([8, 3]), tf.ones([8, 1])))
        data = data.batch(batch, drop_remainder=True)
        it = (tf1.data.make_one_shot_iterator(data) if one_shot
              else tf1.data.make_initializable_iterator(data))
        x, y = it.get_next()
        _model(x, y)
    return graph_io.load_graph(g.as_graph_def())


def _split(graph, placeholder):
    return next(s for s in ops(graph, "Split") if graph.node(placeholder) in [t.node for t in s.inputs])


def _outputs_read(ctx, graph, node):
    """{replica: the output indices of ``node`` its readers read}."""
    out = {}
    for c, _ in node.consumers():
        for t in c.inputs:
            if t.node is node:
                out.setdefault(replica_of(ctx, graph, c), set()).add(t.index)
    return out


def test_a_dynamic_batch_is_split_across_the_replicas_on_the_host():
    """
        x [None, 3] ─> Split(2) ─┬─:0─> MatMul (replica 0)
                                 └─:1─> MatMul' (replica 1)
    """
    g = dense()
    ctx = context(devices_per_worker=2)
    result = run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    assert result.modified
    for name in ("x", "y"):
        split = _split(g, name)
        assert split.attr["num_split"].i == 2
        assert split.device == ctx.replicas.global_device == "/device:CPU:0"
        assert replica_of(ctx, g, split) is None
        # the placeholder is read by its split alone; replica k reads slice k
        assert [c for c, _ in g.node(name).consumers()] == [split]
        assert _outputs_read(ctx, g, split) == {0: {0}, 1: {1}}
    assert g.node("x").attr["shape"].shape.dim[0].size == -1


def test_a_static_batch_is_fed_for_every_replica_and_split():
    """
        x [4, 3]  becomes  x [8, 3] ─> Split(2) ─┬─:0─> replica 0 (rows 0..3)
                                                 └─:1─> replica 1 (rows 4..7)
    """
    g = static_dense()
    ctx = context(devices_per_worker=2)
    run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    assert {ip.mode for ip in ctx.plan.input_plans().values()} == {"per_replica"}
    for name, cols in (("x", 3), ("y", 1)):
        shape = g.node(name).attr["shape"].shape
        assert [d.size for d in shape.dim] == [8, cols]
        split = _split(g, name)
        assert split.attr["num_split"].i == 2
        assert _outputs_read(ctx, g, split) == {0: {0}, 1: {1}}


def test_an_iterator_with_a_static_batch_is_drawn_once_per_replica():
    """
        IteratorGetNext ──────────────────┐
          └─^─> IteratorGetNext (draw 2) ─┴─> IdentityN ─┬─:0─> replica 0's x
                                                         └─:1─> replica 1's x
    """
    g = iterator_dense()
    ctx = context(devices_per_worker=2)
    run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    draws = ops(g, "IteratorGetNext")
    assert len(draws) == 2 and all(replica_of(ctx, g, d) is None for d in draws)
    (second,) = [d for d in draws if set(draws) & set(d.control_inputs)]
    (first,) = [d for d in draws if d is not second]
    assert first in second.control_inputs   # replica 1's batch is the second drawn
    handouts = ops(g, "IdentityN")
    assert len(handouts) == 2   # one per output of the iterator (x and y)
    for h in handouts:
        assert [t.node for t in h.inputs] == [first, second]
        assert _outputs_read(ctx, g, h) == {0: {0}, 1: {1}}
    assert ops(g, "Split") == []


def test_between_graph_each_worker_shards_the_dataset_before_batching():
    """
        task worker:1 of 2:
            TensorSlice ─> ShardDataset(2, 1) ─> BatchDataset ─> MakeIterator ─> iterator
    """
    g = iterator_dense()
    ctx = context(WORKERS2, task="worker:1")
    assert SplitInputsPass().applies(ctx)
    run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    (shard,) = ops(g, "ShardDataset")
    (batch,) = ops(g, "BatchDatasetV2")
    assert shard in [t.node for t in batch.inputs]
    values = [tf.make_ndarray(t.node.attr["value"].tensor) for t in shard.inputs if t.node.op == "Const"]
    assert sorted(int(v) for v in values) == [1, 2]   # num_workers 2, this worker's index 1
    (make,) = ops(g, "MakeIterator")
    assert reaches(shard, make)
    assert [replica_of(ctx, g, n) for n in (shard, batch)] == [None, None]


def test_between_graph_a_one_shot_iterator_reads_the_workers_shard():
    """
        task worker:1 of 2, one-shot iterator:
            OneShotIterator(dataset_factory = f)   f: TensorSlice ─> Batch
        after:
            OneShotIterator(dataset_factory = f_shard_1_of_2)
            f_shard_1_of_2: TensorSlice ─> ShardDataset(2, 1) ─> Batch
        (the iterator builds its pipeline by calling f; the dataset ops in the graph are
        copies nothing reads). f stays as it was.
    """
    g = iterator_dense(one_shot=True)
    original = g.library.SerializeToString(deterministic=True)
    ctx = context(WORKERS2, task="worker:1")
    run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    (iterator,) = ops(g, "OneShotIterator")
    factory = iterator.attr["dataset_factory"].func.name
    functions = {f.signature.name: f for f in g.library.function}
    assert factory.endswith("_shard_1_of_2")
    body = {nd.name: nd for nd in functions[factory].node_def}
    (batch,) = [nd for nd in body.values() if nd.op == "BatchDatasetV2"]
    shard = body[batch.input[0].split(":")[0]]
    assert shard.op == "ShardDataset" and batch.input[0] == f"{shard.name}:handle:0"
    source, count, index = (body[t.split(":")[0]] for t in shard.input)
    assert source.op == "TensorSliceDataset"
    values = [tf.make_ndarray(n.attr["value"].tensor) for n in (count, index)]
    assert values == [2, 1]
    assert [d.size for d in shard.attr["output_shapes"].list.shape[0].dim] == [3]   # an element: no batch axis
    before = type(g.library)()
    before.ParseFromString(original)
    unchanged = factory[:-len("_shard_1_of_2")]
    assert functions[unchanged] == next(f for f in before.function if f.signature.name == unchanged)


def test_the_one_shot_iterator_of_worker_0_calls_its_own_shard():
    g = iterator_dense(one_shot=True)
    run_passes(g, context(WORKERS2, task="worker:0"), PlanPass(), ReplicatePass(), SplitInputsPass())
    (iterator,) = ops(g, "OneShotIterator")
    assert iterator.attr["dataset_factory"].func.name.endswith("_shard_0_of_2")


def test_split_inputs_does_not_apply_to_one_in_graph_replica():
    """One replica, no task: nothing to split or shard (the pass manager skips it)."""
    g = dense()
    ctx = context()
    run_passes(g, ctx, PlanPass(), ReplicatePass(), SplitInputsPass())
    assert not SplitInputsPass().applies(ctx)
    assert ctx.passes_run == ["plan", "replicate"] and ops(g, "Split") == []
    assert SplitInputsPass().applies(context(devices_per_worker=2))


def test_split_inputs_requires_the_replicas():
    """Without replicate before it, split_inputs is refused (it needs the ReplicaMap)."""
    assert SplitInputsPass.requires == {"plan", "replicas"}
    with pytest.raises(GraphRewriteError, match="'split_inputs' requires replicas"):
        run_passes(dense(), context(devices_per_worker=2), PlanPass(), SplitInputsPass())


def _py_func_pipeline():
    """tf.data rows (x [3], y [1]) with x passed through a tf.compat.v1.py_func (its
    output's shape unknown, as a script decoding images in Python leaves it), batched by 8."""
    import numpy as np
    tf1 = tf.compat.v1
    rng = np.random.RandomState(0)
    xs, ys = rng.randn(32, 3).astype(np.float32), rng.randn(32, 1).astype(np.float32)
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        ds = tf.data.Dataset.from_tensor_slices((xs, ys)).map(
            lambda x, y: (tf1.py_func(lambda a: a * 2, [x], tf.float32), y)).batch(8)
        iterator = tf1.data.make_initializable_iterator(ds)
        x, y = iterator.get_next()
        w = tf1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.reshape(x, [-1, 3]), w) - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.group(tf1.variables_initializer(tf1.global_variables(), name="init_variables"), iterator.initializer,
                 name="init")
    return g.as_graph_def()


def test_a_batch_component_of_unknown_rank_is_split_with_the_others():
    """A batched dataset gives every component the batch's rows, also one whose shape a
    py_func left unknown: it is split like the others (it was read whole by every
    replica, a shape error against the replica's labels), and 2 replicas train as one
    device."""
    import numpy as np
    import graph_rewriter as gr
    from graph_rewriter.analysis import analyze
    graph_def = _py_func_pipeline()
    assert [t.name for t in analyze(graph_io.load_graph(graph_def)).batch_inputs] == ["IteratorGetNext:0",
                                                                                     "IteratorGetNext:1"]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run("init")
        want = [sess.run(["loss:0", "train_op"])[0] for _ in range(3)] + [sess.run("w/Read/ReadVariableOp:0")]
    with gr.Session(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU")) as sess:
        sess.run("init")
        got = [sess.run(["loss:0", "train_op"])[0] for _ in range(3)] + [sess.run("w/Read/ReadVariableOp:0")]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
