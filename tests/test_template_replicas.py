"""Template replicas: with three or more local replicas in-graph, the IR builds replica 0
and replica 1 only, and the export writes replica 1 once per replica 1..R-1. The output
must be the graph that building every replica gives (``materialize_replicas=True``):
the same nodes, each with the same op, data inputs (in order), control inputs, device
and attributes.

Every example model is compared on single-machine CPU and GPU replicas (the GPU case
crosses ten replicas, so prefixes and indices change length), on in-graph multi-worker
clusters (hosts differ per replica; with CPU replicas a host equals another replica's
device), on between-graph workers' graphs (the chief's and another's), and with the options that add per-replica ops (accumulation, compression,
sparse_as_dense, many packs) or single nodes reading every replica (summaries). The
numeric equivalence tests (test_equivalence.py and test_ps_equivalence.py at R=4,
test_accumulation.py at R=3) run template graphs as well.

The parameter-server strategies ("ps", "hybrid") are compared the same way, for every
example model, on clusters with one or two ps tasks and one or two workers of 2 to 11
replicas, in-graph and between-graph, and with the options that change their
per-replica work: asynchronous training, accumulation_steps, staleness and sharded ps
variables. A combination the rewrite refuses (a plan error, or a graph the ps passes
cannot build yet) must be refused with the same message either way.
"""

import json

import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import graph_rewriter as gr
from graph_rewriter.testing import models

tf1 = tf.compat.v1

TEMPLATE_NOTE = "the template of the others"


def _cluster(workers):
    return {"worker": [f"localhost:{2220 + i}" for i in range(workers)]}


CONFIGS = {
    "cpu4": dict(devices_per_worker=4, device_type="CPU"),
    "gpu11": dict(devices_per_worker=11, device_type="GPU"),
    "2workers_gpu2": dict(cluster_spec=_cluster(2), devices_per_worker=2, device_type="GPU"),
    "3workers_cpu2": dict(cluster_spec=_cluster(3), devices_per_worker=2, device_type="CPU"),
    # between-graph: the chief's graph (its replica 0 broadcasts the initial values) and
    # another worker's (every replica receives them)
    "chief_of_2_gpu4": dict(cluster_spec=_cluster(2), task="worker:0", devices_per_worker=4, device_type="GPU"),
    "worker1_of_3_cpu3": dict(cluster_spec=_cluster(3), task="worker:1", devices_per_worker=3, device_type="CPU"),
    # hierarchical packs: each worker's replica 0 leads it (the template others receive)
    "chief_of_2_gpu4_hierarchical": dict(cluster_spec=_cluster(2), task="worker:0", devices_per_worker=4,
                                         device_type="GPU", allreduce_algorithm="hierarchical"),
    "worker1_of_2_cpu3_hierarchical": dict(cluster_spec=_cluster(2), task="worker:1", devices_per_worker=3,
                                           device_type="CPU", allreduce_algorithm="hierarchical"),
    # packs summed by one single AddN that lists every replica's pack
    "cpu4_reduce_to_one": dict(devices_per_worker=4, device_type="CPU", allreduce_algorithm="reduce_to_one"),
    "gpu11_reduce_to_one": dict(devices_per_worker=11, device_type="GPU", allreduce_algorithm="reduce_to_one"),
}


def _optimizer(model):
    return {"keras": "keras_adam", "keras_embedding": "keras_adagrad",
            "embedding": "adam", "lstm_v1": "momentum"}.get(model, "sgd")


def _rewrite_both(graph_def, **kw):
    """(materialized nodes, template nodes, the template run's log lines)."""
    lines = []
    built = gr.rewrite(graph_def, materialize_replicas=True, **kw)
    template = gr.rewrite(graph_def, log=lines.append, **kw)
    return _nodes(built), _nodes(template), lines, template


def _nodes(result):
    gd = graph_pb2.GraphDef.FromString(result.serialized())
    nodes = {n.name: n for n in gd.node}
    assert len(nodes) == len(gd.node) == result.num_nodes
    return nodes


def _canonical(node):
    """The node with its control inputs sorted: TensorFlow treats them as a set, and the
    expansion lists a single node's control inputs from replica 1..R-1 per reference
    where building every replica lists them in the order the passes added them."""
    out = type(node)()
    out.CopyFrom(node)
    controls = sorted(i for i in node.input if i.startswith("^"))
    del out.input[:]
    out.input.extend([i for i in node.input if not i.startswith("^")] + controls)
    return out


def _assert_same_graph(built, template):
    assert sorted(built) == sorted(template)
    differing = [name for name in built if _canonical(built[name]) != _canonical(template[name])]
    assert not differing, (f"{len(differing)} nodes differ, e.g. {differing[0]}:\n"
                           f"built:\n{built[differing[0]]}\ntemplate:\n{template[differing[0]]}")


def _used_template(lines):
    return any(line.startswith("replicate:") and TEMPLATE_NOTE in line for line in lines)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("model", models.MODELS)
def test_template_output_equals_every_replica_built(model, config):
    example = models.build(model, _optimizer(model))
    built, template, lines, result = _rewrite_both(example.graph_def, **CONFIGS[config])
    assert _used_template(lines), lines
    _assert_same_graph(built, template)
    # every local replica exists, with its own copy of every variable
    local = result.metadata["local_replicas"]
    assert local >= 3
    for name in example.variables:
        for k in range(1, local):
            assert f"replica_{k}/{name}" in template


@pytest.mark.parametrize("config", ["2workers_gpu2", "3workers_cpu2", "chief_of_2_gpu4"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_template_keeps_a_global_colocation_targets_device(strategy, config):
    """A v1 cond's Switch is colocated with what it switches, here a placeholder (global):
    every replica's Switch sits on the global device, which in-graph is also the host of
    replica 1 (on the first worker). Placement records it (ReplicaMap.fixed_devices), so
    replica 3 does not get its own host there."""
    kw = dict(CONFIGS[config])
    if strategy == "ps":
        kw["cluster_spec"] = dict(kw["cluster_spec"], ps=["localhost:2230"])
    example = models.build("cond", "sgd", control_flow="v1")
    built, template, lines, _ = _rewrite_both(example.graph_def, strategy=strategy, **kw)
    assert _used_template(lines)
    _assert_same_graph(built, template)


@pytest.mark.parametrize("options", [
    dict(accumulation_steps=2),
    dict(compression="fp16"),
    dict(bytes_per_pack=64),
    dict(sparse_as_dense=True),
])
def test_template_with_options_that_add_per_replica_ops(options):
    example = models.build("embedding", "adagrad")
    built, template, lines, _ = _rewrite_both(example.graph_def, devices_per_worker=10,
                                              device_type="GPU", **options)
    assert _used_template(lines)
    _assert_same_graph(built, template)


def _summary_loop_graph():
    """x -> dense -> v1 while loop -> loss, a scalar summary of the loss, an embedding."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        w = tf1.get_variable("w", [4, 4], use_resource=True)
        emb = tf1.get_variable("emb", [10, 4], use_resource=True)
        h = tf.tanh(tf.matmul(x, w)) + tf.nn.embedding_lookup(emb, ids)
        tf1.disable_control_flow_v2()
        try:
            _, h = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(a)), [tf.constant(0), h])
        finally:
            tf1.enable_control_flow_v2()
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf1.summary.scalar("loss_summary", loss)
        step = tf1.train.get_or_create_global_step()
        tf1.train.AdamOptimizer(0.1).minimize(loss, global_step=step, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


def test_template_expands_single_nodes_reading_every_replica():
    built, template, lines, result = _rewrite_both(_summary_loop_graph(), devices_per_worker=12,
                                                   device_type="GPU")
    assert _used_template(lines)
    _assert_same_graph(built, template)
    # the summary's mean sums all twelve replicas' losses: AddN's N follows its inputs
    add = template["loss_summary/mean_over_replicas/sum"]
    assert add.attr["N"].i == 12
    assert list(add.input) == ["loss"] + [f"replica_{k}/loss" for k in range(1, 12)]
    # running the train op by name runs every replica's copy
    controls = [i for i in template["train_op"].input if i.startswith("^replica_")]
    assert controls == [f"^replica_{k}/train_op" for k in range(1, 12)]
    # each replica reads its own slice of the batch and enters its own loop frame
    for k in range(1, 12):
        assert f"x/split_for_replicas:{k}" in template[f"replica_{k}/MatMul"].input
        frames = {n.attr["frame_name"].s for name, n in template.items()
                  if name.startswith(f"replica_{k}/") and n.op == "Enter"}
        assert f"replica_{k}/while/while_context".encode() in frames
        assert all(f.startswith(f"replica_{k}/".encode()) for f in frames)
    assert json.loads(template["graph_rewriter/metadata"].attr["value"].tensor.string_val[0])[
        "num_nodes"] == len(template)


@pytest.mark.parametrize("kw", [
    dict(devices_per_worker=2, device_type="CPU"),                 # two replicas: nothing to save
    dict(devices_per_worker=2, device_type="CPU", strategy="ps"),
    dict(devices_per_worker=4, device_type="CPU", materialize_replicas=True),
    dict(cluster_spec=_cluster(3), task="worker:1", devices_per_worker=2, device_type="CPU"),
])
def test_every_replica_is_built_where_a_template_does_not_apply(kw):
    lines = []
    gr.rewrite(models.build("mlp", "sgd").graph_def, log=lines.append, **kw)
    assert any(line.startswith("replicate:") for line in lines)
    assert not _used_template(lines)


def _ps_cluster(ps, workers):
    return {"ps": [f"localhost:{2230 + i}" for i in range(ps)],
            "worker": [f"localhost:{2220 + i}" for i in range(workers)]}


PS_CONFIGS = {
    # no cluster: the ps is the host CPU, which is every replica's host too
    "cpu4": dict(devices_per_worker=4, device_type="CPU"),
    # prefixes and indices change length at replica 10
    "1ps_1worker_gpu11": dict(cluster_spec=_ps_cluster(1, 1), devices_per_worker=11, device_type="GPU"),
    # in-graph over two workers: replica 1's host is the global device and, with CPU
    # replicas, replica 0's device
    "2ps_2workers_cpu2": dict(cluster_spec=_ps_cluster(2, 2), devices_per_worker=2, device_type="CPU"),
    # between-graph: the chief's graph (it takes the gradients and releases the tokens)
    # and another worker's (it only applies its gradients and waits)
    "chief_2ps_2workers_gpu4": dict(cluster_spec=_ps_cluster(2, 2), task="worker:0", devices_per_worker=4,
                                    device_type="GPU"),
    "worker1_1ps_2workers_cpu3": dict(cluster_spec=_ps_cluster(1, 2), task="worker:1", devices_per_worker=3,
                                      device_type="CPU"),
}

# (option set, config): the options that change the ps passes' per-replica work, each
# where the plan accepts it (staleness only between-graph)
PS_OPTIONS = [
    ("async", dict(sync=False), "2ps_2workers_cpu2"),
    ("async", dict(sync=False), "chief_2ps_2workers_gpu4"),
    ("accumulation_steps=2", dict(accumulation_steps=2), "cpu4"),
    ("accumulation_steps=2", dict(accumulation_steps=2), "worker1_1ps_2workers_cpu3"),
    ("staleness=1", dict(staleness=1), "chief_2ps_2workers_gpu4"),
    ("staleness=1,accumulation_steps=2", dict(staleness=1, accumulation_steps=2), "worker1_1ps_2workers_cpu3"),
    ("ps_shard_bytes=64", dict(ps_shard_bytes=64), "2ps_2workers_cpu2"),
    ("ps_shard_bytes=64", dict(ps_shard_bytes=64), "chief_2ps_2workers_gpu4"),
]


def _check_ps_template(model, **kw):
    """The template output equals every replica built; or both refuse alike."""
    example = models.build(model, _optimizer(model))
    try:
        built = gr.rewrite(example.graph_def, materialize_replicas=True, **kw)
    except gr.GraphRewriteError as refused:
        with pytest.raises(gr.GraphRewriteError) as again:
            gr.rewrite(example.graph_def, **kw)
        assert str(again.value) == str(refused)
        return
    lines = []
    template = gr.rewrite(example.graph_def, log=lines.append, **kw)
    assert _used_template(lines), lines
    _assert_same_graph(_nodes(built), _nodes(template))


# every model under "ps"; "hybrid" puts only sparse gradients' variables on the ps, and
# only the embedding models have any (on the others it is allreduce)
PS_MODELS = ([(m, "ps") for m in models.MODELS]
             + [(m, "hybrid") for m in ("embedding", "keras_embedding")])


@pytest.mark.parametrize("config", sorted(PS_CONFIGS))
@pytest.mark.parametrize("model,strategy", PS_MODELS)
def test_ps_template_output_equals_every_replica_built(model, strategy, config):
    _check_ps_template(model, strategy=strategy, **PS_CONFIGS[config])


@pytest.mark.parametrize("options,config", [(o, c) for _, o, c in PS_OPTIONS],
                         ids=[f"{name}-{c}" for name, _, c in PS_OPTIONS])
@pytest.mark.parametrize("model,strategy", PS_MODELS)
def test_ps_template_with_options(model, strategy, options, config):
    _check_ps_template(model, strategy=strategy, **PS_CONFIGS[config], **options)


def test_ps_template_writes_every_replicas_accumulator_apply():
    """The single nodes that wait for replica 1's work wait for every replica's: the take
    for every apply, the token wait for every replica's 'gradients applied' marker; the
    accumulator still needs all R gradients."""
    lines = []
    result = gr.rewrite(models.build("embedding", "adam").graph_def, strategy="ps", log=lines.append,
                        **PS_CONFIGS["chief_2ps_2workers_gpu4"])
    assert _used_template(lines)
    nodes = _nodes(result)
    prefixes = [""] + [f"replica_{k}/" for k in range(1, 4)]
    take = nodes["graph_rewriter/accumulators/embedding/take"]
    applies = [f"^{p}graph_rewriter/accumulators/embedding/apply" for p in prefixes]
    assert [i for i in take.input if i.startswith("^")] == applies
    num_required = nodes[take.input[1]]
    assert num_required.attr["value"].tensor.int_val == [8]   # two workers' four replicas
    wait = nodes["graph_rewriter/tokens/wait"]
    assert [f"^{p}graph_rewriter/gradients_applied" for p in prefixes] == [
        i for i in wait.input if i.endswith("gradients_applied")]
    for k in range(1, 4):
        apply = nodes[f"replica_{k}/graph_rewriter/accumulators/embedding/apply"]
        assert apply.device == "/job:ps/replica:0/task:0/device:CPU:0"
        assert any(i.startswith(f"replica_{k}/") for i in apply.input)


def test_materialize_replicas_must_be_a_bool():
    with pytest.raises(gr.GraphRewriteError, match="materialize_replicas must be True or False"):
        gr.rewrite(models.build("mlp", "sgd").graph_def, devices_per_worker=4, materialize_replicas="yes")


def test_asking_for_an_unbuilt_replica_is_an_error_not_the_master():
    """A pass that looped over every replica instead of ReplicaMap.built would get the
    master's node for replica 2 (the fallback for nodes that were never cloned) and wire
    replica 2's ops to it: the map refuses instead."""
    from graph_rewriter import graph_io
    from graph_rewriter.replicas import ReplicaMap
    graph = graph_io.load_graph(models.build("mlp", "sgd").graph_def)
    rm = ReplicaMap(prefixes=["", "replica_1/", "replica_2/"], devices=["/cpu:0"] * 3,
                    hosts=["/cpu:0"] * 3, global_device="/cpu:0", template=True)
    assert list(rm.built) == [0, 1]
    assert rm.node(graph, 0, "loss").name == "loss"
    with pytest.raises(gr.GraphRewriteError, match="replica 2's copy of 'loss'.*only replicas 0 and 1"):
        rm.node(graph, 2, "loss")
    with pytest.raises(gr.GraphRewriteError, match="ReplicaMap.built"):
        rm.tensor(graph, 2, "loss:0")
