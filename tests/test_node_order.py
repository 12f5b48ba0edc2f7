"""The plan does not depend on the order of the GraphDef's nodes.

A GraphDef's node order means nothing to TensorFlow, but the analysis walks the graph
in a topological order that breaks ties by it, so a rule that judges only the first
node it meets of some kind can decide differently for the same graph written in
another order. One did: the normalizers rule judged only the first division by a sum
over the batch, and where the backward pass's division came first (as TensorFlow wrote
the v2 sequence tagger) the token count went unsynchronised.

Each graph here is rewritten as written, with its nodes reversed and with them shuffled
(seeded), and what the plan decides must be the same: which tensors are synchronised and
how (the gradient cuts' values, indices, sync and role), the batch and broadcast inputs,
the sparse inputs, the normalizers, selected means, loss sums, random draws and batch
statistics, the variables' placement, and the notes (as sets: a note lists names in the
order it met them). Names the plan makes up from the order (a second update's
"/update_1", a pack's number, which of two variables a gradient updates is named its
primary) are not decisions and are left out.
"""

import json
import random

import pytest

import graph_rewriter as gr
from graph_rewriter.protos import graph_pb2
from graph_rewriter.testing import real_models, tf1_scripts

GRAPHS = {
    "tagger_v2": lambda: tf1_scripts.sequence_tagger("dataset", "v2"),
    "tagger_v1": lambda: tf1_scripts.sequence_tagger("placeholder", "v1"),
    "masked_losses": lambda: tf1_scripts.masked_sequence_model("losses"),
    "transformer_dropout": lambda: tf1_scripts.transformer_block(dropout=0.1)[0],
    "labelled_rows": lambda: tf1_scripts.rows_meeting_mlp("labelled_rows"),
    "loss_sum": lambda: tf1_scripts.summed_loss_mlp("sum_plus_decay"),
    "multi_task": lambda: tf1_scripts.multi_task("adam", embedding=True, clip=True)[0],
    "sparse_dataset": lambda: tf1_scripts.sparse_features_model(
        "dataset", records=tf1_scripts.sparse_feature_records(16)),
    "bert": lambda: real_models.build("bert")[0].graph_def,
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
                                             "selected_means", "loss_sums", "random_draws", "batch_statistics")},
        "notes": sorted(_words(n) for n in plan.get("notes") or []),
    }


def _words(note):
    """A note's words in sorted order (it lists names in the order it met them)."""
    return " ".join(sorted(note.replace(",", " ").split()))


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
