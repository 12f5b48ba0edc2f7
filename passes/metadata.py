"""metadata: record inside the graph what the Session wrapper and `inspect` need.

One Const node, ``graph_rewriter/metadata``, holds JSON: the replicas and their
devices, the plan, how batch inputs reach the replicas (when any is taken per replica),
which original nodes differ per replica (for merging fetches), the merge overrides, the
outputs the graph merges itself (``merged``: original op name -> replica 0's renamed op,
present when any), the session configuration the graph needs, and the passes that ran.
Nothing reads the node, so it never runs; it travels with the GraphDef wherever it goes.
"""

import dataclasses
import json
import os

from graph_rewriter.health import heartbeat_metadata
from graph_rewriter.incarnations import incarnation_metadata
from graph_rewriter.metadata import METADATA_FORMAT, METADATA_NODE
from graph_rewriter.op_builder import const
from graph_rewriter.pass_manager import Pass
from graph_rewriter.ps_state import RUN_ID, reset_metadata


class MetadataPass(Pass):
    name = "metadata"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"place", "meta_graph"})   # it records the finished graph (its node count, its passes, its Saver)

    def run(self, graph, ctx):
        rm = ctx.replicas
        opts = ctx.options
        doc = {
            "format": METADATA_FORMAT,
            "num_replicas": rm.group_size,
            "local_replicas": rm.num_local,
            "group_devices": rm.group_devices,
            "first_replica": rm.first_replica,
            "chief": rm.chief,
            "replica_prefixes": rm.prefixes,
            "replica_devices": rm.devices,
            "host_devices": rm.hosts,
            "device_type": opts.device_type,
            "devices_per_worker": opts.devices_per_worker,
            "cluster": ctx.cluster.as_dict(),
            "task": list(ctx.cluster.task) if ctx.cluster.task else None,
            "batch_inputs": ctx.plan.batch_inputs,
            "variant": rm.variant,
            "merge": dict(opts.merge),
            "session_config": session_config(ctx),
            "plan": ctx.plan.to_dict(),
            "passes": ctx.passes_run + [self.name],
            "source": source_name(graph.source),
            "num_nodes": rm.expanded_size(graph) + 1,
        }
        meta = graph.meta_graph
        if meta is not None and meta.HasField("saver_def"):
            # the emitted graph's own Saver ops (RewriteResult.saver), from a .pb too
            sd = meta.saver_def
            doc["saver"] = {"filename_tensor_name": sd.filename_tensor_name,
                            "save_tensor_name": sd.save_tensor_name,
                            "restore_op_name": sd.restore_op_name, "version": int(sd.version)}
        if "heartbeat" in ctx.passes_run:
            # between-graph: the ops graph_rewriter.health runs to tell live peers from gone ones
            doc["heartbeat"] = heartbeat_metadata(ctx.cluster, ctx.options.heartbeat_seconds)
        if RUN_ID in graph:
            # between-graph ps: the handshake by which workers wait for the chief's reset
            doc["ps_reset"] = reset_metadata(graph, rm.chief)
        if "record_incarnations" in ctx.passes_run:
            # collectives across tasks: what a client reads to see that no server still
            # holds a restarted peer's earlier incarnation (graph_rewriter.incarnations)
            doc["incarnations"] = incarnation_metadata(ctx.cluster.compute_tasks)
        if rm.merged:
            # ops whose original name now holds the merge of every replica's value
            # (merge_outputs); absent when none, so other graphs stay as they were
            doc["merged"] = dict(rm.merged)
        if ctx.plan.inputs is not None:
            # how each batch input reaches the replicas; absent when every one is split
            # (the graphs of split-only inputs stay as they were before per-replica inputs)
            doc["inputs"] = [dataclasses.asdict(ip) for ip in ctx.plan.inputs]
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        if METADATA_NODE in graph:
            graph.remove_node(graph.node(METADATA_NODE))
        node = const(graph, METADATA_NODE, text.encode(), "string", rm.global_device).node
        assert node.name == METADATA_NODE
        return True


def source_name(source):
    """What the metadata records of the input: a file's or directory's base name, not
    the path as typed, so the output does not depend on the working directory (the same
    file rewritten from anywhere gives the same bytes); a label such as "<GraphDef>" as is."""
    if source.startswith("<"):
        return source
    return os.path.basename(os.path.normpath(source))


def session_config(ctx):
    """What a tf.compat.v1.ConfigProto must allow for this graph to run."""
    opts = ctx.options
    cfg = {}
    if opts.device_type == "CPU":
        cfg["device_count"] = {"CPU": opts.devices_per_worker}
    # Collectives of several in-process replicas block inter-op threads while they wait;
    # fewer threads than replicas + 1 can deadlock the step.
    cfg["inter_op_parallelism_threads"] = max(2, opts.devices_per_worker + 2)
    # Every blocking op (a collective, a queue, an accumulator, a recv from a dead peer)
    # fails after timeout_seconds instead of hanging. The session's deadline cancels the
    # step, which leaves the servers usable; a collective's own timeout attr would abort
    # its server's collectives for good (collectives.py).
    if opts.timeout_seconds:
        cfg["operation_timeout_in_ms"] = int(opts.timeout_seconds * 1000)
    return cfg
