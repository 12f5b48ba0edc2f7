"""Every rewrite option, described once.

Each field of ``Options`` carries an ``OptionSpec`` in its metadata (see ``option()``):
its help text, how a value is checked, its keyword in ``rewrite()`` and its flag(s) in
the ``graph-rewrite`` command. ``rewrite()``'s keywords and docstring, the CLI's rewrite
flags and the checks of both are generated from it, so adding an option is one field
here (and its use in a pass):

    my_option: bool = option(False, "What it does and why (one or two sentences).",
                             check=boolean("my_option"),
                             cli=Flag("--my-option", action="const", const=True))

An option without a flag is marked ``api_only=True`` (``log``); flags that set no option
(``--cluster``, ``--plan``, ``-v``, the input and output paths) stay in cli.py.

Nothing here imports TensorFlow (the CLI builds its parser from this module).
"""

import dataclasses
import difflib
import textwrap
import typing

from graph_rewriter.cost_model import CostModel
from graph_rewriter.errors import GraphRewriteError

STRATEGIES = ("allreduce", "ps", "hybrid", "auto")
DEVICE_TYPES = ("GPU", "CPU")
COMPRESSIONS = (None, "fp16", "bf16")
MERGES = ("sum", "mean", "concat", "master")
BATCH_SPLITS = ("global", "per_replica")
COMMUNICATIONS = ("auto", "ring", "nccl")
ALLREDUCE_ALGORITHMS = ("flat", "hierarchical", "reduce_to_one", "auto")
DEFAULT_BYTES_PER_PACK = 32 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_HEARTBEAT_SECONDS = 5.0
DEFAULT_PS_SHARD_BYTES = 64 * 1024 * 1024

COMMANDS = ("rewrite", "plan")   # the commands whose flags come from here (IN OUT, and plan IN)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag of an option.

    ``action``: "store" (takes a value, converted by ``type``), "append" (repeatable; the
    option gets the list), "const" (takes no value; the option gets ``const``).
    ``convert`` turns what argparse parsed into the keyword's value; ``check`` rejects a
    parsed value in the flag's own words before that. ``key``: for an option set by
    several flags, the entry of the dict they build (``OptionSpec.cli_combine``).
    ``commands``: the subcommands that have the flag."""
    name: str
    metavar: str = None
    type: typing.Callable = None
    action: str = "store"
    const: object = None
    choices: tuple = None
    help: str = None
    check: typing.Callable = None
    convert: typing.Callable = None
    key: str = None
    group: str = None
    commands: tuple = COMMANDS

    @property
    def dest(self):
        return self.name.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What the schema says about one ``Options`` field (``option()`` builds it)."""
    help: str
    keyword: str = None            # the rewrite() keyword (default: the field's name)
    check: typing.Callable = None  # value -> None, raises GraphRewriteError naming the option
    convert: typing.Callable = None  # the keyword's value -> the field's (before check)
    cli: tuple = ()                # Flag(s); () with api_only
    cli_combine: typing.Callable = None  # {flag key: value} -> keyword value (several flags)
    api_only: bool = False
    default_text: str = None       # how docs and --help show the default
    accepts: str = None            # what the keyword takes, for the docstring


def option(default=None, help="", *, default_factory=None, keyword=None, check=None, convert=None,
           cli=(), cli_combine=None, api_only=False, default_text=None, accepts=None):
    """A dataclass field of ``Options`` with its ``OptionSpec``."""
    if isinstance(cli, Flag):
        cli = (cli,)
    if not cli and not api_only:
        raise ValueError("an option without a flag must be marked api_only")
    spec = OptionSpec(help=help, keyword=keyword, check=check, convert=convert, cli=tuple(cli),
                      cli_combine=cli_combine, api_only=api_only, default_text=default_text,
                      accepts=accepts)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": spec})
    return dataclasses.field(default=default, metadata={"option": spec})


# ----- checks: each raises GraphRewriteError with the message users have always seen -------

def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def one_of(choices, message, hint):
    def check(value):
        if value not in choices:
            raise GraphRewriteError(message.format(value=value), hint=hint)
    return check


def boolean(name):
    def check(value):
        if not isinstance(value, bool):
            raise GraphRewriteError(f"{name} must be True or False, got {value!r}",
                                    hint=f"pass {name}=True or {name}=False")
    return check


def _bool_or_names(name):
    """True or False as given; one name, or several, as a tuple."""
    names = _tuple_of(name, "True, False or names", "True or ['bn/moments/mean']")

    def convert(value):
        return value if isinstance(value, bool) else names(value)
    return convert


def _check_bool_or_names(name):
    def check(value):
        if isinstance(value, bool):
            return
        if not value or not all(isinstance(v, str) and v for v in value):
            raise GraphRewriteError(f"{name} must be True, False or names, got {value!r}",
                                    hint=f"pass {name}=True, or the names the plan's notes list")
    return check


def _check_devices_per_worker(value):
    if not _is_int(value):
        raise GraphRewriteError(f"devices_per_worker must be an integer >= 1, got {value!r}",
                                hint="give the number of GPUs (or CPU replicas) per machine, e.g. 2")
    if value < 1:
        raise GraphRewriteError(f"devices_per_worker must be >= 1, got {value}",
                                hint="give the number of GPUs (or CPU replicas) per machine")


def _check_bytes_per_pack(value):
    if value is not None and (not _is_int(value) or value < 0):
        raise GraphRewriteError(
            f"bytes_per_pack must be a non-negative integer (0: one pack per dtype), got {value!r}",
            hint="give a byte count, e.g. 33554432 (32 MiB), or 0")


def _check_heartbeat(value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and (value == 0 or value >= 1)):
        raise GraphRewriteError(
            f"heartbeat_seconds must be 0 (no heartbeats) or a number >= 1, got {value!r}",
            hint="give seconds, e.g. 5; a client beats every heartbeat_seconds / 5 s")


def _check_timeout(value):
    if not (isinstance(value, (int, float)) and value >= 0):
        raise GraphRewriteError(
            f"timeout_seconds must be a number >= 0 (0 waits forever), got {value!r}",
            hint="give seconds, e.g. 600, or 0")


def _check_staleness(value):
    if not _is_int(value) or value < 0:
        raise GraphRewriteError(f"staleness must be an integer >= 0, got {value!r}",
                                hint="give a number of steps, e.g. 1, or 0 for none")


def _check_ps_shard_bytes(value):
    if not _is_int(value) or value < 0:
        raise GraphRewriteError(
            f"ps_shard_bytes must be a non-negative integer (0: never shard), got {value!r}",
            hint="give a byte count, e.g. 67108864 (64 MiB), or 0")


def _check_accumulation_steps(value):
    if not _is_int(value) or value < 1:
        raise GraphRewriteError(
            f"accumulation_steps must be an integer >= 1 (1: apply every step), got {value!r}",
            hint="give the number of runs per applied step, e.g. 4, or 1")


def _check_merge(value):
    for name, how in value.items():
        if how not in MERGES:
            raise GraphRewriteError(f"merge for '{name}' is {how!r}", hint=f"use one of {', '.join(MERGES)}")


def _check_outputs(value):
    if not all(isinstance(name, str) and name and not name.startswith("^") for name in value):
        raise GraphRewriteError(f"outputs must be tensor names, got {list(value)!r}",
                                hint="give e.g. ['loss:0', 'predictions:0']")


def _check_task(value):
    # the cluster checks the job and index (cluster.parse_task); here only the form
    if not (value is None or isinstance(value, (str, tuple, list))):
        raise GraphRewriteError(f"task {value!r} is not JOB:INDEX or a (job, index) pair",
                                hint='write e.g. "worker:1" or ("worker", 1)')


def _check_tag(value):
    if value is not None and not (isinstance(value, str) and any(t.strip() for t in value.split(","))):
        raise GraphRewriteError(f"tag must be a SavedModel tag or comma-separated tags, got {value!r}",
                                hint="give e.g. 'train' or 'serve,gpu', or None for the only MetaGraphDef")


def _tags(value):
    """A list or tuple of tags as the comma-separated string the option holds."""
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return ",".join(value)
    return value


def _check_dump_after(value):
    if not all(isinstance(name, str) for name in value):
        raise GraphRewriteError(f"dump_after must be pass names, got {list(value)!r}",
                                hint="give e.g. ('replicate',) or ('all',)")


def _check_dump_dir(value):
    if not isinstance(value, str):
        raise GraphRewriteError(f"dump_dir must be a folder's path, got {value!r}",
                                hint="give the folder as a string")


def _check_log(value):
    if value is not None and not callable(value):
        raise GraphRewriteError(f"log must be a callable taking one line, or None, got {value!r}",
                                hint="pass e.g. log=print, or None")


def _dict_of(name, what):
    def convert(value):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise GraphRewriteError(f"{name} must be a dict {what}, got {value!r}",
                                    hint=f"give {name} as a dict, or None")
        return dict(value)
    return convert


def _tuple_of(name, what, example, none=False):
    """A converter to a tuple of names (one string is one name; ``none``: None is empty)."""
    def convert(value):
        if value is None and none:
            return ()
        if isinstance(value, str):
            return (value,)
        try:
            return tuple(value)
        except TypeError:
            raise GraphRewriteError(f"{name} must be {what}, got {value!r}",
                                    hint=f"give e.g. {example}") from None
    return convert


# ----- command-line conversions -------------------------------------------------------------

def _pairs(items, flag):
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise GraphRewriteError(f"{flag} {item!r} is not NAME=VALUE",
                                    hint="join the name and the value with '=', e.g. loss:0=sum")
        out[key] = value
    return out


def _gradient_pairs(items):
    return {var: tuple(grad.split(",", 1)) if "," in grad else grad
            for var, grad in _pairs(items, "--gradient").items()}


def _flag_at_least_1(flag):
    def check(value):
        if value < 1:
            raise GraphRewriteError(f"{flag} must be at least 1, got {value}",
                                    hint=f"give {flag} a whole number, 1 or more")
    return check


def _check_device_type_flag(value):
    if value not in DEVICE_TYPES:
        raise GraphRewriteError(f"--device-type must be GPU or CPU, got {value!r}",
                                hint="use --device-type GPU or --device-type CPU")


def _link_flag(flag, scale):
    """A cost-model flag in GB/s or microseconds: checked in its own units, given in SI."""
    latency = "latency" in flag

    def check(value):
        if not value > 0 and not (value == 0 and latency):
            raise GraphRewriteError(f"{flag} must be a positive number, got {value}",
                                    hint=f"give {flag} in microseconds, e.g. 50, or 0" if latency
                                    else f"give {flag} in GB/s, e.g. 1.25")
    return dict(check=check, convert=lambda value: value * scale)


_COSTS = "cost model (strategy auto)"


@dataclasses.dataclass(frozen=True)
class Options:
    """What the user asked a rewrite for, validated once (``validate``)."""
    strategy: str = option(
        "allreduce",
        "How gradients are kept in sync: allreduce (collectives between the replicas), ps "
        "(variables on parameter servers), hybrid (sparse gradients on parameter servers, dense "
        "ones allreduced) or auto (per variable what the cost model predicts cheapest; see "
        "docs/strategies.md).",
        accepts='"allreduce" | "ps" | "hybrid" | "auto" | a Plan | the path of a plan\'s .json',
        check=one_of(STRATEGIES, "unknown strategy {value!r}", f"use one of {', '.join(STRATEGIES)}"),
        cli=Flag("--strategy", metavar="S"))
    devices_per_worker: int = option(
        1, "Replicas per machine: its GPUs, or CPU replicas with device type CPU.",
        check=_check_devices_per_worker,
        cli=Flag("--devices-per-worker", metavar="N", type=int,
                 check=_flag_at_least_1("--devices-per-worker")))
    device_type: str = option(
        "GPU", "The replicas' device type: GPU, or CPU (replicas on CPU:0..N-1, for tests and "
        "CPU clusters).",
        check=one_of(DEVICE_TYPES, "unknown device type {value!r}", "use GPU or CPU"),
        cli=Flag("--device-type", metavar="GPU|CPU", check=_check_device_type_flag))
    task: object = option(
        None, "None: one client drives every worker (in-graph replication); \"worker:1\" or "
        "(\"worker\", 1): build the graph that task's own client runs (between-graph replication).",
        default_text="None", accepts='None | "job:index" | (job, index)', check=_check_task,
        cli=Flag("--task", metavar="JOB:INDEX",
                 help="build the graph this task's own client runs (between-graph replication); "
                      "default: one client drives every worker (in-graph)"))
    tag: typing.Optional[str] = option(
        None, "A SavedModel input: the tag set of the MetaGraphDef to rewrite, its tags "
        "comma-separated (\"train\", \"serve,gpu\"); None: the SavedModel's only MetaGraphDef.",
        default_text="None", accepts='None | "tag" | "tag,tag"', convert=_tags, check=_check_tag,
        cli=Flag("--tag", metavar="TAGS"))
    batch_split: str = option(
        "global", "Inputs with an unknown batch dimension: global splits each fed or drawn batch "
        "across the replicas; per_replica gives each replica its own batch (a feed holds the "
        "replicas' batches concatenated in replica order, an iterator is drawn once per replica). "
        "Inputs with a static batch dimension are always per replica.",
        check=one_of(BATCH_SPLITS, "unknown batch_split {value!r}", f"use one of {', '.join(BATCH_SPLITS)}"),
        cli=Flag("--batch-split", choices=BATCH_SPLITS))
    accumulation_steps: int = option(
        1, "Sum gradients over K runs of the train op (micro-batches); every K-th run "
        "synchronises their mean and applies it once.",
        check=_check_accumulation_steps, cli=Flag("--accumulation-steps", metavar="K", type=int))
    bytes_per_pack: typing.Optional[int] = option(
        None, "Dense gradients are all-reduced in packs of same-dtype gradients of at most this "
        "many bytes (fewer, larger collectives); 0: one pack per dtype. Unless given, CPU "
        "replicas of one machine all-reduce each gradient of 1 MiB or more in a pack of its own "
        "(no concatenation copy).",
        default_text="32 MiB (auto: the cost model's choice)", check=_check_bytes_per_pack,
        cli=Flag("--bytes-per-pack", metavar="BYTES", type=int))
    compression: typing.Optional[str] = option(
        None, "fp16 or bf16: dense gradients are cast down for the all-reduce and back after "
        "(half the bytes on the wire).",
        check=one_of(COMPRESSIONS, "unknown compression {value!r}", "use fp16, bf16 or none"),
        cli=Flag("--compression", choices=("fp16", "bf16", "none"),
                 help="cast dense gradients down for the all-reduce and back after (half the "
                      "bytes on the wire); default: none",
                 convert=lambda value: None if value == "none" else value))
    communication: str = option(
        "auto", "The implementation every gradient all-reduce and all-gather asks TensorFlow "
        "for (the collectives' communication_hint): auto lets TensorFlow choose, ring is its "
        "gRPC ring (CPU and GPU), nccl NVIDIA's NCCL (GPU replicas only). A plan can set it "
        "per pack.",
        check=one_of(COMMUNICATIONS, "unknown communication {value!r}",
                     f"use one of {', '.join(COMMUNICATIONS)}"),
        cli=Flag("--communication", choices=COMMUNICATIONS))
    allreduce_algorithm: typing.Optional[str] = option(
        None, "How each pack is all-reduced across machines: flat is one ring over every "
        "replica; hierarchical reduces within each worker, all-reduces across one replica per "
        "worker and broadcasts back within the worker (fewer cross-machine messages: for many "
        "workers with several devices each); reduce_to_one sums every replica's pack on one "
        "device of a single worker and every replica reads the mean from there (no collective: "
        "for replicas of one process, such as CPU devices); auto lets the cost model choose per "
        "pack. A plan can set it per pack.",
        default_text="flat (strategy auto: auto)",
        check=one_of((None,) + ALLREDUCE_ALGORITHMS, "unknown allreduce_algorithm {value!r}",
                     f"use one of {', '.join(ALLREDUCE_ALGORITHMS)}"),
        cli=Flag("--allreduce-algorithm", choices=ALLREDUCE_ALGORITHMS))
    sparse_as_dense: bool = option(
        False, "All-reduce sparse gradients as dense tensors instead of gathering their rows.",
        check=boolean("sparse_as_dense"),
        cli=Flag("--sparse-as-dense", action="const", const=True))
    sync_batch_statistics: object = option(
        False, "All-reduce the statistics training takes over the batch's rows (BatchNorm in "
        "training mode, tf.nn.moments) over every replica's rows, forward and backward, so each "
        "replica normalises with one device's statistics (synchronised BatchNorm); True: every "
        "one the analysis lists, or the names of some. A fused BatchNorm is replaced by its ops "
        "(inside a v2 cond, behind a Keras learning phase, the cond is first lowered to Switch and Merge).",
        accepts="False | True | names of batch statistics", convert=_bool_or_names("sync_batch_statistics"),
        check=_check_bool_or_names("sync_batch_statistics"),
        cli=Flag("--sync-batch-statistics", action="const", const=True,
                 help="all-reduce batch statistics (BatchNorm in training mode) over every "
                      "replica's rows, forward and backward (synchronised BatchNorm)"))
    merge: dict = option(
        default_factory=dict,
        help="How a fetched tensor is merged across the replicas, per tensor: sum, mean, "
             "concat or master (default: a scalar is averaged, a batch concatenated, anything "
             "else comes from replica 0). The graph merges these tensors itself, so any "
             "session fetches them merged (see outputs).",
        accepts='{"name:0": "sum" | "mean" | "concat" | "master"}',
        convert=_dict_of("merge", '{"tensor:0": "sum" | "mean" | "concat" | "master"}'),
        check=_check_merge,
        cli=Flag("--merge", metavar="TENSOR=HOW", action="append",
                 convert=lambda items: _pairs(items, "--merge")))
    outputs: tuple = option(
        (), "Tensors (\"name:0\") that any session, not only Session, fetches merged over this "
        "graph's replicas by their original names: the graph merges them (a float scalar "
        "averaged, a batch concatenated) and renames replica 0's op. The merge option's "
        "tensors, the losses collection and scalar summaries' values are merged too.",
        accepts="tensor names", check=_check_outputs,
        convert=_tuple_of("outputs", "tensor names", "['loss:0', 'predictions:0']", none=True),
        cli=Flag("--merge-output", metavar="TENSOR", action="append",
                 help="a tensor any session fetches merged over the replicas by its name "
                      "(repeatable; see docs/semantics.md)"))
    gradients: dict = option(
        default_factory=dict,
        help="A custom optimizer's gradient per variable, where the rewrite cannot find it: "
             "{variable: \"tensor:0\"}, a sparse one as a (values, indices) pair.",
        accepts='{variable: "tensor:0" | (values, indices)}',
        convert=_dict_of("gradients", '{variable: "tensor:0" or (values, indices)}'),
        cli=Flag("--gradient", metavar="VAR=TENSOR", action="append", convert=_gradient_pairs,
                 help="a custom optimizer's gradient for a variable (repeatable); sparse: "
                      "VAR=VALUES,INDICES"))
    timeout_seconds: float = option(
        DEFAULT_TIMEOUT_SECONDS, "A collective or parameter-server wait longer than this for a "
        "peer fails the step instead of hanging; 0: wait forever.",
        default_text="600", check=_check_timeout,
        cli=Flag("--timeout-seconds", metavar="S", type=float))
    heartbeat_seconds: float = option(
        DEFAULT_HEARTBEAT_SECONDS, "Between-graph: a worker whose client has sent no heartbeat for "
        "this long is taken as gone, and the steps waiting for it fail (gr.Session, HeartbeatHook) "
        "instead of waiting for timeout_seconds; 0: no heartbeats.",
        default_text="5", check=_check_heartbeat,
        cli=Flag("--heartbeat-seconds", metavar="S", type=float))
    sync: bool = option(
        True, "Parameter servers: False trains asynchronously (every replica applies its own "
        "gradient, nobody waits).",
        check=boolean("sync"),
        cli=Flag("--async", action="const", const=False,
                 help="parameter servers: every replica applies its own gradient, nobody waits "
                      "(sync=False)"))
    staleness: int = option(
        0, "Parameter servers, between-graph: the steps a worker may run ahead of the applied "
        "updates (0: none).",
        check=_check_staleness, cli=Flag("--staleness", metavar="S", type=int))
    ps_shard_bytes: int = option(
        DEFAULT_PS_SHARD_BYTES, "Parameter-server variables larger than this many bytes are "
        "split by rows across the ps tasks; 0: never.",
        default_text="64 MiB", check=_check_ps_shard_bytes,
        cli=Flag("--ps-shard-bytes", metavar="BYTES", type=int))
    cost_model: object = option(
        None, "Strategy auto: the link speeds and the global batch its cost model assumes, a "
        "CostModel or a dict of its fields (None: 12 GB/s within a machine, 1.25 GB/s between "
        "machines, 10 and 50 us per message, a global batch of 256).",
        accepts="None | CostModel | dict of its fields",
        convert=CostModel.from_value,
        cli=(Flag("--intra-bandwidth", metavar="GB/S", type=float, key="intra_bandwidth", group=_COSTS,
                  help="between the devices of one machine (default 12, PCIe 3.0 x16)",
                  **_link_flag("--intra-bandwidth", 1e9)),
             Flag("--inter-bandwidth", metavar="GB/S", type=float, key="inter_bandwidth", group=_COSTS,
                  help="between machines (default 1.25, 10 Gb Ethernet)",
                  **_link_flag("--inter-bandwidth", 1e9)),
             Flag("--intra-latency", metavar="US", type=float, key="intra_latency", group=_COSTS,
                  help="per message within a machine, microseconds (default 10)",
                  **_link_flag("--intra-latency", 1e-6)),
             Flag("--inter-latency", metavar="US", type=float, key="inter_latency", group=_COSTS,
                  help="per message between machines, microseconds (default 50)",
                  **_link_flag("--inter-latency", 1e-6)),
             Flag("--cost-batch-size", metavar="N", type=int, key="batch_size", group=_COSTS,
                  help="global batch the sparse gradients' costs assume (default 256)",
                  check=_flag_at_least_1("--cost-batch-size"))),
        cli_combine=dict)
    materialize_replicas: bool = option(
        False, "Build every replica while rewriting instead of one template for replicas "
        "1..R-1: the same output graph, slower; for debugging a pass.",
        check=boolean("materialize_replicas"),
        cli=Flag("--materialize-replicas", action="const", const=True, commands=("rewrite",)))
    verify: bool = option(
        True, "Run the verifier after every pass (False: only on the final graph; faster).",
        keyword="verify_each", check=boolean("verify_each"),
        cli=Flag("--no-verify", action="const", const=False, commands=("rewrite",),
                 help="verify only the final graph, not after every pass (verify_each=False)"))
    dump_after: tuple = option(
        (), "Pass names ('all': every pass): write the graph after them into dump_dir as "
        "after_<pass>.pbtxt, to debug a pass.",
        accepts="pass names", check=_check_dump_after,
        convert=_tuple_of("dump_after", "pass names", "('replicate',) or ('all',)"),
        cli=Flag("--dump-after", metavar="PASS", action="append", commands=("rewrite",),
                 help="write the graph after this pass (repeatable; 'all' for every pass)"))
    dump_dir: str = option(
        ".", "Where dump_after writes.", check=_check_dump_dir,
        cli=Flag("--dump-dir", metavar="DIR", commands=("rewrite",),
                 help="where --dump-after writes"))
    log: typing.Optional[typing.Callable] = option(
        None, "A callable receiving progress lines (the CLI's -v prints them).",
        accepts="None | callable(str)", check=_check_log, api_only=True)

    def validate(self):
        """Checks every field (its spec's check), then the combinations; returns self."""
        for f, spec in specs():
            if spec.check is not None:
                spec.check(getattr(self, f.name))
        if self.staleness and not self.sync:
            raise GraphRewriteError("staleness bounds synchronous training; with sync=False "
                                    "workers are never held back", hint="drop one of the two options")
        if (self.staleness or not self.sync) and self.strategy not in ("ps", "hybrid"):
            raise GraphRewriteError(
                f"staleness and sync=False apply to parameter servers, not strategy {self.strategy!r}",
                hint="use strategy='ps' or 'hybrid'")
        if self.communication == "nccl" and self.device_type != "GPU":
            raise GraphRewriteError(
                "communication 'nccl' runs on GPUs, but the replicas are CPU devices",
                hint="use communication 'ring' or 'auto' for CPU replicas")
        if self.accumulation_steps > 1 and not self.sync:
            raise GraphRewriteError(
                "accumulation_steps with sync=False: asynchronous workers apply their own gradients "
                "as they come, so there is no step to accumulate towards",
                hint="train synchronously, or drop accumulation_steps")
        return self

    @classmethod
    def from_keywords(cls, **keywords):
        """Options from ``rewrite()``'s keywords: unknown names rejected with the closest
        valid one, each value converted (``OptionSpec.convert``), then validated."""
        by_keyword = {keyword_of(f, spec): (f, spec) for f, spec in specs()}
        for name in keywords:
            if name not in by_keyword:
                raise unknown_keyword(name, by_keyword)
        values = {}
        for name, value in keywords.items():
            f, spec = by_keyword[name]
            values[f.name] = spec.convert(value) if spec.convert is not None else value
        for f, spec in specs():   # a default goes through convert too (cost_model: CostModel())
            if f.name not in values and spec.convert is not None and f.default is not dataclasses.MISSING:
                values[f.name] = spec.convert(f.default)
        return cls(**values).validate()


def specs():
    """(dataclasses.Field, OptionSpec) of every option, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(Options)]


def keyword_of(f, spec):
    return spec.keyword or f.name


def keywords():
    """rewrite()'s option keywords, in declaration order."""
    return [keyword_of(f, spec) for f, spec in specs()]


def default_of(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def unknown_keyword(name, valid):
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    if close:
        hint = (f"use '{close[0]}', the closest valid keyword "
                "(help(graph_rewriter.rewrite) lists every option)")
    else:
        hint = f"use one of {', '.join(valid)}"
    return GraphRewriteError(f"rewrite() got an unknown keyword '{name}'", hint=hint)


def keywords_from_cli(args, command="rewrite"):
    """rewrite()'s keywords from parsed flags: only the flags given (the rest keep the
    schema's defaults), each checked in the flag's words and converted."""
    out = {}
    for f, spec in specs():
        given = {}
        for flag in spec.cli:
            if command not in flag.commands:
                continue
            value = getattr(args, flag.dest, None)
            if value is None:
                continue
            if flag.check is not None:
                flag.check(value)
            given[flag.key or f.name] = flag.convert(value) if flag.convert is not None else value
        if given:
            out[keyword_of(f, spec)] = spec.cli_combine(given) if spec.cli_combine else given[f.name]
    return out


def docstring(summary):
    """``rewrite()``'s docstring: ``summary`` and every option with its default and help."""
    lines = [summary.rstrip(), "", "Options (keyword=default, what it takes; the CLI flag):", ""]
    for f, spec in specs():
        default = spec.default_text or repr(default_of(f))
        flags = ", ".join(flag.name for flag in spec.cli) or "API only"
        lines.append(f"``{keyword_of(f, spec)}`` = {default}"
                     + (f" ({spec.accepts})" if spec.accepts else "") + f" [{flags}]")
        lines.extend("    " + line for line in textwrap.wrap(spec.help, 84))
    return "\n".join(lines) + "\n"
