"""Reduce-to-one all-reduce (``allreduce_algorithm="reduce_to_one"``): every replica's
pack summed on one device of the worker and divided by the replica count there, every
replica reading the mean back. No collective: for replicas of one process (CPU devices
share memory, so nothing is copied).

What is checked: the plan and its refusals, what ``auto`` picks, the graph the allreduce
pass builds (one AddN listing every replica's pack, also when the export writes the
template replicas), and numeric equality with one device for every optimizer, sparse
gradients made dense, BatchNorm's moving statistics and compression.
"""

import numpy as np
import pytest
from tensorflow.core.framework import graph_pb2

import graph_rewriter as gr
from graph_rewriter import cost_model as cm
from graph_rewriter import inspect_report
from graph_rewriter.testing import harness, models

STEPS, BATCH = 3, 8
RTOL, ATOL = 1e-4, 1e-6
ALGORITHM = dict(allreduce_algorithm="reduce_to_one", device_type="CPU")


def _nodes(result):
    return list(graph_pb2.GraphDef.FromString(result.serialized()).node)


@pytest.fixture(scope="module")
def mlp():
    return models.build("mlp", "adam").graph_def


# ----- the plan ---------------------------------------------------------------------------

def test_the_option_makes_every_pack_reduce_to_one_and_the_plan_records_it(mlp, tmp_path):
    result = gr.rewrite(mlp, devices_per_worker=2, **ALGORITHM)
    assert [p.algorithm for p in result.plan.packs] == ["reduce_to_one"]
    assert result.plan.to_dict()["packs"][0]["algorithm"] == "reduce_to_one"
    path = tmp_path / "plan.json"
    path.write_text(result.plan.to_json())
    again = gr.rewrite(mlp, devices_per_worker=2, device_type="CPU", strategy=str(path))
    assert [p.algorithm for p in again.plan.packs] == ["reduce_to_one"]
    assert again.serialized() == result.serialized()
    text = inspect_report.format_report(inspect_report.report(result))
    assert "pack 0: float32" in text and "reduced on one device" in text


@pytest.mark.parametrize("device_type, expected", [("CPU", ["reduce_to_one"]), ("GPU", [None])])
def test_auto_sums_on_one_device_only_where_the_replicas_share_memory(mlp, device_type, expected):
    """CPU replicas of one worker share the process's memory; GPUs keep the ring (NCCL),
    which moves 2 (R - 1) / R of a pack per device instead of 2 (R - 1) through one."""
    result = gr.rewrite(mlp, devices_per_worker=4, device_type=device_type, allreduce_algorithm="auto")
    assert [p.algorithm for p in result.plan.packs] == expected


def test_auto_on_several_workers_never_reduces_to_one(mlp):
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    for dpw in (1, 2):
        result = gr.rewrite(mlp, cluster, devices_per_worker=dpw, device_type="CPU", allreduce_algorithm="auto")
        assert all(p.algorithm != "reduce_to_one" for p in result.plan.packs)


def test_the_default_stays_the_flat_ring(mlp):
    result = gr.rewrite(mlp, devices_per_worker=2, device_type="CPU")
    assert [p.algorithm for p in result.plan.packs] == [None]
    assert any(n.op == "CollectiveReduceV2" for n in result.graph_def.node)


@pytest.mark.parametrize("task", [None, "worker:1"])
def test_several_workers_are_refused_naming_the_count(mlp, task):
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    with pytest.raises(gr.GraphRewriteError, match=r"needs every replica in one worker; this cluster has 2 workers"):
        gr.rewrite(mlp, cluster, devices_per_worker=2, task=task, **ALGORITHM)


def test_a_plan_asking_for_it_on_several_workers_is_refused_naming_the_pack(mlp, tmp_path):
    cluster = {"worker": ["w0:2222", "w1:2222"]}
    plan = gr.rewrite(mlp, cluster, devices_per_worker=1, device_type="CPU").plan
    plan.packs[0].algorithm = "reduce_to_one"
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    with pytest.raises(gr.GraphRewriteError, match=r"the plan's pack 0 asks to reduce on one device"):
        gr.rewrite(mlp, cluster, devices_per_worker=1, device_type="CPU", strategy=str(path))


def test_a_single_worker_between_graph_may_reduce_to_one(mlp):
    result = gr.rewrite(mlp, {"worker": ["w0:2222"]}, task="worker:0", devices_per_worker=2, **ALGORITHM)
    assert [p.algorithm for p in result.plan.packs] == ["reduce_to_one"]


def test_the_cost_model_copies_nothing_in_shared_memory():
    model, topo = cm.CostModel(), cm.Topology(workers=1, devices_per_worker=4)
    shared = cm.reduce_to_one_cost(100 * 1000 * 1000, topo, model, shared_memory=True)
    copied = cm.reduce_to_one_cost(100 * 1000 * 1000, topo, model)
    assert shared.bytes_per_link == 0 and shared.messages == 0
    assert copied.bytes_per_link == 2 * 3 * 100 * 1000 * 1000   # 3 replicas' packs in, the mean out
    ring = cm.allreduce_cost(100 * 1000 * 1000, topo, model)
    assert copied.seconds > ring.seconds   # why GPUs keep the ring
    assert cm.reduce_to_one_cost(0, topo, model) == cm.FREE


# ----- the graph --------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [2, 5])
def test_one_addn_per_pack_lists_every_replica_and_every_replica_reads_its_mean(replicas):
    """5 replicas: the IR builds replicas 0 and 1 only, the export lists all five."""
    ex = models.build("mlp", "adam")
    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, bytes_per_pack=64, **ALGORITHM)
    nodes = _nodes(result)
    by_name = {n.name: n for n in nodes}
    packs = result.plan.packs
    assert len(packs) > 1
    assert not [n.name for n in nodes if n.op == "CollectiveReduceV2" and "allreduce" in n.name]
    prefixes = result.metadata["replica_prefixes"]
    for p in range(len(packs)):
        total = by_name[f"allreduce/pack_{p}/sum"]
        assert total.op == "AddN" and total.attr["N"].i == replicas
        assert total.device == result.devices[p % replicas]   # the packs take turns
        members = [i.split(":")[0] for i in total.input]
        assert [m.split("allreduce/")[0] for m in members] == prefixes
        mean = by_name[f"allreduce/pack_{p}/mean"]
        assert mean.op == "Div" and mean.input[0] == total.name
        count = by_name[mean.input[1]]
        assert count.attr["value"].tensor.float_val == [replicas]
        readers = [n for n in nodes if f"allreduce/pack_{p}/mean" in n.input]
        assert sorted(n.name.split("allreduce/")[0] for n in readers) == sorted(prefixes)
        for reader in readers:   # each replica's split or reshape is on its own device
            prefix = reader.name.split("allreduce/")[0]
            assert reader.device == result.devices[prefixes.index(prefix)]


def test_compressed_packs_are_summed_compressed(mlp):
    result = gr.rewrite(mlp, devices_per_worker=2, compression="fp16", **ALGORITHM)
    total = {n.name: n for n in result.graph_def.node}["allreduce/pack_0/sum"]
    assert total.attr["T"].type == 19   # DT_HALF
    casts = [n.name for n in result.graph_def.node if n.op == "Cast" and "allreduce/pack_0/" in n.name]
    assert sorted(c.rsplit("/", 1)[-1] for c in casts) == ["compress", "compress", "decompress", "decompress"]


# ----- equal to one device ----------------------------------------------------------------

def _check(model, optimizer, replicas, rtol=RTOL, atol=ATOL, algorithm="reduce_to_one", **options):
    ex = models.build(model, optimizer)
    want_losses, want = harness.run_single(ex, steps=STEPS, batch_size=BATCH)
    _, initial = harness.run_single(ex, steps=0, batch_size=BATCH)
    assert len([n for n in want if not np.array_equal(want[n], initial[n])]) >= 2   # it trained
    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type="CPU", allreduce_algorithm=algorithm,
                        **options)
    assert {p.algorithm or "flat" for p in result.plan.packs} == {algorithm}
    losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=BATCH, replica_copies=True)
    np.testing.assert_allclose(losses, want_losses, rtol=rtol, atol=atol, err_msg="losses per step")
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=f"variable '{name}'")
    for prefix in result.metadata["replica_prefixes"][1:]:
        for name in want:
            np.testing.assert_allclose(got[prefix + name], got[name], rtol=rtol, atol=atol,
                                       err_msg=f"replica copy '{prefix + name}'")


QUICK_V1 = ("sgd", "momentum", "adam", "adagrad", "rmsprop_centered", "ftrl")
QUICK_KERAS = ("keras_sgd_momentum", "keras_adam", "keras_nadam")


def _cases(optimizers, quick):
    return [pytest.param(o, r, marks=() if o in quick and r in (2, 4) else [pytest.mark.slow])
            for o in optimizers for r in (2, 4, 8)]


@pytest.mark.parametrize("optimizer, replicas", _cases(models.OPTIMIZERS_V1, QUICK_V1))
def test_v1_optimizers_equal_one_device(optimizer, replicas):
    _check("mlp", optimizer, replicas)


@pytest.mark.parametrize("optimizer, replicas", _cases(models.OPTIMIZERS_KERAS, QUICK_KERAS))
def test_keras_optimizers_equal_one_device(optimizer, replicas):
    _check("keras", optimizer, replicas)


@pytest.mark.parametrize("algorithm", ["flat", "reduce_to_one"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad"])   # not Momentum, Ftrl: docs/semantics.md
@pytest.mark.parametrize("replicas", [2, 4])
def test_sparse_gradients_made_dense_equal_one_device(optimizer, replicas, algorithm):
    """Also with the flat ring: the optimizer's deduplication reads Shape(unique indices)
    for its segment count, which must keep the local indices (it once read the dense
    row range, and every run failed with a shape error)."""
    _check("embedding", optimizer, replicas, algorithm=algorithm, sparse_as_dense=True)


@pytest.mark.parametrize("model, optimizer", [("cond", "sgd"), ("lstm_v1", "momentum"), ("lstm_v2", "adam"),
                                              ("lr_schedule", "sgd")])
def test_other_models_equal_one_device(model, optimizer):
    _check(model, optimizer, 2)


def test_compressed_packs_equal_one_device_within_half_precision():
    _check("mlp", "sgd", 4, rtol=2e-3, atol=2e-4, compression="fp16")


@pytest.mark.parametrize("replicas", [2, 4])
def test_batchnorm_moving_statistics_are_the_mean_of_the_replicas(replicas):
    """The moving statistics' updates are packed and averaged like gradients: after one
    step each replica's moving variance is momentum * v0 + (1 - momentum) * the mean of
    the shards' batch variances (which differs from one device's)."""
    ex = models.build("batchnorm", "sgd")
    _, initial = harness.run_single(ex, steps=0, batch_size=BATCH)
    want = harness.sharded_moving_variance(ex, ex.batch(0, BATCH), replicas, initial["bn/moving_variance"])
    _, single = harness.run_single(ex, steps=1, batch_size=BATCH)
    assert not np.allclose(want, single["bn/moving_variance"], rtol=RTOL, atol=ATOL)
    result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, **ALGORITHM)
    _, got = harness.run_rewritten(result, ex, steps=1, batch_size=BATCH, replica_copies=True)
    for prefix in result.metadata["replica_prefixes"]:
        np.testing.assert_allclose(got[prefix + "bn/moving_mean"], single["bn/moving_mean"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got[prefix + "bn/moving_variance"], want, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("model, optimizer", [("mlp", "adam"), ("embedding", "adagrad")])
def test_on_a_server_the_replicas_equal_one_device(model, optimizer):
    """A real TensorFlow server (one worker with 2 CPU devices, in its own process on a
    loopback port): the sum reads the other device's pack through the server's local
    rendezvous. The embedding's sparse gradient is still gathered (a collective) while
    its dense ones are summed on one device."""
    from graph_rewriter.local_cluster import LocalCluster
    ex = models.build(model, optimizer)
    want_losses, want = harness.run_single(ex, steps=STEPS, batch_size=BATCH)
    with LocalCluster(workers=1, devices_per_worker=2, start_timeout=60) as cluster:
        result = gr.rewrite(ex.graph_def, cluster.spec, devices_per_worker=2, **ALGORITHM)
        assert {p.algorithm for p in result.plan.packs} == {"reduce_to_one"}
        assert all(d.startswith("/job:worker/replica:0/task:0/") for d in result.devices), result.devices
        losses, got = harness.run_rewritten(result, ex, steps=STEPS, batch_size=BATCH, replica_copies=True,
                                            target=cluster.target("worker", 0))
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL, err_msg="losses per step")
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=f"variable '{name}'")
        np.testing.assert_allclose(got["replica_1/" + name], got[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("replicas", [2, 4])
def test_with_accumulation_it_trains_as_the_flat_ring_does(replicas):
    """accumulation_steps=2: the micro-batch sums reach the packs as the ring's do (the
    flat ring's accumulation is held to one device in tests/test_accumulation.py)."""
    ex = models.build("mlp", "momentum")
    runs = {}
    for algorithm in ("flat", "reduce_to_one"):
        result = gr.rewrite(ex.graph_def, devices_per_worker=replicas, device_type="CPU",
                            allreduce_algorithm=algorithm, accumulation_steps=2)
        runs[algorithm] = harness.run_rewritten(result, ex, steps=4, batch_size=BATCH)
    (flat_losses, flat), (losses, got) = runs["flat"], runs["reduce_to_one"]
    np.testing.assert_allclose(losses, flat_losses, rtol=RTOL, atol=ATOL)
    for name, value in flat.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    _, initial = harness.run_single(ex, steps=0, batch_size=BATCH)
    assert any(not np.allclose(flat[n], initial[n]) for n in flat)   # it trained
