"""The communication cost model behind ``strategy="auto"``, ``inspect`` and tools/simulate.py.

An alpha-beta model: sending a message of ``b`` bytes over a link costs ``latency +
b / bandwidth``. Two kinds of link: between the devices of one machine (PCIe/NVLink)
and between machines (the NIC). Per variable it predicts one step's communication for
each way of synchronising it and the rewrite picks the cheapest:

* allreduce (ring, what CollectiveReduceV2 runs): every replica sends and receives
  ``2 (n - 1) / n`` of the gradient's bytes over its ring link in ``2 (n - 1)`` messages;
  the messages' latency is shared by the gradients of one pack. With several machines
  the ring's slowest link, the NIC, sets the pace.
* hierarchical allreduce (a pack's choice on several workers with several devices
  each): a ring within each worker over its ``d`` devices, a ring across one replica per
  worker over the NICs, then a broadcast back within each worker. The cross-machine ring
  has ``w`` members instead of ``w d``: its ``2 (w - 1)`` messages replace the flat ring's
  ``2 (w d - 1)``, for the price of two passes over the machine's bus.
* allgather (sparse gradients, passes/allgather.py): every replica receives the other
  ``n - 1`` replicas' rows, padded to a power of two, values and ids.
* ps (parameter servers, passes/accumulate.py): every replica pushes its gradient (a
  sparse one: its rows) and pulls the variable (a sparse one: the rows of its examples)
  each step, push then pull. The ps task's link carries all ``n`` replicas' share of the
  variable it holds; a worker's NIC carries its ``devices_per_worker`` replicas'. A
  variable split in ``s`` shards spreads the ps side over ``s`` tasks at the price of
  ``s`` messages per direction.

The model reproduces the rule of thumb (dense variables allreduce; sparse variables
whose touched rows are a small fraction of the table go to the parameter servers) and
refines it with the cluster's shape: with two replicas an allgather of the rows costs
less than a ps round trip; a sparse table most of whose rows every step touches is
cheaper to allreduce densely. Pure Python on purpose: tools/simulate.py uses it for
clusters of 1 to 1024 GPUs without TensorFlow.
"""

import dataclasses
import math

from graph_rewriter.errors import GraphRewriteError

_INDEX_BYTES = {"int32": 4, "int64": 8}
_MIN_PACK, _MAX_PACK = 1 << 20, 256 << 20


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Link speeds (bytes per second, seconds) and the global batch the costs assume.

    Defaults: PCIe 3.0 x16 within a machine, 10 Gb Ethernet between machines; a global
    batch of 256 examples (only sparse gradients' costs depend on it)."""
    intra_bandwidth: float = 12e9
    inter_bandwidth: float = 1.25e9
    intra_latency: float = 10e-6
    inter_latency: float = 50e-6
    batch_size: int = 256

    @classmethod
    def from_value(cls, value):
        """A CostModel from None (the defaults), a CostModel, or a dict of its fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value.validate()
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise GraphRewriteError(
                    f"cost_model has unknown field '{sorted(unknown)[0]}'",
                    hint=f"use {', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value).validate()
        raise GraphRewriteError(f"cost_model must be a CostModel or a dict, got {type(value).__name__}",
                                hint="pass e.g. {\"inter_bandwidth\": 1.25e9}, or None for the defaults")

    def validate(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            positive = f.name != "intra_latency" and f.name != "inter_latency"
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (positive and v == 0) \
                    or (isinstance(v, float) and not math.isfinite(v)):
                raise GraphRewriteError(
                    f"cost_model.{f.name} must be a {'positive' if positive else 'non-negative'} "
                    f"number, got {v!r}",
                    hint="give bandwidths in bytes/s, latencies in seconds (0 allowed), the batch in examples")
        if not isinstance(self.batch_size, int):
            raise GraphRewriteError(f"cost_model.batch_size must be an integer, got {self.batch_size!r}",
                                    hint="give the global batch size, e.g. 256")
        return self

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The cluster's shape: machines running replicas, replicas on each, ps tasks (0 = the
    host CPU of the only machine)."""
    workers: int = 1
    devices_per_worker: int = 1
    ps_tasks: int = 0

    @property
    def replicas(self):
        return self.workers * self.devices_per_worker

    @classmethod
    def of(cls, cluster, devices_per_worker):
        return cls(workers=len(cluster.compute_tasks), devices_per_worker=devices_per_worker,
                   ps_tasks=len(cluster.ps_tasks))

    def link(self, model):
        """(bandwidth, latency) of the ring's slowest link."""
        if self.workers > 1:
            return model.inter_bandwidth, model.inter_latency
        return model.intra_bandwidth, model.intra_latency

    def ps_link(self, model):
        """(bandwidth, latency) between a replica and a parameter server: remote ps tasks
        are reached over the network, the local host CPU over the machine's bus."""
        if self.ps_tasks:
            return model.inter_bandwidth, model.inter_latency
        return model.intra_bandwidth, model.intra_latency


@dataclasses.dataclass(frozen=True)
class Cost:
    """One step's predicted communication for one variable (or a whole plan)."""
    seconds: float
    bytes_per_link: int     # the busiest link's bytes per step (one direction)
    messages: int = 0

    def to_dict(self):
        return {"seconds": self.seconds, "bytes_per_link": int(self.bytes_per_link), "messages": self.messages}


FREE = Cost(0.0, 0, 0)


def allreduce_cost(nbytes, topo, model, pack_bytes=None):
    """A ring all-reduce of ``nbytes``; its latency shared with the rest of its pack
    (``pack_bytes``: the pack's size; None = a pack of its own)."""
    n = topo.replicas
    if n < 2 or not nbytes:
        return FREE
    bw, lat = topo.link(model)
    share = 1.0 if not pack_bytes else min(1.0, nbytes / pack_bytes)
    moved = 2 * (n - 1) / n * nbytes
    return Cost(2 * (n - 1) * lat * share + moved / bw, int(moved), 2 * (n - 1))


def hierarchical_cost(nbytes, topo, model, pack_bytes=None):
    """A two-level all-reduce of ``nbytes``: ring within each worker, ring across one
    replica per worker, broadcast back within the worker (the flat ring's cost when the
    cluster has a single worker or a single device per worker)."""
    w, d = topo.workers, topo.devices_per_worker
    if w < 2 or d < 2 or not nbytes:
        return allreduce_cost(nbytes, topo, model, pack_bytes)
    share = 1.0 if not pack_bytes else min(1.0, nbytes / pack_bytes)
    within = allreduce_cost(nbytes, Topology(1, d), model, pack_bytes)
    across = allreduce_cost(nbytes, Topology(w, 1), model, pack_bytes)
    back = (d - 1) * model.intra_latency * share + nbytes / model.intra_bandwidth
    return Cost(within.seconds + across.seconds + back, across.bytes_per_link,
                within.messages + across.messages + d - 1)


def reduce_to_one_cost(nbytes, topo, model, shared_memory=False):
    """Every replica's pack summed on one device, the mean read back from it: the other
    replicas' bytes cross that device's link twice (in, then out). CPU replicas of one
    process share memory: nothing is copied, and what is left is one pass over the packs."""
    n = topo.replicas
    if n < 2 or not nbytes:
        return FREE
    bw, lat = topo.link(model)
    if shared_memory:
        return Cost(n * nbytes / bw, 0, 0)
    moved = 2 * (n - 1) * nbytes
    return Cost(2 * lat + moved / bw, int(moved), 2 * (n - 1))


def pack_cost(pack, topo, model, device_type="GPU"):
    """One pack's all-reduce, by the algorithm the plan gives it."""
    if pack.algorithm == "hierarchical":
        return hierarchical_cost(pack.bytes, topo, model)
    if pack.algorithm == "reduce_to_one":
        return reduce_to_one_cost(pack.bytes, topo, model, shared_memory=device_type == "CPU")
    return allreduce_cost(pack.bytes, topo, model)


def choose_algorithms(plan, topo, model):
    """Gives each pack the algorithm the model predicts cheapest: CPU replicas of one
    process (one worker) sum their packs on one device, which shares their memory (no
    collective, no copy); otherwise the two-level all-reduce where it beats the flat ring
    (only clusters of several workers with several devices each have two levels); the
    others keep the flat ring (``algorithm`` None)."""
    for pack in plan.packs:
        if topo.workers == 1 and topo.replicas > 1 and plan.device_type == "CPU":
            pack.algorithm = "reduce_to_one"
            continue
        flat = allreduce_cost(pack.bytes, topo, model).seconds
        two_level = hierarchical_cost(pack.bytes, topo, model).seconds
        pack.algorithm = "hierarchical" if two_level < flat * (1 - 1e-9) else None


def allgather_cost(rows, row_bytes, index_bytes, topo, model):
    """A ring all-gather of every replica's ``rows`` (padded to a power of two), values
    and ids, plus the row counts: three gathers of ``n - 1`` messages each."""
    n = topo.replicas
    if n < 2:
        return FREE
    bw, lat = topo.link(model)
    padded = 1 << max(rows - 1, 0).bit_length()
    moved = (n - 1) * (padded * (row_bytes + index_bytes) + 8)
    return Cost(3 * (n - 1) * lat + moved / bw, int(moved), 3 * (n - 1))


def ps_cost(push_bytes, pull_bytes, topo, model, shards=1):
    """Every replica pushes ``push_bytes`` to and pulls ``pull_bytes`` from the
    variable's ps task(s), one after the other; ``shards`` tasks share the ps side."""
    n, d = topo.replicas, topo.devices_per_worker
    if n < 2:
        return FREE
    bw, lat = topo.ps_link(model)
    shards = max(1, shards)
    times = []
    for b in (push_bytes, pull_bytes):
        at_ps = n * b / shards
        at_worker = d * b if topo.ps_tasks else b      # the host bus: one replica's link
        times.append(shards * lat + max(at_ps, at_worker) / bw)
    busiest = max(n * max(push_bytes, pull_bytes) / shards, d * max(push_bytes, pull_bytes))
    return Cost(sum(times), int(busiest), 2 * shards)


def pack_bytes_for(topo, model, overhead=0.05):
    """The allreduce pack size at which the ring's message latency is ``overhead`` of
    its transfer time (larger packs save little latency and start communicating later,
    overlapping less with backprop), within 1 MiB .. 256 MiB."""
    n = topo.replicas
    if n < 2:
        return _MAX_PACK
    bw, lat = topo.link(model)
    # 2(n-1) lat = overhead * 2(n-1)/n * B / bw  =>  B = n * lat * bw / overhead
    size = int(n * lat * bw / overhead)
    return max(_MIN_PACK, min(_MAX_PACK, size))


def rows_per_replica(cut, topo, model):
    """Rows of a sparse variable one replica touches per step: its share of the global
    batch times the ids per example (1 when that is not fixed), at most the table."""
    per_example = cut.rows_per_example if cut.rows_per_example is not None else 1
    rows = -(-model.batch_size // max(topo.replicas, 1)) * per_example
    table = cut.shape[0] if cut.shape else rows
    return max(1, min(rows, table))


def _row_bytes(cut):
    rows = cut.shape[0] if cut.shape else 1
    return (cut.bytes or 0) // max(rows, 1)


def cut_costs(cut, topo, model, pack_bytes, ps_shards=1, can_use_ps=True):
    """{sync: Cost} for every way the cut's gradient could be synchronised."""
    out = {}
    if cut.kind == "dense":
        out["allreduce"] = allreduce_cost(cut.bytes or 0, topo, model, pack_bytes)
        if can_use_ps:
            out["accumulate"] = ps_cost(cut.bytes or 0, cut.bytes or 0, topo, model, ps_shards)
        return out
    rows = rows_per_replica(cut, topo, model)
    rb, ib = _row_bytes(cut), _INDEX_BYTES.get(cut.index_dtype, 8)
    out["allgather"] = allgather_cost(rows, rb, ib, topo, model)
    out["allreduce"] = allreduce_cost(cut.bytes or 0, topo, model, pack_bytes)   # sparse_as_dense
    if can_use_ps:
        out["accumulate"] = ps_cost(rows * (rb + ib), rows * rb, topo, model, ps_shards)
    return out


def best_shards(cut, variable_plan, topo, model, max_shards):
    """The shard count (1 .. ``max_shards``) with the cheapest ps cost; only resource
    variables of rank >= 1 with at least that many rows can be split."""
    rows = variable_plan.shape[0] if variable_plan.shape else None
    if variable_plan.kind != "resource" or not rows or rows < 2:
        return 1
    best, best_s = None, 1
    for s in range(1, min(max_shards, rows) + 1):
        c = cut_costs(cut, topo, model, None, s)["accumulate"].seconds
        if best is None or c < best * (1 - 1e-9):
            best, best_s = c, s
    return best_s


def choose(plan, topo, model, can_use_ps, mode="mixed"):
    """Sets, per gradient, the cheapest synchronisation (moving a variable and its slots
    to the parameter servers when that wins) and records every alternative's cost on
    the cut; returns the pack size the allreduced gradients should use. ``mode``
    "mirrored" keeps every variable mirrored (allreduce or allgather), "ps" puts every
    trained variable on the parameter servers. State updates (batch statistics) are
    always all-reduced: they have no ps update."""
    pack = pack_bytes_for(topo, model)
    # a model smaller than one pack shares each collective's latency among all its gradients
    fill = min(pack, sum(c.bytes or 0 for c in plan.cuts)) or pack
    for cut in plan.cuts:
        if cut.role == "state":
            if cut.sync != "local":   # (a state of each replica's own rows: no exchange)
                cut.costs = {"allreduce": allreduce_cost(cut.bytes or 0, topo, model, fill).to_dict()}
            continue
        var = plan.variable(cut.variable)
        shards = best_shards(cut, var, topo, model, max(topo.ps_tasks, 1)) if can_use_ps else 1
        costs = cut_costs(cut, topo, model, fill, shards, can_use_ps)
        # ties (one replica: all free) keep the mirrored default
        order = ["allreduce", "allgather", "accumulate"]
        allowed = {"mixed": order, "mirrored": order[:2], "ps": order[2:]}[mode]
        sync = min((s for s in costs if s in allowed), key=lambda s: (costs[s].seconds, order.index(s)))
        cut.costs = {s: c.to_dict() for s, c in costs.items()}
        if sync == "accumulate":
            plan.set_placement(var.name, "ps")
            if shards > 1:
                cut.costs["accumulate"]["shards"] = shards
        else:
            cut.sync = sync
    return pack


def predict(plan, topo, model):
    """One step's communication for a whole plan: {"seconds", "allreduce", "allgather",
    "ps", "bytes": {link: bytes}}. Allreduce packs run one after the other (each
    collective waits for the previous one); gathers and ps traffic add up; a ps task's
    link carries the share of every variable it holds."""
    n = topo.replicas
    result = {"replicas": n, "workers": topo.workers, "devices_per_worker": topo.devices_per_worker,
              "ps_tasks": topo.ps_tasks, "allreduce": 0.0, "allgather": 0.0, "ps": 0.0,
              "bytes": {"ring_link": 0, "ps_link": 0, "worker_link": 0}}
    if n < 2:
        result["seconds"] = 0.0
        return result
    for p in plan.packs:
        c = pack_cost(p, topo, model, plan.device_type)
        result["allreduce"] += c.seconds
        result["bytes"]["ring_link"] += c.bytes_per_link
    ps_load = [0.0] * max(topo.ps_tasks, 1)
    worker_load, ps_messages = 0.0, 0
    for cut in plan.cuts:
        if cut.sync == "allgather":
            rows = rows_per_replica(cut, topo, model)
            c = allgather_cost(rows, _row_bytes(cut), _INDEX_BYTES.get(cut.index_dtype, 8), topo, model)
            result["allgather"] += c.seconds
            result["bytes"]["ring_link"] += c.bytes_per_link
        elif cut.sync == "accumulate":
            if cut.kind == "dense":
                push = pull = cut.bytes or 0
            else:
                rows = rows_per_replica(cut, topo, model)
                push = rows * (_row_bytes(cut) + _INDEX_BYTES.get(cut.index_dtype, 8))
                pull = rows * _row_bytes(cut)
            var = plan.variable(cut.variable)
            parts = var.shards or [{"ps_task": var.ps_task or 0, "rows": 1}]
            total_rows = sum(s["rows"] for s in parts)
            for s in parts:
                ps_load[s["ps_task"] % len(ps_load)] += n * (push + pull) * s["rows"] / total_rows
            worker_load += (topo.devices_per_worker if topo.ps_tasks else 1) * (push + pull)
            ps_messages = max(ps_messages, 2 * len(parts))
    if any(ps_load):
        bw, lat = topo.ps_link(model)
        result["ps"] = ps_messages * lat + max(max(ps_load), worker_load) / bw
        result["bytes"]["ps_link"] = int(max(ps_load))
        result["bytes"]["worker_link"] = int(worker_load)
    result["seconds"] = result["allreduce"] + result["allgather"] + result["ps"]
    return result
