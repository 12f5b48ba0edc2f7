"""communication: gives each gradient collective the implementation the plan asks for.

Before (allreduce and allgather build their collectives with TensorFlow's default):

    replica i:  grad --> CollectiveReduceV2 (instance key of pack p, hint "auto") --> update

After, for a pack whose plan says "ring" (the rewrite's ``communication`` option, or a
hand-edited plan.json naming it for that pack):

    replica i:  grad --> CollectiveReduceV2 (instance key of pack p, hint "ring") --> update

TensorFlow reads ``communication_hint`` when it first runs a collective instance: "ring"
is its gRPC ring (CPU and GPU tensors), "nccl" NVIDIA's NCCL (GPU tensors only: on a CPU
device the collective fails at run time, which is why the options and the planner refuse
it for CPU replicas), "auto" lets TensorFlow choose (NCCL for GPU tensors when the
server's ConfigProto turns on ``experimental.collective_nccl``, its ring otherwise; see
docs/deployment.md, "Server configuration"). A pack's collectives are found by their instance key,
which the plan defines (collectives.dense_instance_key), not by name. The sparse
gradients' all-gathers follow the rewrite's option. Every replica of a group must ask for
the same implementation; they do, as every worker rewrites with the same plan.
"""

from graph_rewriter.collectives import dense_instance_key, hierarchical_instance_keys, key_of
from graph_rewriter.pass_manager import Pass


class CommunicationPass(Pass):
    name = "communication"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"allreduce", "allgather"})   # it sets the hint of the collectives they build

    def applies(self, ctx):
        return ctx.num_replicas > 1 and (
            ctx.options.communication != "auto"
            or any(p.communication not in (None, "auto") for p in ctx.plan.packs))

    def run(self, graph, ctx):
        plan, default = ctx.plan, ctx.options.communication
        by_key = {dense_instance_key(plan, i): pack.communication or default
                  for i, pack in enumerate(plan.packs)}
        for i, pack in enumerate(plan.packs):   # a hierarchical pack's reduce within the worker
            if pack.algorithm == "hierarchical":
                by_key[hierarchical_instance_keys(plan, i)[0]] = pack.communication or default
        changed = False
        for n in graph.nodes:
            if n.op == "CollectiveReduceV2":
                hint = by_key.get(key_of(n, "instance_key"))
            elif n.op == "CollectiveGatherV2":
                hint = default
            else:
                continue
            if hint is not None and n.attr["communication_hint"].s.decode() != hint:
                n.set_attr("communication_hint", hint)
                changed = True
        return changed
