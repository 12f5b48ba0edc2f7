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
numeric equivalence tests (test_equivalence.py, R=4) run template graphs as well.
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
    dict(devices_per_worker=4, device_type="CPU", strategy="ps"),  # per-replica ps accumulation
    dict(devices_per_worker=4, device_type="CPU", materialize_replicas=True),
    dict(cluster_spec=_cluster(3), task="worker:1", devices_per_worker=2, device_type="CPU"),
])
def test_every_replica_is_built_where_a_template_does_not_apply(kw):
    lines = []
    gr.rewrite(models.build("mlp", "sgd").graph_def, log=lines.append, **kw)
    assert any(line.startswith("replicate:") for line in lines)
    assert not _used_template(lines)


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
