"""Tests of the merge_outputs pass alone (after plan and replicate): an output the user
names, the graph marks (the losses collection) or a scalar summary reports, and that
depends on the batch, is merged under its original name; replica 0's op is renamed:

    loss ──> gradients (replica 0)          replica_0/loss ──> gradients       (only the name moved)
    replica_1/loss ──> replica_1/...   =>   replica_1/loss ──> replica_1/...
                                            replica_0/loss, replica_1/loss ─> AddN ─> RealDiv(R) = "loss"

    pred [batch, 1] (outputs=["pred:0"])  =>  ConcatV2(replica_0/pred, replica_1/pred, axis 0) = "pred"
    ScalarSummary(loss)                   =>  ScalarSummary reads the merged "loss" (one mean per tensor)
"""

import pytest
import tensorflow as tf

from graph_rewriter import graph_io, passes
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GLOBAL
from graph_rewriter.pass_manager import PassManager, run_passes
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, reads, replica_of

tf1 = tf.compat.v1


def merge(graph, ctx):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), passes.MergeOutputsPass())


def with_losses(summary=False, extra=None):
    """dense()'s model as a MetaGraphDef whose losses collection holds "loss"
    (tf.compat.v1.losses adds its result there; here a mean, named):
        x --> MatMul(w) = pred --> + b --> loss = mean squared error (losses collection)
    ``extra(x, pred)`` adds more ops to the graph."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        pred = tf.matmul(x, w, name="pred")
        loss = tf.identity(tf1.losses.mean_squared_error(y, pred, loss_collection=None), name="loss")
        tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
        if summary:
            tf1.summary.scalar("loss", loss)
        if extra is not None:
            extra(x, pred)
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
        meta = tf1.train.export_meta_graph()
    return graph_io.load_graph(meta)


def merged_node(graph, name):
    node = graph.node(name)
    assert node.replica == GLOBAL
    return node


def copies_read(graph, node):
    """The nodes a merge reads by data edge, less its constants (axis, replica count)."""
    inner = [p for p in reads(node) if p.op == "AddN"]
    source = inner[0] if inner else node
    return [p for p in reads(source) if p.op != "Const"]


def test_a_loss_in_the_losses_collection_is_the_mean_under_its_name():
    """
        replica_0/loss, replica_1/loss --> AddN --> RealDiv(2) = "loss" (global device)
    """
    g = with_losses()
    ctx = context(WORKERS2)
    master = g.node("loss")
    readers_before = set(master.consumer_nodes())
    merge(g, ctx)
    rm = ctx.replicas
    node = merged_node(g, "loss")
    assert node.op == "RealDiv" and node is not master
    total, divisor = reads(node)
    assert total.op == "AddN" and divisor.op == "Const"
    assert divisor.attr["value"].tensor.float_val == [2.0]
    assert reads(total) == [master, g.node("replica_1/loss")]
    assert node.device == total.device == rm.global_device
    # replica 0's op only moved: renamed, still replica 0's, read by what read it before
    assert master.name == "replica_0/loss" and master.op == "Identity"
    assert rm.merged == {"loss": "replica_0/loss"} and rm.node(g, 0, "loss") is master
    assert replica_of(ctx, g, master) == 0
    assert set(master.consumer_nodes()) == readers_before | {total}


def test_a_named_per_example_output_is_concatenated_in_replica_order():
    """
        outputs=["pred:0"]:  replica_0/pred, replica_1/pred, axis 0 --> ConcatV2 = "pred"
    """
    g = with_losses()
    ctx = context(WORKERS2, outputs=["pred:0"])
    merge(g, ctx)
    node = merged_node(g, "pred")
    assert node.op == "ConcatV2"
    values, axis = reads(node)[:2], reads(node)[2]
    assert values == [g.node("replica_0/pred"), g.node("replica_1/pred")]
    assert axis.op == "Const" and axis.attr["value"].tensor.int_val == [0]
    assert g.node("replica_0/pred").op == "MatMul"


def test_the_merge_option_chooses_sum():
    """
        merge={"loss:0": "sum"}:  replica_0/loss, replica_1/loss --> AddN = "loss"
    """
    g = with_losses()
    ctx = context(WORKERS2, merge={"loss:0": "sum"})
    merge(g, ctx)
    node = merged_node(g, "loss")
    assert node.op == "AddN"
    assert reads(node) == [g.node("replica_0/loss"), g.node("replica_1/loss")]


def test_master_and_tensors_the_batch_does_not_change_are_left_alone():
    """
        merge={"loss:0": "master"}:  loss keeps its name (replica 0's value)
        outputs=["w/Read/ReadVariableOp:0"] (a variable's value, not variant): unchanged
    """
    g = with_losses()
    read = [n for n in ops(g, "ReadVariableOp") if n.name.startswith("w/")][0].name
    lines = []
    ctx = context(WORKERS2, merge={"loss:0": "master"}, outputs=[f"{read}:0"])
    ctx.log = lines.append
    merge(g, ctx)
    assert g.node("loss").op == "Identity" and g.node("loss").replica == 0
    assert g.node(read).op == "ReadVariableOp" and g.node(read).replica == 0
    assert "replica_0/loss" not in g and f"replica_0/{read}" not in g
    assert ctx.replicas.merged == {}
    assert any(read in line and "does not depend on the batch" in line for line in lines)


def test_an_op_with_several_outputs_keeps_its_name():
    """
        parts = SplitV(pred) (2 outputs), outputs=["parts:0"]: left alone (only a whole op
        can take a name), said in the log
    """
    def extra(x, pred):
        tf.split(tf.concat([pred, pred], axis=1), [1, 1], axis=1, name="parts")
    g = with_losses(extra=extra)
    lines = []
    ctx = context(WORKERS2, outputs=["parts:0"])
    ctx.log = lines.append
    merge(g, ctx)
    assert g.node("parts").op == "SplitV" and g.node("parts").replica == 0
    assert any("parts:0" in line and "several outputs" in line for line in lines)
    assert ctx.replicas.merged == {"loss": "replica_0/loss"}   # the loss still is


def test_an_output_that_names_no_tensor_is_refused():
    g = with_losses()
    with pytest.raises(GraphRewriteError, match="outputs names 'nosuch:0'"):
        merge(g, context(WORKERS2, outputs=["nosuch:0"]))
    g = with_losses()
    with pytest.raises(GraphRewriteError, match="outputs names 'loss:3'"):
        merge(g, context(WORKERS2, outputs=["loss:3"]))


def test_a_graph_def_without_collections_merges_nothing_unnamed():
    """A GraphDef (no losses collection, no summary) and no option: nothing to merge,
    nothing renamed, the pass reports no change."""
    g = dense()
    ctx = context(WORKERS2)
    run_passes(g, ctx, passes.PlanPass(), passes.ReplicatePass())
    before = list(g.names())
    run_passes(g, ctx, passes.MergeOutputsPass())
    assert list(g.names()) == before
    assert g.node("loss").op == "Mean" and ctx.replicas.merged == {}
    assert [m for name, _, m in ctx.timings if name == "merge_outputs"] == [False]


def test_a_summary_of_a_merged_loss_reads_that_one_mean():
    """
        loss (losses collection) and ScalarSummary(loss): the summary reads "loss", the
        only mean of the replicas' losses
    """
    g = with_losses(summary=True)
    ctx = context(WORKERS2)
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 0)
    assert reads(summary)[1] is g.node("loss")
    assert g.node("loss").op == "RealDiv"
    means = [n for n in ops(g, "AddN") if g.node("replica_0/loss") in reads(n)]
    assert len(means) == 1


def test_a_summary_of_a_loss_merged_as_sum_still_reports_the_mean():
    """merge={"loss:0": "sum"}: "loss" is the sum; the summary reads a mean of its own"""
    g = with_losses(summary=True)
    ctx = context(WORKERS2, merge={"loss:0": "sum"})
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 0)
    mean = reads(summary)[1]
    assert mean.op == "RealDiv" and mean is not g.node("loss")
    assert copies_read(g, mean) == [g.node("replica_0/loss"), g.node("replica_1/loss")]
    assert g.node("loss").op == "AddN"


def test_between_graph_the_merge_is_over_this_workers_replicas():
    """worker 0 of 2, two replicas each: "loss" is the mean of the two local replicas"""
    g = with_losses()
    ctx = context(WORKERS2, task=("worker", 0), devices_per_worker=2)
    merge(g, ctx)
    assert ctx.replicas.num_local == 2 and ctx.replicas.group_size == 4
    node = merged_node(g, "loss")
    total, divisor = reads(node)
    assert divisor.attr["value"].tensor.float_val == [2.0]
    assert reads(total) == [g.node("replica_0/loss"), g.node("replica_1/loss")]
    assert node.device == ctx.replicas.global_device and "/task:0/" in node.device


def test_with_template_replicas_the_export_merges_every_replica():
    """4 local replicas (replica 1 the template): the exported AddN reads all four losses"""
    g = with_losses()
    ctx = context(WORKERS2, devices_per_worker=2)
    merge(g, ctx)
    assert ctx.replicas.template and ctx.replicas.num_local == 4
    exported = {n.name: n for n in graph_io.to_graph_def(g, ctx.replicas).node}
    node = exported["loss"]
    total = exported[node.input[0]]
    assert total.op == "AddN" and total.attr["N"].i == 4
    assert list(total.input) == ["replica_0/loss"] + [f"replica_{i}/loss" for i in (1, 2, 3)]
    divisor = exported[node.input[1]]
    assert divisor.attr["value"].tensor.float_val == [4.0]


def test_it_runs_before_place():
    """place gives every node a device, so the pass that adds the merges comes first"""
    assert "merge_outputs" in passes.PlacePass.after
    with pytest.raises(GraphRewriteError, match="merge_outputs"):
        PassManager([passes.PlanPass(), passes.ReplicatePass(), passes.PlacePass(),
                     passes.MergeOutputsPass()]).run(with_losses(), context(WORKERS2))


# ----- scalar summaries (what the merge_summaries pass did before) ---------------------------

def with_rate_summary():
    """dense()'s model plus a summary of a constant learning rate (not batch dependent):
        x --> MatMul(w) --> loss --> ScalarSummary("loss");  rate (Const) --> ScalarSummary("rate")
    """
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        rate = tf.constant(0.1, name="rate")
        tf1.summary.scalar("loss", loss)
        tf1.summary.scalar("rate", rate)
        tf1.train.GradientDescentOptimizer(rate).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return graph_io.load_graph(g.as_graph_def())


def summaries_of(graph, ctx, replica):
    return [n for n in ops(graph, "ScalarSummary") if replica_of(ctx, graph, n) == replica]


def test_the_masters_loss_summary_reads_the_mean_over_replicas():
    """
        replica_0/loss, replica_1/loss --> AddN --> RealDiv(2) = "loss" --> ScalarSummary (replica 0)
    """
    g = dense(summary=True)
    ctx = context(WORKERS2)
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 0)
    mean = [n for n in reads(summary) if n.op == "RealDiv"]
    assert len(mean) == 1
    total, divisor = reads(mean[0])
    assert total.op == "AddN" and divisor.op == "Const"
    assert divisor.attr["value"].tensor.float_val == [2.0]
    losses = [ctx.replicas.node(g, i, "loss") for i in (0, 1)]
    assert reads(total) == losses and losses[0].op == "Mean"
    assert total.device == mean[0].device == ctx.replicas.global_device   # computed once, on the host


def test_a_replicas_own_summary_keeps_its_own_value():
    """
        replica_1/loss --> replica_1/ScalarSummary   (unchanged)
    """
    g = dense(summary=True)
    ctx = context(WORKERS2)
    merge(g, ctx)
    (summary,) = summaries_of(g, ctx, 1)
    assert reads(summary)[1] is ctx.replicas.node(g, 1, "loss")


def test_a_summary_of_a_value_the_batch_does_not_change_is_left_alone():
    """
        rate (Const) --> ScalarSummary("rate")   (unchanged: every replica has the same value)
    """
    g = with_rate_summary()
    ctx = context(WORKERS2)
    merge(g, ctx)
    masters = summaries_of(g, ctx, 0)
    assert len(masters) == 2
    values = sorted((reads(n)[1] for n in masters), key=lambda n: n.op)
    assert [n.op for n in values] == ["Const", "RealDiv"]
    assert values[0] is g.node("rate")


@pytest.mark.parametrize("cluster, task", [
    (None, None),                     # one device
    (PS2_WORKERS2, ("worker", 1)),    # between-graph: this graph holds one replica
])
def test_applies_only_with_several_local_replicas(cluster, task):
    """One local replica: its values already are the local merge; the pass is skipped."""
    g = dense(summary=True)
    ctx = context(cluster, task=task, strategy="ps" if cluster else "allreduce")
    merge(g, ctx)
    assert not passes.MergeOutputsPass().applies(ctx)
    assert "merge_outputs" not in ctx.passes_run
    (summary,) = ops(g, "ScalarSummary")
    assert reads(summary)[1] is g.node("loss") and g.node("loss").op == "Mean"
    assert passes.MergeOutputsPass().applies(context(WORKERS2))


def test_static_batches_count_as_the_batch_and_other_first_dimensions_do_not():
    """
        x [4, 3] (a static batch: 4 rows per replica) --> pred [4, 1]: concatenated
        pred_t = transpose(pred) [1, 4]: its first dimension is not the batch, left alone
    """
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 3], name="x")
        w = tf1.get_variable("w", [3, 1], use_resource=True)
        pred = tf.matmul(x, w, name="pred")
        tf.transpose(pred, name="pred_t")
        loss = tf.reduce_mean(tf.square(pred), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    g = graph_io.load_graph(g.as_graph_def())
    lines = []
    ctx = context(WORKERS2, outputs=["pred:0", "pred_t:0", "loss:0"])
    ctx.log = lines.append
    merge(g, ctx)
    assert g.node("pred").op == "ConcatV2"
    assert g.node("loss").op == "RealDiv"
    assert g.node("pred_t").op == "Transpose" and g.node("pred_t").replica == 0
    assert any("pred_t:0" in line and "first dimension is not the batch" in line for line in lines)
