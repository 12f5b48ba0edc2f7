"""The plan: every per-variable decision of a rewrite, as data a user can read and edit.

This module holds the data only: the dataclasses and their JSON round trip, and no
TensorFlow. The decisions are made in graph_rewriter/planner.py (``planner.plan``); the
plan is carried in the rewrite context, applied by the passes, and returned as
``result.plan``. It serialises to JSON (``to_json``/``Plan.from_json``); ``graph-rewrite
plan`` prints one and ``--plan FILE`` applies an edited one, after the planner's
``check_plan`` has compared it with the graph.
"""

import dataclasses
import json

from graph_rewriter.errors import GraphRewriteError

PLAN_FORMAT = "graph_rewriter.plan/1"
DENSE_SYNCS = ("allreduce", "accumulate")
# a state of a row per row of the batch (combine "rows", a stateful RNN's): each
# replica's copy keeps its own value, no exchange
LOCAL = "local"
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
    # the train ops that apply this update, when not every gradient's are the same (a
    # GAN): gradients of different train ops go in different packs; None: absent from the JSON
    train_ops: list = None
    # a state update that is a sum or a count over the batch: "sum" (the replicas' values
    # are added, not averaged); a state of a row per row of a static batch: "rows" (each
    # replica keeps its own, sync "local"); None: averaged (absent from the JSON)
    combine: str = None
    # a later update of a variable another cut updates too (a BatchNorm applied twice):
    # "<variable>/update_<k>", what packs list; None: the variable's name (absent from the JSON)
    name: str = None
    # a state update computed from other states' averages on the way to their updates
    # (weight normalization's data-dependent init): their keys, packed before it; None:
    # none (absent from the JSON)
    after: list = None

    @property
    def key(self):
        """The cut's name in packs and accumulators: its variable's, or ``name``."""
        return self.name or self.variable

    @property
    def run_by_nothing(self):
        """True when the analysis found no op that runs this update (``train_ops`` is an
        empty list): a tf_keras layer first called on its own Input leaves that call's
        moving-average updates in the graph, reading the Input's placeholder, and no
        train op runs them."""
        return self.train_ops == []


@dataclasses.dataclass
class PackPlan:
    dtype: str
    cuts: list                  # variable names, in issue order
    bytes: int
    # the collective implementation the pack asks for ("auto", "ring", "nccl"); None:
    # the rewrite's communication option (absent from the JSON then)
    communication: str = None
    # "hierarchical": reduced within each worker, all-reduced across one replica per
    # worker, broadcast back within the worker; None: one flat ring (absent from the JSON)
    algorithm: str = None


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


DRAWN = frozenset(("iterator", "queue"))   # InputPlan kinds whose batches are drawn, not fed


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
    kind: str                   # "placeholder" (fed) | "iterator" | "queue" (drawn)
    mode: str                   # "split" | "per_replica"
    static_batch: int = None
    global_batch: int = None


def sparse_line(triples):
    """One line naming the batch's SparseTensors (a plan's sparse_inputs) for summaries."""
    return ("SparseTensors of the batch (each replica takes its rows' entries): "
            + "; ".join(" + ".join(t) for t in triples))


def joined_train_ops(keys):
    """{key: the first of the keys it shares a train op with, directly or through
    others} for tuples of train-op names (the plan's cuts' train_ops): gradients whose
    train ops overlap run together whenever one of those runs."""
    groups = []   # [(train ops, keys)]: disjoint
    for key in keys:
        ops, members = set(key), [key]
        for group in [g for g in groups if g[0] & ops]:
            groups.remove(group)
            ops |= group[0]
            members += group[1]
        groups.append((ops, members))
    return {k: min(members, key=keys.index) for _, members in groups for k in members}


def _plain(value):
    """``dataclasses.asdict`` without its deep copy of every leaf (a plan's leaves are
    JSON scalars; asdict's copying was 4% of a profiled 16-replica rewrite). Scalars
    return first and each dataclass's field names are looked up once: a ResNet50 plan
    has about 15,000 values."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_SCALARS = frozenset((str, int, float, bool, type(None)))
_FIELD_NAMES = {}   # dataclass -> its field names, in order


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
    # gradients of at least this many bytes were given a pack of their own (no concat
    # copy): the default for CPU replicas of one machine (planner.alone_bytes_for); None:
    # every pack filled up to bytes_per_pack, and absent from the JSON
    alone_bytes: int = None
    # InputPlan per batch input, when any is taken per replica; None when every batch
    # input is split (the plan then says nothing more than batch_inputs does)
    inputs: list = None
    # short remarks on the plan a user should see (inspect and the summary print them),
    # e.g. that hybrid found no sparse gradient; None or empty: absent from the JSON
    notes: list = None
    # tensors a loss divides by that are sums over the batch (a count of tokens): every
    # replica divides by their mean over the replicas (passes/normalizers.py); None:
    # none, and absent from the JSON
    normalizers: list = None
    # means over rows a condition on the batch selects (reduce_mean(tf.boolean_mask(...))):
    # every replica's is scaled by its count of rows over the replicas' mean count, so it
    # divides by that mean (passes/normalizers.py); None: none, and absent from the JSON
    selected_means: list = None
    # seeded random ops that draw one value per row of the batch (dropout's mask): each
    # replica draws the R replicas' rows with the op's seeds and keeps its own
    # (passes/random_draws.py); None: none, and absent from the JSON; an empty list in a
    # given plan leaves every replica drawing its clone's rows
    random_draws: list = None
    # constants and fills with one row per row of the batch that its values do not decide
    # (an RNN's zero initial state, fed by name with the last step's final state): the
    # name gives every replica's rows, concatenated, and each replica reads its own of
    # them (passes/row_defaults.py), so a value fed by the name reaches every replica;
    # None: none, and absent from the JSON; an empty list in a given plan leaves each
    # replica its own
    row_defaults: list = None
    # maxima (minima) over the batch's rows that bound while loops whose steps draw
    # random numbers (dynamic_rnn's longest sequence, a dropout per time step): every
    # replica reads the replicas' maximum (minimum), the batch's, so its loops run the
    # steps one device's run and its draws follow one device's (passes/loop_bounds.py);
    # None: none, and absent from the JSON; an empty list in a given plan leaves each
    # replica's loops at its own rows' bound
    loop_bounds: list = None
    # [tensor, [[reader, input position], ...]]: forward tensors holding the replica's rows
    # that updates write into state variables (MoCo's queue of keys), and the update ops
    # reading them: each replica's readers read every replica's rows, gathered in replica
    # order (passes/gather_rows.py); None: none, and absent from the JSON
    gathered_rows: list = None
    # the head of the batch's in-batch products (a dual encoder's every query against
    # every document): every replica computes it over every replica's rows, gathered,
    # and keeps R times its own rows' gradients (passes/product_heads.py; its fields:
    # graph_rewriter/product_heads.py, ProductHead); None: none, and absent from the
    # JSON; an empty dict in a given plan leaves each replica's rows meeting its own
    product_head: dict = None
    # rows moved within the batch (mixup's reversed or shuffled batch) that come from the
    # batch alone: every replica moves every replica's rows, gathered, and keeps its own
    # (passes/row_moves.py; its fields: graph_rewriter/row_moves.py, RowMoves); None: none,
    # and absent from the JSON; an empty dict in a given plan leaves each replica moving
    # its own rows
    row_moves: dict = None
    # sums over the batch's rows a loss adds up undivided (tf.reduce_sum of squared
    # errors, tf.nn.l2_loss): each replica's sum, and the gradient into it, is scaled by
    # the replica count (passes/loss_sums.py); None: none, and absent from the JSON; an
    # empty list in a given plan leaves them averaged
    loss_sums: list = None
    # batch statistics (BatchNorm's in training mode) all-reduced over every replica's
    # rows, forward and at their backward pass (passes/batch_statistics.py; the option
    # sync_batch_statistics asks for them); None: none, and absent from the JSON
    sync_batch_statistics: list = None
    # [op name, input position, [Shape or Size of a batch tensor]] where a value of a
    # synced sum over the rows (a Sum, a MatMul contracting them) meets a count of the
    # batch's rows (tf.shape(h)[0]): there the count is every replica's rows, those
    # shapes' rows summed over the replicas (passes/batch_statistics.py); None: none,
    # and absent from the JSON
    synced_row_counts: list = None
    # the batch's SparseTensors, each [indices, values, dense_shape] tensor names (also in
    # batch_inputs): every replica takes the entries of its rows of the batch, their row
    # numbers and dense shape its own (passes/split_inputs.py); None: none, and absent
    # from the JSON
    sparse_inputs: list = None
    # [variable, AddN, [its input tensors]]: terms of a dense gradient computed from variables and
    # constants alone (weight decay's), the same on every replica: the first replica adds
    # them R times, the others leave them out, and the all-reduce's mean is one device's
    # (passes/invariant_terms.py; the default for CPU replicas of one machine); None:
    # none, and absent from the JSON; an empty list in a given plan keeps every replica
    # computing them
    invariant_terms: list = None

    def variable(self, name):
        for v in self.variables:
            if v.name == name:
                return v
        raise GraphRewriteError(f"the plan has no variable '{name}'",
                                hint="use a variable name the plan lists (its \"variables\")")

    def group(self, name):
        """A variable with the optimizer slots that must live with it."""
        primary = self.variable(name)
        if primary.slot_of:
            primary = self.variable(primary.slot_of)
        return [primary] + [v for v in self.variables if v.slot_of == primary.name]

    def uses_collectives(self):
        """Whether replicas meet in collectives: a mirrored variable (its initial values
        broadcast, its gradient all-reduced) or an all-reduced or gathered gradient."""
        return (any(v.placement == "mirrored" for v in self.variables)
                or any(c.sync in ("allreduce", "allgather") for c in self.cuts))

    def set_placement(self, name, placement, ps_task=None):
        """Moves a variable (with its slots) to "ps" (task ``ps_task``, default 0) or
        "mirrored", and its gradient to the matching synchronisation."""
        if placement not in ("ps", "mirrored"):
            raise GraphRewriteError(f"placement for '{name}' is {placement!r}", hint="use ps or mirrored")
        group = self.group(name)
        local = [c.variable for c in self.cuts if c.sync == LOCAL and c.variable in {v.name for v in group}]
        if local and placement == "ps":
            raise GraphRewriteError(
                f"variable '{local[0]}' holds a row per row of each replica's batch (each replica keeps its "
                "own rows: sync 'local'), which one copy on a parameter server cannot hold",
                hint="keep it mirrored")
        for v in group:
            v.placement = placement
            v.ps_task = (ps_task or 0) if placement == "ps" else None
            v.shards = None
        names = {v.name for v in group}
        for c in self.cuts:
            if c.variable in names and c.sync != LOCAL:
                c.sync = "accumulate" if placement == "ps" else (
                    "allreduce" if c.kind == "dense" else "allgather")
        return self

    def to_dict(self):
        d = {"format": PLAN_FORMAT, **_plain(self)}
        if d["inputs"] is None:
            del d["inputs"]
        if not d["notes"]:
            del d["notes"]
        if d["alone_bytes"] is None:
            del d["alone_bytes"]
        if d["normalizers"] is None:
            del d["normalizers"]
        if d["selected_means"] is None:
            del d["selected_means"]
        if d["random_draws"] is None:
            del d["random_draws"]
        if d["row_defaults"] is None:
            del d["row_defaults"]
        if d["loop_bounds"] is None:
            del d["loop_bounds"]
        if d["gathered_rows"] is None:
            del d["gathered_rows"]
        if d["product_head"] is None:
            del d["product_head"]
        if d["row_moves"] is None:
            del d["row_moves"]
        if d["loss_sums"] is None:
            del d["loss_sums"]
        if d["sync_batch_statistics"] is None:
            del d["sync_batch_statistics"]
        if d["synced_row_counts"] is None:
            del d["synced_row_counts"]
        if d["sparse_inputs"] is None:
            del d["sparse_inputs"]
        if d["invariant_terms"] is None:
            del d["invariant_terms"]
        for c in d["cuts"]:
            if c["train_ops"] is None:
                del c["train_ops"]
            if c["combine"] is None:
                del c["combine"]
            if c["name"] is None:
                del c["name"]
            if c["after"] is None:
                del c["after"]
        for p in d["packs"]:
            if p["communication"] is None:
                del p["communication"]
            if p["algorithm"] is None:
                del p["algorithm"]
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
            raise GraphRewriteError(f"{source}: not a graph_rewriter plan (expected \"format\": \"{PLAN_FORMAT}\")",
                                    hint="pass a file written by `graph-rewrite plan` or Plan.to_json()")
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
                bytes_per_pack=d.get("bytes_per_pack"), alone_bytes=d.get("alone_bytes"),
                inputs=[InputPlan(**i) for i in d["inputs"]] if d.get("inputs") is not None else None,
                notes=list(d["notes"]) if d.get("notes") else None,
                normalizers=d.get("normalizers"), selected_means=d.get("selected_means"),
                random_draws=d.get("random_draws"), row_defaults=d.get("row_defaults"),
                loop_bounds=d.get("loop_bounds"),
                gathered_rows=d.get("gathered_rows"), product_head=d.get("product_head"),
                row_moves=d.get("row_moves"),
                loss_sums=d.get("loss_sums"), sync_batch_statistics=d.get("sync_batch_statistics"),
                synced_row_counts=d.get("synced_row_counts"), sparse_inputs=d.get("sparse_inputs"),
                invariant_terms=d.get("invariant_terms"))
        except (KeyError, TypeError) as e:
            raise GraphRewriteError(f"{source}: malformed plan: {e}", hint="pass a file written by `graph-rewrite plan` or Plan.to_json()") from None

    @classmethod
    def from_json(cls, text, source="plan"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphRewriteError(f"{source}: not valid JSON: {e.msg} at line {e.lineno}",
                                    hint="fix the JSON, or write the plan again with `graph-rewrite plan`") from None
        return cls.from_dict(d, source)

    def cut(self, key):
        """The cut named ``key``: a variable's (its first update), or a later update's name."""
        for c in self.cuts:
            if c.key == key:
                return c
        return None

    def cut_index(self):
        """{key: cut} for every cut, as ``cut`` finds them (the first of a key): for a
        caller that looks up every cut of a graph (hundreds), instead of ``cut`` each."""
        index = {}
        for c in self.cuts:
            index.setdefault(c.key, c)
        return index
