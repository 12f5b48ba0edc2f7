"""strategy="auto": the cost model's formulas on hand-computed cases, the choices it makes
for dense and sparse models on several clusters, and that an auto plan trains like one
device.

The hand computations use the model's documented defaults unless a case sets its own:
10 Gb Ethernet (1.25e9 B/s, 50 us) between machines, PCIe (12e9 B/s, 10 us) within one,
a global batch of 256.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import cost_model as cm
from graph_rewriter.testing import harness, models

MB = 1000 * 1000
ROWS, DIM, IDS_PER_EXAMPLE = 100_000, 64, 10     # a 25.6 MB embedding table
HIDDEN = 4096                                     # a 1 MB dense layer after it


def cluster(workers, ps):
    spec = {"worker": [f"w{i}:2222" for i in range(workers)]}
    if ps:
        spec["ps"] = [f"p{i}:2222" for i in range(ps)]
    return spec


def big_embedding_model(rows=ROWS):
    """ids [batch, 10] -> embedding [rows, 64] (sparse gradient) -> dense layer of 4096
    -> output -> mean squared loss, Adagrad; seeded. Returns an models.Example (feeds "ids:0", "y:0")."""
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(3)
        ids = tf.compat.v1.placeholder(tf.int64, [None, IDS_PER_EXAMPLE], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        with tf.compat.v1.variable_scope("", use_resource=True):
            table = tf.compat.v1.get_variable(
                "embedding", [rows, DIM], initializer=tf.compat.v1.random_normal_initializer(seed=1))
            w = tf.compat.v1.get_variable("hidden/kernel", [DIM, HIDDEN],
                                          initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
            b = tf.compat.v1.get_variable("hidden/bias", [HIDDEN], initializer=tf.compat.v1.zeros_initializer())
            v = tf.compat.v1.get_variable("output/kernel", [HIDDEN, 1],
                                          initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
        h = tf.nn.relu(tf.matmul(h, w) + b)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, v) - y), name="loss")
        step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.train.AdagradOptimizer(0.5).minimize(loss, global_step=step, name="train_op")
        tf.group(*[v.initializer for v in tf.compat.v1.global_variables()], name="init")
        variables = {v.op.name: models._read_tensor_name(v) for v in tf.compat.v1.global_variables()}
    return models.Example(graph_def=g.as_graph_def(), model="big_embedding", optimizer="adagrad",
                            resource=True, feeds=["ids:0", "y:0"], variables=variables)


# ----- formulas -----------------------------------------------------------------------

def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_bytes_per_link():
    model = cm.CostModel(inter_bandwidth=1e9, inter_latency=0.0)
    two = cm.allreduce_cost(100 * MB, cm.Topology(workers=2), model)
    assert two.bytes_per_link == 100 * MB and two.seconds == pytest.approx(0.1)
    four = cm.allreduce_cost(100 * MB, cm.Topology(workers=4), model)
    assert four.bytes_per_link == 150 * MB and four.seconds == pytest.approx(0.15)
    # latency: 2(n-1) messages, shared by the gradients of a pack by their bytes
    lat = cm.CostModel(inter_bandwidth=1e9, inter_latency=1e-3)
    assert cm.allreduce_cost(100 * MB, cm.Topology(workers=4), lat).seconds == pytest.approx(0.15 + 6e-3)
    assert cm.allreduce_cost(25 * MB, cm.Topology(workers=4), lat, pack_bytes=100 * MB).seconds == \
        pytest.approx(0.0375 + 6e-3 / 4)


def test_one_machine_uses_the_machines_link_and_one_replica_communicates_nothing():
    model = cm.CostModel(intra_bandwidth=10e9, intra_latency=0.0)
    assert cm.allreduce_cost(100 * MB, cm.Topology(devices_per_worker=2), model).seconds == pytest.approx(0.01)
    alone = cm.Topology(workers=1, devices_per_worker=1)
    assert cm.allreduce_cost(100 * MB, alone, model) == cm.FREE
    assert cm.ps_cost(100 * MB, 100 * MB, alone, model) == cm.FREE
    assert cm.allgather_cost(1000, 256, 8, alone, model) == cm.FREE


def test_parameter_server_cost_is_push_then_pull_through_the_busiest_link():
    model = cm.CostModel(inter_bandwidth=1e9, inter_latency=0.0)
    # 4 workers x 1 GPU, one ps holding a 10 MB variable: the ps link carries 4 x 10 MB each way
    one = cm.ps_cost(10 * MB, 10 * MB, cm.Topology(workers=4, ps_tasks=1), model)
    assert one.seconds == pytest.approx(2 * 0.04) and one.bytes_per_link == 40 * MB
    # split over 4 ps tasks: each carries 10 MB, as much as a worker's own NIC
    four = cm.ps_cost(10 * MB, 10 * MB, cm.Topology(workers=4, ps_tasks=4), model, shards=4)
    assert four.seconds == pytest.approx(2 * 0.01) and four.bytes_per_link == 10 * MB


def test_allgather_pads_rows_to_a_power_of_two_and_gathers_every_other_replica():
    model = cm.CostModel(inter_bandwidth=1e9, inter_latency=0.0)
    c = cm.allgather_cost(600, 256, 8, cm.Topology(workers=3), model)
    assert c.bytes_per_link == 2 * (1024 * 264 + 8)
    assert c.seconds == pytest.approx(c.bytes_per_link / 1e9)


def test_pack_size_makes_latency_a_twentieth_of_the_transfer_within_bounds():
    model = cm.CostModel()
    assert cm.pack_bytes_for(cm.Topology(workers=16), model) == 20_000_000   # 16 * 50us * 1.25e9 / 0.05
    assert cm.pack_bytes_for(cm.Topology(devices_per_worker=2), model) == 4_800_000
    assert cm.pack_bytes_for(cm.Topology(workers=1024), model) == 256 << 20    # capped


# ----- choices ------------------------------------------------------------------------

def dense_model(width=1024):
    """x [batch, 256] -> 3 dense layers of ``width`` -> 1, Momentum: about 9 MB of
    float32 gradients, most of them in the weight matrices."""
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(5)
        x = tf.compat.v1.placeholder(tf.float32, [None, 256], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        with tf.compat.v1.variable_scope("", use_resource=True):
            for k, (n_in, n_out) in enumerate([(256, width), (width, width), (width, width), (width, 1)]):
                w = tf.compat.v1.get_variable(f"layer_{k}/kernel", [n_in, n_out],
                                              initializer=tf.compat.v1.glorot_uniform_initializer(seed=k))
                b = tf.compat.v1.get_variable(f"layer_{k}/bias", [n_out],
                                              initializer=tf.compat.v1.zeros_initializer())
                h = tf.matmul(h, w) + b
                if n_out > 1:
                    h = tf.nn.relu(h)
            out = h
        loss = tf.reduce_mean(tf.square(out - y), name="loss")
        tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train_op")
        tf.group(*[v.initializer for v in tf.compat.v1.global_variables()], name="init")
    return g.as_graph_def()


def test_a_dense_only_model_allreduces_everything_even_with_parameter_servers():
    r = gr.rewrite(dense_model(), cluster(4, 2), strategy="auto", device_type="CPU")
    plan = r.plan
    assert plan.cuts and all(c.sync == "allreduce" for c in plan.cuts)
    assert all(v.placement == "mirrored" for v in plan.variables)
    for c in plan.cuts:
        assert c.costs["allreduce"]["seconds"] < c.costs["accumulate"]["seconds"], c.variable
    assert plan.bytes_per_pack == cm.pack_bytes_for(cm.Topology(workers=4, ps_tasks=2), cm.CostModel())
    assert plan.cost["predicted"]["ps"] == 0 and plan.cost["predicted"]["allreduce"] > 0


def test_a_large_sparse_embedding_goes_to_the_parameter_servers_in_shards():
    r = gr.rewrite(big_embedding_model().graph_def, cluster(4, 2), strategy="auto", device_type="CPU")
    plan = r.plan
    emb = plan.cut("embedding")
    assert emb.sync == "accumulate" and plan.variable("embedding").placement == "ps"
    # the Adagrad slot travels with it; the dense layer stays all-reduced
    assert all(v.placement == "ps" for v in plan.group("embedding"))
    assert plan.cut("hidden/kernel").sync == "allreduce"
    # By hand: a replica touches 64 examples x 10 ids = 640 rows of 256 B (+ 8 B ids).
    rows, row, idx, bw, lat = 640, 256, 8, 1.25e9, 50e-6
    allgather = 3 * 3 * lat + 3 * (1024 * (row + idx) + 8) / bw
    assert emb.costs["allgather"]["seconds"] == pytest.approx(allgather)
    # ps over 2 shards: each ps task gets 4 replicas' rows / 2, push then pull
    push, pull = rows * (row + idx), rows * row
    ps = (2 * lat + 4 * push / 2 / bw) + (2 * lat + 4 * pull / 2 / bw)
    assert emb.costs["accumulate"]["seconds"] == pytest.approx(ps)
    assert emb.costs["accumulate"]["shards"] == 2
    assert emb.costs["allreduce"]["seconds"] == pytest.approx(2 * 3 * lat * 1.0 + 1.5 * ROWS * DIM * 4 / bw, rel=1e-3)
    shards = plan.variable("embedding").shards
    assert [s["ps_task"] for s in shards] == [0, 1] and sum(s["rows"] for s in shards) == ROWS
    # the graph holds the two parts on the two ps tasks
    devices = {n.name: n.device for n in r.graph_def.node}
    assert devices["embedding/part_0"].startswith("/job:ps/replica:0/task:0")
    assert devices["embedding/part_1"].startswith("/job:ps/replica:0/task:1")


def test_with_two_replicas_gathering_rows_beats_a_parameter_server_round_trip():
    r = gr.rewrite(big_embedding_model().graph_def, None, strategy="auto", devices_per_worker=2, device_type="CPU")
    emb = r.plan.cut("embedding")
    assert emb.sync == "allgather"
    assert emb.costs["allgather"]["seconds"] < emb.costs["accumulate"]["seconds"] < emb.costs["allreduce"]["seconds"]


def test_a_table_that_every_step_touches_whole_is_allreduced_densely():
    # 4096 rows, a global batch of 4096 x 10 ids: every replica touches every row
    r = gr.rewrite(big_embedding_model(rows=4096).graph_def, cluster(4, 1), strategy="auto", device_type="CPU",
                   cost_model={"batch_size": 4096})
    assert r.plan.cut("embedding").sync == "allreduce"
    assert r.plan.variable("embedding").placement == "mirrored"


def test_one_worker_with_one_device_needs_no_communication():
    r = gr.rewrite(big_embedding_model().graph_def, None, strategy="auto", device_type="CPU")
    plan = r.plan
    assert all(c.sync != "accumulate" for c in plan.cuts)
    assert all(cost["seconds"] == 0 for c in plan.cuts for cost in c.costs.values())
    assert plan.cost["predicted"]["seconds"] == 0
    assert not [n for n in r.graph_def.node if n.op.startswith("Collective")]


def test_cost_model_options_change_the_choice_and_an_explicit_pack_size_wins():
    small = gr.rewrite(big_embedding_model(rows=20000).graph_def, cluster(4, 2), strategy="auto",
                       device_type="CPU")
    assert small.plan.cut("embedding").sync == "accumulate"
    # a batch that touches every row of the table makes the dense allreduce cheapest
    large = gr.rewrite(big_embedding_model(rows=20000).graph_def, cluster(4, 2), strategy="auto",
                       device_type="CPU", cost_model={"batch_size": 65536})
    assert large.plan.cut("embedding").sync == "allreduce"
    assert large.plan.cost["model"]["batch_size"] == 65536
    sized = gr.rewrite(big_embedding_model().graph_def, cluster(4, 1), strategy="auto", device_type="CPU",
                       bytes_per_pack=1024)
    assert sized.plan.bytes_per_pack == 1024


def test_a_saved_auto_plan_applies_again_with_its_pack_size(tmp_path):
    r = gr.rewrite(big_embedding_model().graph_def, cluster(4, 2), strategy="auto", device_type="CPU")
    path = tmp_path / "plan.json"
    path.write_text(r.plan.to_json())
    again = gr.rewrite(big_embedding_model().graph_def, cluster(4, 2), strategy=str(path), device_type="CPU")
    assert again.plan.bytes_per_pack == r.plan.bytes_per_pack
    assert [(c.variable, c.sync) for c in again.plan.cuts] == [(c.variable, c.sync) for c in r.plan.cuts]
    assert again.serialized() == r.serialized()


def test_inspect_shows_each_choice_with_its_predicted_cost(tmp_path):
    from graph_rewriter.inspect_report import format_report, report
    r = gr.rewrite(big_embedding_model().graph_def, cluster(4, 2), strategy="auto", device_type="CPU")
    text = format_report(report(r))
    assert "auto: predicted communication per step of each choice (chosen first):" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("embedding ") and " ms" in ln)
    assert line.split()[1] == "ps" and "(2 shards)" in line and "allgather" in line
    assert "cost model: 4 worker(s) x 1 device(s), 2 ps task(s)" in text
    assert "predicted communication per step:" in text


# ----- an auto plan trains like one device ---------------------------------------------

def test_auto_plan_mixing_ps_and_allreduce_trains_like_one_device():
    import tensorflow as tf
    ex = big_embedding_model(rows=5000)
    # four replicas on this machine: the cost model puts the table on the host (ps)
    r = gr.rewrite(ex.graph_def, None, strategy="auto", devices_per_worker=4, device_type="CPU")
    assert r.plan.cut("embedding").sync == "accumulate" and r.plan.cut("hidden/kernel").sync == "allreduce"
    rng = np.random.default_rng(0)
    batches = [{"ids:0": rng.integers(0, 50, size=(8, IDS_PER_EXAMPLE)),
                "y:0": rng.normal(size=(8, 1)).astype(np.float32)} for _ in range(3)]
    ref_losses, ref = harness.run_single(ex, steps=3, feeds=batches)
    losses, values = harness.run_rewritten(r, ex, steps=3, feeds=batches, replica_copies=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert ref["global_step"] == 3
    # float32 sums over 4096 hidden units, reduced in another order across replicas
    for name, value in ref.items():
        np.testing.assert_allclose(values[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    for i in (1, 2, 3):
        np.testing.assert_array_equal(values[f"replica_{i}/hidden/kernel"], values["hidden/kernel"])


def test_the_whole_step_is_checked_so_a_latency_bound_model_pays_one_round_of_messages():
    # a few hundred bytes of gradients: per gradient, ps and allreduce are close, and a mix
    # would pay both rounds' latency; the whole-plan check keeps one
    ex = models.build("embedding", optimizer="adam")
    r = gr.rewrite(ex.graph_def, None, strategy="auto", devices_per_worker=4, device_type="CPU")
    cost = r.plan.cost
    assert set(cost["alternatives"]) == {"mixed", "mirrored", "ps"}
    assert cost["predicted"]["seconds"] == min(cost["alternatives"].values())
    assert cost["alternatives"]["mixed"] > cost["predicted"]["seconds"]
    syncs = {c.sync for c in r.plan.cuts}
    assert syncs == {"accumulate"} or "accumulate" not in syncs
