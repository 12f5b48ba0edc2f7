"""Large gradients in packs of their own on CPU replicas of one machine (planner.alone_bytes_for).

Packing a gradient with others costs a copy of it (the ConcatV2 building the pack), which
on CPU replicas competes with their own work for memory bandwidth; a collective more
costs little within one process. So for CPU replicas of one machine a gradient of at
least ALONE_BYTES_CPU bytes is all-reduced alone, with no concatenation, and the smaller
gradients between them still share packs. Elsewhere (GPU replicas, several workers) and
with an explicit ``bytes_per_pack``, packs fill up as before. The graph must still train
as one device does.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.plan import Plan
from graph_rewriter.planner import ALONE_BYTES_CPU
from graph_rewriter.testing import harness, models

from test_equivalence import ATOL, BATCH, RTOL, STEPS

tf1 = tf.compat.v1
WIDE = 512   # a WIDE x WIDE float32 kernel is 1 MiB: the threshold exactly
TWO_WORKERS = {"worker": ["localhost:2222", "localhost:2223"]}


def _example():
    """x[None,6] -> dense 6xWIDE -> dense WIDExWIDE (1 MiB) -> dense WIDEx1, Momentum."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, models.FEATURES], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        for i, units in enumerate((WIDE, WIDE, 1)):
            w = tf1.get_variable(f"dense_{i}/kernel", [h.shape[1], units], use_resource=True,
                                 initializer=tf1.glorot_uniform_initializer(seed=i))
            b = tf1.get_variable(f"dense_{i}/bias", [units], use_resource=True,
                                 initializer=tf1.random_uniform_initializer(-0.1, 0.1, seed=10 + i))
            h = tf.matmul(h, w) + b
            if units != 1:
                h = tf.tanh(h)
        loss = tf.identity(tf.reduce_mean(tf.square(h - y)), name="loss")
        step = tf1.train.get_or_create_global_step()
        tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=step, name="train_op")
        variables = tf1.global_variables()
        tf1.variables_initializer(variables, name="init")
        tf1.train.Saver()
    reads = {v.op.name: models._read_tensor_name(v) for v in variables}
    return models.Example(graph_def=g.as_graph_def(), model="mlp", optimizer="momentum", resource=True,
                          feeds=["x:0", "y:0"], variables=reads, step_counter=reads["global_step"])


@pytest.fixture(scope="module")
def example():
    return _example()


def _packs(result):
    return [list(p.cuts) for p in result.plan.packs]


def test_a_large_gradient_gets_a_pack_of_its_own_on_cpu_replicas(example):
    result = gr.rewrite(example.graph_def, devices_per_worker=2, device_type="CPU")
    packs = _packs(result)
    assert ["dense_1/kernel"] in packs
    # the smaller gradients between the large one and the others still share packs
    assert any(len(p) > 1 for p in packs)
    assert result.plan.alone_bytes == ALONE_BYTES_CPU
    nodes = {n.name: n for n in result.graph_def.node}
    for prefix in ("", "replica_1/"):
        for p, cuts in enumerate(packs):
            reduce = nodes[f"{prefix}allreduce/pack_{p}/all_reduce"]
            producer = nodes[reduce.input[0].split(":")[0]]
            assert producer.op == ("ConcatV2" if len(cuts) > 1 else "Reshape"), (p, cuts)
    # the plan keeps the choice through JSON, and a given plan makes the same packs
    again = Plan.from_json(result.plan.to_json())
    assert again.alone_bytes == ALONE_BYTES_CPU
    given = gr.rewrite(example.graph_def, strategy=again, devices_per_worker=2, device_type="CPU")
    assert _packs(given) == packs


def test_strategy_auto_packs_alone_too(example):
    result = gr.rewrite(example.graph_def, strategy="auto", devices_per_worker=2, device_type="CPU")
    assert result.plan.cut("dense_1/kernel").sync == "allreduce"   # one machine: the cost model mirrors it
    assert ["dense_1/kernel"] in _packs(result)
    assert result.plan.alone_bytes == ALONE_BYTES_CPU


@pytest.mark.parametrize("how", ["explicit bytes_per_pack", "GPU", "two workers"])
def test_packs_fill_up_elsewhere(example, how):
    kw = {"explicit bytes_per_pack": dict(devices_per_worker=2, device_type="CPU", bytes_per_pack=32 << 20),
          "GPU": dict(devices_per_worker=2, device_type="GPU"),
          "two workers": dict(cluster_spec=TWO_WORKERS, device_type="CPU")}[how]
    result = gr.rewrite(example.graph_def, **kw)
    assert len(result.plan.packs) == 1
    assert result.plan.alone_bytes is None
    assert "alone_bytes" not in result.plan.to_dict()


def test_small_models_are_unchanged():
    ex = models.build("mlp", optimizer="momentum")
    result = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    assert len(result.plan.packs) == 1 and result.plan.alone_bytes is None


@pytest.mark.parametrize("replicas", [2, 4])
def test_alone_packs_train_like_one_device(example, replicas):
    losses, values = harness.run_single(example, steps=STEPS, batch_size=BATCH)
    result = gr.rewrite(example.graph_def, devices_per_worker=replicas, device_type="CPU")
    assert ["dense_1/kernel"] in _packs(result)
    losses2, values2 = harness.run_rewritten(result, example, steps=STEPS, batch_size=BATCH,
                                             replica_copies=True)
    np.testing.assert_allclose(losses2, losses, rtol=RTOL, atol=ATOL)
    assert values["global_step"] == STEPS
    for name, value in values.items():
        np.testing.assert_allclose(values2[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
        for prefix in result.metadata["replica_prefixes"][1:]:
            np.testing.assert_array_equal(values2[prefix + name], values2[name], err_msg=prefix + name)
    moved = harness.run_single(example, steps=0, batch_size=BATCH)[1]
    assert not np.allclose(moved["dense_1/kernel"], values["dense_1/kernel"])
