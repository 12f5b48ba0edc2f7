"""The planner: every decision of a rewrite, and every check of it, in one module.

``plan(graph, analysis, options, cluster, num_replicas, given=None, log=None)`` returns
the final Plan (graph_rewriter/plan.py holds the data): it checks that the graph can be
planned, makes the default plan for the options' strategy (or checks a given one),
then applies, in order, the decisions that depend on more than the strategy: ops that
cannot use a sharded variable keep it whole, gradients a parameter server cannot
average like one device stay mirrored, dtypes a collective cannot carry and cluster
setups TensorFlow would abort are refused. The passes only apply the result.

TensorFlow is imported inside the functions that need it, not at the top: a Plan, its
placement and packing need none (tools/simulate.py plans without it).
"""

import copy
import dataclasses
import hashlib

from graph_rewriter import cost_model
from graph_rewriter.cost_model import Topology
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.op_vocabulary import input_kind, shardable_user
from graph_rewriter.options import COMMUNICATIONS, DEFAULT_BYTES_PER_PACK
from graph_rewriter.plan import (DENSE_SYNCS, DRAWN, LOCAL, SPARSE_SYNCS, CutPlan, InputPlan, PackPlan, Plan, VariablePlan,
                                 joined_train_ops)


def plan(graph, analysis, options, cluster, num_replicas, given=None, log=None, aliases=None):
    """The final plan of a rewrite of ``graph`` (whose ``analysis`` is given) into
    ``num_replicas`` replicas on ``cluster``: ``given`` (a user's plan, checked against
    the graph and completed) or the default plan for the options. ``log`` takes one
    line per decision the options did not spell out. ``aliases`` maps a batch
    statistic's name before passes/lower_conds.py inlined its cond to its name now."""
    info = log if log is not None else (lambda message: None)
    _check_plannable(graph, analysis, options, cluster, num_replicas)
    r = num_replicas
    if given is None:
        result = make_plan(analysis, options, r, num_ps=len(cluster.ps_tasks),
                           topology=Topology.of(cluster, options.devices_per_worker),
                           can_use_ps=_can_use_ps(cluster))
    else:
        result = check_plan(given, analysis, options, r)
    result.fingerprint = graph_fingerprint(graph)
    local = options.devices_per_worker if cluster.task is not None else r
    result.sparse_inputs = _sparse_inputs(analysis, options.batch_split, local)
    result.inputs = plan_inputs(analysis, options.batch_split, r)
    _check_collective_dtypes(result, r)
    _keep_unshardable_whole(result, graph, info)
    _keep_coupled_together(result, analysis, info)
    _keep_rows_unsummed(result, analysis, info)
    _mirror_state_left_on_ps(result, analysis, cluster, info)
    _mirror_forward_writes(result, analysis, info)
    _plan_gathered_rows(result, analysis, cluster, info)
    # (on the placement the steps above settle: strategy ps can end with a gradient
    # mirrored, an embedding whose rows a norm reads)
    _check_shared_step_ids(result, cluster)
    _check_train_ops_between_graph(result, cluster)
    _check_ordered_states_between_graph(result, cluster)
    _choose_communication(result, options)
    _choose_algorithm(result, options, Topology.of(cluster, options.devices_per_worker))
    _note_hybrid_without_sparse(result, info)
    _note_queues_without_runners(result, graph, info)
    _note_row_states(result, info)
    _plan_normalizers(result, analysis, cluster, info)
    _plan_random_draws(result, analysis, info)
    _plan_row_defaults(result, analysis, info)
    _plan_loop_bounds(result, analysis, cluster, info)
    _plan_loss_sums(result, analysis, info)
    _plan_invariant_terms(result, analysis, info)
    _plan_batch_statistics(result, analysis, options, cluster, info, aliases or {})
    _plan_product_head(result, analysis, cluster, info)
    _plan_row_moves(result, analysis, cluster, info)
    _note_rows_meeting(result, analysis, info)
    planned = {vp.name: vp for vp in result.variables}
    for v in analysis.variables.values():
        vp = planned.get(v.name)
        if vp is not None:
            vp.initializer = v.initializer.name if v.initializer is not None else None
    info(f"plan: {len(analysis.variables)} variables, {len(result.cuts)} gradients "
         f"({sum(c.kind == 'sparse' for c in result.cuts)} sparse), "
         f"{len(result.packs)} packs, batch inputs {', '.join(result.batch_inputs) or 'none'}")
    for ip in result.input_plans().values():
        info(f"plan: input {ip.name}: {describe_input(ip, r)}")
    return result


def _choose_communication(plan, options):
    """Each pack's collective implementation: the one the (given) plan names, or the
    rewrite's ``communication`` option when that is not "auto" (left unset otherwise, so
    plans and graphs made without the option stay as they were)."""
    for i, pack in enumerate(plan.packs):
        if pack.communication is None and options.communication != "auto":
            pack.communication = options.communication
        if pack.communication is not None and pack.communication not in COMMUNICATIONS:
            raise GraphRewriteError(
                f"the plan's pack {i} asks for communication {pack.communication!r}",
                hint=f"use one of {', '.join(COMMUNICATIONS)}")
        if pack.communication == "nccl" and plan.device_type != "GPU":
            raise GraphRewriteError(
                f"the plan's pack {i} asks for communication 'nccl', which runs on GPUs, but "
                "the replicas are CPU devices", hint="use 'ring' or 'auto' for CPU replicas")


def _choose_algorithm(plan, options, topology):
    """Each pack's all-reduce algorithm: the rewrite's ``allreduce_algorithm`` when given
    ("auto": the cost model's choice per pack), else the plan's (strategy auto: the cost
    model's; a given plan: its own), else the flat ring. The two-level all-reduce needs
    two levels: several workers with several devices each. reduce_to_one needs every
    replica in one task (one process), where one device can read every replica's pack."""
    choice = options.allreduce_algorithm
    if choice == "auto":
        cost_model.choose_algorithms(plan, topology, options.cost_model or cost_model.CostModel())
    elif choice is not None:
        for pack in plan.packs:
            pack.algorithm = None if choice == "flat" else choice
    for i, pack in enumerate(plan.packs):
        if pack.algorithm == "flat":
            pack.algorithm = None
        if pack.algorithm not in PACK_ALGORITHMS:
            raise GraphRewriteError(f"the plan's pack {i} asks for algorithm {pack.algorithm!r}",
                                    hint="use 'flat' (or no algorithm) for one ring, 'hierarchical' or "
                                         "'reduce_to_one'")
        who = f"allreduce_algorithm {choice!r}" if choice == pack.algorithm else f"the plan's pack {i}"
        if pack.algorithm == "hierarchical" and (topology.workers < 2 or topology.devices_per_worker < 2):
            raise GraphRewriteError(
                f"{who} asks for the hierarchical all-reduce, which needs several workers with several "
                f"devices each; this cluster has {topology.workers} worker(s) with "
                f"{topology.devices_per_worker} device(s) each",
                hint="use the flat all-reduce (allreduce_algorithm 'flat' or 'auto') on this cluster")
        if pack.algorithm == "reduce_to_one" and topology.workers > 1:
            raise GraphRewriteError(
                f"{who} asks to reduce on one device, which needs every replica in one worker; this "
                f"cluster has {topology.workers} workers",
                hint="use the flat all-reduce (allreduce_algorithm 'flat' or 'auto') on this cluster")


PACK_ALGORITHMS = (None, "hierarchical", "reduce_to_one")


HYBRID_WITHOUT_SPARSE = "hybrid: no sparse gradients, every variable is all-reduced"


def _note_hybrid_without_sparse(plan, log):
    """Strategy hybrid puts only variables with sparse gradients on the parameter
    servers; a graph without any trains exactly as strategy allreduce, which the plan's
    notes (inspect, the summary) and the log say rather than leave the user to guess.
    A given plan keeps the note only while it holds (no variable moved to a ps)."""
    holds = (plan.strategy == "hybrid" and not any(c.kind == "sparse" for c in plan.cuts)
             and not any(v.placement == "ps" for v in plan.variables))
    if not holds:
        if plan.notes and HYBRID_WITHOUT_SPARSE in plan.notes:
            plan.notes = [n for n in plan.notes if n != HYBRID_WITHOUT_SPARSE] or None
        return
    if HYBRID_WITHOUT_SPARSE not in (plan.notes or []):
        plan.notes = (plan.notes or []) + [HYBRID_WITHOUT_SPARSE]
    log(f"plan: {HYBRID_WITHOUT_SPARSE} (as with strategy allreduce)")


QUEUES_WITHOUT_RUNNERS = ("the batches come from queues, and the input, a GraphDef, has no QueueRunners: "
                          "the rewrite rebuilds them into the output's MetaGraphDef, which a .pb "
                          "does not keep (save the result as .meta, or use it in this process)")


def _note_queues_without_runners(plan, graph, log):
    """A batch dequeued from a queue (tf.train.batch) waits for QueueRunner threads that
    only a MetaGraphDef's ``queue_runners`` collection describes. From a GraphDef the
    meta_graph pass rebuilds them, but a result saved as .pb loses them again, and its
    first step would wait until its timeout: the plan says so."""
    notes = [n for n in plan.notes or [] if n != QUEUES_WITHOUT_RUNNERS]
    queued = any(input_kind(graph.tensor(name).node.op) == "queue" for name in plan.batch_inputs)
    meta = graph.meta_graph
    if queued and (meta is None or "queue_runners" not in meta.collection_def):
        notes.append(QUEUES_WITHOUT_RUNNERS)
        log(f"plan: {QUEUES_WITHOUT_RUNNERS}")
    plan.notes = notes or None


UNSYNCED_NORMALIZERS_START = "the loss divides by a sum over the batch"
UNSYNCED_NORMALIZERS = (UNSYNCED_NORMALIZERS_START + " (a count of tokens or of non-zero weights: "
                        "{names}); without collectives between the workers (a ps plan across machines) each "
                        "replica divides by its own shard's, which equals one device only when the shards' sums "
                        "are equal (strategy allreduce or hybrid averages it)")
MICRO_BATCH_COUNTS_START = "with accumulation_steps"
MICRO_BATCH_COUNTS = (MICRO_BATCH_COUNTS_START + " {k} the loss divides by each micro-batch's count ({names}), "
                      "not the whole batch's: unless the micro-batches count alike (tokens, non-zero weights, "
                      "selected rows), the {k} runs differ from one step on the whole batch")


ROW_STATES_START = "variables hold a row per row of each replica's batch"
ROW_STATES = (ROW_STATES_START + " ({names}: a stateful RNN's state): each replica keeps its own rows, and "
              "one device's value is the replicas' copies concatenated in replica order; a checkpoint saves "
              "replica 0's copy, which a restore gives every replica")


def _note_row_states(plan, log):
    """Names the states each replica keeps its own rows of (sync "local"): what a user
    reads by the variable's name, and what a checkpoint holds, is replica 0's rows."""
    names = [c.variable for c in plan.cuts if c.sync == LOCAL]
    plan.notes = [n for n in plan.notes or [] if not n.startswith(ROW_STATES_START)] or None
    if names and plan.num_replicas > 1:
        note = ROW_STATES.format(names=", ".join(names))
        plan.notes = (plan.notes or []) + [note]
        log(f"plan: {note}")


def _check_given(given, found, field, what):
    """A given plan's ``field`` lists only what the analysis found."""
    unknown = [n for n in given or [] if n not in found]
    if unknown:
        raise GraphRewriteError(
            f"the plan's {field} names '{unknown[0]}', which is not {what} (found: {', '.join(found) or 'none'})",
            hint=f"list only what the plan `graph-rewrite plan` writes lists in {field}, or [] for none")


def _plan_random_draws(plan, analysis, log):
    """The seeded random ops that draw one value per row of the batch (the analysis
    finds them): each replica draws every replica's rows with the op's seeds and keeps
    its own, so the replicas together draw what one device draws for their R batches,
    at R times the drawing. A given plan keeps its own choice (an empty list: none)."""
    _plan_found(plan, "random_draws", analysis.batch_draws,
                "a seeded random op drawing one value per row of this graph's batch",
                "random draws of the batch's rows, each replica keeping its own", log)


def _plan_row_defaults(plan, analysis, log):
    """The initial states (the analysis finds them: an RNN's zero state, a Fill or
    Const of a row per row of the batch): under its name the graph holds every local
    replica's rows, and each replica reads its own, so a value a script feeds by the
    name (the last step's final state) reaches every replica, as a fed placeholder does.
    A given plan keeps its own choice (an empty list: none)."""
    _plan_found(plan, "row_defaults", analysis.row_defaults,
                "an initial state (a fill or constant of a row per row) of this graph's batch",
                "initial states, fed by name with every replica's rows", log)


def _plan_found(plan, field, found, what, says, log):
    """Sets the plan's ``field`` to the names the analysis ``found`` (None with one
    replica or none found), unless a given plan lists its own (checked: only names
    found, ``what`` says what they must be); logs ``says`` and the names."""
    names = list(found)
    _check_given(getattr(plan, field), names, field, what)
    if plan.num_replicas < 2 or not names:
        setattr(plan, field, None)
    elif getattr(plan, field) is None:
        setattr(plan, field, names)
        log(f"plan: {says}: {', '.join(names)}")


def _collectives_span(plan, cluster):
    """True if a collective can join every replica of ``plan``: they are in one task, or
    the plan already all-reduces or gathers between tasks (the servers then take part
    in collectives). The small collectives of normalizers, loop bounds, gathered rows
    and synced batch statistics ask for it."""
    return len(cluster.compute_tasks) == 1 or plan.uses_collectives()


def _plan_loop_bounds(plan, analysis, cluster, log):
    """The loop bounds (a Max over the batch's rows that only bounds while loops, as
    dynamic_rnn's longest sequence does) whose loops draw random numbers at every step:
    every replica reads the replicas' maximum, the batch's, so each runs one device's
    steps and its stateful draws advance as one device's do (the analysis finds them;
    a bound without draws leaves the values alike whatever the steps, and stays the
    replica's). A collective needs every replica in one group, as the normalizers do. A
    given plan keeps its own choice (an empty list: each replica's own bound)."""
    _check_given(plan.loop_bounds, analysis.outer_loop_bounds, "loop_bounds",
                 "a maximum or minimum over this graph's batch, computed outside loops, that only bounds while "
                 "loops")
    if plan.num_replicas < 2 or not analysis.outer_loop_bounds or not _collectives_span(plan, cluster):
        plan.loop_bounds = None
    elif plan.loop_bounds is None:
        plan.loop_bounds = list(analysis.drawing_loop_bounds) or None
        if plan.loop_bounds:
            log("plan: while loops that draw random numbers at every step run to the batch's bound (the "
                f"replicas' maximum or minimum of theirs): {', '.join(plan.loop_bounds)}")


def _plan_gathered_rows(plan, analysis, cluster, log):
    """Updates that write rows of the batch into a variable (MoCo's queue of keys) read
    every replica's rows, gathered in replica order (the analysis finds the tensors and
    their readers): each replica's update is then one device's, the same on every
    replica, so the variables they write are mirrored (a parameter server's single copy
    would take R such updates in one step). Gathering takes a collective, so every
    replica in one collective group: in one task, or where the plan already all-reduces
    or gathers between tasks; otherwise the rewrite stops. A given plan keeps its own
    choice (an empty list: each replica writes its own rows)."""
    names = [t for t, _ in analysis.gathered_rows]
    given = plan.gathered_rows
    _check_given([entry[0] for entry in given or []], names, "gathered_rows",
                 "a tensor of the batch's rows that an update of this graph writes into a variable")
    if plan.num_replicas < 2 or not names:
        plan.gathered_rows = None
        return
    if given is not None:
        names = [entry[0] for entry in given]
        if not names:
            return
    if not _collectives_span(plan, cluster):
        raise GraphRewriteError(
            f"variable '{analysis.row_state_variables[0]}' is assigned rows of the batch ({_listed(names)}): "
            "every replica must gather every replica's rows for its update, which takes a collective, but "
            "this plan has none between the tasks (each worker's gradients go to parameter servers)",
            hint="use strategy allreduce or hybrid, or mirror a variable whose gradient is all-reduced")
    on_ps = [v for v in analysis.row_state_variables if plan.variable(v).placement == "ps"]
    for name in on_ps:
        plan.set_placement(name, "mirrored")
    plan.gathered_rows = [[t, [list(r) for r in readers]] for t, readers in analysis.gathered_rows if t in names]
    log(f"plan: updates write rows of the batch into {_listed(analysis.row_state_variables)}: every replica "
        f"gathers every replica's rows of {_listed(names)} for them"
        + (f" (mirrored: {_listed(on_ps)})" if on_ps else ""))


def _plan_product_head(plan, analysis, cluster, log):
    """The head of the batch's in-batch products (a contrastive loss's every query
    against every document: graph_rewriter/product_heads.py): every replica computes it
    over every replica's rows, gathered, so its loss is one device's, and keeps R times
    its own rows' gradients. It takes a collective, so every replica in one group, as
    the normalizers do; with micro-batches each would meet only its micro-batch's rows,
    so it is left to the note. A given plan keeps its own choice (an empty dict: each
    replica's rows meet its own)."""
    head = analysis.product_head
    given = plan.product_head
    if given:
        found = head.products if head is not None else []
        _check_given(given.get("products") if isinstance(given, dict) else given, found, "product_head",
                     "an in-batch product of this graph whose head every replica can compute over every "
                     "replica's rows")
    if plan.num_replicas < 2 or head is None or plan.accumulation_steps > 1 or not _collectives_span(plan, cluster):
        plan.product_head = None
    elif given is None or given:
        plan.product_head = dataclasses.asdict(head)
        log(f"plan: the in-batch products {_listed(head.products)} and their head ({len(head.head)} ops) are "
            f"computed over every replica's rows: each replica gathers {_listed([t for t, _ in head.gathered])} "
            "and keeps its own rows' gradients")


def _plan_row_moves(plan, analysis, cluster, log):
    """Rows moved within the batch that come from the batch alone (mixup's reversed or
    shuffled batch: graph_rewriter/row_moves.py): every replica moves every replica's
    rows, gathered, and keeps its own, so the moved batch is one device's. Like the
    product head, it takes a collective spanning the replicas and no micro-batches; a
    given plan keeps its own choice (an empty dict: each replica moves its own rows)."""
    moves = analysis.row_moves
    given = plan.row_moves
    if given:
        _check_given(given.get("moves") if isinstance(given, dict) else given, moves.moves if moves else [],
                     "row_moves", "a move of the batch's rows within it that comes from the batch alone")
    if plan.num_replicas < 2 or moves is None or plan.accumulation_steps > 1 or not _collectives_span(plan, cluster):
        plan.row_moves = None
    elif given is None or given:
        plan.row_moves = dataclasses.asdict(moves)
        log(f"plan: the rows moved within the batch by {_listed(moves.moves)} (or stacked by loops that draw "
            f"at every step) are moved over every replica's rows: each replica gathers "
            f"{_listed([t for t, _ in moves.gathered])} and keeps its own rows of the moves")


def _plan_invariant_terms(plan, analysis, log):
    """The gradient terms every replica computes alike (the analysis finds them: weight
    decay's), of gradients all-reduced to their mean in one step: the first replica adds
    them R times and the others leave them out (passes/invariant_terms.py). By default
    on CPU replicas of one machine, which share its cores, so the work the other
    replicas skip is the step's; GPUs work side by side, and there the first one's
    step, which does it all, is no shorter. A given plan keeps its own choice, checked
    (an empty list: every replica computes them)."""
    cuts = {c.key: c for c in plan.cuts}
    eligible = {}   # (cut key, AddN) -> its terms
    if plan.num_replicas > 1 and plan.accumulation_steps == 1:
        for key, total, positions in analysis.invariant_terms:
            cut = cuts.get(key)
            if cut is not None and cut.sync == "allreduce" and cut.combine is None:
                eligible[key, total.name] = [total.inputs[pos].name for pos in positions]
    given = plan.invariant_terms
    if given is not None:
        for entry in given:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[2], (list, tuple))
                    and entry[2]):
                raise GraphRewriteError(
                    f"the plan's invariant_terms entry {entry!r} is not [variable, AddN name, [its input tensors]]",
                    hint="list only entries `graph-rewrite plan` writes, or [] for none")
            key, name, terms = entry
            unknown = [t for t in terms if t not in eligible.get((key, name), ())]
            if unknown:
                found = ", ".join(f"{k} ({n})" for k, n in eligible) or "none"
                raise GraphRewriteError(
                    f"the plan's invariant_terms names '{unknown[0]}' in the gradient '{name}' of variable "
                    f"'{key}', which is not a term every replica computes alike of a gradient all-reduced "
                    f"to its mean (found: {found})",
                    hint="list only entries `graph-rewrite plan` writes, or [] for none")
        if plan.num_replicas < 2:
            plan.invariant_terms = None
        return
    one_machine = plan.device_type == "CPU" and plan.num_replicas == plan.devices_per_worker
    if one_machine and eligible:
        plan.invariant_terms = [[key, name, terms] for (key, name), terms in eligible.items()]
        log(f"plan: gradient terms every replica computes alike (weight decay's), added {plan.num_replicas} "
            f"times by the first replica alone, of: {', '.join(key for key, _ in eligible)}")


def _plan_loss_sums(plan, analysis, log):
    """The sums over the batch's rows a loss adds up without dividing by a count (the
    analysis finds them): one device's gradient is the sum of the replicas', so each
    replica's sum counts R times (R x accumulation_steps in its gradient), and the mean
    over the replicas is one device's. A given plan keeps its own choice (an empty
    list: averaged, as a mean)."""
    names = list(analysis.loss_sums)
    _check_given(plan.loss_sums, names, "loss_sums",
                 "a sum over this graph's batch that a loss adds up undivided")
    if plan.loss_sums is not None:
        from graph_rewriter.analysis import summed_op
        for c in analysis.cuts:
            total = summed_op(c.values).name
            if total in names and total not in plan.loss_sums and plan.cut(c.key).combine != "sum":
                raise GraphRewriteError(
                    f"the plan leaves the loss sum '{total}' unscaled, but the statistic '{c.variable}' that "
                    "adds it up is averaged across the replicas (its cut has no \"combine\": \"sum\")",
                    hint=f"give the cut of '{c.variable}' \"combine\": \"sum\" in the plan, or list "
                         f"'{total}' in loss_sums")
    if plan.num_replicas * plan.accumulation_steps < 2 or not names:
        plan.loss_sums = None
    elif plan.loss_sums is None:
        plan.loss_sums = names
        log(f"plan: the loss sums over the batch's rows; each replica's sum is scaled by the "
            f"{plan.num_replicas} replicas: {', '.join(names)}")


SYNCED_MICRO_BATCHES = ("with accumulation_steps {k} the synchronised batch statistics ({names}) are each "
                        "micro-batch's, over the {r} replicas' rows of it, not the whole step's")


def _plan_batch_statistics(plan, analysis, options, cluster, log, aliases):
    """The batch statistics to all-reduce over every replica's rows (the option
    sync_batch_statistics: True for every one the analysis lists, or names; a given
    plan keeps its own list). One the rewrite cannot synchronise, or a plan whose
    replicas meet in no collective group (parameter servers across machines), is
    refused: the user asked for one device's statistics."""
    found = list(analysis.batch_statistics)
    wanted, field = plan.sync_batch_statistics, "the plan's sync_batch_statistics"
    if wanted is None:
        asked, field = options.sync_batch_statistics, "sync_batch_statistics"
        wanted = found if asked is True else [aliases.get(name, name) for name in asked or []]
    for name in wanted:
        if name not in found:
            raise GraphRewriteError(
                f"{field} names '{name}', which is not a statistic over the batch's rows that this graph "
                f"trains with (found: {', '.join(found) or 'none'})",
                hint="name only what the plan's notes list as batch statistics, or pass True for all")
        if name in analysis.statistics_obstacles:
            others = [n for n in found if n not in analysis.statistics_obstacles]
            raise GraphRewriteError(
                f"{field}: the batch statistic '{name}' cannot be synchronised: "
                f"{analysis.statistics_obstacles[name]}",
                hint=f"pass the names of the others ({_listed(others)})" if others
                else "drop sync_batch_statistics")
    if plan.num_replicas < 2 or not wanted:
        plan.sync_batch_statistics = [] if plan.sync_batch_statistics == [] else None
        plan.synced_row_counts = None
        return
    if not _collectives_span(plan, cluster):
        raise GraphRewriteError(
            f"{field}: the replicas of this {plan.strategy} plan across machines meet in no collective "
            "group, so their batch statistics cannot be all-reduced",
            hint="use strategy allreduce or hybrid, or leave sync_batch_statistics off")
    plan.sync_batch_statistics = list(wanted)
    counts = [[op, pos, list(reads)] for name in wanted for op, pos, reads in analysis.statistics_row_counts.get(name, ())]
    plan.synced_row_counts = counts or None
    log(f"plan: batch statistics all-reduced over the {plan.num_replicas} replicas' rows: {_listed(wanted)}")
    if plan.accumulation_steps > 1:
        note = SYNCED_MICRO_BATCHES.format(k=plan.accumulation_steps, names=_listed(wanted), r=plan.num_replicas)
        plan.notes = (plan.notes or []) + [note]
        log(f"plan: {note}")


ROWS_MEET_START = "rows of the batch meet other rows"
ROW_PRODUCTS = (ROWS_MEET_START + " in {names} (a product of two batch tensors over their features, "
                "e.g. a contrastive loss's in-batch negatives): each replica computes it over its own rows, so a "
                "row meets {shard} of one device's rows, and the step differs from one device's")
MOVED_ROWS = (ROWS_MEET_START + " in {names} (rows moved or ranked within the batch, e.g. mixup's reversed or "
              "shuffled batch, a top_k of the rows' losses): each replica moves or ranks its own rows only, so a "
              "row meets other rows than on one device, and the step differs from one device's")
POSITIONED_ROWS = (ROWS_MEET_START + " in {names} (rows taken by their position in the batch, e.g. its halves by "
                   "tf.split(h, 2, 0) where the input pipeline put two views of the examples, or h[:n]): each "
                   "replica's batch is a contiguous shard of the batch, so the rows at those positions are not one "
                   "device's, and the step differs from one device's")
BATCH_STATISTICS = (ROWS_MEET_START + " in {names} (statistics over the batch's rows that training uses, e.g. "
                    "batch normalization in training mode): each replica computes them over its own rows, as "
                    "data-parallel training without synchronised batch statistics does, and the step differs "
                    "from one device's; moving averages of them are averaged across the replicas "
                    "(sync_batch_statistics all-reduces them over every replica's rows)")
STORED_STATISTICS = (ROWS_MEET_START + " in {names} (statistics over the batch's rows that a state update stores, "
                     "e.g. a moving maximum of the activations, as quantization-aware training keeps, or weight "
                     "normalization's data-dependent init): each replica computes them over its own rows, and the "
                     "replicas' average of what they store is not what one device stores, nor what the step reads "
                     "from it (sync_batch_statistics all-reduces them over every replica's rows)")
LOOP_BOUNDS_START = "while loops run to a bound over the batch's rows"
LOOP_BOUNDS = (LOOP_BOUNDS_START + " ({names}: the longest sequence, as tf.nn.dynamic_rnn's sequence_length "
               "gives): each replica runs them to its own rows' bound. A loop that leaves its finished rows "
               "unchanged, as dynamic_rnn does, computes one device's values; a stateful random op in it (a "
               "dropout per step) draws once per step it runs, so from then on its draws are not one device's")
SAMPLED_ROWS = (ROWS_MEET_START + " in {names} (seeded draws of samples per row from the rows' own values, e.g. "
                "tf.random.categorical(logits, 1, seed)): each replica's kernel draws for its rows what one device "
                "draws for the batch's first rows, so the samples, and the step, differ from one device's")
LOOPED_DRAWS_START = "seeded random ops draw in while loops over the batch's rows"
LOOPED_DRAWS = (LOOPED_DRAWS_START + " ({names}, e.g. tf.map_fn's random flip or crop per image): each replica's "
                "loop runs a step per row of its own rows, and its kernel draws for them what one device draws "
                "for the batch's first rows, so the draws, and the step, differ from one device's (the "
                "replicas' draws coincide)")
REGRADIENTS = (ROWS_MEET_START + " in {names} (a gradient of the batch's loss that the step differentiates "
               "again, e.g. GradNorm's norms of the tasks' gradients, MAML's inner step on the whole batch): "
               "each replica computes it from its own rows, with or without synchronised batch statistics, "
               "and the step differs from one device's")
ROW_GRADIENTS = (ROWS_MEET_START + " in {names} (a gradient with respect to the batch's rows that leaves the "
                 "backward pass, of a mean over the rows, e.g. a gradient penalty on tf.gradients(tf.reduce_mean(D(x)), "
                 "x) or a curvature factor from the loss's output gradients times a constant batch size): each "
                 "replica's loss is the mean over its own rows, so its gradient per row is {replicas} times one "
                 "device's, or divided by its norm over the replica's rows, and the step differs from one device's; "
                 "differentiate a sum over the rows (tf.reduce_sum) or multiply by tf.shape(x)[0], which is the "
                 "replica's count of rows")
UNSPLIT_JOINS_START = "gradients meet after the backward pass"
UNSPLIT_JOINS = (UNSPLIT_JOINS_START + " in the updates of {names} through a nonlinear function of several of "
                 "them that the rewrite cannot average apart (gradients batched by tf.vectorized_map, as PCGrad "
                 "projects them): each replica computes it from its own gradients and the replicas average the "
                 "results, so the step differs from one device's; compute the per-task gradients with one "
                 "tf.gradients call each")
SELECTED_MEANS = (ROWS_MEET_START + " in {names} (a mean over the rows a condition on the batch selects, e.g. "
                  "tf.boolean_mask of the labelled rows): each replica divides by its own count of selected "
                  "rows and the replicas' means are averaged alike, so unless every replica selects as many "
                  "rows the step differs from one device's")


def _note_rows_meeting(plan, analysis, log):
    """Where the batch's rows meet each other in the forward pass (in-batch negatives,
    mixup, batch statistics, a mean over selected rows left unsynced), each replica
    computes with its own rows: the plan's notes and the log say so (docs/semantics.md,
    "Rows that meet other rows")."""
    notes = [n for n in plan.notes or [] if not n.startswith((ROWS_MEET_START, LOOP_BOUNDS_START, LOOPED_DRAWS_START,
                                                               UNSPLIT_JOINS_START))]
    if plan.num_replicas > 1 and analysis.unsplit_joins:
        notes.append(UNSPLIT_JOINS.format(names=_listed(analysis.unsplit_joins)))
        log(f"plan: {notes[-1]}")
    unsynced = [n for n in analysis.loop_bounds if n not in (plan.loop_bounds or ())]
    if plan.num_replicas > 1 and unsynced:
        notes.append(LOOP_BOUNDS.format(names=_listed(unsynced)))
        log(f"plan: {notes[-1]}")
    if plan.num_replicas > 1:
        computed = set((plan.product_head or {}).get("head") or ()) | set(
            (plan.row_moves or {}).get("moves") or ())   # (one device's rows meet there)
        products, moved, positioned, sampled = ([n for n in names if n not in computed] for names in (
            analysis.row_products, analysis.moved_rows, analysis.positioned_rows, analysis.sampled_rows))
        left = products + [n for n in analysis.ranked_rows if n not in computed]
        if left and analysis.product_head_obstacle:
            log(f"plan: the head of {_listed(left)} (rows meeting every row of the batch) cannot be computed "
                f"over every replica's rows: {analysis.product_head_obstacle}")
        looped = [name for name, stacks in analysis.looped_draws.items()
                  if not stacks or not computed.issuperset(stacks)]
        for name in moved + sampled:
            if name in analysis.row_move_obstacles:
                log(f"plan: the rows '{name}' moves cannot be moved over every replica's rows: "
                    f"{analysis.row_move_obstacles[name]}")
        for name in looped:
            if name in analysis.row_move_obstacles:
                log(f"plan: the loop '{name}' cannot run over every replica's rows: "
                    f"{analysis.row_move_obstacles[name]}")
        for template, names in ((ROW_PRODUCTS, products), (MOVED_ROWS, moved), (POSITIONED_ROWS, positioned),
                                (SAMPLED_ROWS, sampled), (LOOPED_DRAWS, looped),
                                (BATCH_STATISTICS, [n for n in analysis.batch_statistics
                                                    if n not in (plan.sync_batch_statistics or ())
                                                    and n not in analysis.stored_statistics]),
                                (STORED_STATISTICS, [n for n in analysis.stored_statistics
                                                     if n not in (plan.sync_batch_statistics or ())]),
                                (SELECTED_MEANS, [n for n in analysis.selected_means
                                                  if n not in (plan.selected_means or ())]),
                                (REGRADIENTS, analysis.regradients), (ROW_GRADIENTS, analysis.row_gradients)):
            if names:
                notes.append(template.format(names=_listed(names), shard=f"1/{plan.num_replicas}",
                                             replicas=plan.num_replicas))
                log(f"plan: {notes[-1]}")
    plan.notes = notes or None


def _listed(names, limit=4):
    """'a', 'b', 'c', 'd' and 3 more."""
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _plan_normalizers(plan, analysis, cluster, log):
    """The loss normalizers the analysis found (sums over the batch a loss divides by,
    and the counts of rows that means over selected rows divide by) are averaged across
    replicas by a collective, so each replica's loss is its share of one device's. A
    collective needs every replica in one collective group: in one task, or where the
    plan already all-reduces or gathers between tasks. Otherwise (a parameter-server
    plan across machines) they stay per replica, and the plan says so. A given plan
    keeps its own choice. With micro-batches each divides by its own count: a note."""
    notes = [n for n in plan.notes or []
             if not n.startswith((UNSYNCED_NORMALIZERS_START, MICRO_BATCH_COUNTS_START))]
    names = [t.name for t in analysis.normalizers]
    means = list(analysis.selected_means)
    if plan.accumulation_steps > 1 and (names or means):
        notes.append(MICRO_BATCH_COUNTS.format(k=plan.accumulation_steps, names=_listed(names + means)))
        log(f"plan: {notes[-1]}")
    _check_given(plan.normalizers, names, "normalizers", "a sum over the batch a loss of this graph divides by")
    _check_given(plan.selected_means, means, "selected_means",
                 "a mean of this graph over rows a condition on the batch selects")
    if plan.num_replicas < 2 or not _collectives_span(plan, cluster):
        if plan.num_replicas > 1 and names:
            notes.append(UNSYNCED_NORMALIZERS.format(names=", ".join(names)))
            log(f"plan: {notes[-1]}")
        plan.normalizers = plan.selected_means = None   # (selected means: a note on rows that meet)
    else:
        if not names:
            plan.normalizers = None
        elif plan.normalizers is None:
            plan.normalizers = names
            log(f"plan: the loss divides by a sum over the batch, averaged across replicas: {', '.join(names)}")
        if not means:
            plan.selected_means = None
        elif plan.selected_means is None:
            plan.selected_means = means
            log(f"plan: a mean over rows the batch selects divides by the replicas' mean count of them: "
                f"{', '.join(means)}")
    plan.notes = notes or None


def _check_plannable(graph, analysis, options, cluster, num_replicas):
    """Rejects graphs that do not train (no variables, or no update that depends on the
    batch), a batch-less graph for several replicas, merge names that are not tensors,
    and options the cluster cannot serve."""
    if not analysis.variables:
        raise _tf2_function_graph(graph) or GraphRewriteError(
            f"{graph.source} has no variables: it looks like an inference graph, and there "
            "is nothing to train", hint="pass the training graph (with its optimizer)")
    r = num_replicas
    if r > 1 and not analysis.batch_inputs:
        raise GraphRewriteError(
            f"{graph.source} has no batch input to give {r} replicas: expected a placeholder "
            "of rank >= 1 (the batch first) or a tf.data iterator output",
            hint="feed the training data through a placeholder or an iterator, not constants")
    if r > 1 and analysis.rows_into_state:
        variable, values = analysis.rows_into_state[0]
        raise GraphRewriteError(
            f"variable '{variable}' is assigned rows of the batch ('{values}' is built from them, as a queue of "
            "keys or a cache of the last batch is) together with values that are not rows (a statistic over "
            f"them): one device's value holds every replica's rows, which neither an average of the {r} "
            "replicas' values nor gathering their rows gives here, so the rewrite would train differently "
            "from one device",
            hint="compute the update from the rows alone (docs/semantics.md, \"Rows written into a "
                 "variable\"), or train such a model on one replica")
    if not analysis.cuts:
        raise _tf2_function_graph(graph) or GraphRewriteError(
            f"{graph.source} has variables but no optimizer update that depends on the batch "
            "(no gradient found)",
            hint="export the graph after calling optimizer.minimize() or apply_gradients()")
    for name in options.merge:
        try:
            graph.tensor(name)
        except GraphRewriteError:
            raise GraphRewriteError(
                f"merge names '{name}', which is not a tensor of {graph.source}",
                hint="use the original graph's tensor names, e.g. loss:0") from None
    if options.strategy in ("ps", "hybrid") and not cluster.is_local and not cluster.ps_tasks:
        raise GraphRewriteError(
            f"strategy '{options.strategy}' needs parameter servers, but the cluster has no "
            "'ps' tasks", hint="add a \"ps\" job to the cluster spec, or use strategy allreduce")
    if options.staleness and cluster.task is None:
        raise GraphRewriteError(
            "staleness bounds how far between-graph workers run ahead of each other; with "
            "one client driving every replica (no task) no worker can run ahead",
            hint="pass task='worker:I' (--task) for each worker's graph, or drop staleness")


def _tf2_function_graph(graph):
    """The error for a TF2 tf.function's graph, or None for any other graph. Such a graph
    trains without any TF1 variable: its variables are resource placeholders captured
    from outside, or its computation is in functions it calls (StatefulPartitionedCall),
    so "no variables" or "no optimizer" would be the wrong diagnosis."""
    from graph_rewriter.saved_model import TF1_INSTEAD
    resource = 20   # DT_RESOURCE
    captured = [n.name for n in graph if n.op == "Placeholder" and n.attr["dtype"].type == resource]
    if captured:
        return GraphRewriteError(
            f"{graph.source} is a TF2 function graph (a tf.function's concrete function): its "
            f"variables are captured resources (resource placeholders such as '{captured[0]}'), "
            "not variables of the graph, so it cannot be rewritten", hint=TF1_INSTEAD)
    calls = [n.name for n in graph if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    if calls:
        return GraphRewriteError(
            f"{graph.source} has no optimizer update in the graph itself: its computation lives "
            f"in tf.functions it calls (such as '{calls[0]}'), as in a TF2 graph, where the "
            "rewrite cannot reach it", hint=TF1_INSTEAD)
    return None


def _sparse_inputs(analysis, batch_split, num_replicas):
    """The plan's sparse_inputs: [indices, values, dense_shape] per SparseTensor of the
    batch, or None, when ``num_replicas`` (this client's) take the batch. Refused: a
    SparseTensor's indices fed without the rest (its entries cannot be split by rows),
    and a tf.data SparseTensor under batch_split "per_replica" (the iterator is drawn
    once per replica, its serialized SparseTensor deserialized from the first draw)."""
    if analysis.unpaired_sparse and num_replicas > 1:
        placeholder, reader, arg = analysis.unpaired_sparse[0]
        raise GraphRewriteError(
            f"placeholder '{placeholder}' is a SparseTensor's indices ('{reader}' reads it as {arg}), but its "
            "values and dense shape were not found: split like a dense batch input, each replica would get "
            "a slice of the entries numbered by the whole batch's rows",
            hint="create it with tf.compat.v1.sparse_placeholder(..., name=\"<name>\"): the rewrite knows "
                 "its placeholders by the names <name>/indices, <name>/values and <name>/shape")
    triples = [[t.name for t in triple] for triple in analysis.sparse_inputs]
    drawn = [names for names, triple in zip(triples, analysis.sparse_inputs)
             if triple[0].node.op == "DeserializeSparse"]
    if drawn and batch_split == "per_replica" and num_replicas > 1:
        raise GraphRewriteError(
            f"batch_split='per_replica' draws the input pipeline once per replica, but the batch's "
            f"SparseTensor '{drawn[0][0].split(':')[0]}' (a tf.data SparseTensor, tf.io.VarLenFeature's) "
            "is split from one batch", hint="leave batch_split at 'split', or batch the dataset with "
                                            "drop_remainder=True (each replica then draws its own batch)")
    return triples or None


def plan_inputs(analysis, batch_split, num_replicas):
    """The InputPlans of the analysis' batch inputs, or None if every one is split: inputs
    with a static first dimension are per replica, the others as ``batch_split`` says.
    An iterator (or a queue) is drawn as a whole, so all its outputs share one mode."""
    out = []
    for t in analysis.batch_inputs:
        kind = input_kind(t.node.op)
        if t.name in analysis.static_batch:
            b = analysis.static_batch[t.name]
            out.append(InputPlan(name=t.name, kind=kind,
                                 mode="per_replica", static_batch=b,
                                 global_batch=b * num_replicas if b is not None else None))
        else:
            mode = "per_replica" if batch_split == "per_replica" else "split"
            out.append(InputPlan(name=t.name, kind=kind, mode=mode))
    if not any(i.mode == "per_replica" for i in out):
        return None
    return out


def dtype_name(enum):
    from graph_rewriter import dtypes
    return dtypes.as_dtype(enum).base_dtype.name


def make_plan(analysis, options, num_replicas, num_ps=0, topology=None, can_use_ps=True):
    """The default plan for the options' strategy over this analysis.

    allreduce: every variable mirrored. ps: every variable on the parameter servers
    (``num_ps`` tasks, or this machine's host CPU when 0), balanced by bytes, a variable
    travelling with its optimizer slots, variables above ``ps_shard_bytes`` split by rows
    across all ps tasks. hybrid: variables with sparse gradients (and their slots) on
    the parameter servers, every other variable mirrored (Parallax's split). auto: per
    gradient the synchronisation the cost model predicts cheapest on ``topology`` (the
    parameter servers only if ``can_use_ps``), ps variables split into the shard count
    it picks, and its pack size unless ``bytes_per_pack`` is given.

    TensorFlow is imported here, not at the top: a Plan, its JSON, placement and packing
    need none (tools/simulate.py plans without it).
    """
    from graph_rewriter.shape_probe import rows_per_example
    from graph_rewriter.op_builder import dtype_of
    cuts = []
    for c in analysis.cuts:
        var = analysis.variables[c.variable]
        sync = LOCAL if c.combine == "rows" else (
            "allreduce" if c.kind == "dense" or options.sparse_as_dense else "allgather")
        shape, nbytes = _state_shape(c, var) if c.role == "state" else (var.shape, var.nbytes)
        cuts.append(CutPlan(
            variable=c.variable, kind=c.kind, values=c.values.name,
            indices=c.indices.name if c.indices is not None else None,
            deduplicated=c.deduplicated, linear=c.linear, role=c.role, source=c.source,
            # (a state's update may cast its value: tf.metrics' count is a float of a Size)
            sync=sync, dtype=dtype_name(dtype_of(c.values) if c.role == "state" else var.dtype),
            shape=shape, bytes=nbytes,
            variables=list(c.variables), received=list(c.received),
            post_processing=list(c.post_processing), train_ops=c.train_ops, combine=c.combine, name=c.name,
            after=list(c.after) if c.after else None,
            rows_per_example=rows_per_example(c.indices, analysis.batch_inputs) if c.kind == "sparse" else None,
            index_dtype=dtype_name(dtype_of(c.indices)) if c.kind == "sparse" else None))
    variables = [VariablePlan(name=v.name, role=v.role, dtype=dtype_name(v.dtype), shape=v.shape,
                              bytes=v.nbytes, slot_of=v.slot_of, kind=v.kind)
                 for v in analysis.variables.values()]
    plan = Plan(
        strategy=options.strategy, num_replicas=num_replicas,
        devices_per_worker=options.devices_per_worker, device_type=options.device_type,
        variables=variables, cuts=cuts, packs=[],
        batch_inputs=[t.name for t in analysis.batch_inputs],
        broadcast_inputs=[t.name for t in analysis.broadcast_inputs],
        sparse_inputs=[[t.name for t in triple] for triple in analysis.sparse_inputs] or None,
        step_counters=list(analysis.step_counters), compression=options.compression,
        sync=options.sync, staleness=options.staleness, num_ps=max(num_ps, 1),
        accumulation_steps=options.accumulation_steps)
    pack_bytes = DEFAULT_BYTES_PER_PACK if options.bytes_per_pack is None else options.bytes_per_pack
    if options.strategy == "auto":
        return _auto_plan(plan, options, topology, can_use_ps)
    place_for_strategy(plan, options.strategy, options.ps_shard_bytes)
    assign_packs(plan, pack_bytes, alone_bytes_for(plan) if options.bytes_per_pack is None else None)
    return plan


# CPU replicas of one machine: a gradient this large is all-reduced in a pack of its own
ALONE_BYTES_CPU = 1024 * 1024


def _state_shape(cut, var):
    """(shape, bytes) a state's update value travels in: the variable's, unless the value
    is of another rank, which the update broadcasts into the variable (a moving mean
    ``v.assign(0.9 * v + 0.1 * tf.reduce_mean(x, 0))`` of a ``[C]`` mean into a ``[1, C]``
    variable): then the value's own, from shape inference. Before, the value travelled
    under the variable's shape: a parameter server's accumulator refused it ("Shape
    mismatch: expected [1,4], got [4]"), and an all-reduce pack reshaped it to a shape
    of other size. A value whose shape inference leaves unknown keeps the variable's."""
    from graph_rewriter.analysis import dtype_size, static_rank
    from graph_rewriter.op_builder import dtype_of
    rank = static_rank(cut.values)
    if rank is None or var.shape is None or rank == len(var.shape):
        return var.shape, var.nbytes
    from graph_rewriter.shape_probe import static_shapes
    shape = static_shapes([cut.values]).get(cut.values)
    if shape is None or any(d is None for d in shape):
        return var.shape, var.nbytes   # (the value's size unknown: as before)
    count = 1
    for d in shape:
        count *= d
    return list(shape), count * dtype_size(dtype_of(cut.values))


def alone_bytes_for(plan):
    """The size from which a gradient gets a pack of its own, or None (packs fill up to
    the pack size). On CPU replicas within one machine, packing a gradient costs a copy
    of it (the ConcatV2 that builds the pack, at memory bandwidth the replicas' own work
    competes for: 12.6 MB took 1.8 ms per replica on a quiet 2-core machine, 6-8 ms on a
    loaded one, docs/performance.md "Emitted step, round two") while one more in-process collective costs tens of microseconds; the
    reduced pack is split back without copies either way (SplitV shares the buffer of
    64-byte-aligned slices). Across machines each pack costs the ring's message latency
    per step, and on GPUs the copy is cheap: there packs fill up as before."""
    if plan.device_type == "CPU" and plan.num_replicas > 1 and plan.num_replicas == plan.devices_per_worker:
        return ALONE_BYTES_CPU
    return None


def place_for_strategy(plan, strategy, shard_bytes):
    """The placement of strategy ps (every variable on the parameter servers) or hybrid
    (variables with sparse gradients and their slots), balanced over the ps tasks; other
    strategies leave the plan mirrored."""
    if strategy not in ("ps", "hybrid"):
        return plan
    if strategy == "ps":
        local = {v.name for c in plan.cuts if c.sync == LOCAL for v in plan.group(c.variable)}
        chosen = [v.name for v in plan.variables if v.name not in local]   # (each replica's own rows)
    else:
        sparse = {c.variable for c in plan.cuts if c.kind == "sparse"}
        chosen = [v.name for v in plan.variables if v.name in sparse or v.slot_of in sparse]
    for name in chosen:
        plan.set_placement(name, "ps")
    balance_ps(plan, shard_bytes)
    return plan


def _auto_plan(plan, options, topology, can_use_ps):
    """Strategy auto: per gradient the cheapest synchronisation, then a check of the whole
    step. A round of messages costs its latency once per step however many gradients
    ride in it, so per-gradient choices can mix two rounds where one would do: the mixed
    plan is compared with the all-mirrored and the all-ps plan, and the cheapest predicted
    step wins (ties: mixed, then mirrored)."""
    model = options.cost_model or cost_model.CostModel()
    candidates = []
    for mode in ("mixed", "mirrored", "ps"):
        if mode == "ps" and not can_use_ps:
            continue
        p = copy.deepcopy(plan)
        pack = cost_model.choose(p, topology, model, can_use_ps, mode)
        pack_bytes = pack if options.bytes_per_pack is None else options.bytes_per_pack
        # (a variable's state cut, a trainable variable also assigned from the batch, has
        # no costs of its own: its gradient's decide)
        shards = {c.variable: c.costs["accumulate"].get("shards", 1)
                  for c in p.cuts if c.sync == "accumulate" and "accumulate" in (c.costs or {})}
        balance_ps(p, 0, shards)
        assign_packs(p, pack_bytes, alone_bytes_for(p) if options.bytes_per_pack is None else None)
        if options.allreduce_algorithm in (None, "auto"):
            cost_model.choose_algorithms(p, topology, model)
        predicted = cost_model.predict(p, topology, model)
        p.cost = {"model": model.to_dict(), "topology": dataclasses.asdict(topology),
                  "choice": mode, "predicted": predicted}
        candidates.append((predicted["seconds"], len(candidates), p))
    best = min(candidates, key=lambda c: c[:2])[2]
    best.cost["alternatives"] = {p.cost["choice"]: p.cost["predicted"]["seconds"] for _, _, p in candidates}
    return best


def balance_ps(plan, shard_bytes, shard_counts=None):
    """Spreads parameter-server variables over the ps tasks by bytes (largest groups
    first, each to the least loaded task); a group whose variable exceeds
    ``shard_bytes`` is split by rows across every task instead, and a variable with a
    count in ``shard_counts`` ({name: shards}) across that many least loaded tasks
    (resource variables of rank >= 1 only: ref variables cannot be partitioned behind
    one name)."""
    loads = [0] * plan.num_ps
    groups, seen = [], set()
    for v in plan.variables:
        if v.placement != "ps" or v.name in seen:
            continue
        group = [g for g in plan.group(v.name) if g.placement == "ps"]
        seen.update(g.name for g in group)
        groups.append(group)
    groups.sort(key=lambda g: -sum(m.bytes or 0 for m in g))
    for group in groups:
        primary = group[0]
        rows = primary.shape[0] if primary.shape else None
        count = (shard_counts or {}).get(primary.name) or (
            plan.num_ps if shard_bytes and (primary.bytes or 0) > shard_bytes else 1)
        count = min(count, plan.num_ps)
        shardable = (count > 1 and all(m.kind == "resource" and m.shape and m.shape[0] == rows for m in group)
                     and rows is not None and rows >= count)
        if shardable:
            base, extra = divmod(rows, count)
            tasks = sorted(sorted(range(plan.num_ps), key=lambda i: (loads[i], i))[:count])
            shards = [{"ps_task": t, "rows": base + (1 if k < extra else 0)} for k, t in enumerate(tasks)]
            for m in group:
                m.shards, m.ps_task = [dict(s) for s in shards], None
            for s in shards:
                loads[s["ps_task"]] += sum(m.bytes or 0 for m in group) * s["rows"] // rows
            continue
        k = min(range(plan.num_ps), key=lambda i: (loads[i], i))
        for m in group:
            m.ps_task, m.shards = k, None
        loads[k] += sum(m.bytes or 0 for m in group)


def assign_packs(plan, bytes_per_pack, alone_bytes=None):
    """Groups allreduced cuts into same-dtype packs of at most ``bytes_per_pack`` bytes
    (0: one pack per dtype), keeping the cuts' order: gradients that backprop produces
    first are issued first, so communication overlaps the rest of backprop. Gradients
    applied by different train ops (a GAN's) never share a pack. A gradient of
    at least ``alone_bytes`` bytes (None: no such size) gets a pack of its own, which
    needs no concatenation (``alone_bytes_for``). A pack made again with the same
    gradients keeps the communication and algorithm a (given) plan chose for it."""
    chosen = {tuple(p.cuts): (p.communication, p.algorithm) for p in plan.packs}
    plan.packs = []
    plan.bytes_per_pack = bytes_per_pack
    plan.alone_bytes = None   # set below if a gradient is that large (otherwise it changed nothing)
    open_pack = {}
    # Batch statistics (BatchNorm moving averages) go first, in packs of their own: with
    # TF1's control_dependencies(UPDATE_OPS) idiom the gradients wait for those updates.
    # A state computed from other states' averages goes after them, in a pack apart.
    ordered = [c for c in plan.cuts if c.role == "state" and not c.after] + [
        c for c in plan.cuts if c.role == "state" and c.after] + [c for c in plan.cuts if c.role != "state"]
    for c in ordered:
        c.pack = None
        if c.sync != "allreduce":
            continue
        size = c.bytes
        key = (c.dtype, c.role == "state", tuple(c.train_ops or ()), c.combine, tuple(c.after or ()))
        p = open_pack.get(key)
        alone = alone_bytes is not None and size is not None and size >= alone_bytes
        if p is None or size is None or alone or (bytes_per_pack and p.bytes + size > bytes_per_pack and p.cuts):
            p = PackPlan(dtype=c.dtype, cuts=[], bytes=0)
            plan.packs.append(p)
            open_pack[key] = p if size is not None and not alone else None
        if alone:
            plan.alone_bytes = alone_bytes
        p.cuts.append(c.key)
        p.bytes += size or 0
        c.pack = len(plan.packs) - 1 if p is plan.packs[-1] else plan.packs.index(p)
    for p in plan.packs:
        p.communication, p.algorithm = chosen.get(tuple(p.cuts), (None, None))


def check_plan(plan, analysis, options, num_replicas):
    """Compares a given (possibly hand-edited) plan with the graph; names what differs."""
    if plan.num_replicas != num_replicas:
        raise GraphRewriteError(
            f"the plan is for {plan.num_replicas} replicas, but the options give {num_replicas}",
            hint="make the plan again with the same cluster and devices_per_worker")
    known = {c.key: c for c in analysis.cuts}
    for c in plan.cuts:
        found = known.get(c.key)
        if found is None:
            raise GraphRewriteError(
                f"the plan names variable '{c.key}', which has no gradient in this graph",
                hint="make the plan again for this graph (graph-rewrite plan)")
        allowed = (LOCAL,) if found.combine == "rows" else DENSE_SYNCS if c.kind == "dense" else SPARSE_SYNCS
        if c.sync not in allowed:
            raise GraphRewriteError(
                f"plan: variable '{c.variable}' has sync {c.sync!r}; a {c.kind} gradient "
                f"allows {', '.join(allowed)}")
    for c in plan.cuts:
        placement = plan.variable(c.variable).placement
        if c.sync == LOCAL and placement == "ps":
            raise GraphRewriteError(
                f"plan: variable '{c.variable}' is on a ps, but it holds each replica's own rows (sync 'local')",
                hint="keep it mirrored")
        if c.sync != LOCAL and (c.sync == "accumulate") != (placement == "ps"):
            raise GraphRewriteError(
                f"plan: variable '{c.variable}' is {placement} but its gradient sync is "
                f"{c.sync!r}", hint="parameter-server variables use sync 'accumulate'; use "
                "Plan.set_placement() to move a variable and its gradient together")
    for v in plan.variables:
        if v.placement not in ("mirrored", "ps"):
            raise GraphRewriteError(
                f"plan: variable '{v.name}' has placement {v.placement!r}", hint="use mirrored or ps")
        if v.placement == "ps":
            for m in plan.group(v.name):
                if m.placement != "ps":
                    raise GraphRewriteError(
                        f"plan: variable '{v.name}' is on a parameter server but its optimizer "
                        f"slot '{m.name}' is not", hint="place a variable and its slots together")
            if v.ps_task is not None and not 0 <= v.ps_task < plan.num_ps:
                raise GraphRewriteError(
                    f"plan: variable '{v.name}' is on ps task {v.ps_task}, but there are {plan.num_ps}")
    missing = set(known) - {c.key for c in plan.cuts}
    if missing:
        raise GraphRewriteError(
            f"the plan has no entry for variable '{sorted(missing)[0]}'",
            hint="make the plan from this graph with `graph-rewrite plan`")
    if options.bytes_per_pack is not None:
        pack_bytes, alone = options.bytes_per_pack, None
    elif plan.bytes_per_pack is not None:
        pack_bytes, alone = plan.bytes_per_pack, plan.alone_bytes
    else:
        pack_bytes, alone = DEFAULT_BYTES_PER_PACK, alone_bytes_for(plan)
    if options.accumulation_steps > 1:
        plan.accumulation_steps = options.accumulation_steps
    assign_packs(plan, pack_bytes, alone)
    return plan


def _can_use_ps(cluster):
    """Strategy auto may put variables on parameter servers when the cluster has ps
    tasks, or is this machine alone (its host CPU serves)."""
    return cluster.is_local or bool(cluster.ps_tasks)


def _check_collective_dtypes(plan, num_replicas):
    """Every gradient a collective carries has a dtype its kernel accepts (the OpDef's
    allowed ``T``), or the rewrite stops here naming the variable."""
    from graph_rewriter import opdefs
    if num_replicas < 2:
        return
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


def _check_shared_step_ids(plan, cluster):
    """Between-graph workers that all-reduce across machines share step ids (TensorFlow
    numbers the steps of graphs with collectives from one sequence per cluster), so on
    a ps task one worker's finished step cleans up, and aborts, another worker's step
    with the same id. Synchronous steps end together (sync_queues orders the end);
    workers that run ahead do not, so that combination is refused, not left to abort
    at random."""
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
            hint="use staleness where every variable stays on the ps (strategy ps; a norm over "
                 "a sparse gradient's rows keeps it all-reduced, and the rewrite log with -v "
                 "says which), or synchronous training, or one in-graph client (no task)")


def _check_train_ops_between_graph(plan, cluster):
    """Between-graph workers with parameter-server variables keep in step through token
    queues (sync_queues): each group of train ops run at steps of its own (a GAN's
    d_train and g_train) has the chief release the workers after its own takes and
    updates. With staleness, a take picks its accumulator by the count of all steps
    taken, which a group's own steps do not follow, so train ops taking turns are
    refused there."""
    if cluster.task is None or not plan.sync or not plan.staleness:
        return
    on_ps = [c for c in plan.cuts if c.sync == "accumulate"]
    if not on_ps:
        return
    # (overlapping train ops run together: a warm-started variable's orphaned initializer
    # is listed beside the train op)
    keys = list(dict.fromkeys(tuple(c.train_ops) for c in plan.cuts if c.role == "gradient" and c.train_ops))
    owners = sorted(set(joined_train_ops(keys).values()), key=keys.index)
    if len(owners) < 2:
        return
    train_ops = [min(key) for key in owners]
    raise GraphRewriteError(
        f"the graph's train ops take turns ({', '.join(repr(t) for t in train_ops[:4])}), and "
        f"staleness={plan.staleness} lets workers run ahead by a count of steps that each "
        f"train op's accumulators (e.g. of '{on_ps[0].variable}') do not keep",
        hint="drop staleness (synchronous training keeps each train op's steps apart), or "
             "use strategy allreduce")


def _check_ordered_states_between_graph(plan, cluster):
    """A state update computed from another state's average (``after``: weight
    normalization's data-dependent init, the bias from the gain's averaged variance)
    needs that average on every replica. Between-graph, a parameter server's average
    exists on the chief alone, after its take: the other workers could not compute
    theirs, so such a plan is refused, naming both."""
    if cluster.task is None:
        return
    syncs = {c.key: c.sync for c in plan.cuts}
    for c in plan.cuts:
        on_ps = [k for k in c.after or () if syncs.get(k) == "accumulate"]
        if on_ps:
            raise GraphRewriteError(
                f"the update of variable '{c.variable}' ('{c.values}') is computed from the average of "
                f"the update of '{on_ps[0]}', which between-graph a parameter server gives the chief alone",
                hint=f"mirror '{on_ps[0]}' (strategy allreduce or hybrid), or rewrite in one graph")


def _keep_coupled_together(plan, analysis, log):
    """Gradients that meet in post-processing (a global norm) must be averaged alike:
    a parameter server's average exists once, on the ps, while an all-reduced one
    exists on every replica, so a norm over both could be computed in neither place
    for every replica. And a parameter server sums a sparse gradient's duplicate rows
    before averaging, so post-processing that reads the rows themselves (the norm of
    IndexedSlices counts each row) would see other rows than on one device. Such
    groups are mirrored (all-reduced and gathered), and the log says why."""
    if not any(c.sync == "accumulate" for c in plan.cuts):
        return
    read_rows = {c.variable: c for c in _rows_read_unsummed(analysis)}
    groups = [list(g) for g in analysis.coupled]
    grouped = {v for g in groups for v in g}
    groups += [[c.variable] for c in analysis.cuts if c.variable not in grouped]
    changed = False
    index = plan.cut_index()
    for group in groups:
        planned = [index.get(v) for v in group]
        on_ps = [c for c in planned if c.sync == "accumulate"]
        if not on_ps:
            continue
        rows = [v for v in group if v in read_rows]
        if rows:
            why = (f"the rows of the sparse gradient of '{rows[0]}' are post-processed "
                   f"({', '.join(read_rows[rows[0]].post_processing)}) before they are summed")
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
        log(f"plan: {len(on_ps)} variables ({names}) stay mirrored, not on a parameter "
            f"server: {why}, which a parameter server's average cannot reproduce")
    if changed:
        _repack(plan)


def _mirror_state_left_on_ps(plan, analysis, cluster, log):
    """A plan whose every gradient ended up mirrored (_keep_coupled_together under
    strategy ps) has no accumulator, so nothing makes a parameter server's writes wait
    for every replica, or the chief write alone.

    Between-graph, each worker's step would write the parameter servers' other
    variables (Adam's beta powers multiplied once per worker, the global step bumped
    once per worker), and collectives spanning the workers beside ps writes abort each
    other's steps ("Cleanup <step id>"). In one graph, a write that follows the
    gradients (an optimizer's update, the global step's bump after it) waits for them
    anyway; one that does not (NVIDIA BERT's local step counter, reset or bumped in a
    cond at the start of the step) ran once while each replica read the variable
    before or after it, so replicas took different branches of the cond it drives
    (mirroring that variable alone left the parameter servers' updates inside one
    replica's cond, which the verifier refuses). Either way the parameter servers'
    variables are mirrored, as under strategy allreduce, and the log says so."""
    from graph_rewriter.traversal import ancestors
    if any(c.sync == "accumulate" for c in plan.cuts):
        return
    on_ps = [v.name for v in plan.variables if v.placement == "ps"]
    if not on_ps:
        return
    if cluster.task is not None:
        reason = (f"no gradient is averaged on a parameter server, so its other variables ({_listed(on_ps)}) "
                  "are mirrored too: between-graph, each worker would otherwise write them at every step")
    else:
        cut_nodes = {c.values.node for c in analysis.cuts}
        unordered = [name for name in on_ps if any(not (ancestors([w]) & cut_nodes)
                                                   for w in analysis.variables[name].step_writes(analysis.saver_nodes))]
        if not unordered:
            return
        reason = (f"{_listed(unordered)} on the parameter servers would be written before the replicas' "
                  f"reads of them (no gradient is accumulated there to wait for): the parameter servers' "
                  f"variables ({_listed(on_ps)}) are mirrored instead")
    for name in on_ps:
        plan.set_placement(name, "mirrored")
    log(f"plan: {reason}")


def _mirror_forward_writes(plan, analysis, log):
    """A variable on a parameter server that the forward pass writes, the same value on
    every replica (spectral normalization's power-iteration vector,
    ``u.assign(normalize(normalize(u @ W^T) @ W))`` each step), would be written once per
    replica, each write reading what another replica's may already have written: R
    power iterations a step, in any order. Such a variable (no gradient's, no slot, no
    step counter, no batch statistic), written where the gradients depend on the write
    and read by the values they are computed from, is mirrored instead, so each replica
    writes its own copy once, as one device does; the log says so. A write in the
    optimizer's update (Adam's beta powers, Keras Nadam's momentum cache) runs once
    where the gradients are applied."""
    from graph_rewriter.traversal import ancestors
    candidates = []
    for v in plan.variables:
        var = analysis.variables.get(v.name)
        if v.placement == "ps" and var is not None and var.role == "other":
            candidates.append((v.name, var.step_writes(analysis.saver_nodes)))
    if not candidates:
        return
    # (the forward pass: what the gradients depend on, by data or control edges; the
    # variable's value must reach them by data: the CIFAR-10 tutorial's loss averages,
    # which its gradients only wait for, are written by the parameter server's one copy
    # as before)
    gradients = [c.values.node for c in analysis.cuts if c.role == "gradient"]
    forward, read = ancestors(gradients), ancestors(gradients, data_only=True)
    written = [name for name, writes in candidates
               if analysis.variables[name].node in read and any(w in forward for w in writes)]
    for name in written:
        plan.set_placement(name, "mirrored")
    if written:
        log(f"plan: the forward pass writes {_listed(written)} (the same on every replica, before the gradients): "
            "mirrored, so each replica writes its own copy once a step, not the parameter servers' R times")


def _rows_read_unsummed(analysis):
    """The sparse gradient cuts whose rows post-processing reads before their duplicates
    are summed (the norm of IndexedSlices in clip_by_global_norm counts every row)."""
    from graph_rewriter.analysis import rows_reduced
    return [c for c in analysis.cuts if c.kind == "sparse" and c.received
            and not c.deduplicated and rows_reduced(c)]


def _keep_rows_unsummed(plan, analysis, log):
    """A sparse gradient whose rows are post-processed before they are summed per id is
    all-gathered, never densified: summing a replica's duplicate rows (sparse_as_dense, or
    the dense all-reduce strategy auto may pick for a sparse gradient) changes what the
    post-processing computes (a global norm over the rows), so the clipped gradient would
    differ from one device's. All-gathered, the replicas' rows together are one device's
    rows. The log says which and why."""
    changed = []
    for c in _rows_read_unsummed(analysis):
        cut = plan.cut(c.key)
        if cut.sync == "allreduce":
            cut.sync = "allgather"
            changed.append(c)
    if not changed:
        return
    names = ", ".join(f"'{c.key}'" for c in changed[:3]) + (" ..." if len(changed) > 3 else "")
    log(f"plan: {len(changed)} sparse gradient{'s' if len(changed) > 1 else ''} ({names}) "
        f"all-gathered, not densified and all-reduced: their rows are post-processed ({', '.join(changed[0].post_processing)}) "
        f"before they are summed, which a dense all-reduce of the summed rows cannot reproduce")
    _repack(plan)


def _repack(plan):
    """The packs made again after a planning step changed some gradients' sync, with the
    plan's pack size (the default when none was chosen)."""
    assign_packs(plan, plan.bytes_per_pack if plan.bytes_per_pack is not None else DEFAULT_BYTES_PER_PACK,
                 plan.alone_bytes)


def _keep_unshardable_whole(plan, graph, log):
    """A variable is split by rows only if every op using it can be rewritten for
    parts; otherwise it stays whole on one ps task (and the log says why)."""
    for vp in plan.variables:
        if not vp.shards:
            continue
        group = plan.group(vp.name)
        blockers = [u for m in group for u, _ in graph.node(m.name).consumers(0) if not shardable_user(u)]
        if blockers:
            for m in group:
                m.ps_task, m.shards = m.shards[0]["ps_task"] if m.shards else 0, None
            log(f"plan: '{vp.name}' stays whole: '{blockers[0].name}' ({blockers[0].op}) cannot use a sharded variable")


def describe_input(ip, num_replicas):
    """One line on how a batch input (an InputPlan) reaches the replicas: its mode, static
    batch and global batch."""
    if ip.mode == "split":
        how = "drawn" if ip.kind in DRAWN else "fed"
        return (f"split, the {how} batch divided across {num_replicas} replica(s) (static batch "
                f"none, global batch as {how})")
    source = ("drawn once per replica, replica 0 first" if ip.kind in DRAWN
              else "fed as the replicas' batches concatenated in replica order")
    if ip.static_batch is None:
        return f"per_replica, {source} (static batch none, global batch {num_replicas} x the batch)"
    return (f"per_replica, {source} (static batch {ip.static_batch}, global batch "
            f"{ip.global_batch} = {num_replicas} x {ip.static_batch})")


def graph_fingerprint(graph):
    """A digest of the single-device graph: two different graphs rewritten in one process
    (or on one cluster) get different collective instance keys."""
    from graph_rewriter.graph_io import graph_def_bytes
    return hashlib.sha256(graph_def_bytes(graph)).hexdigest()[:16]
