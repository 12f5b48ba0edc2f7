"""A variable that receives two gradients: a multi-task script's train ops over a shared
encoder (graph_rewriter.testing.tf1_scripts.multi_task).

Task A's train op and task B's each minimize their own loss over the encoder and their
own head, and the script runs them in turns. Every shared variable then has two
gradients, one per train op, each applied by its own update. The analysis refused such a
graph ("receives two different gradients ... it looks updated by two optimizers"). Each
gradient is now a cut of its own (the later one named '<variable>/update_1', its own
train ops), averaged apart and packed with its train op's other gradients, so running
train_a computes and all-reduces task A's gradients only.

Also here, since a multi-task script clips each task's gradients: a sparse gradient whose
rows a global norm reads before their duplicates are summed is all-gathered, never
densified (strategy auto picked the dense all-reduce on CPU replicas, and so did
sparse_as_dense; the norm of the summed rows differs from one device's).
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import GradientCut, _Analyzer, analyze
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.testing.tf1_scripts import MULTI_TASK_OPTIMIZERS, multi_task, multi_task_batches

import test_cluster as tc
from test_two_train_ops import _ancestors
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

tf1 = tf.compat.v1
STEPS, BATCH = 6, 8
RTOL, ATOL = 1e-5, 1e-6
SHARED = ("encoder/kernel", "encoder/bias")
STEP_OPS = (("loss_a:0", "train_a"), ("loss_b:0", "train_b"))


def _train(session, feeds, reads, step_ops=STEP_OPS):
    """Step k runs step_ops[k mod n] (by default train_a at even steps, train_b at odd
    ones): (losses, {variable: value})."""
    with session as sess:
        sess.run("init")
        losses = [sess.run(list(step_ops[i % len(step_ops)]), feed)[0] for i, feed in enumerate(feeds)]
        return np.array(losses), sess.run(reads)


def _one_device(graph_def, feeds, reads, step_ops=STEP_OPS):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    return _train(tf1.Session(graph=graph), feeds, reads, step_ops)


def _assert_as_one_device(got, want, reads):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name in reads:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_each_shared_variable_has_a_gradient_cut_per_train_op():
    found = analyze(graph_io.load_graph(multi_task("adam", embedding=True)[0]))
    cuts = {c.key: c for c in found.cuts}
    for name in SHARED + ("embedding",):
        assert cuts[name].variable == cuts[f"{name}/update_1"].variable == name
        assert (cuts[name].train_ops, cuts[f"{name}/update_1"].train_ops) == (["train_a"], ["train_b"])
    assert cuts["embedding/update_1"].kind == "sparse"
    assert not [k for k in cuts if k.startswith("head_") and k.endswith("update_1")]


CASES = (
    # every optimizer, dense, one optimizer object per task
    [(opt, False, False, False, s) for opt in MULTI_TASK_OPTIMIZERS
     for s in ("allreduce", "ps")]
    + [("adam", False, False, False, "hybrid")]
    # one optimizer object for both tasks: the slots (and Adam's beta powers) shared
    + [(opt, True, False, False, s) for opt in ("momentum", "adam") for s in ("allreduce", "ps")]
    # a shared embedding: two sparse gradients of one table
    + [(opt, False, True, False, s) for opt in ("sgd", "adagrad", "adam") for s in ("allreduce", "ps", "hybrid")]
    # each task's gradients clipped to a global norm
    + [("adam", True, True, True, s) for s in ("allreduce", "ps", "hybrid", "auto")])


@pytest.mark.parametrize("optimizer, shared_optimizer, embedding, clip, strategy", CASES,
                         ids=["-".join([c[0], "shared" if c[1] else "own", "embedding" if c[2] else "dense",
                                        "clip" if c[3] else "plain", c[4]]) for c in CASES])
def test_alternating_tasks_train_as_one_device(optimizer, shared_optimizer, embedding, clip, strategy):
    graph_def, reads = multi_task(optimizer, shared_optimizer, embedding, clip)
    feeds = multi_task_batches(STEPS, BATCH, embedding)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    got, want = _train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads)
    _assert_as_one_device(got, want, reads)
    assert got[1]["global_step"] == STEPS // 2
    for name in SHARED:   # trained by both tasks, away from its initial value
        assert not np.allclose(got[1][name], _initial(graph_def, reads, name))


def _initial(graph_def, reads, name):
    graph = tf.Graph()
    with graph.as_default():
        tf1.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        sess.run("init")
        return sess.run(reads[name])


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_four_replicas_from_a_template_train_as_one_device(strategy):
    graph_def, reads = multi_task("adam", embedding=True)
    feeds = multi_task_batches(STEPS, BATCH, embedding=True)
    result = gr.rewrite(graph_def, devices_per_worker=4, device_type="CPU", strategy=strategy)
    _assert_as_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads), reads)


@pytest.mark.parametrize("strategy, task", [("allreduce", None), ("ps", None), ("allreduce", "worker:0")],
                         ids=["allreduce", "ps", "allreduce-between"])
def test_each_train_op_computes_only_its_own_gradients(strategy, task):
    """Running train_a reaches none of task B's backward pass (tf.gradients' second
    scope, "gradients_1/"), nor train_b task A's: the two gradients of a shared variable
    are packed with their own train op's."""
    graph_def, _ = multi_task("adam", embedding=True)
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]} if task else None
    result = gr.rewrite(graph_def, cluster, devices_per_worker=2, device_type="CPU", strategy=strategy, task=task)
    assert not [n for n in _ancestors(result.graph_def, "train_a") if n.startswith("gradients_1/")]
    assert not [n for n in _ancestors(result.graph_def, "train_b") if n.startswith("gradients/")]
    if strategy == "allreduce":
        owners = [{c.train_ops[0] for c in result.plan.cuts if c.pack == i} for i in range(len(result.plan.packs))]
        assert sorted(map(sorted, owners)) == [["train_a"], ["train_b"]]


def test_a_plan_given_back_rewrites_to_the_same_bytes():
    graph_def, _ = multi_task("adam", embedding=True, clip=True)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy="hybrid")
    assert "encoder/kernel/update_1" in result.plan.to_json()
    again = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU",
                       strategy=gr.Plan.from_json(result.plan.to_json()))
    assert again.graph_def.SerializeToString(deterministic=True) == \
        result.graph_def.SerializeToString(deterministic=True)


def test_a_gradient_that_reaches_no_update_of_its_variable_is_refused():
    """The analysis' own safety net: a second gradient given to a variable whose updates
    it never reaches (what a wrong guess of a sparse gradient's variable once produced,
    tests/test_word2vec.py) is refused, naming the variable and both tensors."""
    analyzer = _Analyzer(graph_io.load_graph(multi_task("adam")[0]), {})
    found = analyzer.run()
    head_b = next(c for c in found.cuts if c.variable == "head_b/kernel")
    wrong = GradientCut(values=head_b.values, kind="dense", variable="encoder/kernel", source="fused-op")
    with pytest.raises(GraphRewriteError, match="variable 'encoder/kernel' receives two different gradients") as e:
        analyzer._check_one_optimizer(found.cuts + [wrong])
    assert head_b.values.node.name in e.value.message
    analyzer._check_one_optimizer(found.cuts)   # the real ones pass


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_hint_for_a_shared_variable_names_the_gradient_of_the_updates_it_reaches(strategy):
    """A gradients= hint is the gradient of the updates it reaches: task A's, here; task
    B's update of the same variable keeps the gradient the analysis finds. (The hint was
    taken for both updates, and task B's was refused: "cannot find the gradient of
    variable 'encoder/kernel'", the very variable the hint named.)"""
    graph_def, reads = multi_task("adam")
    feeds = multi_task_batches(STEPS, BATCH)
    found = {c.key: c for c in analyze(graph_io.load_graph(graph_def)).cuts}
    hints = {"encoder/kernel": found["encoder/kernel"].values.name}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy, gradients=hints)
    cuts = {c.key: c for c in result.plan.cuts if c.variable == "encoder/kernel"}
    assert {k: (c.source, c.values) for k, c in cuts.items()} == {
        "encoder/kernel": ("hint", hints["encoder/kernel"]),
        "encoder/kernel/update_1": ("fused-op", found["encoder/kernel/update_1"].values.name)}
    _assert_as_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads), reads)


def test_a_hint_that_reaches_no_update_of_its_variable_is_refused():
    graph_def, _ = multi_task("adam")
    with pytest.raises(GraphRewriteError) as e:
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", gradients={"encoder/kernel": "loss_b:0"})
    message = e.value.message
    assert "hint for variable 'encoder/kernel' names 'loss_b:0', which reaches no update of it" in message
    assert "'train_a/update_encoder/kernel/ResourceApplyAdam'" in message, message


def test_a_hint_that_leaves_its_update_depending_on_the_batch_says_so():
    """A hint naming a batch input the gradient is computed from (not the gradient): the
    update still depends on the batch, and the error says the hint did not explain it
    rather than asking for the hint the user gave."""
    graph_def, _ = multi_task("sgd")
    with pytest.raises(GraphRewriteError, match="the gradients= hint for variable 'head_a/bias' .'y_a:0'. does "
                                                "not make its update") as e:
        gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", gradients={"head_a/bias": "y_a:0"})
    assert "not the loss or an input" in e.value.hint


@pytest.mark.parametrize("how", ["auto", "sparse_as_dense"])
def test_sparse_rows_a_global_norm_reads_are_all_gathered(how):
    """Strategy auto on CPU replicas of one worker chose the dense all-reduce for the
    embedding's gradient, and sparse_as_dense asks for it: the replicas' rows summed per
    id, whose global norm differs from the one over one device's rows, so the clipped
    step differed (4e-3 in the table after four steps). The plan all-gathers them and the
    log says why."""
    graph_def, reads = multi_task("adam", True, embedding=True, clip=True)
    feeds = multi_task_batches(STEPS, BATCH, embedding=True)
    lines = []
    options = {"strategy": "auto"} if how == "auto" else {"strategy": "allreduce", "sparse_as_dense": True}
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", log=lines.append, **options)
    assert [c.sync for c in result.plan.cuts if c.kind == "sparse"] == ["allgather", "allgather"]
    said = [line for line in lines if "all-gathered, not densified" in line]
    assert len(said) == 1 and "'embedding', 'embedding/update_1'" in said[0], lines
    _assert_as_one_device(_train(gr.Session(result), feeds, reads), _one_device(graph_def, feeds, reads), reads)


def test_between_graph_with_staleness_is_refused():
    """With staleness a take picks its accumulator by the count of all steps, which one
    train op's steps do not follow: refused, naming both train ops."""
    graph_def, _ = multi_task("adam", embedding=True)
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    with pytest.raises(GraphRewriteError, match="train ops take turns \\('train_a', 'train_b'\\)") as e:
        gr.rewrite(graph_def, cluster, devices_per_worker=1, device_type="CPU", strategy="ps", task="worker:1",
                   staleness=1)
    assert "drop staleness" in e.value.hint


@pytest.mark.parametrize("task", ["worker:0", "worker:1"])
def test_between_graph_ps_gives_each_train_op_its_own_step(task):
    """Between-graph ps: each train op waits for its own token; the chief's token for
    train_a follows train_a's takes and bump only, and a worker's train_a reaches none of
    task B's gradients (before, the chief's one step applied both tasks' updates at
    every step, whichever the workers ran: refused)."""
    graph_def, _ = multi_task("adam", embedding=True)
    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    out = gr.rewrite(graph_def, cluster, devices_per_worker=2, device_type="CPU", strategy="ps",
                     task=task).graph_def
    a, b = _ancestors(out, "train_a"), _ancestors(out, "train_b")
    assert "graph_rewriter/tokens/wait" in a and "graph_rewriter/tokens/group_1/wait" not in a
    assert "graph_rewriter/tokens/group_1/wait" in b and "graph_rewriter/tokens/wait" not in b
    assert not [n for n in a if "gradients_1/" in n or "update_1/" in n]
    assert not [n for n in b if n.startswith(("gradients/", "replica_1/gradients/"))]
    if task == "worker:0":
        token = _ancestors(out, "graph_rewriter/tokens/step")
        assert "graph_rewriter/sync_step/increment" in token
        assert not [n for n in token if "update_1" in n or "head_b" in n or "increment_1" in n]
    else:
        assert not [n for n in a | b if n.endswith("/take")], "a non-chief worker takes no gradient"


@pytest.mark.slow
def test_two_workers_train_as_one_device_on_loopback_servers(pool, procs, tmp_path):
    """Between-graph allreduce, 2 workers x 1 replica, each its own worker_client process
    running train_a and train_b in turns on its half of every batch."""
    graph_def, reads = multi_task("adam", embedding=True, clip=True)
    feeds = multi_task_batches(STEPS, BATCH, embedding=True)
    _, want = _one_device(graph_def, feeds, reads)
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "allreduce", STEPS, reads.values(), feeds,
                              step_ops=STEP_OPS)
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "hybrid"])
def test_two_workers_with_variables_on_the_ps_train_as_one_device(strategy, pool, procs, tmp_path):
    """Between-graph ps and hybrid (the embedding on the ps, the rest all-reduced), 2
    workers x 1 replica on loopback servers running train_a and train_b in turns: as one
    device, every variable and the global step. Before, such graphs were refused: the
    chief's one step sequence applied both tasks' updates at every step (on loopback
    servers under hybrid, the embedding ended 0.05 off one device). Unclipped: a global
    norm over the embedding's rows keeps every gradient mirrored."""
    graph_def, reads = multi_task("adam", embedding=True)
    feeds = multi_task_batches(STEPS, BATCH, embedding=True)
    _, want = _one_device(graph_def, feeds, reads)
    plan = gr.rewrite(graph_def, {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]},
                      device_type="CPU", strategy=strategy, task="worker:0").plan
    assert {c.key for c in plan.cuts if c.sync == "accumulate"} >= {"embedding", "embedding/update_1"}
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, strategy, STEPS, reads.values(), feeds,
                              step_ops=STEP_OPS)
    assert want["global_step"] == STEPS // 2
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.slow
def test_one_train_op_whose_every_gradient_stays_mirrored_under_ps(pool, procs, tmp_path):
    """Strategy ps, but a global norm over the embedding's rows keeps every gradient
    mirrored: Adam's beta powers were left on the ps, written by each worker's step beside
    collectives spanning the workers, and the run aborted ("Cleanup <step id>" from the
    ps). With no gradient on a ps, the plan mirrors them too (as strategy allreduce)."""
    graph_def, reads = multi_task("adam", embedding=True, clip=True)
    feeds = multi_task_batches(STEPS, BATCH, embedding=True)
    lines = []
    plan = gr.rewrite(graph_def, {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]},
                      device_type="CPU", strategy="ps", task="worker:1", log=lines.append).plan
    assert {v.placement for v in plan.variables} == {"mirrored"}
    assert any("'beta1_power'" in line and "mirrored too" in line for line in lines), lines
    _, want = _one_device(graph_def, feeds, reads, STEP_OPS[:1])
    got = tc.two_workers_read(pool, procs, tmp_path, graph_def, "ps", STEPS, reads.values(), feeds,
                              step_ops=STEP_OPS[:1])
    for name, tensor in reads.items():
        np.testing.assert_allclose(got[tensor], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_inspect_names_each_gradient_of_a_shared_variable():
    """`graph-rewrite inspect` lists both gradients of a shared variable by their names in
    the plan, the variable's packs, and both embedding gradients' gathered rows (keyed by
    variable, the report kept only the later of each)."""
    from graph_rewriter.inspect_report import format_report, report
    graph_def, _ = multi_task("adam", embedding=True)
    rep = report(gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU"), batch_size=16)
    text = format_report(rep)
    assert [g["cut"] for g in rep["gradients"] if g["variable"] == "encoder/kernel"] == \
        ["encoder/kernel", "encoder/kernel/update_1"]
    assert "encoder/kernel/update_1  allreduce" in text
    assert next(v["sync"] for v in rep["variables"] if v["name"] == "encoder/kernel") == "allreduce packs 0, 1"
    assert sorted(rep["bytes_per_step_per_replica"]["sparse"]) == ["embedding", "embedding/update_1"]
