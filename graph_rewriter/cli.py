"""The graph-rewrite command.

    graph-rewrite IN OUT [--cluster SPEC] [--strategy S] [--devices-per-worker N]
                         [--device-type GPU|CPU] [--task JOB:INDEX] [-v] ...
    graph-rewrite plan IN [...]           print the per-variable plan as JSON
    graph-rewrite inspect FILE            what a rewritten graph does
    graph-rewrite serve --cluster SPEC --task JOB:INDEX
    graph-rewrite demo

Rejected input exits with status 2 and one line ``graph-rewrite: error: ...`` on stderr,
never a traceback, and leaves OUT as it was (the output is written to a temporary file
and renamed into place only when everything succeeded).
"""

import argparse
import os
import signal
import sys
import threading
import time

from graph_rewriter import __version__
from graph_rewriter.errors import GraphRewriteError

PROG = "graph-rewrite"
SUBCOMMANDS = ("plan", "inspect", "serve", "demo")

REWRITE_EXAMPLES = """examples:
  graph-rewrite train.pb train_4gpu.pb --devices-per-worker 4
  graph-rewrite train.pbtxt out.pb --device-type CPU --devices-per-worker 2 -v
  graph-rewrite train.meta out.meta --devices-per-worker 8 --compression fp16
  graph-rewrite saved_model_dir/ out_dir/ --tag train --devices-per-worker 4
  graph-rewrite train.pb out.pb --plan plan.json
  graph-rewrite train.pb worker1.pb --cluster cluster.json --strategy ps --task worker:1
  graph-rewrite train.pb out.pb --dump-after replicate --dump-dir /tmp/dumps

other commands: graph-rewrite {plan,inspect,serve,demo} --help
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message):
        sys.stderr.write(f"{PROG}: error: {message}. To fix this, see `{self.prog} --help`\n")
        sys.exit(2)


def _add_rewrite_options(p, command="rewrite"):
    """--cluster, every rewrite option's flag(s) of ``command`` (generated from
    graph_rewriter/options.py) and -v."""
    from graph_rewriter import options
    p.add_argument("--cluster", metavar="SPEC",
                   help="cluster spec: JSON text or a JSON file {\"worker\": [\"host:port\", ...], \"ps\": [...]}; "
                        "default: this machine only (or TF_CONFIG when set)")
    groups = {}
    for f, spec in options.specs():
        for flag in spec.cli:
            if command not in flag.commands:
                continue
            if flag.group is None:
                target = p
            elif flag.group not in groups:
                target = groups[flag.group] = p.add_argument_group(flag.group)
            else:
                target = groups[flag.group]
            _add_flag(target, flag, spec, f)
    p.add_argument("-v", "--verbose", action="store_true", help="print progress and per-pass timings")


def _add_flag(target, flag, spec, f):
    """One argparse argument from the schema; an absent flag parses as None, so the
    option keeps rewrite()'s default."""
    from graph_rewriter import options
    help_text = flag.help
    if help_text is None:
        help_text = spec.help[:1].lower() + spec.help[1:].rstrip(".")
        if flag.action == "store":
            help_text += f"; default: {spec.default_text or options.default_of(f)}"
    help_text = help_text.replace("%", "%%")
    kwargs = dict(dest=flag.dest, default=None, help=help_text)
    if flag.action == "const":
        kwargs.update(action="store_const", const=flag.const)
    else:
        kwargs.update(action=flag.action, metavar=flag.metavar, choices=flag.choices)
        if flag.type is not None:
            kwargs["type"] = flag.type
    target.add_argument(flag.name, **kwargs)


def _rewrite_parser():
    p = _Parser(prog=PROG, description="Rewrite a single-device TensorFlow 1 training graph into a "
                "data-parallel one.", epilog=REWRITE_EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN", help="the training graph: .pb, .pbtxt (GraphDef), .meta (MetaGraphDef) "
                   "or a TF1 SavedModel directory (see --tag)")
    p.add_argument("output", metavar="OUT", help="where to write the rewritten graph (.pb, .pbtxt or .meta); "
                   "with a SavedModel IN, any other path is a new SavedModel directory")
    _add_rewrite_options(p, "rewrite")
    p.add_argument("--plan", metavar="FILE", help="apply a plan written by `graph-rewrite plan` (and perhaps edited)")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return p


def _plan_parser():
    p = _Parser(prog=f"{PROG} plan", description="Print the per-variable plan of a rewrite as JSON.",
                epilog="example:\n  graph-rewrite plan train.pb --devices-per-worker 4 > plan.json\n"
                       "  (edit plan.json, then) graph-rewrite train.pb out.pb --devices-per-worker 4 --plan plan.json",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN", help="the training graph: .pb, .pbtxt (GraphDef), .meta (MetaGraphDef) "
                   "or a TF1 SavedModel directory (see --tag)")
    _add_rewrite_options(p, "plan")
    return p


def _inspect_parser():
    p = _Parser(prog=f"{PROG} inspect", description="Describe a rewritten graph: replicas, devices, "
                "per-variable plan, collectives, bytes moved per step.",
                epilog="example:\n  graph-rewrite inspect out.pb\n  graph-rewrite inspect out.pb --json\n"
                       "  graph-rewrite inspect out.pb --batch-size 4096   # sparse bytes per step\n"
                       "  graph-rewrite inspect out.pb --dot out.dot --tensorboard logs/",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a graph (or SavedModel directory) written by graph-rewrite "
                   "or result.save()")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="the global batch size: sparse gradients' bytes per step instead of per example")
    p.add_argument("--dot", metavar="FILE",
                   help="also write a Graphviz picture of the replicas, variables and communication "
                        "(render with: dot -Tsvg FILE -o out.svg)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the graph as a TensorBoard event file in DIR (tensorboard --logdir DIR)")
    return p


def _serve_parser():
    p = _Parser(prog=f"{PROG} serve", description="Start a TensorFlow server configured for rewritten "
                "graphs and block until interrupted.",
                epilog="example:\n  graph-rewrite serve --cluster cluster.json --task worker:0\n"
                       "  graph-rewrite serve --cluster '{\"worker\": [\"localhost:2222\"]}' --task worker:0 "
                       "--device-type CPU --devices-per-worker 2\n"
                       "  graph-rewrite serve --cluster cluster.json --task worker:1 --communication nccl",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", metavar="SPEC", help="JSON text or a JSON file (default: TF_CONFIG's cluster)")
    p.add_argument("--task", metavar="JOB:INDEX", help="this server's task, e.g. worker:0 (default: TF_CONFIG's task)")
    p.add_argument("--device-type", default="GPU", metavar="GPU|CPU",
                   help="the replicas' device type the graphs will use (CPU: the server gets N CPU devices)")
    p.add_argument("--devices-per-worker", type=int, default=1, metavar="N",
                   help="replicas per worker, as given to the rewrite (default 1)")
    p.add_argument("--communication", choices=("auto", "ring", "nccl"), default="auto", metavar="auto|ring|nccl",
                   help="nccl: every GPU collective uses NCCL, whatever the graph's hint "
                        "(ConfigProto.experimental.collective_nccl); auto and ring: TensorFlow's "
                        "default, NCCL only where the graph asks for it. Give every server the "
                        "same value (default: auto)")
    p.add_argument("--no-supervise", action="store_true",
                   help="run the TensorFlow server in this process and nothing more. By default "
                        "serve runs it in a child process and starts a new one on the same address "
                        "when its collectives are unusable until the process ends: TensorFlow "
                        "aborted them, or a peer it formed groups with has restarted since "
                        "(docs/reliability.md)")
    return p


def _demo_parser():
    p = _Parser(prog=f"{PROG} demo", description="Build a small model, train it on one device, start a "
                "local cluster (1 ps + 2 worker servers on loopback, 2 CPU devices each), rewrite the "
                "model per worker, train it there and print both losses side by side.",
                epilog="examples:\n  graph-rewrite demo\n  graph-rewrite demo --strategy hybrid --steps 50",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=("ps", "hybrid", "allreduce"), default="ps",
                   help="how the workers share the variables (default: ps)")
    p.add_argument("--steps", type=int, default=30, metavar="N", help="training steps (default: 30)")
    return p


def _rewrite_kwargs(args, command="rewrite"):
    """rewrite()'s keywords from the parsed flags (the schema maps and checks them)."""
    from graph_rewriter.options import keywords_from_cli
    return dict(cluster_spec=args.cluster, **keywords_from_cli(args, command))


def _log(message):
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()


def cmd_rewrite(argv):
    args = _rewrite_parser().parse_args(argv)
    if not os.path.exists(args.input):
        raise GraphRewriteError(f"{args.input}: no such file",
                                hint="check the path (and the working directory)")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise GraphRewriteError(f"{args.output}: cannot write: folder '{out_dir}' does not exist",
                                hint="create the folder first, or write somewhere else")
    if not os.access(out_dir, os.W_OK):
        raise GraphRewriteError(f"{args.output}: cannot write: folder '{out_dir}' is not writable",
                                hint="write somewhere this process may create files")
    from graph_rewriter import saved_model
    if saved_model.saved_model_dir(args.input) is not None and saved_model.is_saved_model_output(args.output):
        saved_model.check_output_dir(args.output)   # before the rewrite's work, not after
    from graph_rewriter.api import rewrite
    kwargs = _rewrite_kwargs(args, "rewrite")
    if args.plan:
        kwargs["strategy"] = args.plan if args.plan.endswith(".json") else _plan_from(args.plan)
    started = time.perf_counter()
    result = rewrite(args.input, **kwargs, log=_log if args.verbose else None)
    result.save(args.output)
    if args.verbose:
        for line in result.summary().splitlines():
            _log(line)
    print(f"{PROG}: wrote {args.output}: {result.metadata['plan']['strategy']}, "
          f"{result.num_replicas} replica(s), {result.num_nodes} nodes, "
          f"{time.perf_counter() - started:.2f} s")
    return 0


def _plan_from(path):
    from graph_rewriter import graph_io
    from graph_rewriter.plan import Plan
    return Plan.from_json(graph_io.read_file(path).decode("utf-8", "replace"), path)


def cmd_plan(argv):
    args = _plan_parser().parse_args(argv)
    from graph_rewriter.api import rewrite
    result = rewrite(args.input, **_rewrite_kwargs(args, "plan"), log=_log if args.verbose else None)
    sys.stdout.write(result.plan.to_json())
    return 0


def cmd_inspect(argv):
    args = _inspect_parser().parse_args(argv)
    from graph_rewriter.api import load
    from graph_rewriter.inspect_report import format_report, report
    if args.batch_size is not None and args.batch_size < 1:
        raise GraphRewriteError(f"--batch-size must be a positive number of examples, got {args.batch_size}",
                                hint="give the global batch size, e.g. --batch-size 256")
    result = load(args.file)
    rep = report(result, batch_size=args.batch_size)
    if args.dot:
        from graph_rewriter.graph_io import write_atomic
        from graph_rewriter.inspect_report import to_dot
        write_atomic(args.dot, to_dot(rep).encode())
    if args.tensorboard:
        from graph_rewriter.inspect_report import write_tensorboard
        try:
            os.makedirs(args.tensorboard, exist_ok=True)
        except OSError as e:
            raise GraphRewriteError(f"--tensorboard {args.tensorboard}: cannot create the directory ({e.strerror})",
                                    hint="give a folder this process may create") from None
        write_tensorboard(result.graph_def, args.tensorboard)
    if args.json:
        import json
        sys.stdout.write(json.dumps(rep, indent=2) + "\n")
    else:
        sys.stdout.write(format_report(rep))
    return 0


def cmd_serve(argv):
    args = _serve_parser().parse_args(argv)
    if (args.cluster is None or args.task is None) and not os.environ.get("TF_CONFIG"):
        raise GraphRewriteError("serve needs --cluster and --task (or a TF_CONFIG environment variable)",
                                hint="pass e.g. --cluster cluster.json --task worker:0")
    task = args.task or "the TF_CONFIG task"
    if not args.no_supervise:
        from graph_rewriter.cluster import parse_cluster
        parse_cluster(args.cluster, args.task)   # a bad spec or task: refused here, not by each child
        from graph_rewriter.supervisor import Supervisor
        level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")
        supervisor = Supervisor([sys.executable, "-m", "graph_rewriter.cli", "serve", *argv, "--no-supervise"],
                                task, _log, forward_level=int(level) if level.isdigit() else 3)
        signal.signal(signal.SIGTERM, supervisor.stop)
        try:
            return supervisor.run()
        except KeyboardInterrupt:
            return 0
    from graph_rewriter.tf_runtime import import_tensorflow
    import_tensorflow("graph-rewrite serve")
    from graph_rewriter.server import start_server
    server = start_server(args.cluster, args.task, device_type=args.device_type,
                          devices_per_worker=args.devices_per_worker, communication=args.communication)
    _log(f"serving {task} at {server.target} (process {os.getpid()}; Ctrl-C to stop)")
    _watch_incarnations(server, args)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(True))
    try:
        # server.join() blocks inside TensorFlow where no Python signal handler runs;
        # sleeping in Python keeps SIGTERM and Ctrl-C prompt.
        while not stopping:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    return 0


def _watch_incarnations(server, args):
    """A compute server of a cluster with several compute tasks watches its collective
    peers' incarnations: once a peer it formed groups with has restarted, TensorFlow
    refuses that peer here until this server restarts, so serve says so (and, supervised,
    replaces this server; graph_rewriter/incarnations.py)."""
    from graph_rewriter.cluster import parse_cluster
    from graph_rewriter.incarnations import Watcher
    cluster = parse_cluster(args.cluster, args.task)
    if cluster.task in cluster.compute_tasks and len(cluster.compute_tasks) > 1:
        label = f"{cluster.task[0]}:{cluster.task[1]}"
        Watcher(server, cluster, lambda message: _log(f"{label}: {message}")).start()


def cmd_demo(argv):
    args = _demo_parser().parse_args(argv)
    if args.steps < 1:
        raise GraphRewriteError(f"--steps must be at least 1, got {args.steps}",
                                hint="give --steps 1 or more")
    from graph_rewriter.tf_runtime import import_tensorflow
    import_tensorflow("graph-rewrite demo")
    from graph_rewriter.demo import run_demo
    return run_demo(log=lambda line: print(line, flush=True), steps=args.steps, strategy=args.strategy)


class _Terminated(BaseException):
    """SIGTERM, raised where the process is so that cleanup (the output's temporary file)
    runs as it does for Ctrl-C."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": cmd_plan, "inspect": cmd_inspect, "serve": cmd_serve, "demo": cmd_demo}
    previous = None
    if not (argv and argv[0] == "serve") and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)   # serve installs its own
    try:
        # Rewriting, planning and inspecting need no TensorFlow (protos.py, opdefs.py):
        # it is imported where its runtime is needed (demo, serve, shape inference).
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        return cmd_rewrite(argv)
    except GraphRewriteError as e:
        sys.stderr.write(f"{PROG}: error: {' '.join(str(e).split())}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    except _Terminated:
        sys.stderr.write(f"{PROG}: terminated\n")
        return 143
    except Exception as e:  # a bug, not bad input: still no traceback unless asked for
        if os.environ.get("GRAPH_REWRITE_DEBUG"):
            raise
        sys.stderr.write(f"{PROG}: internal error: {type(e).__name__}: {' '.join(str(e).split())[:500]} "
                         f"(set GRAPH_REWRITE_DEBUG=1 for a traceback; please report it)\n")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
