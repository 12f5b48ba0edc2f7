"""Names of the parameter-server synchronisation state, shared by the passes that build
it and the code that reads it (between-graph workers find it by these names)."""

COUNTER = "graph_rewriter/sync_step"             # int64 variable: steps applied so far
INCREMENT = COUNTER + "/increment"                 # bumps it after a step's updates
ACCUMULATORS = "graph_rewriter/accumulators"       # scope of one accumulator per gradient
TOKENS = "graph_rewriter/tokens"                   # scope of the per-worker token queues
INIT_BARRIER = "graph_rewriter/init_done"          # queue: the chief initialized the ps
APPLIED = "graph_rewriter/gradients_applied"       # per replica: its gradients are in
WORKER_STEP = "graph_rewriter/worker_step"         # with staleness: this worker's own steps


def shared_name(fingerprint, what):
    """A shared_name every worker of a between-graph run derives alike."""
    return f"graph_rewriter/{fingerprint}/{what}"
