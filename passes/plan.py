"""plan: analyse the single-device graph and decide, per variable, how it is synchronised.

Leaves the graph unchanged; puts the Plan in the context (or checks a given one).
Rejects graphs that do not train: no variables, or no update that depends on the batch.
"""

import hashlib

from graph_rewriter.analysis import analyze, shardable_user
from graph_rewriter.graph_io import graph_def_bytes
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import Pass
from graph_rewriter import opdefs
from graph_rewriter.cost_model import Topology
from graph_rewriter.plan import check_plan, make_plan


class PlanPass(Pass):
    name = "plan"
    ensures = frozenset({"plan"})

    def run(self, graph, ctx):
        analysis = analyze(graph, ctx.options.gradients)
        if not analysis.variables:
            raise GraphRewriteError(
                f"{graph.source} has no variables: it looks like an inference graph, and there "
                "is nothing to train", hint="pass the training graph (with its optimizer)")
        r = ctx.num_replicas
        if r > 1 and not analysis.batch_inputs:
            raise GraphRewriteError(
                f"{graph.source} has no batch input to split across {r} replicas: expected a "
                "placeholder with an unknown first dimension or a tf.data iterator output",
                hint="build inputs with shape [None, ...] (a static batch size is folded into "
                     "constants by TensorFlow, so it cannot be split)")
        if not analysis.cuts:
            raise GraphRewriteError(
                f"{graph.source} has variables but no optimizer update that depends on the batch "
                "(no gradient found)",
                hint="export the graph after calling optimizer.minimize() or apply_gradients()")
        for name in ctx.options.merge:
            try:
                graph.tensor(name)
            except GraphRewriteError:
                raise GraphRewriteError(
                    f"merge names '{name}', which is not a tensor of {graph.source}",
                    hint="use the original graph's tensor names, e.g. loss:0") from None
        if ctx.options.strategy in ("ps", "hybrid") and not ctx.cluster.is_local and not ctx.cluster.ps_tasks:
            raise GraphRewriteError(
                f"strategy '{ctx.options.strategy}' needs parameter servers, but the cluster has no "
                "'ps' tasks", hint="add a \"ps\" job to the cluster spec, or use strategy allreduce")
        if ctx.options.staleness and ctx.cluster.task is None:
            raise GraphRewriteError(
                "staleness bounds how far between-graph workers run ahead of each other; with "
                "one client driving every replica (no task) no worker can run ahead",
                hint="pass task='worker:I' (--task) for each worker's graph, or drop staleness")
        if ctx.plan is None:
            ctx.plan = make_plan(analysis, ctx.options, r, num_ps=len(ctx.cluster.ps_tasks),
                                 topology=Topology.of(ctx.cluster, ctx.options.devices_per_worker),
                                 can_use_ps=self._can_use_ps(ctx))
        else:
            check_plan(ctx.plan, analysis, ctx.options, r)
        ctx.plan.fingerprint = graph_fingerprint(graph)
        self._check_shared_step_ids(ctx)
        self._check_collective_dtypes(ctx, r)
        self._keep_unshardable_whole(graph, ctx, analysis)
        planned = {vp.name: vp for vp in ctx.plan.variables}
        for v in analysis.variables.values():
            vp = planned.get(v.name)
            if vp is not None:
                vp.initializer = v.initializer.name if v.initializer is not None else None
        ctx.info(f"plan: {len(analysis.variables)} variables, {len(ctx.plan.cuts)} gradients "
                 f"({sum(c.kind == 'sparse' for c in ctx.plan.cuts)} sparse), "
                 f"{len(ctx.plan.packs)} packs, batch inputs {', '.join(ctx.plan.batch_inputs) or 'none'}")
        return False


    @staticmethod
    def _can_use_ps(ctx):
        """Strategy auto may put variables on parameter servers when the cluster has ps
        tasks, or is this machine alone (its host CPU serves)."""
        return ctx.cluster.is_local or bool(ctx.cluster.ps_tasks)

    @staticmethod
    def _check_collective_dtypes(ctx, num_replicas):
        """Every gradient a collective carries has a dtype its kernel accepts (the OpDef's
        allowed ``T``), or the rewrite stops here naming the variable."""
        if num_replicas < 2:
            return
        plan = ctx.plan
        wire = {"fp16": "float16", "bf16": "bfloat16"}.get(plan.compression)
        for c in plan.cuts:
            op = {"allreduce": "CollectiveReduceV2", "allgather": "CollectiveGatherV2"}.get(c.sync)
            if op is None:
                continue
            dtype = wire if wire and c.dtype in ("float32", "float64") and c.sync == "allreduce" else c.dtype
            allowed = opdefs.allowed_types(op, "T")
            if dtype not in allowed:
                raise GraphRewriteError(
                    f"variable '{c.variable}' has a {dtype} gradient, which {op} cannot carry "
                    f"(it takes {', '.join(allowed)})",
                    hint="keep the variable on a parameter server (strategy ps, or a plan placing it "
                         "\"ps\"), or train it in a supported dtype")

    @staticmethod
    def _check_shared_step_ids(ctx):
        """Between-graph workers that all-reduce across machines share step ids (TensorFlow
        numbers the steps of graphs with collectives from one sequence per cluster), so on
        a ps task one worker's finished step cleans up, and aborts, another worker's step
        with the same id. Synchronous steps end together (sync_queues orders the end);
        workers that run ahead do not, so that combination is refused, not left to abort
        at random."""
        plan, cluster = ctx.plan, ctx.cluster
        if cluster.task is None or len(cluster.compute_tasks) < 2:
            return
        on_ps = [v.name for v in plan.variables if v.placement == "ps"]
        mirrored = [c.variable for c in plan.cuts if c.sync != "accumulate"]
        if on_ps and mirrored and plan.accumulation_steps > 1:
            # The runs that only accumulate skip the end-of-step barrier with the rest of
            # the update, so the same abort would hit them.
            raise GraphRewriteError(
                f"accumulation_steps={plan.accumulation_steps} cannot be combined with all-reduced "
                f"variables (e.g. '{mirrored[0]}') and ps variables (e.g. '{on_ps[0]}') in "
                "between-graph workers: TensorFlow gives every worker's run the same id once "
                "collectives span workers, and the runs that only accumulate end without the "
                "barrier that keeps one worker's run from aborting another's on the ps",
                hint="use strategy allreduce or ps (not both kinds of variables) with "
                     "accumulation_steps, or one in-graph client (no task)")
        if not (plan.staleness or not plan.sync):
            return
        if on_ps and mirrored:
            mode = f"staleness={plan.staleness}" if plan.sync else "sync=False"
            raise GraphRewriteError(
                f"{mode} cannot be combined with all-reduced variables (e.g. '{mirrored[0]}') "
                f"and ps variables (e.g. '{on_ps[0]}') in between-graph workers: TensorFlow gives "
                "every worker's step the same id once collectives span workers, and a worker "
                "running ahead would abort the chief's step on the ps",
                hint="use strategy ps (every variable on the ps) with staleness, or synchronous "
                     "hybrid, or one in-graph client (no task)")

    def _keep_unshardable_whole(self, graph, ctx, analysis):
        """A variable is split by rows only if every op using it can be rewritten for
        parts; otherwise it stays whole on one ps task (and the log says why)."""
        for vp in ctx.plan.variables:
            if not vp.shards:
                continue
            group = ctx.plan.group(vp.name)
            blockers = [u for m in group for u, _ in graph.node(m.name).consumers(0) if not shardable_user(u)]
            if blockers:
                for m in group:
                    m.ps_task, m.shards = m.shards[0]["ps_task"] if m.shards else 0, None
                ctx.info(f"plan: '{vp.name}' stays whole: '{blockers[0].name}' ({blockers[0].op}) cannot use a sharded variable")


def graph_fingerprint(graph):
    """A digest of the single-device graph: two different graphs rewritten in one process
    (or on one cluster) get different collective instance keys."""
    return hashlib.sha256(graph_def_bytes(graph)).hexdigest()[:16]
