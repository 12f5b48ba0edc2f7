"""``rewrite()``: load a single-device training graph, run the strategy's passes, and
return the distributed GraphDef with everything needed to run it (``RewriteResult``)."""

import gc
import inspect
import os
import time

from graph_rewriter import graph_io
from graph_rewriter import options as option_schema
from graph_rewriter import passes
from graph_rewriter import protos
from graph_rewriter import saved_model
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.context import RewriteContext
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.metadata import METADATA_NODE, read_metadata, read_metadata_of
from graph_rewriter.options import Options
from graph_rewriter.pass_manager import PassManager
from graph_rewriter.plan import Plan, sparse_line
from graph_rewriter.verifier import check_collectives_run, verify, verify_changes


class RewriteResult:
    """What ``rewrite`` returns and ``load`` reads back."""

    def __init__(self, graph_def=None, metadata=None, meta_graph=None, timings=None, serialized=None,
                 saved_model_dir=None):
        self._graph_def = graph_def
        self._serialized = serialized     # the exported bytes, while graph_def is untouched
        self.metadata = metadata
        self.meta_graph = meta_graph      # MetaGraphDef parts of the input, if it was one
        self.timings = timings or []      # (step, seconds, modified)
        self.saved_model_dir = saved_model_dir   # the input SavedModel's directory, if it was one

    @property
    def graph_def(self):
        """The rewritten tf.compat.v1.GraphDef (parsed on first use; after that, save()
        writes this object, with any change made to it)."""
        if self._graph_def is None:
            from graph_rewriter.protos import graph_pb2
            self._graph_def = graph_pb2.GraphDef.FromString(self._serialized)
        self._serialized = None
        self._graph_def = protos.for_tensorflow(self._graph_def)
        return self._graph_def

    def serialized(self):
        """The binary GraphDef (bytes, or the bytearray the export assembled),
        deterministic: the same input and options give the same bytes."""
        if self._serialized is not None:
            return self._serialized
        return self._graph_def.SerializeToString(deterministic=True)

    @property
    def num_replicas(self):
        return self.metadata["num_replicas"]

    @property
    def plan(self):
        return Plan.from_dict(self.metadata["plan"])

    @property
    def num_nodes(self):
        return self.metadata.get("num_nodes") or len(self.graph_def.node)

    @property
    def is_chief(self):
        """Whether this graph is the chief's (in-graph: the one client's). As
        tf.distribute strategies' ``should_checkpoint`` and ``should_save_summary``:
        only the chief checkpoints and writes summaries (MonitoredTrainingSession's
        ``is_chief``)."""
        return bool(self.metadata.get("chief", True))

    should_checkpoint = is_chief
    should_save_summary = is_chief

    @property
    def devices(self):
        return list(self.metadata["replica_devices"])

    def save(self, path):
        """Writes ONE file (binary GraphDef; text for .pbtxt; MetaGraphDef for .meta), or,
        when the input was a SavedModel and ``path`` has none of those suffixes, a
        SavedModel directory with the input's variables/ and assets/ (saved_model.py)."""
        path = os.fspath(path)
        if self.saved_model_dir is not None and saved_model.is_saved_model_output(path):
            return saved_model.write_saved_model(
                path, saved_model.meta_graph_with(self.meta_graph, self.graph_def), self.saved_model_dir)
        if path.endswith(".meta"):
            data = graph_io.serialize(saved_model.meta_graph_with(self.meta_graph, self.graph_def), path)
        elif os.path.splitext(path)[1].lower() in graph_io.TEXT_SUFFIXES:
            data = graph_io.serialize(self.graph_def, path)
        else:
            data = self.serialized()
        graph_io.write_atomic(path, data)
        return path

    def session_config(self, config=None):
        """``config`` (a tf.compat.v1.ConfigProto or None) completed with what this graph
        needs to run (CPU device count for CPU replicas, inter-op threads for in-process
        collectives, the operation timeout): for sessions other than ``gr.Session``
        (MonitoredTrainingSession's ``config``, a plain tf.compat.v1.Session)."""
        from graph_rewriter.session import session_config
        return session_config(self.metadata["session_config"], config)

    def saver(self, max_to_keep=5, keep_checkpoint_every_n_hours=10000.0):
        """A tf.compat.v1.train.Saver of the rewritten graph's own save and restore ops:
        checkpoints with the original variable names (a parameter-server variable split
        in parts is saved whole), which restore into the single-device graph and the
        other way round. Use it with a session running this graph (``gr.Session``, or
        one that imported it with ``name=""``); ``save`` writes the ``checkpoint`` index
        file, so ``tf.train.latest_checkpoint`` finds the result."""
        import tensorflow as tf
        from tensorflow.core.protobuf import saver_pb2
        names = self.metadata.get("saver")
        if names is None:
            raise GraphRewriteError(
                "this rewritten graph has no Saver (it was written by an older graph_rewriter)",
                hint="rewrite the single-device graph again")
        saver_def = saver_pb2.SaverDef(max_to_keep=max_to_keep,
                                       keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
                                       **names)
        return tf.compat.v1.train.Saver(saver_def=saver_def)

    def summary(self):
        """A few readable lines: replicas, devices, gradients, packs, time."""
        plan = self.metadata["plan"]
        cuts = plan["cuts"]
        dense = [c for c in cuts if c["sync"] == "allreduce"]
        sparse = [c for c in cuts if c["sync"] == "allgather"]
        accumulated = [c for c in cuts if c["sync"] == "accumulate"]
        on_ps = sum(v["placement"] == "ps" for v in plan["variables"])
        lines = [
            f"strategy {plan['strategy']}: {self.num_replicas} replica(s) on "
            f"{', '.join(self.devices)}",
            f"variables: {len(plan['variables'])} ({sum(v['role'] == 'trainable' for v in plan['variables'])} trainable"
            + (f", {on_ps} on parameter servers" if on_ps else "") + "), "
            f"gradients: {len(dense)} allreduced in {len(plan['packs'])} pack(s), {len(sparse)} allgathered"
            + (f", {len(accumulated)} accumulated on parameter servers" if accumulated else ""),
            _inputs_line(plan),
            *([sparse_line(plan["sparse_inputs"])] if plan.get("sparse_inputs") else []),
            f"nodes: {self.num_nodes}",
        ]
        lines[1:1] = [f"note: {note}" for note in plan.get("notes") or []]
        if plan.get("accumulation_steps", 1) > 1:
            lines.append(f"accumulation: gradients summed over {plan['accumulation_steps']} runs, "
                         "applied on every last one")
        if plan.get("cost"):
            p = plan["cost"]["predicted"]
            lines.append(f"auto: predicted communication {p['seconds'] * 1000:.3f} ms per step "
                         f"(allreduce {p['allreduce'] * 1000:.3f}, allgather {p['allgather'] * 1000:.3f}, "
                         f"ps {p['ps'] * 1000:.3f}); see graph-rewrite inspect")
        total = sum(s for name, s, _ in self.timings if name != "verify")
        if self.timings:
            lines.append(f"time: {total * 1000:.0f} ms "
                         f"(verify {sum(s for n, s, _ in self.timings if n == 'verify') * 1000:.0f} ms)")
        return "\n".join(lines)


def _inputs_line(plan):
    per_replica = [i for i in plan.get("inputs") or [] if i["mode"] == "per_replica"]
    split = [n for n in plan["batch_inputs"] if n not in {i["name"] for i in per_replica}]
    line = f"batch inputs split across replicas: {', '.join(split) or 'none'}"
    if per_replica:
        line += "; per replica: " + ", ".join(
            i["name"] + (f" ({i['static_batch']} rows each, global batch {i['global_batch']})"
                         if i["static_batch"] is not None else "") for i in per_replica)
    return line


def pipeline():
    """Every pass a rewrite may run, in order. Each declares what it requires, provides and
    must run after (the pass manager refuses an order that breaks one) and whether a
    given plan needs it (the pass manager skips it when not)."""
    return [passes.SaverPass(), passes.LowerCondsPass(), passes.PlanPass(), passes.ReplicatePass(),
            passes.SplitInputsPass(), passes.NormalizersPass(), passes.LoopBoundsPass(), passes.GatherRowsPass(),
            passes.ProductHeadsPass(), passes.RowMovesPass(), passes.BatchStatisticsPass(), passes.RandomDrawsPass(),
            passes.LossSumsPass(), passes.InvariantTermsPass(),
            passes.MirrorVariablesPass(), passes.MicroBatchesPass(), passes.AllReducePass(),
            passes.AllGatherPass(), passes.CommunicationPass(), passes.AccumulatePass(), passes.SyncQueuesPass(),
            passes.ShardVariablesPass(), passes.RowDefaultsPass(), passes.MergeOutputsPass(), passes.MetaGraphPass(), passes.HeartbeatPass(),
            passes.RecordIncarnationsPass(), passes.StepSequencePass(), passes.PlacePass(), passes.MetadataPass()]


def _check_client_task(cluster):
    if cluster.task is not None and cluster.task[0] not in ("chief", "worker"):
        job, index = cluster.task
        raise GraphRewriteError(
            f"task {job}:{index} runs no client graph: between-graph replication builds the graph "
            "of a chief or worker task", hint="pass a worker task (ps tasks only run a server)")


def rewrite(graph_def, cluster_spec=None, **options):
    # The docstring and signature are generated from the options' schema (below).
    plan, options = _options(options)
    # The IR allocates many small objects; CPython's cyclic collector would otherwise walk
    # all of TensorFlow's module objects again and again while it does (a third of the
    # run time on small graphs). Nothing here needs collecting before the rewrite ends.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _rewrite(graph_def, cluster_spec, options, plan)
    finally:
        if collecting:
            gc.enable()


rewrite.__doc__ = option_schema.docstring(
    """Rewrites a single-device training graph for data-parallel training.

``graph_def``: a tf.compat.v1.GraphDef, MetaGraphDef, tf.Graph, its bytes, the path of a
.pb, .pbtxt or .meta file, or a TF1 SavedModel directory (``tag`` picks its
MetaGraphDef; ``result.save(dir)`` then writes a SavedModel). ``cluster_spec``: None
(this machine only, or TF_CONFIG's cluster and task when set), a dict {"chief": [...],
"worker": [...], "ps": [...]}, a tf.train.ClusterSpec, JSON text or the path of a JSON
file. Returns a ``RewriteResult``.
The contract is docs/api.md, which also describes the options below; every
``graph-rewrite`` flag mirrors one (graph_rewriter/options.py is their one description).""")
rewrite.__signature__ = inspect.Signature(
    [inspect.Parameter("graph_def", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("cluster_spec", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    + [inspect.Parameter(option_schema.keyword_of(f, spec), inspect.Parameter.KEYWORD_ONLY,
                         default=option_schema.default_of(f))
       for f, spec in option_schema.specs()])


def _options(keywords):
    """(plan or None, Options) from rewrite()'s keywords: ``strategy`` may be a Plan or
    the path of a plan's JSON, which gives the strategy."""
    plan = None
    strategy = keywords.get("strategy")
    if isinstance(strategy, Plan):
        plan = strategy
    elif isinstance(strategy, (str, os.PathLike)) and os.fspath(strategy).endswith(".json"):
        path = os.fspath(strategy)
        plan = Plan.from_json(graph_io.read_file(path).decode("utf-8", "replace"), path)
    if plan is not None:
        keywords = dict(keywords, strategy=plan.strategy)
    return plan, Options.from_keywords(**keywords)


def _rewrite(graph_def, cluster_spec, options, plan=None):
    started = time.perf_counter()
    cluster = parse_cluster(cluster_spec, options.task)
    ctx = RewriteContext(options=options, cluster=cluster, plan=plan, log=options.log)
    _check_client_task(cluster)
    t0 = time.perf_counter()
    graph = graph_io.load_graph(graph_def, tag=options.tag)
    if METADATA_NODE in graph:
        raise GraphRewriteError(
            f"{graph.source} is already the output of graph-rewrite",
            hint="rewrite the original single-device graph")
    ctx.timings.append(("load", time.perf_counter() - t0, False))
    ctx.info(f"loaded {graph.source}: {len(graph)} nodes in {(time.perf_counter() - t0) * 1000:.1f} ms")
    manager = PassManager(pipeline(), verifier=verify, verify_changes=verify_changes,
                          verify_each=options.verify, dump_after=options.dump_after,
                          dump_dir=options.dump_dir, verify_final=check_collectives_run)
    manager.run(graph, ctx)
    t0 = time.perf_counter()
    data = graph_io.graph_def_bytes(graph, ctx.replicas)
    ctx.timings.append(("export", time.perf_counter() - t0, False))
    metadata = read_metadata_of(graph)
    ctx.info(f"rewrite done: {len(graph)} nodes in {(time.perf_counter() - started) * 1000:.1f} ms")
    return RewriteResult(None, metadata, meta_graph=graph.meta_graph, timings=ctx.timings, serialized=data,
                         saved_model_dir=_saved_model_dir(graph_def))


def _saved_model_dir(source):
    """The SavedModel directory ``source`` names, or None (any other input)."""
    if isinstance(source, (str, os.PathLike)):
        return saved_model.saved_model_dir(source)
    return None


def load(path):
    """Reads a rewritten graph written by ``RewriteResult.save`` or the CLI (a graph file
    or a SavedModel directory)."""
    from graph_rewriter.protos import meta_graph_pb2
    item = graph_io.load_graph(path)
    gd = graph_io.to_graph_def(item)
    metadata = read_metadata(gd, os.fspath(path) if isinstance(path, (str, os.PathLike)) else "graph")
    meta = None
    if item.meta_graph is not None:
        meta = meta_graph_pb2.MetaGraphDef()
        meta.CopyFrom(item.meta_graph)
    return RewriteResult(gd, metadata, meta_graph=meta, saved_model_dir=_saved_model_dir(path))
