"""sync_queues: keep between-graph workers of a parameter-server run in step.

Each worker runs its own graph. Per worker k there is a token queue on the first ps task
(FIFOQueue, shared_name from the graph's fingerprint):

    every worker:  its replicas' accumulator applies ─> dequeue a token from queue k
                   (the train op waits for it: the next step reads the new variables)
    the chief:     take the averaged gradients ─> bump the step counter ─> apply the
                   updates ─> enqueue one token into every worker's queue

so the chief applies each step once and every worker waits for it. Train ops run at
steps of their own (a GAN's d_train and g_train: the accumulate pass's groups, one
counter bump each) have token ops of their own (``<TOKENS>/group_<j>/...``): the chief's
d_train releases the workers after the discriminator's takes, bump and updates, and a
worker's d_train applies and waits for its own gradients only. With staleness s,
each queue starts with s tokens: a worker may run up to s steps ahead of the applied
updates, never more (the accumulate pass keeps one accumulator per step in flight, so
every step still averages exactly its own gradients). The chief's init op drains what an
earlier run left in the queues. Without sync, workers apply their own gradients and
nobody waits.

Initialization: the chief's init op initializes the shared variables and then puts a
token per other worker in an init queue; another worker's init op does not initialize
shared variables (that would overwrite the chief's) but waits for its token. Running
the original init op is therefore safe, and necessary, on every worker.

When collectives also span the workers (hybrid), every train and init op ends with a
barrier: a one-number all-reduce over the workers' host CPUs after all else the op runs.
TensorFlow numbers the steps of graphs with collectives from one sequence shared by the
workers, so the chief's step and another worker's step carry the same id, and a master
that finishes its step cleans that id up on every task it used: on the ps it would
abort whatever of the other worker's step is still waiting there ("Aborted: Cleanup
<step id>"). After the barrier nobody has anything left on the ps: an op's data inputs
(a train op that is the global step's assign_add on the ps) are read through copies on
the worker's host that the barrier waits for. (A replica's copy
of the init op runs inside replica 0's, before that barrier, and has none of its own.)

With template replicas (ReplicaMap.template) the pass sees replicas 0 and 1 only: the
token wait waits for replica 1's "gradients applied" marker, which the export expands to
every replica's; the token and queue counts are the workers', not the replicas'.
"""

from graph_rewriter import dtypes
from graph_rewriter.analysis import is_pure_initial_value, written_variables
from graph_rewriter.collectives import all_reduce_mean, barrier_instance_key, group_key, host_group
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, make_op, read_or_default, shape_attr
from graph_rewriter.op_vocabulary import COLLECTIVES
from graph_rewriter.pass_manager import Pass
from graph_rewriter.protos import attr_value_pb2, tensor_shape_pb2
from graph_rewriter.ps_state import (APPLIED, COUNTER, INCREMENT, INIT_BARRIER, RESET_DONE, RUN_ID, TOKENS,
                                     WORKER_STEP, TAKES, restore_region, shared_name, step_takes)
from graph_rewriter.traversal import ancestors, descendants, is_back_edge

_SWITCHES = frozenset(("Switch", "RefSwitch"))
_MERGES = frozenset(("Merge", "RefMerge"))


def _cond_switch(node):
    """A v1 tf.cond's Switch (not a while loop's, whose predicate is a LoopCond)."""
    return node.op in _SWITCHES and node.inputs[1].node.op != "LoopCond"


def _live_after(graph, rm, nodes, takes, stop):
    """``nodes`` (ops after the takes), where one may not run when the takes do (it is in
    the branch of a v1 tf.cond not taken: dead, and so is every op that waits for it),
    replaced by the first ops after it that run whenever the takes do (the Merge that
    ends the cond); ``stop``: nodes not to look past. The conditions a node runs under
    are the (predicate, branch) pairs of the Switches it depends on; a Merge keeps those
    its inputs share (a cond's branches differ by the branch)."""
    if not any(_cond_switch(n) for n in descendants(takes)):
        return nodes
    region = descendants([n for n in graph if _cond_switch(n)])
    pending = {n: sum(1 for p in _producers(n) if p in region) for n in region}
    ready = [n for n, k in pending.items() if not k]
    conds = {}
    empty = frozenset()

    def along(t):   # the conditions of a data edge
        c = conds.get(t.node, empty)
        if _cond_switch(t.node):
            pred = t.node.inputs[1]
            c = c | {(pred.node, pred.index, t.index)}
        return c

    while ready:
        n = ready.pop()
        data = [t for t in n.inputs if not is_back_edge(t.node, n)]
        if n.op in _MERGES and data:
            c = frozenset.intersection(*[along(t) for t in data])
        else:
            c = empty.union(*[along(t) for t in data])
        conds[n] = c.union(*[conds.get(p, empty) for p in n.control_inputs])
        for m in _consumers(n):
            if m in pending:
                pending[m] -= 1
                if not pending[m]:
                    ready.append(m)
    base = empty.union(*[conds.get(t, empty) for t in takes])
    out = {}
    for n in nodes:
        if conds.get(n, empty) <= base:
            out[n] = None
            continue
        seen, todo = {n}, [n]
        while todo:
            m = todo.pop()
            for c in _consumers(m):
                if c in seen or c in stop or rm.replica_of(graph, c.name) is not None:
                    continue
                seen.add(c)
                if conds.get(c, empty) <= base:
                    out[c] = None
                else:
                    todo.append(c)
    return list(out)


def _ps_writes(graph, rm, plan):
    """The global ops that write a parameter-server variable during a step (not its
    initializer, not a restore): a counter of runs a predicate reads, bumped after a
    v1 cond. Synchronous training writes such a variable once per step, so the chief
    does it and the other workers wait for it with the update. An assign of an initial
    value that nothing runs is none: the initializer init_from_checkpoint replaced (the
    init op assigns the checkpoint's value instead); run each step, it would reset the
    variable."""
    on_ps = {v.name for v in plan.variables if v.placement == "ps"}
    initializers = {v.initializer for v in plan.variables if v.initializer}
    restores = restore_region(graph)
    out = []
    for n in graph:
        if n.name in initializers or rm.replica_of(graph, n.name) is not None or n in restores:
            continue
        if n.is_sink and n.op in ("Assign", "AssignVariableOp") and is_pure_initial_value(n.inputs[1].node):
            continue
        if any(v.name in on_ps for v, _ in written_variables(n, graph.library)):
            out.append(n)
    return out


class _Step:
    """The step of one group of train ops (the accumulate pass's groups: all of them
    unless train ops run at steps of their own): its takes, the counter's bump after
    them, each built replica's "gradients applied" marker, and the scope of its token
    ops; ``after``, ``roots`` and ``enqueues`` are filled in by the pass."""

    def __init__(self, takes, increment, markers, scope):
        self.takes, self.increment, self.markers, self.scope = takes, increment, markers, scope
        self.after, self.roots, self.enqueues = set(), [], []


def _increments(graph):
    """The counter's bumps (ps_state.INCREMENT), one per group of train ops, in the
    order the accumulate pass made them."""
    out = []
    name = INCREMENT
    while name in graph:
        out.append(graph.node(name))
        name = f"{INCREMENT}_{len(out)}"
    return out


def _steps(graph, rm):
    """One _Step per group of train ops run at steps of its own. A group's markers are
    those joining the applies its takes wait for."""
    increments = _increments(graph)
    if len(increments) < 2:
        return [_Step(step_takes(graph), i, [rm.node(graph, r, APPLIED) for r in rm.built], TOKENS)
                for i in increments]
    markers = []
    for r in rm.built:
        k = 0
        while (m := rm.node(graph, r, APPLIED if k == 0 else f"{APPLIED}_{k}")) is not None:
            markers.append(m)
            k += 1
    steps = []
    for j, increment in enumerate(increments):
        takes = [t for t in increment.control_inputs if t.op in TAKES]
        waited = {a for t in takes for a in t.control_inputs}
        mine = [m for m in markers if any(a in waited for a in m.control_inputs)]
        steps.append(_Step(takes, increment, mine, TOKENS if j == 0 else f"{TOKENS}/group_{j}"))
    return steps


def _unrun_updates(graph, rm, plan):
    """The global ops downstream of the updates no op runs (CutPlan.run_by_nothing; the
    accumulate pass leaves them as they were, reading replica 0's values): the chief's
    step must not run them."""
    sources = [rm.tensor(graph, 0, c.values).node for c in plan.cuts if c.run_by_nothing]
    if not sources:
        return set()
    return {n for n in descendants(sources) if rm.replica_of(graph, n.name) is None}


def _producers(node):
    return [t.node for t in node.inputs if not is_back_edge(t.node, node)] + list(node.control_inputs)


def _consumers(node):
    return [c for c, _ in node.consumers() if not is_back_edge(node, c)] + list(node.control_consumers)


def _scalar_queue(graph, name, fingerprint, what, device):
    shapes = attr_value_pb2.AttrValue()
    shapes.list.shape.add().CopyFrom(tensor_shape_pb2.TensorShapeProto())
    return make_op(graph, "FIFOQueueV2", name, [], device=device, attrs={
        "component_types": [dtypes.int64], "shapes": shapes,
        "shared_name": shared_name(fingerprint, what)})


class SyncQueuesPass(Pass):
    name = "sync_queues"
    requires = frozenset({"plan", "replicas"})
    # its tokens wait for the updates accumulate builds (and the counter it bumps)
    after = frozenset({"accumulate"})

    def applies(self, ctx):
        return ctx.cluster.task is not None and any(v.placement == "ps" for v in ctx.plan.variables)

    def run(self, graph, ctx):
        plan, cluster = ctx.plan, ctx.cluster
        on_ps = [v for v in plan.variables if v.placement == "ps"]
        if cluster.task is None or not on_ps:
            return False
        rm = ctx.replicas
        before = set(graph.names())
        ps0 = cluster.ps_device(0)
        fp = plan.fingerprint
        workers = cluster.compute_tasks
        me = workers.index(cluster.task)
        ps_initializers = [graph.node(v.initializer) for v in on_ps if v.initializer]
        if COUNTER in graph:
            ps_initializers.append(graph.node(f"{COUNTER}/initial_value"))
        init_ops = {c for i in ps_initializers for c in i.control_consumers if c.op == "NoOp"}
        # shared state the chief's init resets too: the accumulators' steps
        ps_initializers += [c for op in init_ops for c in op.control_inputs if c.op == "AccumulatorSetGlobalStep"]
        barrier = _scalar_queue(graph, INIT_BARRIER, fp, "init_done", ps0)
        # The train ops: what the user runs each step, i.e. the roots after the updates.
        # (Not what the token wait waits for: a replica's "gradients applied" marker and
        # the worker's step count, which follow the takes only when the gradients wait
        # for a statistic's update.)
        after_updates = descendants(step_takes(graph))
        steps = _steps(graph, rm)
        # (with staleness, the worker's own step count: one group of train ops then)
        counted = [graph.node(f"{WORKER_STEP}/increment")] if f"{WORKER_STEP}/increment" in graph else []
        applies = [m for step in steps for m in step.markers] + counted
        roots = [n for n in graph if n.is_sink
                 and n in after_updates and n not in applies]
        for step in steps:
            step.after = after_updates if len(steps) == 1 else descendants(step.takes)
            step.roots = [n for n in roots if n in step.after]
        if rm.chief:
            # (what an earlier run's init left for workers that never took it, e.g. the
            # restore of a MonitoredTrainingSession chief, whose workers run no init op)
            left = make_op(graph, "QueueSizeV2", f"{INIT_BARRIER}/left", [barrier.output(0)], device=ps0)
            drain = make_op(graph, "QueueDequeueUpToV2", f"{INIT_BARRIER}/drain", [barrier.output(0), left.output(0)],
                            attrs={"component_types": [dtypes.int64]}, device=ps0)
            ready = make_op(graph, "QueueEnqueueManyV2", f"{INIT_BARRIER}/release",
                            [barrier.output(0), [const(graph, f"{INIT_BARRIER}/tokens", [0] * (len(workers) - 1), "int64", ps0)]],
                            control_inputs=ps_initializers + [drain], device=ps0)
            for op in init_ops:
                op.add_control_input(ready)
        else:
            wait = make_op(graph, "QueueDequeueV2", f"{INIT_BARRIER}/wait", [barrier.output(0)],
                           attrs={"component_types": [dtypes.int64]}, device=ps0)
            for op in init_ops:
                for init in ps_initializers:
                    if init in op.control_inputs:
                        op.remove_control_input(init)
                op.add_control_input(wait)
        barrier = self._barrier_maker(graph, ctx)
        # The barrier ends the init ops a user runs: replica 0's (whose control edges run
        # every replica's copy in the same step, before its barrier) and the restore op.
        # A replica's copy needs none of its own, and one per copy would make the copies
        # differ by more than their replica's names (a template replica could not stand
        # for them).
        ended = sorted((op for op in init_ops if rm.replica_of(graph, op.name) in (None, 0)),
                       key=lambda n: n.name)
        if not plan.sync or INCREMENT not in graph:
            for k, op in enumerate(ended):
                barrier(op, "init", k)
            graph.mark_new_global(before)
            return True
        queues = [_scalar_queue(graph, f"{TOKENS}/worker_{k}", fp, f"tokens/{k}", ps0) for k in range(len(workers))]
        graph.mark_new_global(before)
        if rm.chief:
            # The tokens go out once the step is applied: after the counter's bump (which
            # follows the takes) and every update (global op downstream of the takes)
            # that runs: an update a v1 cond skips is waited for through the cond's Merge.
            # Train ops run at steps of their own (a GAN's) each release the tokens after
            # their own bump and updates.
            increments = {step.increment for step in steps}
            unrun = _unrun_updates(graph, ctx.replicas, plan)
            ps_writes = [n for n in _ps_writes(graph, ctx.replicas, plan) if n not in unrun]
            for step in steps:
                updates = [n for n in graph if n in step.after and n not in roots and n not in increments
                           and rm.replica_of(graph, n.name) is None]
                # (a ps write no update follows, a global step bumped beside the train op
                # by tf.group, is the step's whose train op runs it)
                mine = ps_writes if len(steps) == 1 else ancestors(step.roots)
                updates += [n for n in ps_writes if n not in updates and n in mine]
                updates = _live_after(graph, ctx.replicas, updates, step.takes, set(roots))
                token = make_op(graph, "ReadVariableOp", f"{step.scope}/step", [graph.node(COUNTER).output(0)],
                                attrs={"dtype": dtypes.int64}, control_inputs=[step.increment] + updates,
                                device=ps0).output(0)
                step.enqueues = [make_op(graph, "QueueEnqueueV2", f"{step.scope}/release_{k}",
                                         [q.output(0), [token]], device=ps0) for k, q in enumerate(queues)]
            for k, q in enumerate(queues):
                # A new run starts with exactly `staleness` tokens per worker: drain what an
                # earlier run on the same servers left, then give the head start.
                size = make_op(graph, "QueueSizeV2", f"{TOKENS}/worker_{k}/left", [q.output(0)], device=ps0)
                drain = make_op(graph, "QueueDequeueUpToV2", f"{TOKENS}/worker_{k}/drain",
                                [q.output(0), size.output(0)], attrs={"component_types": [dtypes.int64]}, device=ps0)
                ready = drain
                if plan.staleness:
                    ready = make_op(graph, "QueueEnqueueManyV2", f"{TOKENS}/head_start_{k}",
                                    [q.output(0), [const(graph, f"{TOKENS}/head_start_{k}/tokens",
                                                         [0] * plan.staleness, "int64", ps0)]],
                                    control_inputs=[drain] + ps_initializers, device=ps0)
                for op in init_ops:
                    op.add_control_input(ready)
        else:
            dropped = self._drop_chief_work(graph, ctx.replicas, _ps_writes(graph, ctx.replicas, plan),
                                            per_root=len(steps) > 1)
        waits = {}   # root -> the token waits it runs
        for step in steps:
            wait = make_op(graph, "QueueDequeueV2", f"{step.scope}/wait", [queues[me].output(0)],
                           attrs={"component_types": [dtypes.int64]},
                           control_inputs=step.markers + counted + step.enqueues,
                           device=ps0, replica=GLOBAL)
            for root in step.roots:
                waits.setdefault(root, []).append(wait)
        for root in roots:
            if root.name in graph:
                for wait in waits.get(root, []):
                    root.add_control_input(wait)
            else:  # a non-chief's train op: it now applies gradients and waits
                graph.add_node(root.name, "NoOp", control_inputs=waits.get(root, []) + [
                    c for c in dropped.get(root.name, []) if c.name in graph])
        _reset_handshake(graph, cluster, rm, ended, ps0)
        for k, op in enumerate(ended):
            barrier(op, "init", k)
        for k, root in enumerate(sorted(roots, key=lambda n: n.name)):
            barrier(graph.node(root.name), "step", k)
        graph.mark_new_global(before)
        return True

    @staticmethod
    def _barrier_maker(graph, ctx):
        """A function that makes an op end with a barrier over the workers (see the module
        docstring), or does nothing when no collective spans the workers. With every
        gradient accumulated on the ps (no all-reduce cut) an op still runs a collective
        where the plan mirrors a variable: the init op's broadcast of its initial value
        (spectral normalization's vectors, a stateful RNN's rows). That step takes its id
        from the workers' shared sequence too, so it ends with a barrier; an op that runs
        no collective keeps a step id of its own and needs none."""
        plan, cluster = ctx.plan, ctx.cluster
        workers = cluster.compute_tasks
        if len(workers) < 2:
            return lambda op, kind, index: None
        every_op = any(c.sync != "accumulate" for c in plan.cuts)
        hosts = host_group(cluster)
        me = cluster.device(cluster.task, "CPU", 0)
        gkey = group_key(hosts)

        def end_with_barrier(op, kind, index):
            if not every_op and not any(n.op in COLLECTIVES for n in ancestors([op])):
                return
            scope = graph.unique_name(f"graph_rewriter/end_of_{kind}")
            zero = const(graph, f"{scope}/zero", 0.0, "float32", me)
            # An op with data inputs (a train op that is the global step's assign_add on
            # the ps, wrapped in an Identity) reads them through copies on this worker
            # that the barrier waits for: a read from the ps after the barrier would be
            # cut off by another worker's cleanup of the same step id on the ps.
            fetched = []
            for pos, t in enumerate(op.inputs):
                copy = make_op(graph, "Identity", f"{scope}/input_{pos}", [t], device=me)
                op.set_input(pos, copy.output(0))
                fetched.append(copy)
            done = all_reduce_mean(graph, scope, zero, len(hosts), gkey, barrier_instance_key(plan, kind, index),
                                   me, control_inputs=list(op.control_inputs) + fetched)
            for c in list(op.control_inputs):
                op.remove_control_input(c)
            op.add_control_input(done)
        return end_with_barrier

    def _drop_chief_work(self, graph, rm, ps_writes=(), per_root=False):
        """A non-chief worker never takes gradients or applies updates, nor writes a
        parameter-server variable in a step (``ps_writes``): the chief does.
        Returns {removed root's name: the control inputs its replacement needs}: what the
        removed nodes ran on the replicas, those it depended on with ``per_root`` (train
        ops run at steps of their own), else all of them."""
        takes = [n for n in graph if n.op in TAKES]   # the init op's drains too
        chief_only = set(takes) | set(ps_writes) | set(_increments(graph))
        # A global op a replica needs (a gradient's constant) that only waits for a
        # chief-only update (control_dependencies(update_ops) around minimize) stays: it
        # loses the wait, as the replicas' own gradient ops do below.
        needed = ancestors([n for n in graph if rm.replica_of(graph, n.name) is not None], data_only=True)
        stack = list(chief_only)
        while stack:
            n = stack.pop()
            for c in [c for c, _ in n.consumers()] + [c for c in n.control_consumers if c not in needed]:
                if c not in chief_only and rm.replica_of(graph, c.name) is None:
                    chief_only.add(c)
                    stack.append(c)
        # (in graph order: the set's order would make the output differ from run to run)
        removable = [n for n in graph if n in chief_only and all(c in chief_only for c, _ in n.consumers())]
        # What the removed nodes also ran on this worker's replicas (e.g. the micro-batch
        # sums' stores under a train op the accumulate pass wrapped) stays with the train
        # ops, whichever removed node it hung from: by a control edge, or by a data edge
        # from a node that waits for work or writes a variable (a global step's
        # assign_add reads replica 0's copy of the optimizer's update group, its `value`,
        # which waits for a mirrored variable's update and so for that update's
        # collective). A plain value (a learning rate) is of no use there. Global work
        # (an optimizer's own updates on the ps) is the chief's.
        def runs(n):
            return list(n.control_inputs) + [t.node for t in n.inputs if t.node.control_inputs
                                             or written_variables(t.node, graph.library)]

        def own_of(nodes):
            return list(dict.fromkeys(c for n in nodes for c in runs(n)
                                      if c not in chief_only and rm.replica_of(graph, c.name) is not None))
        own = own_of(removable)
        # (the sinks the removal touches: removed ones, and kept ones losing a chief-only
        # control input; with per_root, each keeps what the removed nodes it ran ran)
        removed = set(removable)
        sinks = [n for n in graph if n.is_sink and (n in removed or n not in chief_only
                                                    and any(c in chief_only for c in n.control_inputs))]
        if per_root:
            mine = {}
            for n in sinks:
                reached = ancestors([n]) | {n}
                mine[n] = own_of(m for m in removable if m in reached)   # (in graph order)
        else:
            mine = {n: own for n in sinks}
        for n in graph:
            if n in chief_only:
                continue
            lost = [c for c in n.control_inputs if c in chief_only]
            for c in lost:
                n.remove_control_input(c)
            if lost and n.is_sink:
                for c in mine[n]:
                    if c is not n and c not in n.control_inputs:
                        n.add_control_input(c)
        dropped = {n.name: mine[n] for n in sinks if n in removed}
        graph.remove_nodes(removable)
        return dropped


def _reset_handshake(graph, cluster, rm, init_ops, ps0):
    """The ops by which another worker's client waits for the chief's reset of this run
    (ps_state.RUN_ID, RESET_DONE). The chief's init and restore ops empty the
    accumulators and reset their steps: a gradient another worker pushed before that
    (its session was ready at once, the ps variables still being initialized from an
    earlier run) is drained with the rest, and the chief's first take then waits for
    ever. So the chief's client draws a run id before it first beats
    (``<RUN_ID>/draw``), its init and restore ops end by copying it into RESET_DONE, and
    another worker's client, once it has seen the chief beat (so the run id it reads is
    this run's), waits until RESET_DONE holds it (graph_rewriter/session.py). A chief
    client whose first run resets nothing runs ``<RESET_DONE>/declare`` first."""
    chief_host = cluster.device(cluster.compute_tasks[0], "CPU", 0)
    with graph.adding_to_replica(GLOBAL):
        run_id = make_op(graph, "VarHandleOp", RUN_ID, [], device=chief_host,
                         attrs={"dtype": dtypes.int64, "shape": shape_attr([]), "shared_name": RUN_ID})
        done = make_op(graph, "VarHandleOp", RESET_DONE, [], device=ps0,
                       attrs={"dtype": dtypes.int64, "shape": shape_attr([]), "shared_name": RESET_DONE})
        current = read_or_default(graph, f"{RUN_ID}/value", run_id.output(0), "int64", 0, chief_host)
        read_or_default(graph, f"{RESET_DONE}/value", done.output(0), "int64", 0, ps0)
        if not rm.chief:
            return
        drawn = make_op(graph, "RandomUniformInt", f"{RUN_ID}/random",
                        [const(graph, f"{RUN_ID}/shape", [], "int32", chief_host),
                         const(graph, f"{RUN_ID}/low", 1, "int64", chief_host),
                         const(graph, f"{RUN_ID}/high", (1 << 62) - 1, "int64", chief_host)],
                        device=chief_host)
        make_op(graph, "AssignVariableOp", f"{RUN_ID}/draw", [run_id.output(0), drawn.output(0)], device=chief_host)
        # (a chief client whose first run is neither an init op nor a restore resets
        # nothing: it declares the run started instead, so the others need not wait)
        make_op(graph, "AssignVariableOp", f"{RESET_DONE}/declare", [done.output(0), current], device=ps0)
        # After the init or restore op's own work, but not after what waits for the other
        # workers: the broadcast of the mirrored variables' initial values (hybrid) pairs
        # with their init ops, which run only once they have seen this copy. (Nor after
        # the init queue's release, which meta_graph leaves out of the init op it names.)
        collectives = [n for n in graph if n.op in COLLECTIVES]
        waits = set(collectives) | descendants(collectives)
        release = f"{INIT_BARRIER}/release"
        for op in init_ops:
            done_set = make_op(graph, "AssignVariableOp", f"{RESET_DONE}/set", [done.output(0), current],
                               control_inputs=[c for c in op.control_inputs
                                               if c.name != release and c not in waits], device=ps0)
            op.add_control_input(done_set)
