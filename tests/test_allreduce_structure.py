"""Structural tests of the allreduce rewrite for GPU replicas (checked on the graph: this
machine has no GPU). Each builds a small training graph, rewrites it, and asserts which
ops exist, where they are placed and how they are wired."""

import collections

import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.context import RewriteContext
from graph_rewriter.options import Options
from graph_rewriter.testing import models
from graph_rewriter.verifier import verify

tf1 = tf.compat.v1


def _train_graph(sparse=True, summary=True, loop=False, layers=3):
    """x[None,4] -> `layers` dense layers (+ embedding of ids, + a v1 while loop) -> loss."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        for i in range(layers):
            w = tf1.get_variable(f"w{i}", [4, 4], use_resource=True)
            h = tf.tanh(tf.matmul(h, w))
        if sparse:
            ids = tf1.placeholder(tf.int32, [None], name="ids")
            emb = tf1.get_variable("emb", [10, 4], use_resource=True)
            h = h + tf.nn.embedding_lookup(emb, ids)
        if loop:
            tf1.disable_control_flow_v2()
            try:
                _, h = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(a)),
                                     [tf.constant(0), h])
            finally:
                tf1.enable_control_flow_v2()
        out = tf1.get_variable("out", [4, 1], use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(h, out) - y)), name="loss")
        if summary:
            tf1.summary.scalar("loss_summary", loss)
        step = tf1.train.get_or_create_global_step()
        tf1.train.AdamOptimizer(0.01).minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer().name  # noqa: B018
        tf1.train.Saver()
    return g.as_graph_def()


def _nodes(result):
    return {n.name: n for n in result.graph_def.node}


@pytest.fixture(scope="module")
def gpu4():
    return gr.rewrite(_train_graph(), devices_per_worker=4, device_type="GPU")


def test_replicas_get_their_gpu_and_cpu_only_ops_their_host(gpu4):
    nodes = _nodes(gpu4)
    prefixes = gpu4.metadata["replica_prefixes"]
    assert prefixes == ["", "replica_1/", "replica_2/", "replica_3/"]
    # the summarised loss is merged under its name on the host; replica 0's is renamed
    assert nodes["replica_0/loss"].device == "/device:GPU:0"
    assert nodes["loss"].device == "/device:CPU:0" and gpu4.metadata["merged"] == {"loss": "replica_0/loss"}
    for i in (1, 2, 3):
        assert nodes[f"replica_{i}/loss"].device == f"/device:GPU:{i}"
        assert nodes[f"replica_{i}/w0"].device == f"/device:GPU:{i}"
        # A summary has no GPU kernel: it runs on the replica's host CPU.
        assert nodes[f"replica_{i}/loss_summary"].device == "/device:CPU:0"
    for name, node in nodes.items():
        if node.op in ("SaveV2", "RestoreV2", "ScalarSummary", "Placeholder", "Split"):
            assert node.device == "/device:CPU:0", name
    assert nodes["graph_rewriter/metadata"].device == "/device:CPU:0"


def test_every_gpu_op_has_a_gpu_kernel(gpu4):
    from graph_rewriter import opdefs
    item = graph_io.load_graph(gpu4.graph_def)
    for node in item:
        if "GPU" in node.device:
            assert opdefs.has_kernel(node, "GPU"), f"{node.name} ({node.op}) has no GPU kernel"


def test_variable_users_share_the_variable_device(gpu4):
    nodes = _nodes(gpu4)
    for n in nodes.values():
        if n.op in ("ReadVariableOp", "ResourceApplyAdam", "AssignVariableOp", "ResourceGather"):
            producer = nodes[n.input[0].lstrip("^").split(":")[0]]
            while producer.op == "Identity":
                producer = nodes[producer.input[0].split(":")[0]]
            assert n.device == producer.device, n.name


def test_one_collective_per_pack_with_unique_keys():
    gd = _train_graph(sparse=False, summary=False, layers=4)
    # 16-float layers: 64 bytes each; 128-byte packs hold two gradients.
    result = gr.rewrite(gd, devices_per_worker=4, device_type="GPU", bytes_per_pack=128)
    plan = result.plan
    assert len(plan.packs) >= 2
    assert all(p.bytes <= 128 for p in plan.packs)
    nodes = _nodes(result)
    reduces = [n for n in nodes.values() if n.op == "CollectiveReduceV2"]
    assert len(reduces) == 4 * len(plan.packs)
    keys = collections.defaultdict(list)
    for n in reduces:
        ikey = nodes[n.input[3]].attr["value"].tensor.int_val[0]
        size = nodes[n.input[1]].attr["value"].tensor.int_val[0]
        assert size == 4
        keys[n.device].append(ikey)
        assert n.attr["merge_op"].s == b"Add" and n.attr["final_op"].s == b"Div"
    assert len(keys) == 4
    for device, ks in keys.items():
        assert len(ks) == len(set(ks)), device
    assert len({tuple(sorted(k)) for k in keys.values()}) == 1  # the same keys on every replica


def test_packs_are_issued_in_order_each_waiting_for_the_previous():
    gd = _train_graph(sparse=False, summary=False, layers=4)
    result = gr.rewrite(gd, devices_per_worker=2, device_type="GPU", bytes_per_pack=64)
    nodes = _nodes(result)
    for prefix in ("", "replica_1/"):
        chain = [nodes[f"{prefix}allreduce/pack_{p}/all_reduce"] for p in range(len(result.plan.packs))]
        for prev, cur in zip(chain, chain[1:]):
            assert "^" + prev.name in cur.input
    # Gradients produced first by backprop (the last layer's) are in the first pack.
    first = result.plan.packs[0].cuts
    assert "out" in first


def test_sparse_gradients_are_gathered_not_reduced(gpu4):
    nodes = _nodes(gpu4)
    gathers = [n for n in nodes.values() if n.op == "CollectiveGatherV2"]
    assert len(gathers) == 3 * 4  # sizes, values, indices on each of 4 replicas
    assert not any("emb" in c for p in gpu4.plan.packs for c in p.cuts)
    dense = gr.rewrite(_train_graph(), devices_per_worker=4, device_type="GPU", sparse_as_dense=True)
    assert not [n for n in dense.graph_def.node if n.op == "CollectiveGatherV2"]
    assert any("emb" in c for p in dense.plan.packs for c in p.cuts)


def test_fp16_compression_casts_around_the_collective():
    result = gr.rewrite(_train_graph(sparse=False), devices_per_worker=2, device_type="GPU",
                        compression="fp16")
    nodes = _nodes(result)
    reduce = nodes["allreduce/pack_0/all_reduce"]
    assert reduce.attr["T"].type == tf.float16.as_datatype_enum
    cast_in = nodes[reduce.input[0]]
    assert cast_in.op == "Cast" and cast_in.attr["DstT"].type == tf.float16.as_datatype_enum
    readers = [n for n in nodes.values() if "allreduce/pack_0/all_reduce" in [i.split(":")[0] for i in n.input]]
    assert any(n.op == "Cast" and n.attr["DstT"].type == tf.float32.as_datatype_enum for n in readers)


def test_train_and_init_ops_run_every_replica(gpu4):
    nodes = _nodes(gpu4)
    for root in ("train_op", "init"):
        for i in (1, 2, 3):
            assert f"^replica_{i}/{root}" in nodes[root].input


def test_clones_have_their_own_shared_names_frames_and_colocation():
    result = gr.rewrite(_train_graph(loop=True), devices_per_worker=2, device_type="GPU")
    nodes = _nodes(result)
    assert nodes["replica_1/w0"].attr["shared_name"].s == b"replica_1/w0"
    assert nodes["w0"].attr["shared_name"].s == b"w0"
    frames = {n.name: n.attr["frame_name"].s for n in nodes.values() if n.op == "Enter"}
    master = {f for name, f in frames.items() if not name.startswith("replica_1/")}
    clone = {f for name, f in frames.items() if name.startswith("replica_1/")}
    assert master and clone and not (master & clone)
    for name, n in nodes.items():
        if name.startswith("replica_1/") and "_class" in n.attr:
            for loc in n.attr["_class"].list.s:
                assert loc.startswith(b"loc:@replica_1/"), (name, loc)


def test_the_output_passes_the_verifier(gpu4):
    item = graph_io.load_graph(gpu4.graph_def)
    ctx = RewriteContext(options=Options(devices_per_worker=4, device_type="GPU"), cluster=parse_cluster(None))
    verify(item, ctx)


def test_one_replica_is_the_identity_plus_placement():
    gd = _train_graph()
    result = gr.rewrite(gd, devices_per_worker=1, device_type="GPU")
    out = {n.name: n for n in result.graph_def.node if n.name != "graph_rewriter/metadata"}
    assert set(out) == {n.name for n in gd.node}
    for n in gd.node:
        assert list(out[n.name].input) == list(n.input), n.name
        assert out[n.name].device in ("/device:GPU:0", "/device:CPU:0")


def test_keras_batchnorm_behind_the_learning_phase_cond():
    """tf_keras BatchNormalization in graph mode computes its statistics inside a cond on
    the learning-phase placeholder, and the forward pass reads the moving averages in its
    inference branch: they are still state (own packs, first), and the backward pass keeps
    reading the replica's own statistics (rewiring it would make a cycle)."""
    import tf_keras
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        inp = tf_keras.Input(shape=(4,))
        h = tf_keras.layers.Dense(8)(inp)
        h = tf_keras.layers.BatchNormalization()(h)
        out = tf_keras.layers.Dense(1)(h)
        model = tf_keras.Model(inp, out)
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        loss = tf.identity(tf.reduce_mean(tf.square(model.output - y)), name="loss")
        opt = tf_keras.optimizers.legacy.SGD(0.1)
        tf.group(*opt.get_updates(loss, model.trainable_weights), *model.updates, name="train_op")
        tf1.variables_initializer(tf1.global_variables() + opt.variables(), name="init")
    result = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type="GPU")
    plan = result.plan
    state = [c for c in plan.cuts if c.role == "state"]
    assert len(state) == 2 and all("moving" in c.variable for c in state)
    first = plan.packs[0].cuts
    assert set(first) == {c.variable for c in state}
    # Numerics: one step on CPU replicas; with equal shards the moving mean is the
    # one-device moving mean (the mean of the shards' means is the batch mean).
    import numpy as np
    gd = g.as_graph_def()
    cpu = gr.rewrite(gd, devices_per_worker=2, device_type="CPU")
    rng = np.random.default_rng(0)
    feed = {"input_1:0": rng.normal(size=(8, 4)).astype(np.float32),
            "y:0": rng.normal(size=(8, 1)).astype(np.float32), "keras_learning_phase:0": True}
    mean_var = next(v.name for v in plan.variables if v.name.endswith("moving_mean"))
    single = tf.Graph()
    with single.as_default():
        tf1.import_graph_def(gd, name="")
        read = tf1.raw_ops.ReadVariableOp(resource=single.get_tensor_by_name(mean_var + ":0"), dtype=tf.float32)
    with tf1.Session(graph=single) as s:
        s.run("init")
        s.run("train_op", feed)
        want = s.run(read)
    with gr.Session(cpu) as s:
        with s.graph.as_default():
            reads = [tf1.raw_ops.ReadVariableOp(resource=s.graph.get_tensor_by_name(p + mean_var + ":0"), dtype=tf.float32)
                     for p in ("", "replica_1/")]
        s.run("init")
        s.run("train_op", feed)
        got = s.run(reads)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-6)


def test_root_ops_fan_out_once_per_replica_and_the_output_grows_linearly():
    """Running a root op (nothing consumes it: a train op, an IsInitialized check) by its
    name runs every replica's copy: the master gets one control input per other replica,
    and no copy depends on another replica's copy (which would make the graph quadratic
    in the replicas)."""
    ex = models.build("mlp", "momentum")
    original = {n.name: n for n in ex.graph_def.node}
    consumed = {i.lstrip("^").split(":")[0] for n in ex.graph_def.node for i in n.input}
    roots = [name for name in original if name not in consumed]
    sizes = {}
    for r in (2, 8):
        result = gr.rewrite(ex.graph_def, devices_per_worker=r, device_type="GPU")
        nodes = {n.name: n for n in result.graph_def.node}
        sizes[r] = len(result.serialized())
        for root in roots:
            if root not in nodes or f"replica_1/{root}" not in nodes:
                continue
            fan = [i for i in nodes[root].input if i.startswith("^replica_") and i.endswith("/" + root)]
            assert sorted(fan) == sorted(f"^replica_{k}/{root}" for k in range(1, r)), root
            for k in range(1, r):
                other = [i for i in nodes[f"replica_{k}/{root}"].input
                         if i.startswith("^replica_") and i.endswith("/" + root)]
                assert not other, f"replica_{k}/{root} waits for other replicas' copies: {other}"
    # 4x the replicas: at most ~4x the bytes (nothing grows with replicas squared)
    assert sizes[8] < 4.6 * sizes[2], sizes


def _initial_value_nodes(graph_def):
    """Names of the nodes an initializer's value input depends on, and the initializers."""
    nodes = {n.name: n for n in graph_def.node}
    inits = [n for n in graph_def.node if n.op == "AssignVariableOp" and n.name.endswith("/Assign")]
    seen, stack = set(), [n.input[1].split(":")[0] for n in inits]
    while stack:
        name = stack.pop()
        if name in seen or nodes[name].op == "VarHandleOp":
            continue
        seen.add(name)
        stack.extend(i.lstrip("^").split(":")[0] for i in nodes[name].input)
    return seen, [n.name for n in inits]


def test_in_graph_copies_initialize_from_the_masters_initial_values_not_dead_clones():
    """In-graph, a replica's initializer reads the master's initial value (one random
    draw), so the initial-value subgraph is not cloned: no replica_1/ copy of it exists
    and replica_1's initializers read the original tensors. Between-graph, each worker's
    copies receive the chief's values by broadcast instead."""
    gd = _train_graph(sparse=False, summary=False)
    values, inits = _initial_value_nodes(gd)
    assert values and inits
    nodes = _nodes(gr.rewrite(gd, devices_per_worker=2, device_type="GPU"))
    for name in values:
        assert f"replica_1/{name}" not in nodes, name
    for init in inits:
        copy = nodes[f"replica_1/{init}"]
        assert copy.input[1] == nodes[init].input[1], (init, copy.input[1])
    cluster = {"worker": ["localhost:1", "localhost:2"]}
    between = _nodes(gr.rewrite(gd, cluster, devices_per_worker=2, device_type="GPU", task="worker:1"))
    assert any(f"replica_1/{name}" in between for name in values)
