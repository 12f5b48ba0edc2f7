"""Tests of the sync_queues pass alone (after plan, replicate and accumulate): between-graph
parameter-server workers are kept in step by token queues on the first ps task.

    every worker:  its accumulator applies --> dequeue a token from its own queue --> train_op
    the chief:     takes --> sync_step bump --> updates --> enqueue a token in every worker's queue
    init:          the chief initializes and releases an init barrier; other workers wait on it
"""

import pytest

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.ps_state import INIT_BARRIER, RESET_DONE, RUN_ID, TOKENS
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, reaches, reads

APPLIES = ("AccumulatorApplyGradient", "SparseAccumulatorApplyGradient")
UPDATES = ("ResourceApplyGradientDescent",)


def sync(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.AccumulatePass(),
                      passes.SyncQueuesPass())


def queue_read_by(node):
    """The FIFOQueueV2 a queue op uses."""
    (q,) = [n for n in reads(node) if n.op == "FIFOQueueV2"]
    return q


def test_each_worker_waits_for_a_token_after_its_applies():
    """
        worker k:  applies --> NoOp --> QueueDequeueV2(tokens_k on ps 0) --> train_op
    """
    for k in (0, 1):
        g = dense()
        ctx = context(PS2_WORKERS2, task=("worker", k), strategy="ps")
        sync(g, ctx)
        train_op = g.node("train_op")
        waits = [n for n in ops(g, "QueueDequeueV2") if n in train_op.control_inputs]
        assert len(waits) == 1, k
        wait = waits[0]
        assert wait.device == queue_read_by(wait).device == ctx.cluster.ps_device(0)
        for a in ops(g, *APPLIES):
            assert reaches(a, wait)
        # each worker dequeues from its own queue: the chief's enqueue into it is the k-th
        own = queue_read_by(wait)
        assert own.attr["shared_name"].s.endswith(f"tokens/{k}".encode())


def test_the_chief_enqueues_a_token_per_worker_after_the_updates():
    """
        chief:  take --> sync_step bump --> update_w, update_b --> read sync_step
                                              --> QueueEnqueueV2(tokens_0), QueueEnqueueV2(tokens_1)
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps")
    sync(g, ctx)
    enqueues = ops(g, "QueueEnqueueV2")
    assert len({queue_read_by(e) for e in enqueues}) == len(enqueues) == 2
    bump = ops(g, "AssignAddVariableOp")[0]
    for e in enqueues:
        assert e.device == ctx.cluster.ps_device(0)
        assert reaches(bump, e)
        for update in ops(g, *UPDATES):
            assert reaches(update, e)
        (wait,) = [n for n in ops(g, "QueueDequeueV2") if n in g.node("train_op").control_inputs]
        assert reaches(e, wait)   # the chief waits for its own token too


def test_another_worker_leaves_the_takes_and_updates_to_the_chief():
    """
        worker 1: applies --> NoOp --> dequeue --> train_op   (no take, no bump, no update)
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 1), strategy="ps")
    sync(g, ctx)
    assert not ops(g, "AccumulatorTakeGradient", "AssignAddVariableOp", "QueueEnqueueV2", *UPDATES)
    assert len(ops(g, "AccumulatorApplyGradient")) == 2
    train_op = g.node("train_op")
    for a in ops(g, *APPLIES):
        assert reaches(a, train_op)


def test_only_the_chief_initializes_the_shared_variables():
    """
        chief:    w/Assign, b/Assign, resets --> QueueEnqueueManyV2(init barrier) --> init
        worker 1: QueueDequeueV2(init barrier) --> init   (no assign of a shared variable)
    """
    chief, other = dense(), dense()
    chief_ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps")
    other_ctx = context(PS2_WORKERS2, task=("worker", 1), strategy="ps")
    sync(chief, chief_ctx)
    sync(other, other_ctx)
    (release,) = [n for n in ops(chief, "QueueEnqueueManyV2") if n in chief.node("init").control_inputs
                  and n.control_inputs]
    assert {"w/Assign", "b/Assign"} <= {c.name for c in release.control_inputs}
    assert any(c.op == "AccumulatorSetGlobalStep" for c in release.control_inputs)
    init = other.node("init")
    assert [c.op for c in init.control_inputs] == ["QueueDequeueV2"]
    barrier = queue_read_by(init.control_inputs[0])
    assert barrier.attr["shared_name"].s == queue_read_by(release).attr["shared_name"].s
    assert not any(reaches(other.node(name), init) for name in ("w/Assign", "b/Assign"))


def test_staleness_gives_every_queue_a_head_start_at_init():
    """
        chief init: drain tokens_k --> QueueEnqueueManyV2(tokens_k, [0] * staleness) --> init
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps", staleness=2)
    sync(g, ctx)
    init = g.node("init")
    head_starts = [n for n in ops(g, "QueueEnqueueManyV2")
                   if any(c.op == "QueueDequeueUpToV2" for c in n.control_inputs) and n.name.startswith(TOKENS)]
    assert len({queue_read_by(n) for n in head_starts}) == 2
    for n in head_starts:
        assert n in init.control_inputs
        tokens = [t for t in reads(n) if t.op == "Const"][0]
        shape = [d.size for d in tokens.attr["value"].tensor.tensor_shape.dim]
        assert shape == [2]


def test_asynchronous_workers_get_an_init_barrier_but_no_tokens():
    """
        sync=False: no accumulator, no token queue; only the init barrier (FIFOQueueV2) remains
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps", sync=False)
    sync(g, ctx)
    assert "sync_queues" in ctx.passes_run
    assert len(ops(g, "FIFOQueueV2")) == 1   # the init barrier only
    assert not ops(g, "QueueDequeueV2", "QueueEnqueueV2")


@pytest.mark.parametrize("cluster, task, strategy", [
    (PS2_WORKERS2, None, "ps"),                # in-graph: one client runs every replica
    (WORKERS2, ("worker", 0), "allreduce"),    # no variable on a parameter server
])
def test_applies_only_between_graph_with_parameter_servers(cluster, task, strategy):
    """In-graph (one client) or without ps variables, nobody needs tokens: the pass is skipped."""
    g = dense()
    ctx = context(cluster, task=task, strategy=strategy)
    run_passes(g, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.AccumulatePass(),
               passes.SyncQueuesPass())
    assert not passes.SyncQueuesPass().applies(ctx)
    assert "sync_queues" not in ctx.passes_run
    assert not ops(g, "FIFOQueueV2")
    between = context(PS2_WORKERS2, task=("worker", 1), strategy="ps")
    passes.PlanPass().run(dense(), between)
    assert passes.SyncQueuesPass().applies(between)


def test_the_chiefs_init_copies_its_run_id_once_it_has_reset_the_shared_state():
    """
        chief:  RUN_ID/draw = Assign(run_id on the chief's host, RandomUniformInt)
                accumulator resets, token drains
                    --> RESET_DONE/set(reset_done on ps 0 := run_id, or 0) --> init
                init-queue drain --> release --> init
                RESET_DONE/declare (the same copy, run alone)
        worker: reads RUN_ID/value and RESET_DONE/value; draws and sets nothing
    """
    g = dense()
    ctx = context(PS2_WORKERS2, task=("worker", 0), strategy="ps")
    sync(g, ctx)
    chief_host = "/job:worker/replica:0/task:0/device:CPU:0"
    draw = g.node(f"{RUN_ID}/draw")
    assert draw.device == chief_host and reads(draw)[1].op == "RandomUniformInt"
    assert g.node(RUN_ID).attr["shared_name"].s.decode() == RUN_ID and g.node(RUN_ID).device == chief_host
    assert g.node(RESET_DONE).device == ctx.cluster.ps_device(0)
    (done_set,) = [n for n in ops(g, "AssignVariableOp") if n.name.startswith(f"{RESET_DONE}/set")]
    init = g.node("init")
    assert done_set in init.control_inputs
    resets = ops(g, "AccumulatorSetGlobalStep") + [n for n in ops(g, "QueueDequeueUpToV2") if n.name.startswith(TOKENS)]
    assert resets and all(reaches(r, done_set) for r in resets)
    # the init queue is emptied before the chief's release puts this run's tokens in it
    release = g.node(f"{INIT_BARRIER}/release")
    assert reaches(g.node(f"{INIT_BARRIER}/drain"), release)
    copied = reads(done_set)[1]          # the run id, or 0 when no client drew one
    assert copied.op == "Merge" and copied.name == f"{RUN_ID}/value"
    assert reads(g.node(f"{RESET_DONE}/declare"))[1] is copied
    worker = dense()
    sync(worker, context(PS2_WORKERS2, task=("worker", 1), strategy="ps"))
    assert f"{RUN_ID}/value" in worker and f"{RESET_DONE}/value" in worker
    assert not any(n.name.startswith((f"{RUN_ID}/draw", f"{RESET_DONE}/set", f"{RESET_DONE}/declare"))
                   for n in worker)


@pytest.mark.parametrize("staleness", [0, 1])
def test_gradients_that_wait_for_a_statistics_update_wait_only_on_the_chief(staleness):
    """BatchNorm with control_dependencies(update_ops) around minimize: the gradients wait
    for the moving averages' update, which the chief runs after its take of the replicas'
    statistics. The chief keeps that order (the update reaches every gradient apply, and
    the gradient applies do not wait for the step counter's bump, which follows the
    takes: a cycle, or with staleness slots a take that never comes). Another worker has
    no update and no take; its gradient constants stay (only their wait goes) and its
    train op still waits for its token. Before, the rewrite failed on both workers."""
    import graph_rewriter as gr
    from graph_rewriter.graph_io import load_graph
    from graph_rewriter.ps_state import APPLIED, INCREMENT
    from graph_rewriter.testing import models
    from graph_rewriter.traversal import ancestors
    ex = models.build("batchnorm", "sgd", update_ops="control")
    cluster = {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}
    for k in (0, 1):
        result = gr.rewrite(ex.graph_def, cluster, task=f"worker:{k}", strategy="ps", device_type="CPU",
                            staleness=staleness)
        g = load_graph(result.graph_def)
        updates = [n for n in g if n.op == "AssignSubVariableOp" and "AssignMovingAvg" in n.name]
        applies = [n for n in g if n.op == "AccumulatorApplyGradient" and "/moving_" not in n.name]
        assert applies and g.node(APPLIED).op == "NoOp"
        assert f"{APPLIED}/before_sync" not in g, "a replica's marker is no train op"
        (wait,) = [n for n in g if n.name.startswith(f"{TOKENS}/wait")]
        assert wait in ancestors([g.node("train_op")])
        if k == 0:
            assert len(updates) == 2
            for a in applies:
                before = ancestors([a])
                assert all(u in before for u in updates), a.name
                assert g.node(INCREMENT) not in before, a.name
        else:
            assert not updates and not [n for n in g if n.op == "AccumulatorTakeGradient" and "drain" not in n.name]
            assert g.node("gradients/Mean_grad/Size").op == "Const"


def test_a_moving_average_is_initialized_at_init_only():
    """An ExponentialMovingAverage after the update (a TF1 script's way of keeping
    averaged weights for evaluation): the shadow variable's initializer reads the
    averaged variable's initialized_value(). The chief's token waits for the average's
    update but not for that initializer, which would reset the average every step;
    another worker keeps its init op (waiting for the chief's)."""
    import graph_rewriter as gr
    from graph_rewriter.graph_io import load_graph
    from graph_rewriter.traversal import ancestors
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], initializer=tf1.ones_initializer())
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        minimize = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([minimize]):
            tf.group(tf1.train.ExponentialMovingAverage(0.9).apply([w]), name="train_op")
        tf1.global_variables_initializer()
    cluster = {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}
    chief, other = (load_graph(gr.rewrite(graph.as_graph_def(), cluster, task=f"worker:{k}", strategy="ps",
                                          device_type="CPU").graph_def) for k in (0, 1))
    before_token = ancestors([chief.node(f"{TOKENS}/step")])
    assert chief.node("ExponentialMovingAverage/AssignMovingAvg/AssignSubVariableOp") in before_token
    assert chief.node("w/ExponentialMovingAverage/Assign") not in before_token
    assert chief.node("w/ExponentialMovingAverage/Assign") in ancestors([chief.node("init")])
    assert [c.op for c in other.node("init").control_inputs] == ["QueueDequeueV2"]
