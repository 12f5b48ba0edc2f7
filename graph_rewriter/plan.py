"""The plan: every per-variable decision of a rewrite, as data a user can read and edit.

A plan is made from the analysis and the options (``make_plan``), carried in the
rewrite context, applied by the passes, and returned as ``result.plan``. It serialises to
JSON (``to_json``/``Plan.from_json``); ``graph-rewrite plan`` prints one and
``--plan FILE`` applies an edited one, after ``check_plan`` has compared it with the graph.
"""

import copy
import dataclasses
import json

from graph_rewriter import cost_model
from graph_rewriter.options import DEFAULT_BYTES_PER_PACK
from graph_rewriter.errors import GraphRewriteError

PLAN_FORMAT = "graph_rewriter.plan/1"
DENSE_SYNCS = ("allreduce", "accumulate")
SPARSE_SYNCS = ("allgather", "allreduce", "accumulate")  # allreduce on sparse = sparse_as_dense


@dataclasses.dataclass
class CutPlan:
    """How one gradient (or state update) is synchronised across replicas."""
    variable: str
    kind: str                   # "dense" | "sparse"
    values: str                 # tensor name in the original graph
    indices: str = None
    deduplicated: bool = False
    linear: bool = False
    role: str = "gradient"      # "gradient" | "state"
    source: str = "fused-op"
    sync: str = "allreduce"     # "allreduce" | "allgather"
    dtype: str = "float32"
    shape: list = None
    bytes: int = None
    pack: int = None            # index into Plan.packs for allreduced cuts
    rows_per_example: int = None  # sparse: index rows per example of the batch, if fixed
    index_dtype: str = None     # sparse: the indices' dtype
    variables: list = dataclasses.field(default_factory=list)
    costs: dict = None          # strategy auto: {sync: predicted cost per step} of each choice
    # where the updates received the gradient, and the post-processing between the
    # average (``values``) and them, when the two differ (clipping, unscaling, ...)
    received: list = dataclasses.field(default_factory=list)
    post_processing: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PackPlan:
    dtype: str
    cuts: list                  # variable names, in issue order
    bytes: int


@dataclasses.dataclass
class VariablePlan:
    name: str
    role: str
    dtype: str
    shape: list
    bytes: int
    placement: str = "mirrored"  # "mirrored": a copy per replica; "ps": one copy on a ps task
    slot_of: str = None
    initializer: str = None      # the assign that initializes it (replicas copy the master)
    kind: str = "resource"       # "resource" | "ref"
    ps_task: int = None          # placement "ps": the task holding it (unsharded)
    shards: list = None          # placement "ps", sharded: [{"ps_task": k, "rows": n}, ...]


@dataclasses.dataclass
class InputPlan:
    """How one batch input reaches the replicas.

    mode "split": the batch fed (or drawn) is split across the replicas in order;
    "per_replica": each replica takes its own batch (a placeholder is fed the replicas'
    batches concatenated in replica order, an iterator is drawn once per replica, replica
    0 first). ``static_batch``: the per-replica batch when the first dimension is
    static; ``global_batch``: the rows one step trains on across every replica of the
    group (all workers), when that is fixed."""
    name: str
    kind: str                   # "placeholder" | "iterator"
    mode: str                   # "split" | "per_replica"
    static_batch: int = None
    global_batch: int = None


def _plain(value):
    """``dataclasses.asdict`` without its deep copy of every leaf (a plan's leaves are
    JSON scalars; asdict's copying was 4% of a profiled 16-replica rewrite)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclasses.dataclass
class Plan:
    strategy: str
    num_replicas: int
    devices_per_worker: int
    device_type: str
    variables: list
    cuts: list
    packs: list
    batch_inputs: list
    broadcast_inputs: list
    step_counters: list
    compression: str = None
    fingerprint: str = ""       # of the single-device graph: keeps collective keys apart
    sync: bool = True           # parameter servers: synchronous (accumulators) or not
    staleness: int = 0          # parameter servers: steps a worker may run ahead
    num_ps: int = 0             # parameter-server devices (1 = this machine's host CPU)
    accumulation_steps: int = 1  # micro-batches whose gradients are summed before each update
    cost: dict = None           # strategy auto: the cost model, topology, pack size, prediction
    bytes_per_pack: int = None  # the pack size the packs were made with
    # InputPlan per batch input, when any is taken per replica; None when every batch
    # input is split (the plan then says nothing more than batch_inputs does)
    inputs: list = None

    def variable(self, name):
        for v in self.variables:
            if v.name == name:
                return v
        raise GraphRewriteError(f"the plan has no variable '{name}'")

    def group(self, name):
        """A variable with the optimizer slots that must live with it."""
        primary = self.variable(name)
        if primary.slot_of:
            primary = self.variable(primary.slot_of)
        return [primary] + [v for v in self.variables if v.slot_of == primary.name]

    def set_placement(self, name, placement, ps_task=None):
        """Moves a variable (with its slots) to "ps" (task ``ps_task``, default 0) or
        "mirrored", and its gradient to the matching synchronisation."""
        if placement not in ("ps", "mirrored"):
            raise GraphRewriteError(f"placement for '{name}' is {placement!r}", hint="use ps or mirrored")
        for v in self.group(name):
            v.placement = placement
            v.ps_task = (ps_task or 0) if placement == "ps" else None
            v.shards = None
        for c in self.cuts:
            if c.variable in {v.name for v in self.group(name)}:
                c.sync = "accumulate" if placement == "ps" else (
                    "allreduce" if c.kind == "dense" else "allgather")
        return self

    def to_dict(self):
        d = {"format": PLAN_FORMAT, **_plain(self)}
        if d["inputs"] is None:
            del d["inputs"]
        return d

    def input_plans(self):
        """{tensor name: InputPlan} of every batch input (split ones too)."""
        given = {i.name: i for i in self.inputs or []}
        return {name: given.get(name) or InputPlan(name=name, kind="placeholder", mode="split")
                for name in self.batch_inputs}

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d, source="plan"):
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise GraphRewriteError(f"{source}: not a graph_rewriter plan (expected \"format\": \"{PLAN_FORMAT}\")")
        try:
            return cls(
                strategy=d["strategy"], num_replicas=d["num_replicas"],
                devices_per_worker=d["devices_per_worker"], device_type=d["device_type"],
                variables=[VariablePlan(**v) for v in d["variables"]],
                cuts=[CutPlan(**c) for c in d["cuts"]],
                packs=[PackPlan(**p) for p in d["packs"]],
                batch_inputs=list(d["batch_inputs"]), broadcast_inputs=list(d["broadcast_inputs"]),
                step_counters=list(d["step_counters"]), compression=d.get("compression"),
                fingerprint=d.get("fingerprint", ""), sync=d.get("sync", True),
                staleness=d.get("staleness", 0), num_ps=d.get("num_ps", 0),
                accumulation_steps=d.get("accumulation_steps", 1), cost=d.get("cost"),
                bytes_per_pack=d.get("bytes_per_pack"),
                inputs=[InputPlan(**i) for i in d["inputs"]] if d.get("inputs") is not None else None)
        except (KeyError, TypeError) as e:
            raise GraphRewriteError(f"{source}: malformed plan: {e}") from None

    @classmethod
    def from_json(cls, text, source="plan"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphRewriteError(f"{source}: not valid JSON: {e.msg} at line {e.lineno}") from None
        return cls.from_dict(d, source)

    def cut(self, variable):
        for c in self.cuts:
            if c.variable == variable:
                return c
        return None


def plan_inputs(analysis, batch_split, num_replicas):
    """The InputPlans of the analysis' batch inputs, or None if every one is split: inputs
    with a static first dimension are per replica, the others as ``batch_split`` says.
    An iterator is drawn as a whole, so all its outputs share one mode."""
    out = []
    for t in analysis.batch_inputs:
        iterator = t.node.op in ("IteratorGetNext", "IteratorGetNextSync")
        if t.name in analysis.static_batch:
            b = analysis.static_batch[t.name]
            out.append(InputPlan(name=t.name, kind="iterator" if iterator else "placeholder",
                                 mode="per_replica", static_batch=b,
                                 global_batch=b * num_replicas if b is not None else None))
        else:
            mode = "per_replica" if batch_split == "per_replica" else "split"
            out.append(InputPlan(name=t.name, kind="iterator" if iterator else "placeholder", mode=mode))
    if not any(i.mode == "per_replica" for i in out):
        return None
    return out


def dtype_name(enum):
    from tensorflow.python.framework import dtypes
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
    from graph_rewriter.analysis import rows_per_example
    from graph_rewriter.op_builder import dtype_of
    cuts = []
    for c in analysis.cuts:
        var = analysis.variables[c.variable]
        sync = "allreduce" if c.kind == "dense" or options.sparse_as_dense else "allgather"
        cuts.append(CutPlan(
            variable=c.variable, kind=c.kind, values=c.values.name,
            indices=c.indices.name if c.indices is not None else None,
            deduplicated=c.deduplicated, linear=c.linear, role=c.role, source=c.source,
            sync=sync, dtype=dtype_name(var.dtype), shape=var.shape, bytes=var.nbytes,
            variables=list(c.variables), received=list(c.received),
            post_processing=list(c.post_processing),
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
        step_counters=list(analysis.step_counters), compression=options.compression,
        sync=options.sync, staleness=options.staleness, num_ps=max(num_ps, 1),
        accumulation_steps=options.accumulation_steps)
    pack_bytes = DEFAULT_BYTES_PER_PACK if options.bytes_per_pack is None else options.bytes_per_pack
    if options.strategy == "auto":
        return _auto_plan(plan, options, topology, can_use_ps)
    place_for_strategy(plan, options.strategy, options.ps_shard_bytes)
    assign_packs(plan, pack_bytes)
    return plan


def place_for_strategy(plan, strategy, shard_bytes):
    """The placement of strategy ps (every variable on the parameter servers) or hybrid
    (variables with sparse gradients and their slots), balanced over the ps tasks; other
    strategies leave the plan mirrored."""
    if strategy not in ("ps", "hybrid"):
        return plan
    if strategy == "ps":
        chosen = [v.name for v in plan.variables]
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
        shards = {c.variable: c.costs["accumulate"].get("shards", 1)
                  for c in p.cuts if c.sync == "accumulate"}
        balance_ps(p, 0, shards)
        assign_packs(p, pack_bytes)
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


def assign_packs(plan, bytes_per_pack):
    """Groups allreduced cuts into same-dtype packs of at most ``bytes_per_pack`` bytes
    (0: one pack per dtype), keeping the cuts' order: gradients that backprop produces
    first are issued first, so communication overlaps the rest of backprop."""
    plan.packs = []
    plan.bytes_per_pack = bytes_per_pack
    open_pack = {}
    # Batch statistics (BatchNorm moving averages) go first, in packs of their own: with
    # TF1's control_dependencies(UPDATE_OPS) idiom the gradients wait for those updates.
    ordered = [c for c in plan.cuts if c.role == "state"] + [c for c in plan.cuts if c.role != "state"]
    for c in ordered:
        c.pack = None
        if c.sync != "allreduce":
            continue
        size = c.bytes
        key = (c.dtype, c.role == "state")
        p = open_pack.get(key)
        if p is None or size is None or (bytes_per_pack and p.bytes + size > bytes_per_pack and p.cuts):
            p = PackPlan(dtype=c.dtype, cuts=[], bytes=0)
            plan.packs.append(p)
            open_pack[key] = p if size is not None else None
        p.cuts.append(c.variable)
        p.bytes += size or 0
        c.pack = len(plan.packs) - 1 if p is plan.packs[-1] else plan.packs.index(p)


def check_plan(plan, analysis, options, num_replicas):
    """Compares a given (possibly hand-edited) plan with the graph; names what differs."""
    if plan.num_replicas != num_replicas:
        raise GraphRewriteError(
            f"the plan is for {plan.num_replicas} replicas, but the options give {num_replicas}",
            hint="make the plan again with the same cluster and devices_per_worker")
    known = {c.variable: c for c in analysis.cuts}
    for c in plan.cuts:
        found = known.get(c.variable)
        if found is None:
            raise GraphRewriteError(
                f"the plan names variable '{c.variable}', which has no gradient in this graph")
        allowed = DENSE_SYNCS if c.kind == "dense" else SPARSE_SYNCS
        if c.sync not in allowed:
            raise GraphRewriteError(
                f"plan: variable '{c.variable}' has sync {c.sync!r}; a {c.kind} gradient "
                f"allows {', '.join(allowed)}")
    for c in plan.cuts:
        placement = plan.variable(c.variable).placement
        if (c.sync == "accumulate") != (placement == "ps"):
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
    missing = set(known) - {c.variable for c in plan.cuts}
    if missing:
        raise GraphRewriteError(
            f"the plan has no entry for variable '{sorted(missing)[0]}'",
            hint="make the plan from this graph with `graph-rewrite plan`")
    if options.bytes_per_pack is not None:
        pack_bytes = options.bytes_per_pack
    elif plan.bytes_per_pack is not None:
        pack_bytes = plan.bytes_per_pack
    else:
        pack_bytes = DEFAULT_BYTES_PER_PACK
    if options.accumulation_steps > 1:
        plan.accumulation_steps = options.accumulation_steps
    assign_packs(plan, pack_bytes)
    return plan
