"""merge_outputs: an output fetched by its original name gives the merged value in any
session, not replica 0's.

    loss ─> (gradients, summaries...)         replica_0/loss ─> (gradients...)   (replica 0, renamed)
    replica_1/loss ─> ...               =>    replica_1/loss ─> ...
                                              replica_0/loss, replica_1/loss ─> AddN ─> / R = "loss"

A plain tf.compat.v1.Session, a hook (LoggingTensorHook) or a MonitoredTrainingSession
fetching ``loss:0`` then reads the mean over this graph's replicas, as ``Session`` does.

Which outputs: the tensors the user names (the keys of the ``merge`` option and the
``outputs`` option), the ones the graph marks (the MetaGraphDef's ``losses`` collection)
and the values of the master's scalar summaries. Each is merged only if it depends on
the batch (``ReplicaMap.variant``) and belongs to replica 0 (a global node, a
placeholder, exists once already). How, by Session's rules: the ``merge`` option's
sum, mean or concat when it names the tensor (master: nothing to build); otherwise a
floating-point scalar is averaged and a tensor whose first dimension is the batch
(unknown, or a static per-replica batch) is concatenated along axis 0, in replica
order; anything else stays replica 0's. Shapes come from TensorFlow's shape inference
(shape_probe). Left to Session's merging in Python, because the graph cannot compute
it the same way: a non-float sum or mean (numpy widens integers, averages them as
floats), a tensor of unknown rank (Session decides at run time).

The merge node takes the original name and replica 0's op is renamed
``replica_0/<name>`` (the first free name; ``ReplicaMap.merged``). Only names move:
every reader of replica 0's value (its gradients, its own ops) keeps reading it, and
variables are never renamed (no variable depends on the batch), so checkpoints keep
their names. Only a whole op can take a name, so an op with several outputs keeps its
name and replica 0's values (an IdentityN of the merged outputs would do, but no loss or
summary value has several outputs and Session still merges such a fetch in Python).

Summaries: the master's scalar summary of a variant value reads the mean over the
replicas, so a loss summary shows the global batch's loss. When the value's op was
merged by a mean it reads that merge node (one mean per tensor); otherwise it reads a
mean of its own, unnamed (a value merged otherwise, an op with several outputs, a
non-float value as before). The master's histogram summary of a value whose first
dimension is the batch and that the forward pass computes (activations, per-example
losses) reads every replica's rows: each replica's value flattened, concatenated in
replica order, so its count, range and buckets are the global batch's (a histogram
ignores the shape). Other values stay replica 0's: one whose first dimension is not the
batch; one the backward pass computes (a replica's gradient is of its own rows' mean,
R times one device's share of it, so its rows are not one device's); one that has been
through a collective or an accumulator (an all-gathered gradient: every replica holds
the whole of it). The replicas' own summaries keep their own values.

Between-graph, a graph holds its own worker's replicas: the merge is over those (the
mean of every worker's would need a collective in the fetch). The merge runs on the
graph's global device (the host CPU), like the batch split.
"""

from graph_rewriter import dtypes
from graph_rewriter.analysis import in_gradients_scope, named_gradient_scopes
from graph_rewriter import opdefs, shape_probe
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GLOBAL, Tensor, split_tensor_name
from graph_rewriter.op_builder import const, dtype_of, make_op
from graph_rewriter.op_vocabulary import COLLECTIVES, VARIABLE_OPS
from graph_rewriter.pass_manager import Pass
from graph_rewriter.replicas import merge_over_replicas
from graph_rewriter.ps_state import TAKES
from graph_rewriter.traversal import ancestors

SCALAR_SUMMARIES = frozenset(("ScalarSummary",))
HISTOGRAM_SUMMARIES = frozenset(("HistogramSummary",))
# ops through which a replica's value takes in the other replicas' (the exchanges the
# rewrite emits, and NCCL's and the resource accumulator's a graph may hold): a value
# downstream of one is no longer the replica's own rows
_EXCHANGES = COLLECTIVES | frozenset(TAKES) | frozenset((
    "NcclAllReduce", "NcclReduce", "NcclBroadcast", "ResourceAccumulatorTakeGradient"))
LOSSES_COLLECTION = "losses"   # tf.compat.v1.GraphKeys.LOSSES


class MergeOutputsPass(Pass):
    name = "merge_outputs"
    requires = frozenset({"plan", "replicas"})
    # It renames replica 0's copy of an output, so every pass that finds replica 0's
    # nodes by their original names (through the ReplicaMap or the graph) runs first.
    after = frozenset({"replicate", "split_inputs", "loss_sums", "mirror_variables", "micro_batches", "allreduce",
                       "allgather", "communication", "accumulate", "sync_queues", "shard_variables",
                       "row_defaults"})

    def applies(self, ctx):
        return ctx.num_local_replicas > 1

    def run(self, graph, ctx):
        rm = ctx.replicas
        if rm.num_local == 1:
            return False
        variant = set(rm.variant)
        # the master's scalar summaries of a variant value, with the value's original
        # name (the merges below rename replica 0's ops)
        summaries, histograms = ([(n, n.inputs[1].name) for n in graph.nodes
                                  if n.op in ops and rm.replica_of(graph, n.name) == 0
                                  and n.inputs[1].node.name in variant]
                                 for ops in (SCALAR_SUMMARIES, HISTOGRAM_SUMMARIES))
        histograms = _rows_histograms(graph, ctx, histograms)
        wanted = _wanted(graph, ctx, variant, [value for _, value in summaries])
        hows = _decide(graph, ctx, wanted)
        merged = {}   # original tensor name -> the merge node's output
        for name, how in hows.items():
            merged[name] = merge_over_replicas(graph, rm, name, how)
            ctx.info(f"merge_outputs: {name} is the {how} over {rm.num_local} replicas; "
                     f"replica 0's value is {rm.name(0, split_tensor_name(name)[0])}:0")
        for node, value in summaries:
            if hows.get(value) == "mean":
                node.set_input(1, merged[value])
            else:
                node.set_input(1, _mean(graph, rm, value, f"{node.name}/mean_over_replicas"))
        concats = {}   # one per value, however many histograms show it
        for node, value in histograms:
            if hows.get(value) == "concat":
                concats[value] = merged[value]   # the rows in replica order already, under its name
            elif value not in concats:
                concats[value] = _flat_concat(graph, rm, value, f"{node.name}/values_over_replicas")
            node.set_input(1, concats[value])
        return bool(hows or summaries or histograms)


def _wanted(graph, ctx, variant, summaries):
    """{tensor name: the merge option's choice or None} of the outputs to merge: named by
    the user, marked by the graph, or summarised; only variant single-output ops of
    replica 0 (each rejected name logged, a name ``outputs`` gives that is no tensor of
    the graph refused)."""
    rm, opts = ctx.replicas, ctx.options
    names = {}
    for name in opts.outputs:
        _check_output_name(graph, name)
        names.setdefault(_key(name), "outputs option")
    for name in opts.merge:
        names.setdefault(_key(name), "merge option")
    mg = graph.meta_graph
    if mg is not None and LOSSES_COLLECTION in mg.collection_def:
        for name in mg.collection_def[LOSSES_COLLECTION].node_list.value:
            names.setdefault(_key(name), "losses collection")
    for name in summaries:
        names.setdefault(name, "scalar summary")
    merge = {_key(k): v for k, v in opts.merge.items()}
    wanted = {}
    for name, source in names.items():
        op, index = split_tensor_name(name)
        node = graph.get(op)
        why = None
        if node is None or index >= opdefs.num_outputs(node):
            why = "names no tensor of the graph"
        elif op not in variant:
            why = "does not depend on the batch (every replica has replica 0's value)"
        elif node.op in VARIABLE_OPS:
            why = "is a variable (variables keep their names, for checkpoints)"
        elif node.replica != 0 or not rm.is_cloned(graph, op):
            why = "exists once (it is not replicated)"
        elif opdefs.num_outputs(node) != 1:
            why = "is an output of an op with several outputs, which cannot take one merged value's name"
        elif merge.get(name) == "master":
            why = "is merged as 'master' (replica 0's value)"
        if why is None:
            wanted[name] = merge.get(name)
        else:
            ctx.info(f"merge_outputs: {name} ({source}) is left alone: it {why}")
    return wanted


def _check_output_name(graph, name):
    op, index = split_tensor_name(name)
    node = graph.get(op)
    if node is None or index >= opdefs.num_outputs(node):
        raise GraphRewriteError(
            f"outputs names '{name}', which is no tensor of the graph",
            hint="name a tensor of the original graph as 'op:index', e.g. 'loss:0'")


def _static_batches(ctx):
    """The first dimensions of static per-replica batches (a replica's batch size)."""
    return {ip.static_batch for ip in ctx.plan.inputs or []
            if ip.mode == "per_replica" and ip.static_batch is not None}


def _first_is_batch(shape, static):
    """True if a static shape's first dimension is the batch's: unknown (split), or a
    static per-replica batch size (``static``)."""
    return bool(shape) and (shape[0] is None or shape[0] in static)


def _rows_histograms(graph, ctx, histograms):
    """The (summary, value) pairs whose value is the replica's rows of a forward value:
    its first dimension is the batch (unknown, or a static per-replica batch), and
    neither the backward pass nor an exchange between the replicas is among it and its
    data ancestors; the others are logged and stay replica 0's."""
    shapes = shape_probe.static_shapes([graph.tensor(value) for _, value in histograms])
    shapes = {t.name: s for t, s in shapes.items()}
    static = _static_batches(ctx)
    scopes = named_gradient_scopes(graph.nodes) if histograms else ()
    out = []
    for node, value in histograms:
        shape, why = shapes.get(value), None
        if not _first_is_batch(shape, static):
            why = "its rank is unknown" if shape is None else "its first dimension is not the batch"
        else:
            node_of_value = graph.tensor(value).node
            upstream = ancestors([node_of_value], data_only=True) | {node_of_value}
            if any(n.op in _EXCHANGES for n in upstream):
                why = "it has been through an exchange between the replicas (each holds all of it)"
            elif any(in_gradients_scope(n.name, scopes) for n in upstream):
                why = "the backward pass computes it (a replica's gradient is of its own rows' mean)"
        if why is None:
            out.append((node, value))
        else:
            ctx.info(f"merge_outputs: the histogram {node.name} shows replica 0's {value}: {why}")
    return out


def _decide(graph, ctx, wanted):
    """{tensor name: "sum" | "mean" | "concat"} for the wanted outputs the graph merges:
    the merge option's choice, else Session's rule for the tensor's static shape."""
    shapes = shape_probe.static_shapes([graph.tensor(n) for n, how in wanted.items() if how is None])
    shapes = {t.name: s for t, s in shapes.items()}
    static = _static_batches(ctx)
    out = {}
    for name, how in sorted(wanted.items()):
        floating = dtypes.as_dtype(dtype_of(graph.tensor(name))).is_floating
        if how is None:
            shape = shapes.get(name)
            if shape == () and floating:
                how = "mean"
            elif _first_is_batch(shape, static):
                how = "concat"
            else:
                why = "its rank is unknown" if shape is None else (
                    "it is a scalar, not of a floating-point type" if shape == () else
                    "its first dimension is not the batch (replica 0's value)")
                ctx.info(f"merge_outputs: {name} is left alone: {why}")
                continue
        elif how in ("sum", "mean") and not floating:
            ctx.info(f"merge_outputs: {name} is left alone: a {how} of a non-float tensor "
                     "is merged by Session in Python")
            continue
        out[name] = how
    return out


def _mean(graph, rm, name, scope):
    """The mean of every local replica's copy of the original tensor ``name``, unnamed."""
    op, index = split_tensor_name(name)
    copies = [Tensor(rm.node(graph, i, op), index) for i in rm.built]
    device = rm.global_device
    dt = dtypes.as_dtype(dtype_of(copies[0]))
    with graph.adding_to_replica(GLOBAL):
        total = make_op(graph, "AddN", f"{scope}/sum", [copies], device=device).output(0)
        return make_op(graph, "RealDiv", scope,
                       [total, const(graph, f"{scope}/replicas", rm.num_local, dt.name, device)],
                       device=device).output(0)


def _flat_concat(graph, rm, name, scope):
    """Every local replica's copy of the original tensor ``name``, each flattened in its
    replica (their other dimensions may differ), concatenated in replica order on the
    global device, unnamed. (Each Reshape belongs to its replica, so a template replica's
    is written once per replica and the Concat's list grows with them.)"""
    op, index = split_tensor_name(name)
    parts = []
    for i in rm.built:
        copy = rm.node(graph, i, op)
        with graph.adding_to_replica(i):
            flat = f"{copy.name}/flat_{index}"
            parts.append(make_op(graph, "Reshape", flat,
                                 [Tensor(copy, index), const(graph, f"{flat}/shape", [-1], "int32", rm.devices[i])],
                                 device=rm.devices[i]).output(0))
    device = rm.global_device
    with graph.adding_to_replica(GLOBAL):
        return make_op(graph, "ConcatV2", scope, [parts, const(graph, f"{scope}/axis", 0, "int32", device)],
                       device=device).output(0)


def _key(name):
    op, index = split_tensor_name(name)
    return f"{op}:{index}"
