"""A stateful language model, whose LSTM state lives in variables of a row per row of its
static batch, trains as one device: Keras' ``LSTM(stateful=True)``
(graph_rewriter.testing.tf1_scripts.keras_stateful_lm) and the same by hand, the state in
non-trainable ``[batch, units]`` variables assigned the final state after every update
(carried_state_lm(batch, "variables")).

One device built for R x B streams holds R x B rows of state; each replica's copy of the
variable, built for B, holds its own B. Before, the analysis took the state for a batch
statistic and all-reduced it: every replica continued from the mean of the replicas'
final states, silently (Keras: 0.004 from one device in the loss after four steps at 2
replicas, 1.6e-3 in a kernel), or, by hand, it gathered every replica's rows into a
variable of one replica's rows and the step failed. Now such a state's cut has sync
"local": each replica keeps its own rows, and the replicas' copies concatenated in
replica order are one device's variable.
"""

import numpy as np
import pytest
import tensorflow as tf

import graph_rewriter as gr
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.planner import ROW_STATES_START
from graph_rewriter.testing import harness
from graph_rewriter.testing.tf1_scripts import LM_STEPS, carried_state_lm, carried_state_text, keras_stateful_lm

tf1 = tf.compat.v1
STEPS, B = 4, 4
RTOL, ATOL = 1e-5, 1e-6
STATES = {"variables": [f"lm/state/layer_{k}_{p}" for k in range(2) for p in "ch"],
          "keras": ["lstm/Variable", "lstm/Variable_1"]}


def _graph(form, batch):
    return carried_state_lm(batch, "variables") if form == "variables" else keras_stateful_lm(batch)[0]


def _feeds(rows):
    text = carried_state_text(rows, STEPS)
    return [{"x:0": text[:, t * LM_STEPS:(t + 1) * LM_STEPS], "y:0": text[:, t * LM_STEPS + 1:(t + 1) * LM_STEPS + 1]}
            for t in range(STEPS)]


class _States:
    """What harness.ReplicaCopies reads: the state variables' names."""

    def __init__(self, names):
        self.variables = dict.fromkeys(names)


_REFERENCES = {}


def _reference(form, rows):
    if (form, rows) not in _REFERENCES:
        _REFERENCES[form, rows] = harness.trained_on_one_device(_graph(form, rows), _feeds(rows))
    return _REFERENCES[form, rows]


def _trained(form, replicas, **options):
    """(losses, {variable: value}) with every state variable the replicas' copies
    concatenated in replica order, and the result."""
    graph_def = _graph(form, B)
    result = gr.rewrite(graph_def, devices_per_worker=replicas, device_type="CPU", **options)
    with gr.Session(result) as sess:
        losses, values = harness.train_and_read(sess, graph_def, _feeds(replicas * B))
        prefixes = result.metadata["replica_prefixes"]
        copies = harness.ReplicaCopies(sess, _States(STATES[form]), prefixes)()
    for name in STATES[form]:
        values[name] = np.concatenate([copies[p + name] for p in prefixes])
    return (losses, values), result, copies


@pytest.mark.parametrize("form", ["keras", "variables"])
@pytest.mark.parametrize("replicas,options", [(2, {}), (4, {}), (2, {"strategy": "ps"}), (2, {"strategy": "hybrid"}),
                                              (3, {"materialize_replicas": True})])
def test_trains_as_one_device(form, replicas, options):
    """Losses and every variable after STEPS steps; a state variable as the replicas'
    copies concatenated. The replicas' copies differ (each holds its own streams' state:
    an average would have made them equal)."""
    want = _reference(form, replicas * B)
    got, result, copies = _trained(form, replicas, **options)
    harness.assert_trained_alike(f"{form} {replicas} {options}", got, want, RTOL, ATOL)
    for name in STATES[form]:
        assert np.abs(copies[name] - copies["replica_1/" + name]).max() > 1e-3, name


@pytest.mark.parametrize("form", ["keras", "variables"])
def test_the_plan_keeps_each_replicas_rows_and_says_so(form):
    """The state's cut has sync "local" (combine "rows"), in no pack and on no parameter
    server under strategy ps; the plan's notes name it and say what a checkpoint holds;
    inspect prints it."""
    from graph_rewriter.inspect_report import format_report, report
    for strategy in ("allreduce", "ps", "auto"):
        result = gr.rewrite(_graph(form, B), devices_per_worker=2, device_type="CPU", strategy=strategy)
        plan = result.plan
        cuts = [c for c in plan.cuts if c.variable in STATES[form]]
        assert [(c.sync, c.combine, c.pack) for c in cuts] == [("local", "rows", None)] * len(STATES[form])
        assert all(plan.variable(name).placement == "mirrored" for name in STATES[form]), strategy
        notes = [n for n in plan.notes or [] if n.startswith(ROW_STATES_START)]
        assert len(notes) == 1 and all(name in notes[0] for name in STATES[form]) and "checkpoint" in notes[0]
    text = format_report(report(result))
    assert "local (each replica keeps its own rows)" in text


def test_a_plan_cannot_put_such_a_state_on_a_parameter_server():
    result = gr.rewrite(_graph("keras", B), devices_per_worker=2, device_type="CPU", strategy="ps")
    with pytest.raises(GraphRewriteError, match="holds a row per row of each replica's batch"):
        result.plan.set_placement("lstm/Variable", "ps")
    plan = result.plan.to_dict()
    for c in plan["cuts"]:
        if c["variable"] == "lstm/Variable":
            c["sync"] = "allreduce"
    with pytest.raises(GraphRewriteError, match="has sync 'allreduce'"):
        gr.rewrite(_graph("keras", B), devices_per_worker=2, device_type="CPU", strategy=gr.Plan.from_dict(plan))


def test_a_batch_statistic_of_a_static_batch_is_still_averaged():
    """The control of the rule: a moving mean over the rows ([units], no row per row)
    and a moving mean of a [B, units] batch's square over the rows kept as [1, units]
    stay averaged; only a variable whose first dimension is the static batch is kept
    per replica."""
    from graph_rewriter import graph_io
    from graph_rewriter.analysis import analyze
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [B, 3], name="x")
        w = tf1.get_variable("w", [3, 3])
        h = tf.matmul(x, w)
        mean = tf1.get_variable("mean", [3], trainable=False, initializer=tf1.zeros_initializer())
        square = tf1.get_variable("square", [1, 3], trainable=False, initializer=tf1.zeros_initializer())
        last = tf1.get_variable("last", [B, 3], trainable=False, initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(h), name="loss")
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.control_dependencies([step]):
            updates = [tf1.assign(mean, 0.9 * mean + 0.1 * tf.reduce_mean(h, 0)),
                       tf1.assign(square, 0.9 * square + 0.1 * tf.reduce_mean(tf.square(h), 0, keepdims=True)),
                       tf1.assign(last, tf.tanh(h))]
        tf.group(*updates, name="train_op")
    a = analyze(graph_io.load_graph(g.as_graph_def()))
    combines = {c.variable: c.combine for c in a.cuts if c.role == "state"}
    assert combines == {"mean": None, "square": None, "last": "rows"}, combines
