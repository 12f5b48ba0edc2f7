"""Rows taken by their position inside a cond: domain-adversarial training (DANN).

pumpikano/tf-dann feeds one batch whose first half is source and second half target
examples; its label predictor takes the first ``batch_size // 2`` rows behind
``tf.cond(train, ...)`` and its domain classifier reads every row through a gradient
reversal layer (graph_rewriter.testing.tf1_scripts.dann). A replica's shard is not the
batch: replica 0 holds source rows only, replica 1 target rows only. Outside a cond,
such a slice starts a product head: every replica computes it over every replica's
rows (docs/semantics.md, "Rows that meet other rows"). Inside one, before:
- a v2 cond (an If; TF2 behaviour) hid the slice in its branch function: nothing was
  found, and 2 replicas trained 0.12 from one device in the loss, with no note; at 4
  replicas the step failed ("Expected size[0] in [0, 2], but got 4");
- a v1 cond (Switch and Merge): the head gathered the Switches' outputs, dead in the
  branch not taken, and every step failed ("Retval[0] does not have value").
Now the head computes a v1 cond's branches itself from the rows their Switches take
(with tf.gradients' zeros for the branch not taken), and passes/lower_conds.py lowers a
v2 cond whose branch slices or splits rows, so R replicas train as one device.
"""

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter import graph_io
from graph_rewriter.analysis import analyze
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import dann, dann_batches

import test_cluster as tc
from test_cluster import pool, procs  # noqa: F401  (fixtures: the server pool, client processes)

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6
FORMS = [("override", "v1", "slice"), ("custom", "v1", "strided"), ("override", "v2", "slice"),
         ("custom", "v2", "strided")]
FORM_IDS = ["-".join(f) for f in FORMS]
STRATEGIES = [("allreduce", 2, {}), ("allreduce", 4, {}), ("allreduce", 2, {"allreduce_algorithm": "reduce_to_one"}),
              ("ps", 2, {}), ("ps", 4, {}), ("hybrid", 2, {})]
STRATEGY_IDS = ["allreduce2", "allreduce4", "reduce_to_one", "ps2", "ps4", "hybrid2"]


def _rewrite(graph_def, replicas=2, strategy="allreduce", **options):
    return gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", strategy=strategy, **options)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("strategy, replicas, options", STRATEGIES, ids=STRATEGY_IDS)
def test_replicas_train_dann_as_one_device(form, strategy, replicas, options):
    graph_def, feeds = dann(*form), dann_batches(STEPS)
    want = harness.trained_on_one_device(graph_def, feeds)
    result = _rewrite(graph_def, replicas, strategy, **options)
    assert result.plan.product_head, "the label predictor's source rows start a head"
    harness.assert_trained_alike(f"{form} {strategy} {replicas}", harness.trained_rewritten(result, graph_def, feeds),
                                 want, RTOL, ATOL)


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_an_evaluation_branch_of_its_own_gives_the_same_head_every_time(control_flow):
    """The evaluation branch normalises every row: its ops read the Switch the slice
    reads (lowered, one Switch for both branches). The head is grown from its inputs in
    the graph's order until no branch adds more: before, the walks went in the order of
    a set of nodes, one of them stopped at the Switch another had added, and the same
    graph's rewrite failed verification or not from call to call (collective
    'l2_normalize/every_replica/all_gather' run by one replica's branch alone)."""
    graph_def, feeds = dann("custom", control_flow, evaluation="normalised"), dann_batches(STEPS)
    heads = {tuple(_rewrite(graph_def).plan.product_head["head"]) for _ in range(4)}
    assert len(heads) == 1
    assert "cond/else/l2_normalize/Rsqrt" in heads.pop() or control_flow == "v1"
    want = harness.trained_on_one_device(graph_def, feeds)
    harness.assert_trained_alike(control_flow, harness.trained_rewritten(_rewrite(graph_def, 4), graph_def, feeds),
                                 want, RTOL, ATOL)


def test_a_v1_conds_branches_join_the_head():
    """The head holds the cond's Switches and gathers what they take (the features and
    the labels), not their outputs, one of which is dead."""
    head = analyze(graph_io.load_graph(dann("override", "v1"))).product_head
    assert {"cond/Slice/Switch", "cond/Switch_1", "cond/Merge", "cond_1/Merge"} <= set(head.head)
    gathered = {name for name, _ in head.gathered}
    assert {"Relu:0", "y:0"} <= gathered and not [name for name in gathered if "Switch" in name]


def test_a_v2_cond_that_slices_rows_is_lowered():
    """The two forward Ifs (the features', the labels') and the backward If (which reads
    the features, not the forward If's outputs) are lowered; none is left."""
    graph_def = dann("custom", "v2")
    assert [n.op for n in graph_def.node if n.op.endswith("If")] == ["StatelessIf"] * 3
    lines = []
    result = _rewrite(graph_def, log=lines.append)
    assert not [n.name for n in result.graph_def.node if n.op.endswith("If")]
    assert ("lower_conds: 2 v2 cond(s) holding rows taken by position lowered to Switch and Merge: 'cond' (and its "
            "backward 'gradients/cond_grad/StatelessIf'), 'cond_1'") in lines, lines


@pytest.mark.parametrize("slicing", ["whole", "flatten"])
def test_a_v2_cond_that_slices_no_rows_is_kept(slicing):
    """A cond whose branches take no rows by position (DANN's label predictor on every
    row; flattened as Keras' Flatten does, which slices the rows' shape, not the rows)
    stays an If: the lowering is for what the analysis must see."""
    graph_def = dann("custom", "v2", slicing)
    result = _rewrite(graph_def)
    assert len([n for n in result.graph_def.node if n.op.endswith("If")]) >= 2
    assert not result.plan.product_head


@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_evaluation_reads_every_row_as_one_device(control_flow):
    """With train=False the cond takes its other branch (every row): after training,
    the rewritten graph's loss on a batch is one device's, in either branch."""
    graph_def, feeds = dann("override", control_flow), dann_batches(STEPS)
    evaluation = {**dann_batches(1, seed=7)[0], "train:0": False}

    def losses(sess):
        sess.run("init")
        for feed in feeds:
            sess.run("train_op", feed)
        return sess.run("loss:0", evaluation), sess.run("loss:0", {**evaluation, "train:0": True})

    with harness.one_device_session(graph_def) as sess:
        want = losses(sess)
    with gr.Session(_rewrite(graph_def, 4)) as sess:
        got = losses(sess)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_without_the_head_the_shards_halves_differ():
    """The control: with ``"product_head": {}`` each replica takes the first half of its
    own shard (replica 1's are target rows), and training differs from one device's."""
    graph_def, feeds = dann("override", "v1"), dann_batches(STEPS)
    want = harness.trained_on_one_device(graph_def, feeds)
    plan = _rewrite(graph_def).plan
    plan.product_head = {}
    got = harness.trained_rewritten(_rewrite(graph_def, strategy=plan), graph_def, feeds)
    assert np.max(np.abs(np.array(got[0]) - np.array(want[0]))) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("control_flow", ["v1", "v2"])
def test_two_workers_train_dann_as_one_device(control_flow, pool, procs, tmp_path):
    """Between-graph, 2 workers x 1 replica: worker 0 is fed the source rows and worker
    1 the target rows; the head gathers both."""
    graph_def, feeds = dann("override", control_flow), dann_batches(3)
    _, want = harness.trained_on_one_device(graph_def, feeds)
    got = tc.two_workers_variables(pool, procs, tmp_path, graph_def, "allreduce", 3, feeds)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def _effectful_cond(take):
    """A v2 cond on a training flag whose branch takes ``take(h)`` of a layer's rows and
    also prints (built as inside a tf.function, where the print is a control output of
    the branch function: such a cond cannot be inlined). Returns the GraphDef."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.enable_control_flow_v2()
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        train = tf1.placeholder_with_default(True, [], name="train")
        w = tf1.get_variable("w", [4, 4], initializer=tf1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)

        def taken():
            rows = take(h)
            tf.print("rows", tf.shape(rows))
            return rows

        g._add_control_dependencies = True   # (what a tf.function's graph sets)
        rows = tf.cond(train, taken, lambda: take(h))
        g._add_control_dependencies = False
        loss = tf.reduce_mean(tf.square(rows), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        tf1.global_variables_initializer()
    return g.as_graph_def()


@pytest.mark.parametrize("take,op", [(lambda h: h[:4], "StridedSlice"), (lambda h: h[1], "StridedSlice"),
                                     (lambda h: tf_split(h, 0), "Split"), (lambda h: tf_gather(h, 0), "GatherV2")],
                         ids=["first_rows", "one_row", "split_rows", "gather_rows"])
def test_a_cond_taking_rows_that_cannot_be_inlined_is_refused(take, op):
    """Before, such a cond stayed a function: each replica took the positions of its own
    rows, silently (the first four rows: 0.59 from one device in the loss after three
    steps at 2 replicas, no note). Now the rewrite stops, naming the cond, its branch,
    the op and why, and says what to do."""
    with pytest.raises(gr.GraphRewriteError) as e:
        _rewrite(_effectful_cond(take))
    message = str(e.value)
    assert "the v2 cond 'cond' takes the batch's rows by position in its branch 'cond_true" in message, message
    assert f"a {op} along axis 0" in message and "control outputs" in message and "outside the cond" in message


@pytest.mark.parametrize("take", [lambda h: h[:, :2], lambda h: tf_split(h, 1), lambda h: tf_gather(h, 1)],
                         ids=["features", "split_features", "gather_features"])
def test_a_cond_taking_features_that_cannot_be_inlined_trains_as_one_device(take):
    """The control: a slice, split or gather of the features (axis 1) takes no rows;
    the cond is left a function and R replicas train as one device."""
    graph_def = _effectful_cond(take)
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(8, 4).astype(np.float32)} for _ in range(3)]
    want = harness.trained_on_one_device(graph_def, feeds)
    got = harness.trained_rewritten(_rewrite(graph_def), graph_def, feeds)
    harness.assert_trained_alike("features", got, want, RTOL, ATOL)


def tf_split(h, axis):
    import tensorflow as tf
    return tf.split(h, 2, axis)[0]


def tf_gather(h, axis):
    import tensorflow as tf
    return tf.gather(h, [0, 1], axis=axis)
