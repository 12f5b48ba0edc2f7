"""accumulate: average parameter-server gradients in accumulators on the variable's ps.

    replica i: grad_i ─> AccumulatorApplyGradient(acc, step, grad_i)   (every replica)
    ps:        AccumulatorTakeGradient(acc, num_required=R) ─> the optimizer's update
               (once; the original apply op now reads the average)

Dense gradients use a ConditionalAccumulator (reduction MEAN). Sparse gradients use a
SparseConditionalAccumulator with reduction SUM, fed rows each replica has already
deduplicated and sorted by row id; the take is divided by R. (With MEAN, TensorFlow
divides each row by the number of replicas that touched it, which is not the mean
gradient; and it merges the rows of different replicas by a sorted merge, so unsorted
ids would leave one row twice in the result.)

Accumulators drop gradients whose step tag is older than their own step, which each take
advances. Replicas tag gradients with ``graph_rewriter/sync_step``, a counter on the first
ps task that this pass increments once per step that takes the gradients: right after the
takes, and every reader of an averaged gradient (the optimizer's update) waits for it. So
the counter keeps pace with the accumulators whatever the user runs (the train op, or an
op of the update fetched by name) and whether or not the updates run (under a v1
tf.cond whose branch is not taken they are dead, and an op waiting for a dead one would
be dead too). Train ops run at steps of their own (a GAN's, the plan's train_ops) bump
it after their own takes only, so running one computes none of the other's gradients.
The init op resets it and every accumulator's step, so a second run on the same servers
starts clean. Accumulators and
the counter have shared_names derived from the graph's fingerprint, so every worker's
graph of a between-graph run uses the same ones.

With staleness s (between-graph), workers run up to s steps ahead of the applied
updates, so gradients of s + 1 different steps can be in flight. A take averages every
gradient its accumulator holds, so one accumulator would mix steps and over-count; each
gradient therefore has s + 1 accumulators, and a worker's step-t gradient goes to
accumulator t mod (s + 1) (a Switch on the step picks the apply, a Merge joins them),
tagged with the worker's own step count (``graph_rewriter/worker_step/<k>``); the chief's
take for applied step t reads accumulator t mod (s + 1). Each take then averages exactly
the R gradients of one step.

Between-graph, each replica's applies are joined in one marker node per group of train
ops (``<prefix>graph_rewriter/gradients_applied``, then ``..._1``), which the sync_queues
pass makes that group's train ops wait for. Asynchronous
training (sync=False) uses no accumulator: each replica applies its own gradient.

With template replicas (ReplicaMap.template) the pass builds the applies of replicas 0
and 1 only; every node of replica 1's apply (its constants on the ps too) belongs to
replica 1, so the export writes a copy per replica, and the take's control edge on
replica 1's apply becomes one on every replica's. The take's ``num_required`` is the
whole group's size either way.
"""

from graph_rewriter import dtypes

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.op_builder import const, dedup_rows, dtype_of, make_op, run_after, shape_attr
from graph_rewriter.pass_manager import Pass
from graph_rewriter.plan import joined_train_ops
from graph_rewriter.ps_state import (ACCUMULATORS, APPLIED, COUNTER, DRAIN, INCREMENT, WORKER_STEP,
                                     init_ops, int_variable, shared_name)
from graph_rewriter.traversal import descendants, is_back_edge, reaches


class AccumulatePass(Pass):
    name = "accumulate"
    requires = frozenset({"plan", "replicas"})
    after = frozenset({"micro_batches", "loss_sums"})   # it accumulates the micro-batch mean, a scaled loss sum

    def applies(self, ctx):
        return ctx.plan.sync and any(c.sync == "accumulate" for c in ctx.plan.cuts)

    def run(self, graph, ctx):
        plan = ctx.plan
        # Between-graph, a worker's step waits for every apply of its replicas and the
        # chief's for every take: an update nothing runs (CutPlan.run_by_nothing) would
        # make each step compute it (reading a placeholder nobody feeds) or wait for
        # gradients nobody sends. It keeps its original update, which nothing runs.
        between = ctx.cluster.task is not None
        cuts = [c for c in plan.cuts if c.sync == "accumulate" and not (between and c.run_by_nothing)]
        if not cuts or not plan.sync:
            return False
        rm = ctx.replicas
        before = set(graph.names())
        ps0 = ctx.cluster.ps_device(0)
        inits = init_ops(graph, plan, ctx.replicas)
        counter = int_variable(graph, COUNTER, shared_name(plan.fingerprint, "sync_step"), ps0, inits)
        applied = make_op(graph, "ReadVariableOp", f"{COUNTER}/read", [counter.output(0)],
                          attrs={"dtype": dtypes.int64}, device=ps0).output(0)
        st = _Step(plan.staleness + 1)   # this run's state (the pass itself keeps nothing)
        if st.slots > 1:
            me = ctx.cluster.compute_tasks.index(ctx.cluster.task)
            wstep = int_variable(graph, WORKER_STEP, shared_name(plan.fingerprint, f"worker_step/{me}"),
                                  ps0, inits)
            st.tag = make_op(graph, "ReadVariableOp", f"{WORKER_STEP}/read", [wstep.output(0)],
                               attrs={"dtype": dtypes.int64}, device=ps0).output(0)
            st.apply_slot = _slot(graph, f"{WORKER_STEP}/slot", st.tag, st.slots, ps0)
            st.take_slot = _slot(graph, f"{COUNTER}/slot", applied, st.slots, ps0)
        else:
            st.tag = applied
        takes = []
        groups = {}   # the train ops of a cut (plan.cuts' train_ops) -> the takes of their cuts
        applies = []  # (a cut's key in groups, [replica i's apply of it, for i in rm.built])
        for cut in cuts:
            accs = self._accumulators(graph, ctx, st, cut, inits)
            # Train ops run at steps of their own are grouped apart (below). Staleness
            # slots pick a take's accumulator by the count of every step, so with slots
            # (between-graph only) there is one group (the planner refuses train ops
            # taking turns there).
            st.group = tuple(cut.train_ops or ()) if st.slots == 1 else ()
            mine = []
            for i in rm.built:
                # Everything the apply builds is replica i's, its constants on the ps
                # included: a template replica's copies are then written per replica.
                with graph.adding_to_replica(i):
                    mine.append(self._apply(graph, ctx, st, cut, accs, i))
            applies.append((st.group, mine))
            takes.append(self._take(graph, ctx, st, cut, accs, mine))
            groups.setdefault(st.group, []).append(takes[-1])
        # Groups whose train ops overlap run together whenever one runs (BatchNorm's
        # statistics, whose gradients wait for them, list some of the backward's ops
        # besides the train op): one group, and one bump, for them.
        joined = joined_train_ops(list(groups))
        merged, merged_applies = {}, {}
        for key, group_takes in groups.items():
            merged.setdefault(joined[key], []).extend(group_takes)
        for key, mine in applies:
            into = merged_applies.setdefault(joined[key], [[] for _ in rm.built])
            for i, done in enumerate(mine):
                into[i].append(done)
        # Between-graph, a replica's applies of a group are joined in one marker per
        # group, which sync_queues makes that group's train ops wait for. (Between-graph
        # only: in-graph nothing waits for a marker, and a sink nobody runs that runs one
        # replica's copy of a collective, a BatchNorm statistic's all-reduce its
        # gradients wait for, would fail check_collectives_run.)
        markers = {}
        if ctx.cluster.task is not None:
            for group, per_replica in merged_applies.items():
                markers[group] = [graph.add_node(graph.unique_name(rm.prefixes[i] + APPLIED), "NoOp",
                                                 control_inputs=done) for i, done in enumerate(per_replica)]
                for i, m in enumerate(markers[group]):
                    m.replica = i
        own_steps = {m for group in markers.values() for m in group}
        if st.slots > 1:
            own_steps.add(make_op(graph, "AssignAddVariableOp", f"{WORKER_STEP}/increment",
                                  [wstep.output(0), const(graph, f"{WORKER_STEP}/one", 1, "int64", ps0)],
                                  control_inputs=markers[()], device=ps0))
        # The counter counts the takes, because each take advances its accumulator's own
        # step: it bumps after the takes, and every reader of an averaged gradient waits
        # for the bump. So whatever the user runs that reads an averaged gradient (the
        # train op, an update op fetched by name, an assign_add of global_step under
        # control dependencies of the updates) bumps it exactly once, and it bumps even
        # when the updates do not run (a v1 tf.cond whose branch holding them is not
        # taken: its ops are dead, and an op waiting for a dead one would be dead too).
        # Between-graph, sync_queues orders the chief's tokens after the updates.
        # Train ops run at steps of their own (a GAN's d_train and g_train: the plan's
        # train_ops) bump it after their own takes only, so running one takes (and
        # computes) none of the other's gradients; an accumulator takes any gradient
        # tagged with a step at least its own, so one counter serves both. Between-graph,
        # each group has its own markers, and sync_queues its own tokens.
        graph.mark_new_global(before)
        # (Not a reader the takes themselves wait for: a BatchNorm moving average's update
        # that the backward pass runs after. With slots a take waits for the applies only
        # through its accumulator, not by an edge: such a reader reaches the markers.)
        feeding = _reaching(st.readers, set(takes) | own_steps)
        for group, group_takes in merged.items():
            after = descendants(group_takes)
            # (A replica's marker and the worker's step count are no train ops: they follow
            # the takes only when the gradients wait for a statistic's update, as with
            # control_dependencies(update_ops) around minimize.)
            roots = [n for n in graph if n in after and n.is_sink and n not in own_steps]
            increment = make_op(graph, "AssignAddVariableOp", INCREMENT,
                                [counter.output(0), const(graph, f"{COUNTER}/one", 1, "int64", ps0)],
                                control_inputs=group_takes, device=ps0)
            for reader, reader_groups in st.readers.items():
                if any(joined[g] == group for g in reader_groups) and reader not in feeding:
                    reader.add_control_input(increment)
            # The train op (a root after the updates) keeps its name and now also waits for
            # the bump.
            run_after(graph, roots, [increment])
        graph.mark_new_global(before)
        return True

    def _accumulators(self, graph, ctx, st, cut, inits):
        """The cut's accumulators (one per staleness slot) on its variable's ps; the init
        op resets their steps to 0."""
        plan = ctx.plan
        var = plan.variable(cut.variable)
        task = var.ps_task if var.ps_task is not None else (var.shards[0]["ps_task"] if var.shards else 0)
        dev = ctx.cluster.ps_device(task)
        sparse = cut.kind == "sparse"
        if sparse and (cut.shape is None or any(d < 0 for d in cut.shape)):
            raise GraphRewriteError(f"variable '{cut.variable}' needs a static shape for a sparse accumulator")
        accs = []
        for j in range(st.slots):
            suffix = "" if st.slots == 1 else f"_{j}"
            acc = make_op(graph, "SparseConditionalAccumulator" if sparse else "ConditionalAccumulator",
                          f"{ACCUMULATORS}/{cut.key}{suffix}", [], device=dev,
                          attrs={"dtype": _wire_dtype(cut), "shape": shape_attr(cut.shape),
                                 "shared_name": shared_name(plan.fingerprint, f"{cut.key}/gradients{suffix}"),
                                 "reduction_type": "SUM" if sparse or cut.combine == "sum" else "MEAN"})
            # An earlier run's gradients may still be in it (a step cancelled after some
            # replicas applied theirs): setting its step to 0 would keep them, since they
            # are tagged with later steps, and the first take would average them in. So
            # the reset first takes whatever it holds, then sets the step.
            left = make_op(graph, "AccumulatorNumAccumulated", f"{acc.name}/leftover", [acc.output(0)], device=dev)
            some = make_op(graph, "Greater", f"{acc.name}/has_leftover",
                           [left.output(0), const(graph, f"{acc.name}/none", 0, "int32", dev)], device=dev)
            switch = make_op(graph, "Switch", f"{acc.name}/drain_switch", [left.output(0), some.output(0)], device=dev)
            drain = make_op(graph, "SparseAccumulatorTakeGradient" if sparse else "AccumulatorTakeGradient",
                            f"{acc.name}{DRAIN}", [acc.output(0), switch.output(1)],
                            type_attrs={"dtype": _wire_dtype(cut)}, device=dev)
            drained = make_op(graph, "Identity", f"{acc.name}/drained", [switch.output(1)], device=dev,
                              control_inputs=[drain])
            empty = make_op(graph, "Merge", f"{acc.name}/empty", [[switch.output(0), drained.output(0)]], device=dev)
            reset = make_op(graph, "AccumulatorSetGlobalStep", f"{acc.name}/reset",
                            [acc.output(0), const(graph, f"{acc.name}/zero", 0, "int64", dev)], device=dev,
                            control_inputs=[empty])
            for op in inits:
                op.add_control_input(reset)
            accs.append(acc)
        return accs

    def _apply(self, graph, ctx, st, cut, accs, i):
        """Replica i's contribution: an apply (or, with slots, the apply of the slot its
        step picks); returns a node that runs when the contribution is made."""
        rm = ctx.replicas
        dev = accs[0].device
        s = f"{rm.prefixes[i]}{ACCUMULATORS}/{cut.key}/apply"
        values = rm.tensor(graph, i, cut.values)
        if _integer(cut):
            values = make_op(graph, "Cast", f"{s}/as_float", [values], attrs={"DstT": _wire_dtype(cut)},
                             device=rm.devices[i], replica=i).output(0)
        inputs = [values]
        if cut.kind == "sparse":
            indices = rm.tensor(graph, i, cut.indices)
            if not cut.deduplicated:
                values, indices = dedup_rows(graph, f"{s}/dedup", values, indices, rm.devices[i])
            idx64 = make_op(graph, "Cast", f"{s}/indices", [indices], attrs={"DstT": dtypes.int64},
                            device=rm.devices[i]).output(0)
            idx64, values = _sorted_rows(graph, f"{s}/sorted", idx64, values, rm.devices[i])
            inputs = [idx64, values]
        shape = const(graph, f"{s}/shape", cut.shape, "int64", dev) if cut.kind == "sparse" else None

        def apply(acc, tag, args, name):
            if cut.kind == "sparse":
                return make_op(graph, "SparseAccumulatorApplyGradient", name,
                               [acc.output(0), tag, args[0], args[1], shape],
                               attrs={"has_known_shape": True}, device=dev, replica=i)
            return make_op(graph, "AccumulatorApplyGradient", name, [acc.output(0), tag, args[0]],
                           device=dev, replica=i)

        if st.slots == 1:
            return apply(accs[0], st.tag, inputs, s)
        alive = []
        for j, acc in enumerate(accs):
            pred = st.apply_slot[j]
            tag = _taken_if(graph, f"{s}_{j}/step", st.tag, pred, dev)
            args = [_taken_if(graph, f"{s}_{j}/arg{k}", t, pred, dev) for k, t in enumerate(inputs)]
            op = apply(acc, tag, args, f"{s}_{j}")
            alive.append(make_op(graph, "Identity", f"{s}_{j}/done", [tag], control_inputs=[op], device=dev).output(0))
        return make_op(graph, "Merge", f"{s}/done", [alive], device=dev, replica=i)

    def _take(self, graph, ctx, st, cut, accs, local_applies):
        """The averaged gradient (from the slot of the applied step, with slots), wired
        into the optimizer's update in place of replica 0's own gradient."""
        rm = ctx.replicas
        dev = accs[0].device
        scope = f"{ACCUMULATORS}/{cut.key}"
        dtype = _wire_dtype(cut)
        sparse = cut.kind == "sparse"
        op = "SparseAccumulatorTakeGradient" if sparse else "AccumulatorTakeGradient"
        r = const(graph, f"{scope}/num_required", rm.group_size, "int32", dev)
        n_out = 2 if sparse else 1
        if st.slots == 1:
            # In-graph, the take follows this graph's applies; between-graph it also
            # blocks until the other workers' gradients arrive.
            take = make_op(graph, op, f"{scope}/take", [accs[0].output(0), r], type_attrs={"dtype": dtype},
                           control_inputs=local_applies, device=dev)
            outs = [take.output(k) for k in range(n_out)]
        else:
            taken = []
            for j, acc in enumerate(accs):
                needed = _taken_if(graph, f"{scope}/take_{j}/num_required", r, st.take_slot[j], dev)
                taken.append(make_op(graph, op, f"{scope}/take_{j}", [acc.output(0), needed],
                                     type_attrs={"dtype": dtype}, device=dev))
            outs = [make_op(graph, "Merge", f"{scope}/take_{k}", [[t.output(k) for t in taken]],
                            device=dev).output(0) for k in range(n_out)]
            take = outs[0].node
        master_values = rm.tensor(graph, 0, cut.values)
        if not sparse:
            taken = outs[0]
            if _integer(cut):
                taken = make_op(graph, "Cast", f"{scope}/as_integer", [taken],
                                attrs={"DstT": dtypes.as_dtype(cut.dtype)}, device=dev).output(0)
            st.add_readers(_rewire(graph, ctx.replicas, master_values, taken))
            return take
        mean = make_op(graph, "RealDiv", f"{scope}/mean",
                       [outs[1], const(graph, f"{scope}/replicas", rm.group_size, dtype.name, dev)],
                       device=dev).output(0)
        master_indices = rm.tensor(graph, 0, cut.indices)
        # the deduplication's Shape(unique ids) reads the ids to compute the values: not a reader to move
        keep = {c for c, _ in master_indices.node.consumers(master_indices.index) if reaches(c, master_values.node)}
        index_dtype = dtypes.as_dtype(dtype_of(master_indices))
        indices = outs[0]
        if index_dtype != dtypes.int64:
            indices = make_op(graph, "Cast", f"{scope}/indices", [indices], attrs={"DstT": index_dtype},
                              device=dev).output(0)
        st.add_readers(_rewire(graph, ctx.replicas, master_values, mean))
        st.add_readers(_rewire(graph, ctx.replicas, master_indices, indices, keep))
        return take


def _integer(cut):
    """An integer state (a count of examples, of correct predictions): TensorFlow's
    accumulators hold floating point only, so it travels as float64 (exact below 2**53)."""
    return not dtypes.as_dtype(cut.dtype).is_floating


def _wire_dtype(cut):
    return dtypes.float64 if _integer(cut) else dtypes.as_dtype(cut.dtype)


class _Step:
    """What one run of the pass shares between its steps: the staleness slots, the step
    tag the applies carry, and the global readers of the averaged gradients, each with
    the train-op groups whose gradients it reads (``group``: the current cut's)."""

    def __init__(self, slots):
        self.slots = slots
        self.tag = None
        self.apply_slot = self.take_slot = None
        self.readers = {}   # reader -> {group}
        self.group = ()

    def add_readers(self, readers):
        for r in readers:
            self.readers.setdefault(r, set()).add(self.group)


def _reaching(nodes, targets):
    """Those of ``nodes`` that some of ``targets`` depends on (data or control edges;
    loop back-edges aside), walking forward from ``nodes``, each node visited once."""
    reach, entered = {}, set()
    for start in nodes:
        stack = [(start, False)]
        while stack:
            n, done = stack.pop()
            if n in reach:
                continue
            outs = [c for c, _ in n.consumers() if not is_back_edge(n, c)] + list(n.control_consumers)
            if done:
                reach[n] = any(reach.get(c, False) for c in outs)
            elif n in targets:
                reach[n] = True
            elif n not in entered:
                entered.add(n)
                stack.append((n, True))
                stack.extend((c, False) for c in outs if c not in reach)
    return {n for n in nodes if reach[n]}


def _slot(graph, name, step, slots, device):
    """[pred_j] for j < slots: step mod slots == j."""
    k = make_op(graph, "FloorMod", name, [step, const(graph, f"{name}/slots", slots, "int64", device)],
                device=device).output(0)
    return [make_op(graph, "Equal", f"{name}/is_{j}", [k, const(graph, f"{name}/value_{j}", j, "int64", device)],
                    device=device).output(0) for j in range(slots)]


def _taken_if(graph, name, tensor, pred, device):
    """``tensor`` where ``pred`` holds; a dead tensor (its readers do not run) elsewhere."""
    return make_op(graph, "Switch", name, [tensor, pred], device=device).output(1)


def _sorted_rows(graph, scope, indices, values, dev):
    """(indices, values) ordered by ascending row id (TopK of the negated ids)."""
    count = make_op(graph, "Size", f"{scope}/count", [indices], attrs={"out_type": dtypes.int32}, device=dev)
    negated = make_op(graph, "Neg", f"{scope}/negated", [indices], device=dev)
    order = make_op(graph, "TopKV2", f"{scope}/order", [negated.output(0), count.output(0)],
                    attrs={"sorted": True}, device=dev).output(1)
    axis = const(graph, f"{scope}/axis", 0, "int32", dev)
    return (make_op(graph, "GatherV2", f"{scope}/indices", [indices, order, axis], device=dev).output(0),
            make_op(graph, "GatherV2", f"{scope}/values", [values, order, axis], device=dev).output(0))


def _rewire(graph, rm, tensor, replacement, keep=()):
    """The global readers of a replica-0 gradient (the optimizer's update) read the
    accumulated one instead; readers inside the replicas keep their own."""
    changed = []
    for c, pos in tensor.node.consumers(tensor.index):
        if rm.replica_of(graph, c.name) is None and c is not replacement.node and c not in keep:
            c.set_input(pos, replacement)
            changed.append(c)
    return changed
