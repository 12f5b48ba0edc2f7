"""The saver pass alone: the graph has a Saver and the rewrite knows its SaverDef.

    no Saver:       w, b ─> their Read/ReadVariableOp ─> SaveV2(filename, names [b, w]) ─^─ Identity(filename)
                    RestoreV2(filename, names) ─> AssignVariableOp(w|b) ─^─ restore_all
    a Saver's nodes, no SaverDef: the SaverDef is read off them (nothing added)
    a SaverDef:     kept as it is
"""

import tensorflow as tf
from tensorflow.core.protobuf import saver_pb2

from graph_rewriter import graph_io
from graph_rewriter.pass_manager import run_passes
from graph_rewriter.passes import SaverPass
from pass_graphs import context, dense, ops, reads, reaches


def _with_saver(meta=False):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.compat.v1.get_variable("w", [3, 1], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf.compat.v1.global_variables_initializer()
        saver = tf.compat.v1.train.Saver(name="my_saver")
        if meta:
            return graph_io.load_graph(saver.export_meta_graph()), saver.as_saver_def()
    return graph_io.load_graph(g.as_graph_def()), saver.as_saver_def()


def test_a_graph_without_a_saver_gets_one_over_its_variables():
    g = dense()
    ctx = context()
    run_passes(g, ctx, SaverPass())
    (save,) = ops(g, "SaveV2")
    (restore,) = ops(g, "RestoreV2")
    variables = {n.name for n in ops(g, "VarHandleOp")}
    assert variables == {"w", "b"}
    saved = {r.name for t in save.inputs[3:] for r in reads(t.node)}   # SaveV2 reads each variable
    assert saved == variables
    names = save.inputs[1].node.attr["value"].tensor.string_val
    assert [n.decode() for n in names] == sorted(variables)   # tf.train.Saver's order
    assigns = ops(g, "AssignVariableOp")
    restored = [a for a in assigns if reaches(restore, a)]
    assert {reads(a)[0].name for a in restored} == variables
    sd = g.meta_graph.saver_def
    restore_all = g.node(sd.restore_op_name)
    assert all(a in restore_all.control_inputs for a in restored)
    saved_tensor = g.node(sd.save_tensor_name.split(":")[0])
    assert save in saved_tensor.control_inputs
    assert sd.filename_tensor_name.split(":")[0] == save.inputs[0].node.name
    assert ctx.passes_run == ["saver"]


def test_a_savers_nodes_give_the_saver_def_and_nothing_is_added():
    g, want = _with_saver()
    names = sorted(g.names())
    run_passes(g, context(), SaverPass())
    assert sorted(g.names()) == names
    sd = g.meta_graph.saver_def
    assert (sd.filename_tensor_name, sd.save_tensor_name, sd.restore_op_name) == (
        want.filename_tensor_name, want.save_tensor_name, want.restore_op_name)
    assert sd.version == saver_pb2.SaverDef.V2


def test_a_meta_graphs_saver_def_is_kept():
    g, want = _with_saver(meta=True)
    g.meta_graph.saver_def.max_to_keep = 3      # a field only the SaverDef knows
    run_passes(g, context(), SaverPass())
    assert g.meta_graph.saver_def.max_to_keep == 3
    assert len(ops(g, "SaveV2")) == 1
