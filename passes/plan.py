"""plan: analyse the single-device graph and decide, per variable, how it is synchronised.

Leaves the graph unchanged; puts the Plan in the context (or checks a given one).
Rejects graphs that do not train: no variables, or no update that depends on the batch.
"""

import hashlib

from graph_rewriter.analysis import analyze, rows_reduced, shardable_user
from graph_rewriter.graph_io import graph_def_bytes
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.pass_manager import Pass
from graph_rewriter import opdefs
from graph_rewriter.cost_model import Topology
from graph_rewriter.plan import DEFAULT_BYTES_PER_PACK, assign_packs, check_plan, make_plan, plan_inputs


class PlanPass(Pass):
    name = "plan"
    provides = frozenset({"plan"})

    def run(self, graph, ctx):
        analysis = analyze(graph, ctx.options.gradients)
        if not analysis.variables:
            raise GraphRewriteError(
                f"{graph.source} has no variables: it looks like an inference graph, and there "
                "is nothing to train", hint="pass the training graph (with its optimizer)")
        r = ctx.num_replicas
        if r > 1 and not analysis.batch_inputs:
            raise GraphRewriteError(
                f"{graph.source} has no batch input to give {r} replicas: expected a placeholder "
                "of rank >= 1 (the batch first) or a tf.data iterator output",
                hint="feed the training data through a placeholder or an iterator, not constants")
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
        ctx.plan.inputs = plan_inputs(analysis, ctx.options.batch_split, r)
        self._check_shared_step_ids(ctx)
        self._check_collective_dtypes(ctx, r)
        self._keep_unshardable_whole(graph, ctx, analysis)
        self._keep_coupled_together(ctx, analysis)
        planned = {vp.name: vp for vp in ctx.plan.variables}
        for v in analysis.variables.values():
            vp = planned.get(v.name)
            if vp is not None:
                vp.initializer = v.initializer.name if v.initializer is not None else None
        ctx.info(f"plan: {len(analysis.variables)} variables, {len(ctx.plan.cuts)} gradients "
                 f"({sum(c.kind == 'sparse' for c in ctx.plan.cuts)} sparse), "
                 f"{len(ctx.plan.packs)} packs, batch inputs {', '.join(ctx.plan.batch_inputs) or 'none'}")
        for ip in ctx.plan.input_plans().values():
            ctx.info(f"plan: input {ip.name}: {describe_input(ip, r)}")
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

    @staticmethod
    def _keep_coupled_together(ctx, analysis):
        """Gradients that meet in post-processing (a global norm) must be averaged alike:
        a parameter server's average exists once, on the ps, while an all-reduced one
        exists on every replica, so a norm over both could be computed in neither place
        for every replica. And a parameter server sums a sparse gradient's duplicate rows
        before averaging, so post-processing that reads the rows themselves (the norm of
        IndexedSlices counts each row) would see other rows than on one device. Such
        groups are mirrored (all-reduced and gathered), and the log says why."""
        plan = ctx.plan
        if not any(c.sync == "accumulate" for c in plan.cuts):
            return
        cuts = {c.variable: c for c in analysis.cuts}
        groups = [list(g) for g in analysis.coupled]
        grouped = {v for g in groups for v in g}
        groups += [[c.variable] for c in analysis.cuts if c.variable not in grouped]
        changed = False
        for group in groups:
            planned = [plan.cut(v) for v in group]
            on_ps = [c for c in planned if c.sync == "accumulate"]
            if not on_ps:
                continue
            rows = [v for v in group if cuts[v].kind == "sparse" and cuts[v].received
                    and not cuts[v].deduplicated and rows_reduced(cuts[v])]
            if rows:
                why = (f"the rows of the sparse gradient of '{rows[0]}' are post-processed "
                       f"({', '.join(cuts[rows[0]].post_processing)}) before they are summed")
            elif len(on_ps) < len(planned):
                mirrored = next(c.variable for c in planned if c.sync != "accumulate")
                why = (f"their gradients meet in post-processing with the all-reduced gradient "
                       f"of '{mirrored}'")
            else:
                continue
            for c in on_ps:
                plan.set_placement(c.variable, "mirrored")
            changed = True
            names = ", ".join(f"'{c.variable}'" for c in on_ps[:3]) + (" ..." if len(on_ps) > 3 else "")
            ctx.info(f"plan: {len(on_ps)} variables ({names}) stay mirrored, not on a parameter "
                     f"server: {why}, which a parameter server's average cannot reproduce")
        if changed:
            assign_packs(plan, plan.bytes_per_pack if plan.bytes_per_pack is not None else DEFAULT_BYTES_PER_PACK)

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


def describe_input(ip, num_replicas):
    """One line on how a batch input (an InputPlan) reaches the replicas: its mode, static
    batch and global batch."""
    if ip.mode == "split":
        return (f"split, the {'drawn' if ip.kind == 'iterator' else 'fed'} batch divided across "
                f"{num_replicas} replica(s) (static batch none, global batch as "
                f"{'drawn' if ip.kind == 'iterator' else 'fed'})")
    source = ("drawn once per replica, replica 0 first" if ip.kind == "iterator"
              else "fed as the replicas' batches concatenated in replica order")
    if ip.static_batch is None:
        return f"per_replica, {source} (static batch none, global batch {num_replicas} x the batch)"
    return (f"per_replica, {source} (static batch {ip.static_batch}, global batch "
            f"{ip.global_batch} = {num_replicas} x {ip.static_batch})")


def graph_fingerprint(graph):
    """A digest of the single-device graph: two different graphs rewritten in one process
    (or on one cluster) get different collective instance keys."""
    return hashlib.sha256(graph_def_bytes(graph)).hexdigest()[:16]
