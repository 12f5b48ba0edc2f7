"""split_inputs: give each replica its slice of the global batch, or its own batch.

    x (global batch, host CPU) ─> Split(num_split=R) ─┬─:0─> replica 0's readers of x
                                                      └─:1─> replica 1's readers of x

Batch inputs are placeholders, tf.data iterator outputs and TF1 queues' DequeueMany/UpTo
outputs (the plan lists them). A SparseTensor of the batch (the plan's sparse_inputs) is
split by its rows, not its entries: a SparseSplit hands replica k the entries of its rows,
renumbered, with its own dense shape (_split_sparse). The
split runs on the host CPU where the batch arrives; a batch whose rows do not divide
evenly by R fails the step with TensorFlow's error from this Split (the Session wrapper
checks fed batches first and names the input).

Per replica (the plan's InputPlan mode "per_replica": every input with a static first
dimension, and with batch_split="per_replica" the others), each replica takes a batch
of its own:

- a placeholder is fed the R replicas' batches concatenated in replica order (a
  PlaceholderWithDefault's default, then, is every replica's: its copies concatenated,
  _default_every_replicas_rows). A static
  one [B, ...] keeps its name and takes R*B rows (its shape attribute says so); the
  same Split hands replica k rows k*B..(k+1)*B-1, whose static shape [B, ...] is what
  the constants TensorFlow folded while building the graph (tf.shape(x), the gradient
  of a mean) assume. A dynamic one is split as above: R equal batches.
- an iterator (or a queue's DequeueMany) is drawn once per replica from the one shared
  iterator (queue), in replica order
  (each draw has a control edge on the previous one, so replica k's batch is the k-th
  drawn in the step), and an IdentityN per output hands replica k draw k:

    IteratorGetNext ───────────────────────┐
      └─^─> IteratorGetNext/draw_1 ─┐      ├─> IdentityN ─┬─:0─> replica 0's readers
              └─^─> .../draw_2 ...  └──────┘               └─:1─> replica 1's readers

  (a single node whose output k replica k reads, like the Split: a template replica
  reads output 1 and the export writes output k for replica k). When the batch
  dimension is dynamic (batch_split="per_replica"), an Assert per replica checks that
  its draw has as many rows as replica 0's: a pipeline's last, smaller batch fails the
  step with a message saying so instead of weighting the replicas' rows unequally.

Between-graph, each worker's client feeds its own batches; a worker that reads its
batches from an in-graph tf.data pipeline reads its own shard of the data: a
ShardDataset(num_workers, worker index) goes in front of every batching dataset op, so
worker k batches elements k, k+W, k+2W, ... (in a one-shot iterator's dataset_factory
function too: that is where its pipeline is built). A TF1 input producer enqueues the
worker's part of its list instead (_shard_queue_producers).
"""

from graph_rewriter import opdefs
from graph_rewriter.analysis import enqueued_from, enqueues_fed_values, is_input_queue
from graph_rewriter.ir import GLOBAL
from graph_rewriter.op_builder import const, function_const, function_node, make_op
from graph_rewriter.op_vocabulary import QUEUES
from graph_rewriter.plan import DRAWN
from graph_rewriter.protos import attr_value_pb2

BATCH_DATASETS = frozenset(("BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
                            "PaddedBatchDatasetV2", "ParallelBatchDataset"))
from graph_rewriter.pass_manager import Pass


class SplitInputsPass(Pass):
    name = "split_inputs"
    requires = frozenset({"plan", "replicas"})

    def applies(self, ctx):
        # several local replicas to split a batch between, or a worker's dataset to shard
        return ctx.num_local_replicas > 1 or ctx.cluster.task is not None

    def run(self, graph, ctx):
        rm = ctx.replicas
        r = rm.num_local
        sharded = self._shard_datasets(graph, ctx) if ctx.cluster.task is not None else False
        if r == 1:
            return sharded
        modes = ctx.plan.input_plans()
        drawn = {}   # iterator nodes drawn once per replica, in plan order
        sparse = ctx.plan.sparse_inputs or []
        for names in sparse:
            _split_sparse(graph, rm, names)
        entries = {name for names in sparse for name in names}
        for name in ctx.plan.batch_inputs:
            if name in entries:
                continue
            x = graph.tensor(name)
            ip = modes[name]
            if ip.mode == "per_replica" and ip.kind in DRAWN:
                drawn.setdefault(x.node, None)
                continue
            static = ip.mode == "per_replica" and ip.static_batch is not None
            if static:
                _set_first_dimension(x.node, r * ip.static_batch)
            if x.node.op == "PlaceholderWithDefault":
                _default_every_replicas_rows(graph, rm, x.node, static)
            readers = [(c, pos) for c, pos in x.node.consumers(x.index)]
            axis = const(graph, f"{x.node.name}/split_for_replicas/axis", 0, "int32", rm.global_device)
            split = make_op(graph, "Split", f"{x.node.name}/split_for_replicas", [axis, x],
                            attrs={"num_split": r}, device=rm.global_device)
            if rm.template:
                rm.per_replica_outputs.append(split.name)   # replica k reads output k
            for c, pos in readers:
                replica = rm.replica_of(graph, c.name)
                if replica is None:
                    continue  # a global reader (e.g. a summary of the raw input) keeps the batch
                c.set_input(pos, split.output(replica))
        for node in drawn:
            self._draw_per_replica(graph, rm, node)
        return bool(ctx.plan.batch_inputs) or sharded

    @staticmethod
    def _draw_per_replica(graph, rm, node):
        """Replica k reads the k-th of R draws of ``node`` (an IteratorGetNext)."""
        draws = [node]
        for k in range(1, rm.num_local):
            draw = graph.clone_node(node, graph.unique_name(f"{node.name}/draw_{k}"))
            for t in node.inputs:
                draw.add_input(t)
            draw.add_control_input(draws[-1])
            draw.replica = GLOBAL
            draws.append(draw)
        checks = _equal_rows(graph, rm, node, draws)
        for i in range(opdefs.num_outputs(node)):
            readers = [(c, pos) for c, pos in node.consumers(i) if c not in draws]
            replicas = [(c, pos, rm.replica_of(graph, c.name)) for c, pos in readers]
            replicas = [(c, pos, k) for c, pos, k in replicas if k is not None]
            if not replicas:
                continue  # read by no replica (or only by global nodes, which keep draw 0)
            outputs = make_op(graph, "IdentityN", f"{node.name}/per_replica_{i}",
                              [[d.output(i) for d in draws]], device=rm.global_device,
                              control_inputs=checks)
            outputs.replica = GLOBAL
            if rm.template:
                rm.per_replica_outputs.append(outputs.name)   # replica k reads output k
            for c, pos, k in replicas:
                c.set_input(pos, outputs.output(k))

    def _shard_datasets(self, graph, ctx):
        workers = ctx.cluster.compute_tasks
        if len(workers) == 1:
            return False
        me = workers.index(ctx.cluster.task)
        host = ctx.replicas.global_device
        batching = [n for n in graph if n.op in BATCH_DATASETS]
        for batch in batching:
            shard = make_op(graph, "ShardDataset", f"{batch.name}/shard_for_worker",
                            [batch.inputs[0],
                             const(graph, f"{batch.name}/num_workers", len(workers), "int64", host),
                             const(graph, f"{batch.name}/worker_index", me, "int64", host)],
                            attrs=_element_attrs(batch.attr), device=host)
            batch.set_input(0, shard.output(0))
        producers = _shard_queue_producers(graph, len(workers), me, host)
        return _shard_one_shot_factories(graph, len(workers), me) or producers or bool(batching)


def _split_sparse(graph, rm, names):
    """Replica k reads the k-th of R SparseTensors a SparseSplit on the first axis makes
    of the batch's SparseTensor (``names``: its indices, values and dense shape): the
    entries of its rows, in their order, renumbered from 0, with the dense shape [rows
    / R, ...]. An IdentityN per component hands replica k output k (as the Split of a
    dense input does), after an Assert that the rows divide evenly: SparseSplit would
    give the first replicas one row more."""
    indices, values, shape = (graph.tensor(name) for name in names)
    host, r = rm.global_device, rm.num_local
    node = indices.node.name
    base = node[:-len("/indices")] if node.endswith("/indices") else node
    name = f"{base}/split_for_replicas"
    # each component's replica readers, taken before the split below reads them too
    readers = [[(n, pos, k) for n, pos in t.node.consumers(t.index)
                for k in [rm.replica_of(graph, n.name)] if k is not None]
               for t in (indices, values, shape)]
    split = make_op(graph, "SparseSplit", name,
                    [const(graph, f"{name}/split_dim", 0, "int64", host), indices, values, shape],
                    attrs={"num_split": r}, device=host, replica=GLOBAL)
    rows = make_op(graph, "GatherV2", f"{name}/rows",
                   [shape, const(graph, f"{name}/first", 0, "int32", host),
                    const(graph, f"{name}/axis", 0, "int32", host)], device=host, replica=GLOBAL)
    even = make_op(graph, "Equal", f"{name}/even",
                   [make_op(graph, "FloorMod", f"{name}/remainder",
                            [rows.output(0), const(graph, f"{name}/replicas", r, "int64", host)],
                            device=host, replica=GLOBAL).output(0),
                    const(graph, f"{name}/zero", 0, "int64", host)], device=host, replica=GLOBAL)
    check = make_op(graph, "Assert", f"{name}/check",
                    [even.output(0), [const(graph, f"{name}/message",
                                            f"graph_rewriter: SparseTensor {base} of the batch: the first "
                                            f"dimension of its dense shape (its rows) does not split evenly "
                                            f"across {r} replicas; rows:".encode(), "string", host),
                                      rows.output(0)]],
                    attrs={"summarize": 3}, device=host, replica=GLOBAL)
    for c, component in enumerate(readers):
        if not component:
            continue   # read by no replica (an embedding lookup never reads the dense shape)
        part = make_op(graph, "IdentityN", f"{name}/{('indices', 'values', 'shape')[c]}",
                       [[split.output(c * r + k) for k in range(r)]], device=host,
                       control_inputs=[check], replica=GLOBAL)
        if rm.template:
            rm.per_replica_outputs.append(part.name)   # replica k reads output k
        for n, pos, k in component:
            n.set_input(pos, part.output(k))


def _shard_queue_producers(graph, num_workers, me, host):
    """TF1's input producers (string_input_producer's file names, slice_input_producer's
    row indices, range_input_producer) enqueue a whole list, computed in the graph, on
    every worker. Each worker's producer takes its own part, elements k, k+W, k+2W, ...:
    a StridedSlice [k::W] of the list, in front of the producer's shuffle and epoch limit
    (its RandomShuffle and Identity). Enqueues of other values (another queue's
    elements, a reader's records, a feed) are left alone: they follow from the
    producers, or each worker's client feeds its own."""
    sliced = False
    for enqueue in [n for n in graph if n.op in ("QueueEnqueueManyV2", "QueueEnqueueMany")]:
        if not is_input_queue(enqueue.inputs[0].node) or enqueues_fed_values(enqueue):
            continue
        if any(n.op in QUEUES or n.op.startswith("Reader") for n in enqueued_from(enqueue)):
            continue   # another queue's elements or a reader's records: they follow from a producer
        for pos in range(1, len(enqueue.inputs)):
            holder, at = enqueue, pos
            while holder.inputs[at].node.op in ("RandomShuffle", "Identity"):
                holder, at = holder.inputs[at].node, 0
                # (a MetaGraphDef's shape hints give the whole list's length: TensorFlow
                # refuses to import a hint its own inference contradicts)
                _set_first_dimension(holder, -1)
            listed = holder.inputs[at]
            scope = f"{listed.node.name}/shard_for_worker"
            part = make_op(graph, "StridedSlice", scope,
                           [listed, const(graph, f"{scope}/begin", [me], "int32", host),
                            const(graph, f"{scope}/end", [0], "int32", host),
                            const(graph, f"{scope}/strides", [num_workers], "int32", host)],
                           attrs={"end_mask": 1}, device=host)
            holder.set_input(at, part.output(0))
            sliced = True
    return sliced


def _element_attrs(batch_attrs):
    """ShardDataset's output_types and output_shapes in front of a batching op with these
    attributes: the batched shapes without their first axis."""
    shapes = attr_value_pb2.AttrValue()
    for s in batch_attrs["output_shapes"].list.shape:
        element = shapes.list.shape.add()
        element.CopyFrom(s)
        if not s.unknown_rank and element.dim:
            del element.dim[0]
    return {"output_types": batch_attrs["output_types"], "output_shapes": shapes}


def _shard_one_shot_factories(graph, num_workers, me):
    """A one-shot iterator builds its pipeline when first drawn, by calling its
    ``dataset_factory`` function: the dataset ops TensorFlow also left in the graph are
    copies nothing reads. So the factory is copied (``<f>_shard_<me>_of_<W>``, leaving
    ``f`` to any other caller), a ShardDataset goes in front of every batching op of the
    copy's body, and the iterator calls the copy."""
    if graph.library is None:
        return False
    functions = {f.signature.name: f for f in graph.library.function}
    changed = False
    for iterator in [n for n in graph if n.op == "OneShotIterator"]:
        factory = iterator.attr["dataset_factory"]
        name = f"{factory.func.name}_shard_{me}_of_{num_workers}"
        if name not in functions:
            original = functions.get(factory.func.name)
            if original is None or not any(nd.op in BATCH_DATASETS for nd in original.node_def):
                continue   # nothing batched in it (as in a graph without batching ops): not sharded
            fn = functions[name] = graph.library.function.add()
            fn.CopyFrom(original)
            fn.signature.name = name
            _shard_function_body(fn, num_workers, me)
        calls = attr_value_pb2.AttrValue()
        calls.CopyFrom(factory)
        calls.func.name = name
        iterator.set_attr("dataset_factory", calls)
        changed = True
    if changed:
        graph.touch()
    return changed


def _shard_function_body(fn, num_workers, me):
    """A ShardDataset(num_workers, me) in front of every batching op of ``fn``'s body."""
    taken = {nd.name for nd in fn.node_def}

    def fresh(base):
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        return name

    for batch in [nd for nd in fn.node_def if nd.op in BATCH_DATASETS]:
        count = function_const(fn, fresh(f"{batch.name}/num_workers"), num_workers, "int64")
        index = function_const(fn, fresh(f"{batch.name}/worker_index"), me, "int64")
        shard = function_node(fn, "ShardDataset", fresh(f"{batch.name}/shard_for_worker"),
                              [batch.input[0], count, index], _element_attrs(batch.attr))
        batch.input[0] = f"{shard.name}:handle:0"


def _default_every_replicas_rows(graph, rm, placeholder, static):
    """A PlaceholderWithDefault batch input (an RNN's initial state over its zero state)
    exists once and is split like a fed batch, so unfed its default must hold every
    replica's rows: the replicas' copies of the default concatenated in replica order
    (a template replica's copy stands for 1..R-1: the export lists every one), or, for
    a default that exists once, R times over where the input takes R static batches.
    A default that exists once beside a split input is the whole batch's already (its
    shape comes from the unsplit input)."""
    default = placeholder.inputs[0]
    if rm.is_cloned(graph, default.node.name):
        parts = [rm.node(graph, i, default.node.name).output(default.index) for i in rm.built]
    elif static:
        parts = [default] * rm.num_local
    else:
        return
    scope = f"{placeholder.name}/default_for_replicas"
    with graph.adding_to_replica(GLOBAL):
        rows = make_op(graph, "ConcatV2", scope, [parts, const(graph, f"{scope}/axis", 0, "int32", rm.global_device)],
                       device=rm.global_device)
    placeholder.set_input(0, rows.output(0))


def _set_first_dimension(node, rows):
    """A placeholder's shape attribute (and its ``_output_shapes`` hint, if any) with
    ``rows`` (-1: unknown) as its first dimension."""
    for key in ("shape", "_output_shapes"):
        if key not in node.attr:
            continue
        value = attr_value_pb2.AttrValue()
        value.CopyFrom(node.attr[key])
        shapes = [value.shape] if key == "shape" else list(value.list.shape)
        for s in shapes:
            if not s.unknown_rank and s.dim:
                s.dim[0].size = rows
        node.set_attr(key, value)


def _equal_rows(graph, rm, node, draws):
    """Asserts (run before any replica reads a draw) that every draw has as many rows as
    the first, when the iterator's batch dimension is dynamic (a queue's DequeueUpTo:
    fewer at the end); [] when it is static."""
    if "output_shapes" in node.attr:
        shapes = node.attr["output_shapes"].list.shape
        dynamic = [i for i, s in enumerate(shapes) if not s.unknown_rank and s.dim and s.dim[0].size < 0]
    else:
        dynamic = [0] if "UpTo" in node.op else []
    if not dynamic or len(draws) < 2:
        return []
    from graph_rewriter import dtypes
    host = rm.global_device
    i, scope = dynamic[0], f"{node.name}/equal_rows"

    def rows(k, draw):
        shape = make_op(graph, "Shape", f"{scope}/shape_{k}", [draw.output(i)],
                        attrs={"out_type": dtypes.int32}, device=host)
        return make_op(graph, "Slice", f"{scope}/rows_{k}",
                       [shape.output(0), const(graph, f"{scope}/begin", [0], "int32", host),
                        const(graph, f"{scope}/size", [1], "int32", host)], device=host).output(0)

    first = rows(0, draws[0])
    message = const(graph, f"{scope}/message",
                    f"graph_rewriter: the replicas' batches drawn from '{node.name}' (batch_split "
                    "per_replica) differ in rows: replica 0's, then replica k's. The mean of replica "
                    "means would weight their rows unequally; batch the pipeline with "
                    "drop_remainder=True", "string", host)
    checks = []
    for k, draw in enumerate(draws[1:], start=1):
        mine = rows(k, draw)
        same = make_op(graph, "Equal", f"{scope}/equal_{k}", [first, mine], device=host)
        every = make_op(graph, "All", f"{scope}/all_{k}",
                        [same.output(0), const(graph, f"{scope}/axis", [0], "int32", host)], device=host)
        checks.append(make_op(graph, "Assert", f"{scope}/assert_{k}", [every.output(0), [message, first, mine]],
                              attrs={"summarize": 3}, device=host))
    for n in checks:
        n.replica = GLOBAL
    return checks
