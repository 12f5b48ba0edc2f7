"""The plan does not depend on how the GraphDef is written: the order of its nodes, a
prefix on every name (a graph imported with import_graph_def(name="import") and
written out again), or the name of tf.gradients' scope (tf.gradients(..., name="grads")).

A GraphDef's node order means nothing to TensorFlow, but the analysis walks the graph
in a topological order that breaks ties by it, so a rule that judges only the first
node it meets of some kind can decide differently for the same graph written in
another order. One did: the normalizers rule judged only the first division by a sum
over the batch, and where the backward pass's division came first (as TensorFlow wrote
the v2 sequence tagger, or any graph with its nodes reversed) the token count went
unsynchronised. And the rules that find a forward op's backward pass read tf.gradients'
names, "gradients/<op>_grad/": under an import prefix that is "import/gradients/Sum_grad/"
for "import/Sum", which they did not match, so loss sums and means over selected rows
went unscaled. Under a scope tf.gradients' ``name`` chose ("grads/Sum_grad/") the rules
that tell the backward pass from the forward did not see it at all: loss sums went
unscaled, NVIDIA-style gradient accumulators were summed over the replicas as batch
counts, and backward reductions were listed as statistics over the batch's rows.

Each graph here is rewritten as written, with its nodes reversed, with them shuffled
(seeded), with every name under "import/" and with tf.gradients' scopes renamed
("gradients" to "grads", "gradients_1" to "grads_1"), and what the plan decides must be the same:
which tensors are synchronised and how (the gradient cuts' values, indices, sync and
role), the batch and broadcast inputs, the sparse inputs, the normalizers, selected
means, loss sums, random draws, loop bounds, gathered rows, batch statistics and the
product head, the variables' placement, and the notes (as sets: a note lists names in the order it met
them). Names the plan makes up from the order (a second update's "/update_1", a pack's
number, which of two variables a gradient updates is named its primary) are not
decisions and are left out. Prefixed and renamed graphs also train as one device.
"""

import dataclasses
import json
import random
import re

import numpy as np
import pytest

import graph_rewriter as gr
from graph_rewriter.protos import graph_pb2
from graph_rewriter.testing import harness, real_models, tf1_scripts

PREFIX = "import/"

GRAPHS = {
    "tagger_v2": lambda: tf1_scripts.sequence_tagger("dataset", "v2"),
    "tagger_v1": lambda: tf1_scripts.sequence_tagger("placeholder", "v1"),
    "tagger_dropout_v1": lambda: tf1_scripts.sequence_tagger("placeholder", "v1", dropout=0.3),
    "moco_pointer": lambda: tf1_scripts.moco("pointer"),
    "scheduled_sampling_v2": lambda: tf1_scripts.scheduled_sampling_decoder("v2"),
    "masked_losses": lambda: tf1_scripts.masked_sequence_model("losses"),
    "transformer_dropout": lambda: tf1_scripts.transformer_block(dropout=0.1)[0],
    "labelled_rows": lambda: tf1_scripts.rows_meeting_mlp("labelled_rows"),
    "loss_sum": lambda: tf1_scripts.summed_loss_mlp("sum_plus_decay"),
    "vae": lambda: real_models.build("vae")[0].graph_def,
    "multi_task": lambda: tf1_scripts.multi_task("adam", embedding=True, clip=True)[0],
    "sparse_dataset": lambda: tf1_scripts.sparse_features_model(
        "dataset", records=tf1_scripts.sparse_feature_records(16)),
    "bert": lambda: real_models.build("bert")[0].graph_def,
    "bert_accumulate": lambda: real_models.build("bert_accumulate")[0].graph_def,
    "batch_norm": lambda: tf1_scripts.batch_norm_cnn("layers_cond")[0],
    "simclr": lambda: tf1_scripts.contrastive("simclr"),
}
CONFIGS = {"allreduce": dict(devices_per_worker=2, device_type="CPU"),
           "ps": dict(devices_per_worker=4, device_type="CPU", strategy="ps")}


def _decisions(plan):
    """What a plan decides, free of the names and numbers it takes from the node order."""
    def names(field):
        return sorted(json.dumps(v, sort_keys=True) for v in plan.get(field) or [])

    cuts = sorted(json.dumps({k: c.get(k) for k in ("values", "indices", "sync", "role", "combine",
                                                    "post_processing", "train_ops")}, sort_keys=True)
                  for c in plan["cuts"])
    return {
        "cuts": cuts,
        "variables": sorted((v["name"], v["placement"]) for v in plan["variables"]),
        **{field: names(field) for field in ("batch_inputs", "broadcast_inputs", "sparse_inputs", "normalizers",
                                             "selected_means", "loss_sums", "random_draws", "loop_bounds",
                                             "gathered_rows", "batch_statistics")},
        "notes": sorted(_words(n) for n in plan.get("notes") or []),
        # (each tensor's readers as a set: they are listed in the order the analysis met them)
        "product_head": sorted(f"{k}:" + json.dumps([e[0], sorted(e[1])] if isinstance(e, list) else e)
                               for k, v in (plan.get("product_head") or {}).items() for e in v),
    }


def _words(note):
    """A note's words in sorted order (it lists names in the order it met them)."""
    return " ".join(sorted(re.findall(r"\w[\w./-]*", note)))


def _reordered(graph_def, order):
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    del out.node[:]
    out.node.extend(order)
    return out.SerializeToString()


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_plan_does_not_depend_on_the_node_order(name):
    graph_def = graph_pb2.GraphDef.FromString(GRAPHS[name]().SerializeToString())
    nodes = list(graph_def.node)
    shuffled = nodes[:]
    random.Random(7).shuffle(shuffled)
    for config, options in CONFIGS.items():
        want = _decisions(gr.rewrite(graph_def.SerializeToString(), **options).metadata["plan"])
        for label, order in (("reversed", nodes[::-1]), ("shuffled", shuffled)):
            got = _decisions(gr.rewrite(_reordered(graph_def, order), **options).metadata["plan"])
            differ = [k for k in want if got[k] != want[k]]
            assert not differ, f"{name}, {config}, nodes {label}: the plan's {differ} differ: " + "; ".join(
                f"{k}: {want[k]} != {got[k]}" for k in differ)


def test_the_regression_is_caught_here():
    """The tagger's token count is a normalizer in every order (the rule the fix made
    order-free); the check above compares normalizers, so it would have failed."""
    graph_def = graph_pb2.GraphDef.FromString(GRAPHS["tagger_v2"]().SerializeToString())
    nodes = list(graph_def.node)
    for order in (nodes, nodes[::-1]):
        plan = gr.rewrite(_reordered(graph_def, order), **CONFIGS["allreduce"]).metadata["plan"]
        assert plan["normalizers"] == ["Sum_1:0"]


def _prefixed(graph_def, prefix=PREFIX):
    """The GraphDef as import_graph_def(name=prefix[:-1]) writes it back: every node's
    name, inputs and colocation targets under ``prefix`` (function bodies keep theirs)."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for n in out.node:
        n.name = prefix + n.name
        inputs = ["^" + prefix + i[1:] if i.startswith("^") else prefix + i for i in n.input]
        del n.input[:]
        n.input.extend(inputs)
        if "_class" in n.attr:
            targets = [v.replace(b"loc:@", b"loc:@" + prefix.encode()) for v in n.attr["_class"].list.s]
            del n.attr["_class"].list.s[:]
            n.attr["_class"].list.s.extend(targets)
    return out


def _unprefixed(plan):
    return json.loads(json.dumps(plan).replace(PREFIX, ""))


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_plan_does_not_depend_on_an_import_prefix(name):
    graph_def = graph_pb2.GraphDef.FromString(GRAPHS[name]().SerializeToString())
    for config, options in CONFIGS.items():
        want = _decisions(gr.rewrite(graph_def.SerializeToString(), **options).metadata["plan"])
        got = _decisions(_unprefixed(gr.rewrite(_prefixed(graph_def).SerializeToString(), **options).metadata["plan"]))
        want = json.loads(json.dumps(want))
        differ = [k for k in want if sorted(map(json.dumps, got[k])) != sorted(map(json.dumps, want[k]))]
        assert not differ, f"{name}, {config}, under '{PREFIX}': the plan's {differ} differ: " + "; ".join(
            f"{k}: {want[k]} != {got[k]}" for k in differ)


@pytest.mark.parametrize("kind,strategy", [("sum_plus_decay", "allreduce"), ("sum", "ps")])
def test_a_prefixed_summed_loss_trains_as_one_device(kind, strategy):
    """The loss summed over the batch, under "import/": each replica's sum counts R times
    (without it the step would be 1/R of one device's), as for the graph as written."""
    graph_def = _prefixed(tf1_scripts.summed_loss_mlp(kind))
    feeds = [{PREFIX + k: v for k, v in f.items()} for f in tf1_scripts.dropout_batches(3, 8)]
    reads = [f"{PREFIX}{v}/Read/ReadVariableOp:0" for v in ("w1", "w2")]
    with harness.one_device_session(graph_def) as sess:
        sess.run(PREFIX + "init")
        want = [sess.run([PREFIX + "loss:0", PREFIX + "train_op"], f)[0] for f in feeds], sess.run(reads)
    result = gr.rewrite(graph_def, devices_per_worker=2, device_type="CPU", strategy=strategy)
    assert result.metadata["plan"]["loss_sums"] == [PREFIX + "Sum"]
    with gr.Session(result) as sess:
        sess.run(PREFIX + "init")
        got = [sess.run([PREFIX + "loss:0", PREFIX + "train_op"], f)[0] for f in feeds], sess.run(reads)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w, name in zip(got[1], want[1], reads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


_DEFAULT_SCOPE = re.compile(r"(^|/)gradients(_\d+)?/")


def _named_gradients(graph_def):
    """The GraphDef as if every tf.gradients call had been given a name: "gradients/..."
    becomes "grads/...", "gradients_1/..." "grads_1/..." (inputs and colocations too)."""
    def rename(name):
        return _DEFAULT_SCOPE.sub(lambda m: m.group(1) + "grads" + (m.group(2) or "") + "/", name)

    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for n in out.node:
        n.name = rename(n.name)
        inputs = ["^" + rename(i[1:]) if i.startswith("^") else rename(i) for i in n.input]
        del n.input[:]
        n.input.extend(inputs)
        if "_class" in n.attr:
            targets = [b"loc:@" + rename(v[len(b"loc:@"):].decode()).encode() for v in n.attr["_class"].list.s]
            del n.attr["_class"].list.s[:]
            n.attr["_class"].list.s.extend(targets)
    return out


def _default_names(plan):
    return json.loads(re.sub(r'(^|/|")grads(_\d+)?/', lambda m: m.group(1) + "gradients" + (m.group(2) or "") + "/",
                             json.dumps(plan)))


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_plan_does_not_depend_on_the_name_of_tf_gradients_scope(name):
    graph_def = graph_pb2.GraphDef.FromString(GRAPHS[name]().SerializeToString())
    renamed = _named_gradients(graph_def)
    assert not any(_DEFAULT_SCOPE.search(n.name) for n in renamed.node)
    for config, options in CONFIGS.items():
        want = json.loads(json.dumps(_decisions(gr.rewrite(graph_def.SerializeToString(), **options).metadata["plan"])))
        got = _decisions(_default_names(gr.rewrite(renamed.SerializeToString(), **options).metadata["plan"]))
        differ = [k for k in want if sorted(map(json.dumps, got[k])) != sorted(map(json.dumps, want[k]))]
        assert not differ, f"{name}, {config}, tf.gradients(name='grads'): the plan's {differ} differ: " + "; ".join(
            f"{k}: {want[k]} != {got[k]}" for k in differ)


def test_named_gradients_accumulated_by_hand_train_as_one_device():
    """NVIDIA's BERT gradient accumulation (accumulators in v1 conds, applied every 2nd
    step) with tf.gradients' scope renamed: the accumulators' cuts are gradients,
    averaged, not batch counts summed over the replicas (0.13 from one device in the
    variables after 4 steps before)."""
    ex, feed = real_models.build("bert_accumulate")
    ex = dataclasses.replace(ex, graph_def=_named_gradients(ex.graph_def))
    want_losses, want = harness.run_single(ex, steps=4, feeds=feed)
    result = gr.rewrite(ex.graph_def, devices_per_worker=2, device_type="CPU")
    losses, values = harness.run_rewritten(result, ex, steps=4, feeds=feed)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-5)
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
