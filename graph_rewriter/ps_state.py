"""graph_rewriter's own training state: the names of the parameter-server synchronisation
state, shared by the passes that build it and the code that reads it (between-graph
workers find it by these names), and how such state is created and reset with the run's
init and restore ops."""

from graph_rewriter import dtypes
from graph_rewriter.op_builder import const, make_op, shape_attr
from graph_rewriter.traversal import descendants

COUNTER = "graph_rewriter/sync_step"             # int64 variable: steps taken so far
INCREMENT = COUNTER + "/increment"                 # bumps it after a step's takes, before its updates
ACCUMULATORS = "graph_rewriter/accumulators"       # scope of one accumulator per gradient
TOKENS = "graph_rewriter/tokens"                   # scope of the per-worker token queues
INIT_BARRIER = "graph_rewriter/init_done"          # queue: the chief initialized the ps
APPLIED = "graph_rewriter/gradients_applied"       # per replica: its gradients are in
WORKER_STEP = "graph_rewriter/worker_step"         # with staleness: this worker's own steps
MICRO_BATCHES = "graph_rewriter/micro_batches"     # gradient sums over accumulation_steps runs
DRAIN = "/drain"     # suffix of the take by which the init op empties an accumulator
# The chief's client draws a run id when it starts (RUN_ID, on its host; before it first
# beats), and its init and restore ops copy it into RESET_DONE (on the first ps) once
# they have reset the shared state; another worker's client starts its first step only
# once RESET_DONE holds the run id it read after seeing the chief beat (sync_queues).
RUN_ID = "graph_rewriter/run_id"
RESET_DONE = "graph_rewriter/reset_done"

TAKES = ("AccumulatorTakeGradient", "SparseAccumulatorTakeGradient")


def reset_metadata(graph, chief):
    """The metadata entry a client reads for the reset handshake (RUN_ID, RESET_DONE):
    the chief's op that draws the run id, the ops that reset (the init and restore ops
    a client runs by name) and the one that declares the run started without a reset;
    or another worker's reads of the run id and of what the chief's reset last copied."""
    if not chief:
        return {"run_id": f"{RUN_ID}/value:0", "reset_done": f"{RESET_DONE}/value:0"}
    resets = sorted({c.name for n in graph if n.op == "AssignVariableOp" and n.name.startswith(f"{RESET_DONE}/set")
                     for c in _runners(n)})
    return {"draw": f"{RUN_ID}/draw", "declare": f"{RESET_DONE}/declare", "resets": resets}


def _runners(node):
    """The sink NoOps whose run runs ``node`` (through control edges and collectives)."""
    out, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        consumers = list(n.control_consumers)
        if n.op == "NoOp" and n.is_sink:
            out.append(n)
        stack.extend(consumers)
    return out


def step_takes(graph):
    """The takes of the training step's averaged gradients (not the init op's drains)."""
    return [n for n in graph if n.op in TAKES and not n.name.endswith(DRAIN)]


SHARED_PREFIX = "graph_rewriter/"


def shared_name(fingerprint, what):
    """A shared_name every worker of a between-graph run derives alike."""
    return f"{SHARED_PREFIX}{fingerprint}/{what}"


def init_ops(graph, plan, rm):
    """The NoOps that start a run's state: the graph's init ops (those running a variable
    initializer) and the Saver's restore ops. A run may begin with a restore instead of
    the init op (a checkpoint restored into fresh servers), and graph_rewriter's own
    state is not in the checkpoint: the restore resets it as the init op does."""
    out = {}
    for vp in plan.variables:
        if vp.initializer and vp.initializer in graph:
            for c in graph.node(vp.initializer).control_consumers:
                if c.op == "NoOp" and rm.replica_of(graph, c.name) in (0, None):
                    out[c] = None
    for assign in restore_region(graph):
        for c in assign.control_consumers:
            if c.op == "NoOp" and rm.replica_of(graph, c.name) is None:
                out[c] = None
    return list(out)


def restore_region(graph):
    """The Saver's restore ops and everything downstream of them (the restore assigns)."""
    from graph_rewriter.analysis import saver_restores
    return descendants(saver_restores(graph))


def int_variable(graph, name, shared, device, inits):
    """An int64 scalar resource variable set to 0 by the init ops."""
    var = make_op(graph, "VarHandleOp", name, [], device=device,
                  attrs={"dtype": dtypes.int64, "shape": shape_attr([]), "shared_name": shared})
    init = make_op(graph, "AssignVariableOp", f"{name}/initial_value",
                   [var.output(0), const(graph, f"{name}/zero", 0, "int64", device)], device=device)
    for op in inits:
        op.add_control_input(init)
    return var
