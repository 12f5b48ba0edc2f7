"""The mirror_variables pass alone: every replica's copy of a mirrored variable starts
from, and is restored to, the master's value.

    in-graph:       w'/Assign(w', <the tensor w/Assign assigns>)   (one random draw)
                    save/restore w ─> read w ─> w' := it            (restore syncs the copies)
    between-graph:  chief:  init ─^─ BcastSend(concat(w, b))
                    worker: w/Assign(w, Reshape(BcastRecv)), b/Assign(b, ...)
"""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io
from graph_rewriter.collectives import BROADCAST_VARIABLES
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import MirrorVariablesPass, PlanPass, ReplicatePass
from graph_rewriter.traversal import ancestors
from pass_graphs import WORKERS2, collective_keys, context, dense, ops, reaches, reads, replica_of

tf1 = tf.compat.v1


def dense_with_saver():
    """dense()'s model with a Saver: save/restore_all runs an assign of w and of b."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        b = tf1.get_variable("b", [1], initializer=tf1.zeros_initializer(), use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
        tf1.train.Saver()
    return graph_io.load_graph(g.as_graph_def())


def _mirrored(graph, cluster=None, **options):
    ctx = context(cluster, **options)
    run_passes(graph, ctx, PlanPass(), ReplicatePass(), MirrorVariablesPass())
    return ctx




def test_in_graph_every_copy_assigns_the_masters_initial_value():
    """
        w/Assign(w, RandomUniform...)   w'/Assign(w', the same RandomUniform...)
    """
    g = dense()
    ctx = _mirrored(g, devices_per_worker=2)
    assert len(ops(g, "RandomUniform")) == 1   # drawn once per run, for every copy
    for v in ctx.plan.variables:
        master = g.node(v.initializer)
        copy = ctx.replicas.node(g, 1, v.initializer)
        assert copy is not master and replica_of(ctx, g, copy) == 1
        value = [p for p in reads(master) if p.op != "VarHandleOp"]
        assert [p for p in reads(copy) if p.op != "VarHandleOp"] == value


def test_a_restore_also_restores_every_copy():
    """
        RestoreV2 ─> w/restore assign ─> save/restore_all
        after:  w/restore assign ─^─ ReadVariableOp(w) ─> AssignVariableOp(w')
                                                            ─^─ save/restore_all
    """
    g = dense_with_saver()
    ctx = _mirrored(g, devices_per_worker=2)
    restore_all = g.node("save/restore_all")
    for v in ("w", "b"):
        copy = ctx.replicas.node(g, 1, v)
        syncs = [n for n in ops(g, "AssignVariableOp") if copy in reads(n) and n in restore_all.control_inputs]
        assert len(syncs) == 1, v
        (value,) = [p for p in reads(syncs[0]) if p is not copy]
        assert value.op == "ReadVariableOp" and reads(value) == [g.node(v)]
        # the value is read after the master's restore
        assert any(a.op == "RestoreV2" for a in ancestors(value.control_inputs))


def test_between_graph_the_chief_broadcasts_its_initial_values():
    """
        chief (worker:0):  w/Assign, b/Assign ─^─ read w, read b ─> concat ─> BcastSend
                           init ─^─ BcastSend
    """
    g = dense()
    ctx = _mirrored(g, WORKERS2, task="worker:0")
    (send,) = initial(ops(g, "CollectiveBcastSendV2"))   # one pack per dtype: float32
    assert ops(g, "CollectiveBcastRecvV2") == []
    assert send.device == "/job:worker/replica:0/task:0/device:CPU:0"
    assert len(collective_keys(send)) == 3 and 2 in collective_keys(send)   # group size 2
    assert send in g.node("init").control_inputs
    sent = ancestors([send])
    assert g.node("w/Assign") in sent and g.node("b/Assign") in sent


def test_between_graph_a_worker_receives_its_initial_values_from_the_chief():
    """
        worker:1:  BcastRecv ─> SplitV ─> Reshape ─> w/Assign   (no random draw of its own)
                                     └──> Reshape ─> b/Assign
    """
    chief, worker = dense(), dense()
    _mirrored(chief, WORKERS2, task="worker:0")
    ctx = _mirrored(worker, WORKERS2, task="worker:1")
    (recv,) = initial(ops(worker, "CollectiveBcastRecvV2"))
    assert ops(worker, "CollectiveBcastSendV2") == []
    assert recv.device == "/job:worker/replica:0/task:1/device:CPU:0"
    (send,) = initial(ops(chief, "CollectiveBcastSendV2"))
    assert collective_keys(recv) == collective_keys(send) and 2 in collective_keys(recv)   # one group, one instance
    for v in ctx.plan.variables:
        assign = worker.node(v.initializer)
        assert reaches(recv, assign)
        assert not any(a.op == "RandomUniform" for a in ancestors([assign]))


def initial(collectives):
    """The broadcasts of initial values (not graph_rewriter/broadcast_variables')."""
    return [c for c in collectives if not c.name.startswith(BROADCAST_VARIABLES)]


def test_between_graph_every_worker_can_take_the_chiefs_current_variables():
    """
        chief:     read w, read b (no initializer before) ─> concat ─> BcastSend ─┐
                                                                   broadcast_variables
        worker:1:  BcastRecv ─> SplitV ─> Reshape ─> AssignVariableOp(w) ─────────┘
                                    └──> Reshape ─> AssignVariableOp(b)
    with its own instance key (it pairs with no initial-value broadcast), so a chief that
    restored a checkpoint hands the restored values to every worker.
    """
    chief, worker = dense(), dense()
    _mirrored(chief, WORKERS2, task="worker:0")
    ctx = _mirrored(worker, WORKERS2, task="worker:1")
    (send,) = [s for s in ops(chief, "CollectiveBcastSendV2") if s not in initial([s])]
    (recv,) = [r for r in ops(worker, "CollectiveBcastRecvV2") if r not in initial([r])]
    (init_send,) = initial(ops(chief, "CollectiveBcastSendV2"))
    assert collective_keys(send) == collective_keys(recv) != collective_keys(init_send)
    assert send in chief.node(BROADCAST_VARIABLES).control_inputs
    sent = ancestors([send])
    assert not any(v.initializer in sent for v in ctx.plan.variables)   # current values, not initial
    assert {n.name for n in sent if n.op == "VarHandleOp"} == {v.name for v in ctx.plan.variables}
    assigns = [a for a in worker.node(BROADCAST_VARIABLES).control_inputs]
    assert sorted(reads(a)[0].name for a in assigns) == sorted(v.name for v in ctx.plan.variables)
    assert all(reaches(recv, a) for a in assigns)


def test_mirror_variables_applies_only_to_mirrored_variables_of_several_replicas():
    """One replica: nothing to mirror. strategy ps: the variables exist once."""
    plan_only = PlanPass()
    for options, expected in (({}, False), ({"strategy": "ps"}, False), ({"devices_per_worker": 2}, True)):
        ctx = context(**options)
        run_passes(dense(), ctx, plan_only)
        assert MirrorVariablesPass().applies(ctx) is expected, options
    g = dense()
    names = sorted(g.names())
    ctx = _mirrored(g)
    assert ctx.passes_run == ["plan", "replicate"] and sorted(g.names()) == names


def test_mirror_variables_requires_the_replicas():
    """Without replicate before it, mirror_variables is refused."""
    assert MirrorVariablesPass.requires == {"plan", "replicas"}
    with pytest.raises(GraphRewriteError, match="'mirror_variables' requires replicas"):
        run_passes(dense(), context(devices_per_worker=2), PlanPass(), MirrorVariablesPass())
