"""Collective group and instance keys, and the collective ops themselves.

Keys derive from the plan and the devices alone, so every worker of a between-graph
run computes the same keys without talking, and two different rewritten graphs on the
same servers do not reuse each other's instance keys (which TensorFlow would mistake for
one collective with mismatched shapes). Instances are numbered in one canonical order:
the dense packs, then a block per sparse gradient, then the initial-value broadcasts;
the workers' barriers and the within-worker stages of hierarchical packs count down
from the end of the rewrite's block.

No collective carries its own ``timeout_seconds``: when that timer fires, TensorFlow
aborts the server's whole collective executor, and every later collective on that server
fails until the process restarts ("Collective ops is aborted by: ..."). The step's bound
is the session's deadline instead (``operation_timeout_in_ms`` from
``RewriteResult.session_config()``, or RunOptions), which cancels the step and leaves the
server healthy (docs/reliability.md, "Poisoned servers").

TensorFlow remembers the shape an instance key first had and fails any later step whose
shape differs. Sparse rows vary from step to step, so they are padded to a power of two
and each power has its own instance key: ``SPARSE_BUCKETS`` keys for values and as many
for indices, one for the row counts, per sparse gradient. A key always sees one shape,
the key space stays bounded, and padding costs at most a factor of two.
"""

import hashlib

from graph_rewriter import dtypes, opdefs
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.op_builder import const, dtype_of, make_op

_INSTANCE_SLOTS = 1 << 13

# Between-graph: the op every worker runs to take the chief's current variables
# (mirror_variables makes it; the emitted local init op runs it)
BROADCAST_VARIABLES = "graph_rewriter/broadcast_variables"
# Between-graph: the control input of every collective that gives the job's steps a step-id
# sequence of their own (passes/step_sequence.py); its V1 collective never runs
STEP_SEQUENCE = "graph_rewriter/step_sequence"
NEVER_RUNS = "_graph_rewriter_never_runs"   # the attribute that marks that collective


def _digest(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def group_key(devices):
    """One group per ordered device set: 1 .. 2**30."""
    return _digest("group|" + "|".join(devices)) % ((1 << 30) - 1) + 1


def replica_group(cluster, device_type, devices_per_worker):
    """Every replica of a cluster in rank order: each compute task's devices in turn."""
    return [cluster.device(task, device_type, j)
            for task in cluster.compute_tasks for j in range(devices_per_worker)]


def host_group(cluster):
    """The host CPU of every compute task: the group of the workers' barriers."""
    return [cluster.device(task, "CPU", 0) for task in cluster.compute_tasks]


def instance_base(plan):
    """The first instance key of this rewrite: from the graph's fingerprint and what sets
    the collectives' shapes (packs and their algorithm, gathered gradients, replica
    count)."""
    shape = "|".join([plan.fingerprint, plan.strategy, str(plan.num_replicas), str(plan.compression)]
                     + [f"{p.dtype}:{p.bytes}:{','.join(p.cuts)}" + (f":{p.algorithm}" if p.algorithm else "")
                        for p in plan.packs]
                     + [f"{c.key}:{c.sync}" for c in plan.cuts])
    return (_digest("instances|" + shape) % (1 << 17)) * _INSTANCE_SLOTS + 1


def step_sequence_key(plan):
    """The instance key of the job's never-run V1 collective (passes/step_sequence.py),
    which names the job's step-id sequence: the same for every worker of a job, another
    for another graph or plan (a positive int32)."""
    return _digest("steps|" + str(instance_base(plan))) % ((1 << 31) - 2) + 1


def dense_instance_key(plan, pack_index):
    return instance_base(plan) + pack_index


SPARSE_BUCKETS = 40          # padded row counts 2**0 .. 2**39
_SPARSE_BLOCK = 1 + 2 * SPARSE_BUCKETS


def sparse_instance_keys(plan, cut_position):
    """(sizes key, first values key, first indices key) of the cut_position-th
    allgathered gradient; bucket b (rows padded to 2**b) adds b to the last two."""
    first = instance_base(plan) + len(plan.packs) + _SPARSE_BLOCK * cut_position
    return first, first + 1, first + 1 + SPARSE_BUCKETS


def init_instance_key(plan, pack_index):
    """Instance key of the pack_index-th broadcast of initial values (between-graph)."""
    gathered = sum(1 for c in plan.cuts if c.sync == "allgather")
    return instance_base(plan) + len(plan.packs) + _SPARSE_BLOCK * gathered + pack_index


# the plan's fields whose collectives take normalizer_instance_key's indices, in order:
# the synced batch statistics last, as they take several each (forward, backward, counts)
_COUNTED_DOWN = ("normalizers", "selected_means", "loop_bounds", "gathered_rows", "product_head", "row_moves",
                 "sync_batch_statistics")


def counted_down_start(plan, field):
    """The first index of normalizer_instance_key that the collectives of the plan's
    ``field`` take: after those of every field before it in _COUNTED_DOWN (a dict
    field, a product head or row moves, takes one per tensor it gathers)."""
    before = _COUNTED_DOWN[:_COUNTED_DOWN.index(field)]
    return sum(len(value["gathered"]) if isinstance(value, dict) else len(value)
               for value in (getattr(plan, f) or [] for f in before))


def normalizer_instance_key(plan, index):
    """Instance key of the all-reduce of the index-th loss normalizer (a sum over the
    batch a loss divides by: passes/normalizers.py), then of the selected means' counts,
    the loop bounds (passes/loop_bounds.py), the gathered rows (passes/gather_rows.py),
    the rows a product head gathers (passes/product_heads.py), the rows moved within
    the batch (passes/row_moves.py) and the synced batch statistics
    (passes/batch_statistics.py), in that order. They count down below the keys the
    hierarchical all-reduce reserves (two per pack), and must not reach the keys counting
    up from the start (packs, gathers, then two initial-value broadcasts per dtype of the
    mirrored variables)."""
    key = instance_base(plan) + _INSTANCE_SLOTS - 1 - 2 * _BARRIERS - 2 * len(plan.packs) - index
    dtypes_mirrored = len({v.dtype for v in plan.variables if v.placement == "mirrored"})
    if key <= init_instance_key(plan, 2 * dtypes_mirrored):
        raise GraphRewriteError(f"too many packs and loss normalizers ({len(plan.packs)}, {index + 1}) "
                                "for one rewrite's collective keys",
                                hint="use larger packs (bytes_per_pack)")
    return key


_BARRIERS = 32               # per kind: ops the user runs that end with a workers' barrier


def barrier_instance_key(plan, kind, index):
    """Instance key of the workers' barrier ending the index-th train op ("step") or init
    op ("init") in name order: the last slots of this rewrite's block."""
    if index >= _BARRIERS:
        raise GraphRewriteError(f"more than {_BARRIERS} {kind} ops need a barrier between workers")
    return instance_base(plan) + _INSTANCE_SLOTS - 1 - index - (_BARRIERS if kind == "init" else 0)


def worker_groups(group_devices, devices_per_worker):
    """(each worker's devices, one device per worker): the groups of a hierarchical
    all-reduce, from every replica in rank order (each worker's devices in turn)."""
    d = devices_per_worker
    return [group_devices[k:k + d] for k in range(0, len(group_devices), d)], group_devices[::d]


def hierarchical_instance_keys(plan, pack_index):
    """(within-worker reduce, within-worker broadcast) instance keys of a hierarchical
    pack; its across-worker all-reduce takes the pack's dense key in the group of one
    replica per worker. They count down below the barriers' keys, and must not reach the
    keys counting up from the start."""
    top = instance_base(plan) + _INSTANCE_SLOTS - 1 - 2 * _BARRIERS - 2 * pack_index
    if top - 1 <= init_instance_key(plan, len(plan.packs)):   # past the initial values' keys
        raise GraphRewriteError(f"too many packs ({len(plan.packs)}) for the hierarchical all-reduce's keys",
                                hint="use larger packs (bytes_per_pack) or the flat all-reduce")
    return top, top - 1


def key_of(node, arg):
    """The value of a V2 collective's key input ``arg`` ("group_size", "group_key",
    "instance_key") when it is a constant; None when computed at run time (the sparse
    buckets' instance keys)."""
    from graph_rewriter import opdefs
    producer = node.inputs[opdefs.input_arg_slices(node)[arg][0]].node
    if producer.op != "Const":
        return None
    return dtypes.int_scalar(producer.attr["value"].tensor)


def _key_inputs(graph, scope, group_size, gkey, ikey, device):
    """Group size, group key and instance key inputs; ``ikey`` may be a Tensor computed at
    run time (the sparse buckets) or an int."""
    from graph_rewriter.ir import Tensor
    key = ikey if isinstance(ikey, Tensor) else const(graph, f"{scope}/instance_key", ikey, "int32", device)
    return [const(graph, f"{scope}/group_size", group_size, "int32", device),
            const(graph, f"{scope}/group_key", gkey, "int32", device), key]


def all_reduce_mean(graph, scope, tensor, group_size, gkey, ikey, device, control_inputs=(), final_op="Div"):
    """CollectiveReduceV2 summing ``tensor`` over the group and dividing by its size
    (``final_op="Id"``: the sum, for an integer count)."""
    return all_reduce(graph, scope, tensor, group_size, gkey, ikey, device, "Add", final_op, control_inputs)


def all_reduce(graph, scope, tensor, group_size, gkey, ikey, device, merge_op, final_op="Id", control_inputs=()):
    """CollectiveReduceV2 merging ``tensor`` over the group with ``merge_op`` ("Add",
    "Max", "Min", "Mul"), then ``final_op`` ("Div": divided by the group's size)."""
    inputs = [tensor] + _key_inputs(graph, scope, group_size, gkey, ikey, device) + [[]]
    return make_op(graph, "CollectiveReduceV2", f"{scope}/all_reduce", inputs,
                   attrs={"merge_op": merge_op, "final_op": final_op, "communication_hint": "auto",
                          "timeout_seconds": 0.0},
                   device=device, control_inputs=control_inputs)


def broadcast_send(graph, scope, tensor, group_size, gkey, ikey, device, control_inputs=()):
    """CollectiveBcastSendV2: ``tensor`` to every other member of the group."""
    inputs = [tensor] + _key_inputs(graph, scope, group_size, gkey, ikey, device)
    return make_op(graph, "CollectiveBcastSendV2", f"{scope}/broadcast", inputs,
                   attrs={"communication_hint": "auto", "timeout_seconds": 0.0},
                   device=device, control_inputs=control_inputs)


def broadcast_recv(graph, scope, shape, dtype, group_size, gkey, ikey, device, control_inputs=()):
    """CollectiveBcastRecvV2: the tensor the group's sender broadcasts."""
    inputs = _key_inputs(graph, scope, group_size, gkey, ikey, device) + [
        const(graph, f"{scope}/shape", shape, "int64", device)]
    return make_op(graph, "CollectiveBcastRecvV2", f"{scope}/receive", inputs,
                   attrs={"communication_hint": "auto", "timeout_seconds": 0.0},
                   type_attrs={"T": dtype}, device=device, control_inputs=control_inputs)


def rows_scope(rm, replica, tensor_name):
    """The name scope of replica ``replica``'s gather of the original tensor
    ``tensor_name`` ("op:k"): the op's name in that replica, "_k" added for k > 0. Named
    as the replica's, not as what it reads: a batch input's part of the split is a
    global node, and a template replica's nodes are known by their prefix."""
    op, _, index = tensor_name.partition(":")
    return rm.name(replica, op) + ("" if index in ("", "0") else f"_{index}")


def gather_in_order(graph, rm, replica, plan, field, entries, keep=()):
    """Replica ``replica``'s gathers of the plan's ``field`` entries ([tensor, [[reader,
    input position]]]), one after the other so every replica issues them in one order,
    with the instance keys counted down for ``field``: each reads what the first reader
    reads (a batch input's part of the split), and every reader but those in ``keep``
    then reads every replica's rows. Returns {the replica's tensor: the gathered one}."""
    gkey = group_key(rm.group_devices)
    first_key = counted_down_start(plan, field)
    previous, out = None, {}   # the chain's last gather
    for k, (name, readers) in enumerate(entries):
        rows = rm.read_by(graph, replica, *readers[0])
        with graph.adding_to_replica(replica):
            previous = all_gather(graph, f"{rows_scope(rm, replica, name)}/every_replica", rows, rm.group_size,
                                  gkey, normalizer_instance_key(plan, first_key + k), rm.devices[replica],
                                  control_inputs=[previous] if previous is not None else [])
        out[rows] = previous.output(0)
        for reader, pos in readers:
            if reader not in keep:
                rm.node(graph, replica, reader).set_input(pos, previous.output(0))
    return out


# the type that carries each one CollectiveGatherV2 does not gather (its OpDef allows
# float, half, double, int32 and int64 alone: a head's boolean mask of the rows, uint8
# images) exactly
_CARRIERS = {"bool": dtypes.int32, "int8": dtypes.int32, "uint8": dtypes.int32, "int16": dtypes.int32,
             "uint16": dtypes.int32, "uint32": dtypes.int64, "bfloat16": dtypes.float32}


def all_gather(graph, scope, tensor, group_size, gkey, ikey, device, control_inputs=()):
    """CollectiveGatherV2: every member's ``tensor`` (same shape) stacked along axis 0;
    a type the kernel does not gather travels cast to a wider one and is cast back (the
    returned node is then that Cast)."""
    dtype = dtypes.as_dtype(dtype_of(tensor))
    gathered = dtype.name in opdefs.allowed_types("CollectiveGatherV2", "T")
    carrier = None if gathered else _CARRIERS.get(dtype.name)
    if not gathered and carrier is None:
        raise GraphRewriteError(
            f"the rows of '{tensor.name}' ({dtype.name}) would be gathered across the replicas, and "
            "CollectiveGatherV2 gathers numbers and booleans only",
            hint='cast it to a number in the model, or leave those rows to each replica with the plan\'s '
                 '"product_head": {} or "row_moves": {} (the note then says what differs from one device)')
    if carrier is not None:
        tensor = make_op(graph, "Cast", f"{scope}/as_{carrier.name}", [tensor], attrs={"DstT": carrier},
                         device=device).output(0)
    inputs = [tensor] + _key_inputs(graph, scope, group_size, gkey, ikey, device) + [[]]
    gathered = make_op(graph, "CollectiveGatherV2", f"{scope}/all_gather", inputs,
                       attrs={"communication_hint": "auto", "timeout_seconds": 0.0},
                       device=device, control_inputs=control_inputs)
    if carrier is None:
        return gathered
    return make_op(graph, "Cast", f"{scope}/as_{dtype.name}", [gathered.output(0)], attrs={"DstT": dtype},
                   device=device)
