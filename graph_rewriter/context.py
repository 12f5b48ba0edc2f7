"""The explicit configuration a rewrite carries through its passes (no globals).

``Options`` holds what the user asked for, validated once; ``RewriteContext`` adds what
the pipeline derives on the way (the cluster, the plan, timings, a log function).
"""

import dataclasses
import typing

from graph_rewriter.errors import GraphRewriteError

STRATEGIES = ("allreduce", "ps", "hybrid", "auto")
DEVICE_TYPES = ("GPU", "CPU")
COMPRESSIONS = (None, "fp16", "bf16")
MERGES = ("sum", "mean", "concat", "master")
BATCH_SPLITS = ("global", "per_replica")
DEFAULT_BYTES_PER_PACK = 32 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_PS_SHARD_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Options:
    strategy: str = "allreduce"
    devices_per_worker: int = 1
    device_type: str = "GPU"
    bytes_per_pack: typing.Optional[int] = None   # None: DEFAULT_BYTES_PER_PACK, or auto's choice
    compression: typing.Optional[str] = None
    sparse_as_dense: bool = False
    merge: dict = dataclasses.field(default_factory=dict)
    gradients: dict = dataclasses.field(default_factory=dict)
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    sync: bool = True
    staleness: int = 0
    ps_shard_bytes: int = DEFAULT_PS_SHARD_BYTES
    verify: bool = True
    dump_after: tuple = ()
    dump_dir: str = "."
    accumulation_steps: int = 1
    cost_model: object = None        # graph_rewriter.cost_model.CostModel (strategy auto)
    materialize_replicas: bool = False  # build every replica in the IR (no template replica)
    # inputs with an unknown first dimension: "global" splits the batch fed (or drawn)
    # across the replicas, "per_replica" gives each replica its own batch (a feed holds the
    # replicas' batches concatenated; an iterator is drawn once per replica). Inputs with a
    # static first dimension are always per replica.
    batch_split: str = "global"

    def validate(self):
        if self.strategy not in STRATEGIES:
            raise GraphRewriteError(
                f"unknown strategy {self.strategy!r}", hint=f"use one of {', '.join(STRATEGIES)}")
        if isinstance(self.devices_per_worker, bool) or not isinstance(self.devices_per_worker, int):
            raise GraphRewriteError(
                f"devices_per_worker must be an integer >= 1, got {self.devices_per_worker!r}")
        if self.devices_per_worker < 1:
            raise GraphRewriteError(
                f"devices_per_worker must be >= 1, got {self.devices_per_worker}",
                hint="give the number of GPUs (or CPU replicas) per machine")
        if self.device_type not in DEVICE_TYPES:
            raise GraphRewriteError(
                f"unknown device type {self.device_type!r}", hint="use GPU or CPU")
        if self.compression not in COMPRESSIONS:
            raise GraphRewriteError(
                f"unknown compression {self.compression!r}", hint="use fp16, bf16 or none")
        if self.bytes_per_pack is not None and (
                isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int)
                or self.bytes_per_pack < 0):
            raise GraphRewriteError(
                f"bytes_per_pack must be a non-negative integer (0: one pack per dtype), got {self.bytes_per_pack!r}")
        if not (isinstance(self.timeout_seconds, (int, float)) and self.timeout_seconds >= 0):
            raise GraphRewriteError(
                f"timeout_seconds must be a number >= 0 (0 waits forever), got {self.timeout_seconds!r}")
        if not isinstance(self.sync, bool):
            raise GraphRewriteError(f"sync must be True or False, got {self.sync!r}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise GraphRewriteError(f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.staleness and not self.sync:
            raise GraphRewriteError("staleness bounds synchronous training; with sync=False "
                                    "workers are never held back", hint="drop one of the two options")
        if (self.staleness or not self.sync) and self.strategy not in ("ps", "hybrid"):
            raise GraphRewriteError(
                f"staleness and sync=False apply to parameter servers, not strategy {self.strategy!r}",
                hint="use strategy='ps' or 'hybrid'")
        if isinstance(self.ps_shard_bytes, bool) or not isinstance(self.ps_shard_bytes, int) or self.ps_shard_bytes < 0:
            raise GraphRewriteError(
                f"ps_shard_bytes must be a non-negative integer (0: never shard), got {self.ps_shard_bytes!r}")
        if (isinstance(self.accumulation_steps, bool) or not isinstance(self.accumulation_steps, int)
                or self.accumulation_steps < 1):
            raise GraphRewriteError(
                f"accumulation_steps must be an integer >= 1 (1: apply every step), got {self.accumulation_steps!r}")
        if self.accumulation_steps > 1 and not self.sync:
            raise GraphRewriteError(
                "accumulation_steps with sync=False: asynchronous workers apply their own gradients "
                "as they come, so there is no step to accumulate towards",
                hint="train synchronously, or drop accumulation_steps")
        if not isinstance(self.materialize_replicas, bool):
            raise GraphRewriteError(
                f"materialize_replicas must be True or False, got {self.materialize_replicas!r}")
        if self.batch_split not in BATCH_SPLITS:
            raise GraphRewriteError(
                f"unknown batch_split {self.batch_split!r}", hint=f"use one of {', '.join(BATCH_SPLITS)}")
        for name, how in self.merge.items():
            if how not in MERGES:
                raise GraphRewriteError(
                    f"merge for '{name}' is {how!r}", hint=f"use one of {', '.join(MERGES)}")
        return self


@dataclasses.dataclass
class RewriteContext:
    """What passes read, and the products they hand on to each other and to the export.

    ``options``, ``cluster`` and ``log`` are the input. Every product a pass hands on
    is a field declared here, with its type, set by the one pass that ``provides`` it
    and read by the passes that ``require`` it (the pass manager checks that order):
    - ``plan`` (graph_rewriter.plan.Plan): provided by the plan pass;
    - ``replicas`` (graph_rewriter.replicas.ReplicaMap): provided by replicate; which
      node belongs to which replica, the per-replica outputs the batch split adds and
      the tensors later passes put between a replica's value and its readers (the export
      and the verifier take it from here, never from the graph).
    """
    options: Options
    cluster: object
    plan: object = None
    log: typing.Callable = None
    replicas: object = None
    timings: list = dataclasses.field(default_factory=list)  # (pass name, seconds, modified)
    passes_run: list = dataclasses.field(default_factory=list)

    @property
    def num_replicas(self):
        return self.options.devices_per_worker * self.cluster.num_workers

    @property
    def num_local_replicas(self):
        """The replicas this graph holds: all of them in-graph, one task's between-graph."""
        return self.options.devices_per_worker if self.cluster.task is not None else self.num_replicas

    def info(self, message):
        if self.log is not None:
            self.log(message)


PRODUCTS = frozenset(("plan", "replicas"))   # the fields above that passes provide
