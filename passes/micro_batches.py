"""micro_batches: sum gradients over ``accumulation_steps`` runs, synchronise and apply once.

With accumulation_steps = k every run of the train op is one micro-batch (what Horovod
calls backward_passes_per_step and EPL num_micro_batch). Per graph, on its host:

    counter += 1 ─> apply = (counter mod k == 0)

Per replica and gradient (BatchNorm statistics and other state updates are left alone):

    dense g:          sum  + g              ─> Switch(apply) ─false─> sum := it
    sparse (v, ids):  concat(rows, ids/v)   ─> Switch(apply) ─false─> rows := them
                                                           └─true──> / k ─> readers of g
                                                                      and sum := 0 (rows := none)

so the readers that lead to the update (the allreduce or allgather or ps accumulator
later passes put there, and the optimizer's update) see the mean gradient of the k
micro-batches on every k-th run. On the other runs the Switch's true output is dead:
TensorFlow runs none of the collectives, accumulator applies, updates or step-counter
increments that depend on it (a dead input makes an op dead; for a run's target that is
no error). Sparse rows are kept as they come (concatenated, not scattered into a dense
table) and deduplicated again when the optimizer expects unique ids. The counter and
the sums are reset by the init op and by a checkpoint restore.
"""

import numpy as np

from graph_rewriter import dtypes
from graph_rewriter.analysis import variable_of, written_variables
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, dedup_rows, dtype_of, make_op, shape_attr
from graph_rewriter.op_vocabulary import PASS_THROUGH, READERS
from graph_rewriter.pass_manager import Pass
from graph_rewriter.ps_state import MICRO_BATCHES, init_ops, int_variable, shared_name
from graph_rewriter.traversal import ancestors, descendants, reaches


def _check_no_gradient_after_another(graph, rm, cuts):
    """Refuses a gradient computed after an update that reads another gradient: SAM's
    second gradient, taken at the weights its ascent along the first moved (the ascent
    reads the first gradient), or a GAN step whose generator gradient waits for the
    discriminator's update. The first gradient's mean over the k micro-batches exists
    only on the k-th run, and the later gradient of every micro-batch would need it: the
    sums would hold gradients of weights one device never had (0.56 in SAM's variables
    after four steps at k=2, on one replica). SAM's ascent is a state cut (an assign of
    the trained variables), which accumulation leaves to every run; a state of other
    variables (a moving average of the loss the gradients wait for) changes no weight."""
    first = rm.built[0]
    trained = {v for c in cuts if c.role != "state" for v in c.variables}
    trained |= {rm.prefixes[first] + v for v in trained}
    earlier = {rm.tensor(graph, first, c.values).node: c for c in cuts
               if c.role != "state" or trained & set(c.variables)}
    gradients = {rm.tensor(graph, first, c.values).node: c for c in cuts if c.role != "state"}

    def writes_after(nodes):
        # (through a write of a trained variable: tf.gradients' own grouping of an op's
        # input gradients is a control edge from one gradient to another)
        return [n for n in descendants(nodes) if any(v.name in trained for v, _ in written_variables(n, graph.library))]

    if not set(gradients) & descendants(writes_after(list(earlier))):
        return    # (one walk for the common case; the pair is looked for only when there is one)
    for node, cut in earlier.items():
        # (sorted: a set's order is the nodes' ids', and the message must not change from run to run)
        later = sorted((gradients[n] for n in descendants(writes_after([node])) if n in gradients and n is not node),
                       key=lambda c: c.values)
        if later:
            raise GraphRewriteError(
                f"accumulation_steps: the gradient '{later[0].values}' of variable '{later[0].variable}' is computed "
                f"after an update that reads the gradient '{cut.values}' of variable '{cut.variable}' (an ascent "
                "along the gradient, as SAM takes, or one optimizer's update before another's gradient): a "
                "micro-batch's later gradient would need the earlier one's mean over every micro-batch, which "
                "exists only on the last run",
                hint="rewrite without accumulation_steps (a larger global batch over more replicas instead)")


class MicroBatchesPass(Pass):
    name = "micro_batches"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        return ctx.plan.accumulation_steps > 1 and any(c.role != "state" for c in ctx.plan.cuts)

    def run(self, graph, ctx):
        plan = ctx.plan
        k = plan.accumulation_steps
        cuts = [c for c in plan.cuts if c.role != "state"]
        if k == 1 or not cuts:
            return False
        rm = ctx.replicas
        _check_no_gradient_after_another(graph, rm, plan.cuts)
        before = set(graph.names())
        inits = init_ops(graph, plan, ctx.replicas)
        counter = int_variable(graph, f"{MICRO_BATCHES}/count",
                               shared_name(plan.fingerprint, "micro_batches/count"), "", inits)
        counter.replica = GLOBAL
        graph.node(f"{MICRO_BATCHES}/count/initial_value").replica = GLOBAL
        bump = make_op(graph, "AssignAddVariableOp", f"{MICRO_BATCHES}/count/increment",
                       [counter.output(0), const(graph, f"{MICRO_BATCHES}/one", 1, "int64", replica=GLOBAL)],
                       replica=GLOBAL)
        count = make_op(graph, "ReadVariableOp", f"{MICRO_BATCHES}/count/read", [counter.output(0)],
                        attrs={"dtype": dtypes.int64}, control_inputs=[bump], replica=GLOBAL).output(0)
        phase = make_op(graph, "FloorMod", f"{MICRO_BATCHES}/phase",
                        [count, const(graph, f"{MICRO_BATCHES}/steps", k, "int64", replica=GLOBAL)],
                        replica=GLOBAL).output(0)
        apply = make_op(graph, "Equal", f"{MICRO_BATCHES}/apply",
                        [phase, const(graph, f"{MICRO_BATCHES}/zero", 0, "int64", replica=GLOBAL)],
                        replica=GLOBAL).output(0)
        branch = make_op(graph, "Switch", f"{MICRO_BATCHES}/branch", [apply, apply], replica=GLOBAL)
        fingerprint = plan.fingerprint
        outputs, dones = [], []
        for i in rm.built:
            stores, resets = [], []
            for cut in cuts:
                outputs += self._accumulate(graph, ctx, i, cut, apply, inits, stores, resets, fingerprint)
            dones.append(self._done(graph, rm, i, branch, stores, resets))
        # The train ops (the sinks after the rerouted readers) also run the stores/resets.
        after = descendants([t.node for t in outputs])
        roots = [n for n in graph if n in after and n.name in before
                 and n.is_sink]
        if not roots:
            raise GraphRewriteError(
                "accumulation_steps: no train op reads the gradients (nothing to accumulate for)")
        self._gate_updates(graph, rm, plan, roots, branch.output(1))
        for root in roots:
            for done in dones:
                root.add_control_input(done)
        ctx.info(f"micro_batches: {len(cuts)} gradient(s) summed over {k} runs on {rm.num_local} replica(s)")
        return True

    def _accumulate(self, graph, ctx, i, cut, apply, inits, stores, resets, fingerprint):
        """Puts replica i's sum of the cut's gradient between the gradient and its
        update readers; returns the new tensors the readers read."""
        rm = ctx.replicas
        k = ctx.plan.accumulation_steps
        scope = f"{rm.prefixes[i]}{MICRO_BATCHES}/{cut.key}"   # (a variable with several gradients: one sum each)
        values = rm.tensor(graph, i, cut.values)
        targets = {rm.prefixes[i] + v for v in cut.variables} | set(cut.variables)
        value_readers = [(c, p) for c, p in values.node.consumers(values.index) if leads_to_write(c, targets)]
        inverse = const(graph, f"{scope}/inverse_steps", 1.0 / k, cut.dtype, replica=i)
        if cut.kind == "dense":
            if cut.shape is None or any(d < 0 for d in cut.shape):
                raise GraphRewriteError(
                    f"variable '{cut.variable}' has no static shape, which accumulation_steps needs "
                    "for its gradient sum", hint="give the variable a fully defined shape")
            zeros = make_op(graph, "Fill", f"{scope}/zeros",
                            [const(graph, f"{scope}/shape", cut.shape, "int64", replica=i),
                             const(graph, f"{scope}/zero", 0, cut.dtype, replica=i)], replica=i).output(0)
            total = self._kept(graph, scope, "sum", values, zeros, list(cut.shape), apply, inits,
                               stores, resets, i, fingerprint, lambda old: make_op(
                                   graph, "AddV2", f"{scope}/add", [old, values], replica=i).output(0))
            mean = make_op(graph, "Mul", f"{scope}/mean", [total, inverse], replica=i).output(0)
            for c, p in value_readers:
                c.set_input(p, mean)
            rm.reroute(i, cut.values, mean)
            return [mean]
        indices = rm.tensor(graph, i, cut.indices)
        index_readers = [(c, p) for c, p in indices.node.consumers(indices.index)
                         if not reaches(c, values.node) and leads_to_write(c, targets)]
        row_shape = list(cut.shape[1:]) if cut.shape else None
        if row_shape is None or any(d < 0 for d in row_shape):
            raise GraphRewriteError(
                f"variable '{cut.variable}' has no static row shape, which accumulation_steps needs "
                "to keep its sparse gradient's rows", hint="give the variable a fully defined shape")
        index_dtype = dtypes.as_dtype(dtype_of(indices)).name
        no_ids = const(graph, f"{scope}/no_ids", np.zeros([0]), index_dtype, replica=i)
        no_rows = const(graph, f"{scope}/no_rows", np.zeros([0] + row_shape), cut.dtype, replica=i)
        axis = const(graph, f"{scope}/axis", 0, "int32", replica=i)

        def concat(new, name):
            return lambda old: make_op(graph, "ConcatV2", f"{scope}/{name}", [[old, new], axis], replica=i).output(0)

        all_ids = self._kept(graph, scope, "ids", indices, no_ids, [-1], apply, inits, stores, resets, i,
                             fingerprint, concat(indices, "append_ids"))
        all_rows = self._kept(graph, scope, "rows", values, no_rows, [-1] + row_shape, apply, inits, stores,
                              resets, i, fingerprint, concat(values, "append_rows"))
        mean = make_op(graph, "Mul", f"{scope}/mean", [all_rows, inverse], replica=i).output(0)
        ids = all_ids
        if cut.deduplicated:
            mean, ids = dedup_rows(graph, f"{scope}/dedup", mean, all_ids, "")
            for n in (mean.node, ids.node, mean.node.inputs[2].node):
                n.replica = i
        for c, p in value_readers:
            c.set_input(p, mean)
        for c, p in index_readers:
            c.set_input(p, ids)
        rm.reroute(i, cut.values, mean)
        rm.reroute(i, cut.indices, ids)
        return [mean, ids]

    @staticmethod
    def _kept(graph, scope, what, like, empty, shape, apply, inits, stores, resets, i, fingerprint, combine):
        """A variable holding what the runs since the last applying one produced:
        ``combine(its value)`` is stored on the other runs, and handed on (the variable
        set back to ``empty``) on applying runs. Returns the handed-on tensor."""
        dtype = dtypes.as_dtype(dtype_of(like))
        var = make_op(graph, "VarHandleOp", f"{scope}/{what}", [], replica=i,
                      attrs={"dtype": dtype, "shape": shape_attr(shape),
                             "shared_name": shared_name(fingerprint, f"{scope}/{what}")})
        init = make_op(graph, "AssignVariableOp", f"{scope}/{what}/initial_value", [var.output(0), empty],
                       replica=i)
        for op in inits:
            op.add_control_input(init)
        old = make_op(graph, "ReadVariableOp", f"{scope}/{what}/read", [var.output(0)],
                      attrs={"dtype": dtype}, replica=i).output(0)
        switch = make_op(graph, "Switch", f"{scope}/{what}/branch", [combine(old), apply], replica=i)
        stores.append(make_op(graph, "AssignVariableOp", f"{scope}/{what}/store",
                              [var.output(0), switch.output(0)], replica=i))
        handed = make_op(graph, "Identity", f"{scope}/{what}/total", [switch.output(1)], replica=i).output(0)
        resets.append(make_op(graph, "AssignVariableOp", f"{scope}/{what}/reset", [var.output(0), empty],
                              control_inputs=[handed.node], replica=i))
        return handed

    @staticmethod
    def _done(graph, rm, i, branch, stores, resets):
        """A tensor alive on every run once replica i's stores (other runs) or resets
        (applying runs) are done: a Merge of the two cases."""
        scope = f"{rm.prefixes[i]}{MICRO_BATCHES}"
        stored = make_op(graph, "Identity", f"{scope}/stored", [branch.output(0)], control_inputs=stores, replica=i)
        reset = make_op(graph, "Identity", f"{scope}/reset", [branch.output(1)], control_inputs=resets, replica=i)
        return make_op(graph, "Merge", f"{scope}/done", [[stored.output(0), reset.output(0)]], replica=i)

    @staticmethod
    def _gate_updates(graph, rm, plan, roots, applying):
        """Every variable write the train op makes, except to batch statistics, waits for
        the applying branch (dead on the other runs): not only the writes that read the
        gradient. Adam's sparse update decays its whole moment (m := beta1 m) and Nadam
        its momentum cache without reading the gradient; step counters are bumped after
        the updates. All of that happens once per applied step."""
        gate = make_op(graph, "Identity", f"{MICRO_BATCHES}/applying", [applying], replica=GLOBAL)
        state = {v.name for v in plan.variables if v.role == "state"}
        gated = {rm.prefixes[i] + v.name for v in plan.variables if v.name not in state
                 for i in rm.built}
        for n in ancestors(roots):
            if any(var.name in gated for var, _ in written_variables(n, graph.library)):
                n.add_control_input(gate)


def leads_to_write(node, variables, limit=256):
    """Whether ``node``'s outputs flow (through at most ``limit`` nodes) into an op that
    writes one of ``variables`` (names): the readers of a gradient on its way to the
    update, not e.g. a summary of it."""
    frontier, seen = [node], {node}
    while frontier and len(seen) <= limit:
        n = frontier.pop()
        if n.op not in READERS and n.op not in PASS_THROUGH:
            for t in n.inputs:
                v = variable_of(t)
                if v is not None and v.name in variables:
                    return True
        for d, _ in n.consumers():
            if d not in seen:
                seen.add(d)
                frontier.append(d)
    return False
