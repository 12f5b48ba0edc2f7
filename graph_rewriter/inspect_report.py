"""What `graph-rewrite inspect` reports about a rewritten graph, as data and as text.

Everything comes from the graph itself: its metadata node (replicas, plan, passes) and
its nodes (devices of variables, the collectives and their keys).
"""

import os
import re

from graph_rewriter import dtypes
from graph_rewriter.collectives import NEVER_RUNS
from graph_rewriter.op_vocabulary import input_kind
from graph_rewriter.plan import DRAWN, sparse_line
from graph_rewriter.verifier import COLLECTIVES

_INDEX_BYTES = {"int32": 4, "int64": 8}
_ACCUMULATORS = ("ConditionalAccumulator", "SparseConditionalAccumulator")
_QUEUES = ("FIFOQueueV2", "FIFOQueue", "PaddingFIFOQueueV2", "RandomShuffleQueueV2", "PriorityQueueV2")


def _row_bytes(cut):
    """Bytes of one gathered row: its values and its index."""
    return cut["bytes"] // max(cut["shape"][0], 1) + _INDEX_BYTES.get(cut.get("index_dtype"), 8)


def sparse_gather_bytes(cut, num_replicas, batch_size):
    """Bytes one replica receives per step gathering a sparse gradient for a global
    batch of ``batch_size`` examples: every replica's rows (before deduplication) padded
    to a power of two (see passes/allgather.py), values and indices, plus the row counts.
    None when the rows per example are not fixed or the batch size is not given."""
    if cut.get("rows_per_example") is None or not cut.get("shape") or not batch_size:
        return None
    rows = -(-batch_size // num_replicas) * cut["rows_per_example"]   # one replica's rows
    padded = 1 << max(rows - 1, 0).bit_length()
    return num_replicas * (padded * _row_bytes(cut) + 8)


def _sparse_entry(cut, num_replicas, batch_size):
    per_example = (cut["rows_per_example"] * _row_bytes(cut)
                   if cut.get("rows_per_example") is not None and cut.get("shape") else None)
    return {"bytes": sparse_gather_bytes(cut, num_replicas, batch_size),
            "bytes_per_example": per_example, "rows_per_example": cut.get("rows_per_example")}


def _const_value(nodes, name):
    n = nodes.get(name.split(":")[0])
    if n is None or n.op != "Const":
        return None
    return dtypes.int_scalar(n.attr["value"].tensor)


def report(result, batch_size=None):
    """A dict describing ``result`` (a RewriteResult); ``batch_size`` (the global batch)
    turns sparse gradients' bytes per example into bytes per step."""
    md = result.metadata
    plan = md["plan"]
    nodes = {n.name: n for n in result.graph_def.node}
    prefixes = md["replica_prefixes"]
    cuts = {}   # variable -> its cuts (two train ops, or two applications of a layer: several)
    for c in plan["cuts"]:
        cuts.setdefault(c["variable"], []).append(c)
    variables = []
    for v in plan["variables"]:
        cut = cuts.get(v["name"], [None])[0]
        on_ps = v.get("placement") == "ps"
        if cut is None:
            sync = ("on the ps (updated once per step, by the chief)" if on_ps
                    else "local (same update on every replica)" if v["role"] != "trainable" else "none")
        elif cut["sync"] == "allreduce":
            packs = sorted({c["pack"] for c in cuts[v["name"]] if c["sync"] == "allreduce"})
            sync = f"allreduce pack{'s' if len(packs) > 1 else ''} {', '.join(map(str, packs))}"
        elif cut["sync"] == "accumulate":
            sync = f"ps accumulator ({cut['kind']})"
        elif cut["sync"] == "local":
            sync = "local (each replica keeps its own rows)"
        else:
            sync = "allgather rows"
        copies = [p + v["name"] for p in prefixes if (p + v["name"]) in nodes]
        shards = v.get("shards") or []
        if shards:
            parts = [f"{v['name']}/part_{k}" for k in range(len(shards))]
            devices = [nodes[p].device for p in parts if p in nodes]
            device = ", ".join(devices) or "?"
        else:
            devices = [nodes[c].device for c in copies]
            device = nodes[v["name"]].device if v["name"] in nodes else ""
        variables.append({
            "name": v["name"], "role": v["role"], "dtype": v["dtype"], "shape": v["shape"],
            "bytes": v["bytes"], "placement": v.get("placement", "mirrored"), "sync": sync,
            "device": device, "devices": devices, "copies": len(copies),
            "shards": [{"ps_task": s["ps_task"], "rows": s["rows"]} for s in shards],
            "costs": (cut or {}).get("costs")})
    gradients = [{"variable": c["variable"], "cut": c.get("name") or c["variable"], "averaged_at": c["values"], "indices": c.get("indices"),
                  "sync": c["sync"], "role": c["role"], "received": c.get("received") or [],
                  "post_processing": c.get("post_processing") or []} for c in plan["cuts"]]
    collectives = []
    for n in result.graph_def.node:
        if n.op not in COLLECTIVES or any(n.name.startswith(p) for p in prefixes[1:]) or NEVER_RUNS in n.attr:
            continue   # (replica 0's stand for the others; the step-sequence marker never runs)
        collectives.append({
            "name": n.name, "op": n.op, "device": n.device,
            "group_size": _const_value(nodes, n.input[1]), "group_key": _const_value(nodes, n.input[2]),
            "instance_key": _const_value(nodes, n.input[3])})
    accumulators = [{"name": n.name, "op": n.op, "device": n.device,
                     "shared_name": n.attr["shared_name"].s.decode()}
                    for n in result.graph_def.node if n.op in _ACCUMULATORS]
    queues = [{"name": n.name, "device": n.device, "shared_name": n.attr["shared_name"].s.decode()}
              for n in result.graph_def.node if n.op in _QUEUES]
    compression = plan.get("compression")
    wire = {None: 1.0, "fp16": 0.5, "bf16": 0.5}.get(compression, 1.0)
    r = md["num_replicas"]
    dense_bytes = sum(int(p["bytes"] * (wire if p["dtype"] in ("float32", "float64") else 1.0))
                      for p in plan["packs"])
    sparse = {c.get("name") or c["variable"]: _sparse_entry(c, r, batch_size)
              for c in plan["cuts"] if c["sync"] == "allgather"}
    ps_cuts = [c for c in plan["cuts"] if c["sync"] == "accumulate"]
    ps_dense = sum(c["bytes"] or 0 for c in ps_cuts if c["kind"] == "dense")
    return {
        "strategy": plan["strategy"], "notes": list(plan.get("notes") or []), "num_replicas": r,
        **({"normalizers": list(plan["normalizers"])} if plan.get("normalizers") else {}),
        **({"selected_means": list(plan["selected_means"])} if plan.get("selected_means") else {}),
        **({"random_draws": list(plan["random_draws"])} if plan.get("random_draws") else {}),
        **({"row_defaults": list(plan["row_defaults"])} if plan.get("row_defaults") else {}),
        **({"loop_bounds": list(plan["loop_bounds"])} if plan.get("loop_bounds") else {}),
        **({"gathered_rows": [t for t, _ in plan["gathered_rows"]]} if plan.get("gathered_rows") else {}),
        **({"product_head": list(plan["product_head"]["products"])} if plan.get("product_head") else {}),
        **({"row_moves": list(plan["row_moves"]["moves"])} if plan.get("row_moves") else {}),
        **({"loss_sums": list(plan["loss_sums"])} if plan.get("loss_sums") else {}),
        **({"invariant_terms": [key for key, _, _ in plan["invariant_terms"]]} if plan.get("invariant_terms") else {}),
        **({"sync_batch_statistics": list(plan["sync_batch_statistics"])}
           if plan.get("sync_batch_statistics") else {}),
        "replicas": [{"prefix": p, "device": d} for p, d in zip(prefixes, md["replica_devices"])],
        "batch_inputs": md["batch_inputs"],
        **({"sparse_inputs": [list(t) for t in plan["sparse_inputs"]]} if plan.get("sparse_inputs") else {}),
        "inputs": _inputs(md, nodes),
        "variables": variables,
        "packs": [{"index": i, "dtype": p["dtype"], "bytes": p["bytes"], "gradients": p["cuts"],
                   **({"algorithm": p["algorithm"]} if p.get("algorithm") else {})}
                  for i, p in enumerate(plan["packs"])],
        "gradients": gradients, "collectives": collectives,
        "accumulators": accumulators,
        "queues": queues,
        "bytes_per_step_per_replica": {
            "dense_payload": dense_bytes if r > 1 else 0,
            "dense_ring_traffic": int(2 * (r - 1) / r * dense_bytes) if r > 1 else 0,
            "sparse": sparse if r > 1 else {},
            "batch_size": batch_size,
            # parameter servers: each replica pushes its gradients to the accumulators and
            # reads the variables it uses (sparse ones: the rows of its examples)
            "ps_dense_gradients": ps_dense,   # a dense gradient has its variable's bytes
            "ps_dense_reads": ps_dense,
            "ps_sparse": {c.get("name") or c["variable"]: _sparse_entry(c, r, batch_size)
                          for c in ps_cuts if c["kind"] == "sparse"},
        },
        "compression": compression,
        "accumulation_steps": plan.get("accumulation_steps", 1),
        "cost_model": plan.get("cost"),
        "passes": md["passes"],
        "nodes": len(result.graph_def.node),
    }


def _inputs(md, nodes):
    """Per batch input: name, kind, mode (split or per_replica), static and global batch.
    A graph whose inputs are all split carries no "inputs" in its metadata: each is split,
    with no static batch and the global batch as fed."""
    if md.get("inputs") is not None:
        return [dict(i) for i in md["inputs"]]
    out = []
    for name in md["batch_inputs"]:
        node = nodes.get(name.split(":")[0])
        kind = input_kind(node.op) if node is not None else "placeholder"
        out.append({"name": name, "kind": kind, "mode": "split", "static_batch": None, "global_batch": None})
    return out


_ALGORITHM_NOTES = {
    "hierarchical": ", hierarchical (within each worker, across the workers' first replicas, back)",
    "reduce_to_one": ", reduced on one device (every replica's pack summed there, the mean read back)",
}


def _size(n):
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n}"


_DEVICE = re.compile(r"^(?P<job>/job:[^/]+)?(?P<replica>/replica:\d+)?(?:/task:(?P<task>\d+))?"
                     r"/device:(?P<type>[^:/]+):(?P<index>\d+)$")


def _ranges(numbers):
    """[0, 1, 2, 3, 6] -> '0-3,6' (sorted, duplicates dropped)."""
    out, run = [], []
    for n in sorted(set(numbers)):
        if run and n != run[-1] + 1:
            out.append(run)
            run = []
        run.append(n)
    if run:
        out.append(run)
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def compact_devices(devices):
    """Devices written compactly, as docs/cli.md describes: the device indices of one
    task as ranges ('/job:worker/replica:0/task:0/device:CPU:0-3'), and tasks with the
    same indices as a range of tasks ('.../task:0-1/device:GPU:0-7': GPUs 0-7 on each
    of tasks 0 and 1). Devices that do not parse are listed as they are."""
    parsed = [_DEVICE.match(d or "") for d in devices]
    if not devices or not all(parsed):
        return ", ".join(dict.fromkeys(d or "?" for d in devices))
    by_task = {}   # (job, replica, type) -> {task: [indices]}, in order of appearance
    for m in parsed:
        key = (m["job"] or "", m["replica"] or "", m["type"])
        task = int(m["task"]) if m["task"] is not None else None
        by_task.setdefault(key, {}).setdefault(task, []).append(int(m["index"]))
    groups = []
    for (job, replica, dtype), tasks in by_task.items():
        by_indices = {}   # the same device indices on several tasks: one range of tasks
        for task, indices in tasks.items():
            by_indices.setdefault(_ranges(indices), []).append(task)
        for indices, task_list in by_indices.items():
            task_part = "" if task_list == [None] else f"/task:{_ranges(task_list)}"
            groups.append(f"{job}{replica}{task_part}/device:{dtype}:{indices}")
    return ", ".join(groups)


def _where(v):
    """Where a variable of the report lives: its copies' (or shards') devices, compact."""
    if not v.get("devices"):
        return v.get("device") or "?"
    text = compact_devices(v["devices"])
    if v.get("shards"):
        return f"{text} ({len(v['shards'])} shards)"
    if v["copies"] > 1:
        return f"{text} ({v['copies']} copies)"
    return text


_COST_NAMES = {"allreduce": "allreduce", "allgather": "allgather", "accumulate": "ps", "ps": "ps"}


def _ms(seconds):
    return f"{seconds * 1000:.3f} ms"


def format_report(rep):
    """The report as readable text."""
    lines = [f"strategy:   {rep['strategy']}"]
    lines += [f"note:       {note}" for note in rep.get("notes") or []]
    if rep.get("normalizers"):
        lines.append("loss normalizers (sums over the batch a loss divides by, averaged across replicas): "
                     + ", ".join(rep["normalizers"]))
    if rep.get("selected_means"):
        lines.append("means over selected rows (each divides by the replicas' mean count of selected rows): "
                     + ", ".join(rep["selected_means"]))
    if rep.get("sync_batch_statistics"):
        lines.append("synchronised batch statistics (all-reduced over every replica's rows, forward and "
                     "backward): " + ", ".join(rep["sync_batch_statistics"]))
    if rep.get("random_draws"):
        lines.append("random draws of the batch's rows (each replica draws every replica's rows and keeps its own): "
                     + ", ".join(rep["random_draws"]))
    if rep.get("row_defaults"):
        lines.append("initial states (the name holds every replica's rows, each replica reads its own: feed them "
                     "with every replica's rows): " + ", ".join(rep["row_defaults"]))
    if rep.get("loop_bounds"):
        lines.append("loop bounds (while loops that draw at every step run to the batch's bound, the replicas' "
                     "maximum): " + ", ".join(rep["loop_bounds"]))
    if rep.get("gathered_rows"):
        lines.append("rows gathered from every replica for the updates that write them into variables: "
                     + ", ".join(rep["gathered_rows"]))
    if rep.get("product_head"):
        lines.append("in-batch products and rankings computed over every replica's rows (each replica gathers "
                     "the rows they meet and keeps its own rows' gradients): " + ", ".join(rep["product_head"]))
    if rep.get("row_moves"):
        lines.append("rows moved within the batch over every replica's rows (each replica gathers the rows, moves "
                     "them and keeps its own): " + ", ".join(rep["row_moves"]))
    if rep.get("loss_sums"):
        lines.append("losses summed over the batch's rows (each replica's sum and its gradient count "
                     f"{rep['num_replicas']} times): " + ", ".join(rep["loss_sums"]))
    if rep.get("invariant_terms"):
        lines.append("gradient terms every replica computes alike (weight decay's: replica 0 adds them "
                     f"{rep['num_replicas']} times, the others leave them out), of: "
                     + ", ".join(rep["invariant_terms"]))
    lines.append(f"replicas:   {rep['num_replicas']}")
    for i, rp in enumerate(rep["replicas"]):
        lines.append(f"  replica {i}: {rp['device']}" + (f"  (nodes '{rp['prefix']}*')" if rp["prefix"] else "  (original names)"))
    inputs = rep.get("inputs") or []
    if rep.get("sparse_inputs"):
        lines.append(sparse_line(rep["sparse_inputs"]))
    if not any(i["mode"] == "per_replica" for i in inputs):
        lines.append(f"batch inputs split across replicas: {', '.join(rep['batch_inputs']) or 'none'}")
    else:
        lines.append(f"batch inputs ({len(inputs)}): split divides the batch across replicas, "
                     "per_replica gives each replica its own batch")
        width = max(len(i["name"]) for i in inputs)
        for i in inputs:
            static = i["static_batch"] if i["static_batch"] is not None else "none"
            if i["global_batch"] is not None:
                total = str(i["global_batch"])
            elif i["mode"] == "per_replica":
                total = f"{rep['num_replicas']} x the batch"
            else:
                total = "as " + ("drawn" if i["kind"] in DRAWN else "fed")
            lines.append(f"  {i['name']:<{width}}  {i['kind']:<11} {i['mode']:<11}  "
                         f"static batch {static}, global batch {total}")
    lines.append("variables:")
    width = max([len(v["name"]) for v in rep["variables"]] + [8])
    for v in rep["variables"]:
        shape = "x".join(str(d) for d in v["shape"]) if v["shape"] is not None else "?"
        lines.append(f"  {v['name']:<{width}}  {v['role']:<9} {v['dtype']:<8} {shape:<12} "
                     f"{_size(v['bytes']):>10}  {v['sync']}  on {_where(v)}")
    grads = rep.get("gradients") or []
    if grads:
        lines.append("gradients: where each is averaged, and what runs on the average before the update:")
        width_g = max(len(g["cut"]) for g in grads)
        for g in grads:
            where = g["averaged_at"] + (f" (rows, ids {g['indices']})" if g["indices"] else "")
            after = (f"then {', '.join(g['post_processing'])} -> {', '.join(g['received'])}"
                     if g["post_processing"] else "read by the update as it is")
            lines.append(f"  {g['cut']:<{width_g}}  {g['sync']:<10} at {where}; {after}")
    priced = [v for v in rep["variables"] if v.get("costs")]
    if priced:
        lines.append("auto: predicted communication per step of each choice (chosen first):")
        for v in priced:
            chosen = _COST_NAMES.get(v["sync"].split(" ")[0], "")
            costs = sorted(v["costs"].items(), key=lambda kv: (_COST_NAMES[kv[0]] != chosen, kv[1]["seconds"]))
            text = ", ".join(f"{_COST_NAMES[s]} {_ms(c['seconds'])}"
                             + (f" ({c['shards']} shards)" if c.get("shards") else "") for s, c in costs)
            lines.append(f"  {v['name']:<{width}}  {text}")
    cost = rep.get("cost_model")
    if cost:
        m, t, p = cost["model"], cost["topology"], cost["predicted"]
        lines.append(
            f"cost model: {t['workers']} worker(s) x {t['devices_per_worker']} device(s), "
            f"{t['ps_tasks']} ps task(s); links {m['intra_bandwidth'] / 1e9:g} GB/s within a machine, "
            f"{m['inter_bandwidth'] / 1e9:g} GB/s between; global batch {m['batch_size']}")
        lines.append(f"  predicted communication per step: {_ms(p['seconds'])} (allreduce "
                     f"{_ms(p['allreduce'])}, allgather {_ms(p['allgather'])}, ps {_ms(p['ps'])})")
    if rep.get("accumulation_steps", 1) > 1:
        lines.append(f"accumulation: gradients summed over {rep['accumulation_steps']} runs "
                     "(micro-batches), synchronised and applied on every last one")
    lines.append(f"packs ({len(rep['packs'])}):")
    for p in rep["packs"]:
        lines.append(f"  pack {p['index']}: {p['dtype']}, {_size(p['bytes'])}, {len(p['gradients'])} gradient(s)"
                     + _ALGORITHM_NOTES.get(p.get("algorithm"), ""))
    if rep["accumulators"]:
        lines.append(f"accumulators ({len(rep['accumulators'])}):")
        for a in rep["accumulators"]:
            lines.append(f"  {a['op']:<29} on {a['device'] or '?'}  {a['name']}")
    if rep["queues"]:
        lines.append(f"queues ({len(rep['queues'])}):")
        for q in rep["queues"]:
            lines.append(f"  {q['name']}  on {q['device'] or '?'}")
    lines.append(f"collectives on replica 0 ({len(rep['collectives'])}):")
    for c in rep["collectives"]:
        lines.append(f"  {c['op']:<20} group {c['group_key']} size {c['group_size']} instance "
                     f"{c['instance_key']}  {c['name']}")
    b = rep["bytes_per_step_per_replica"]
    lines.append(f"bytes per step per replica: dense {_size(b['dense_payload'])} of gradients "
                 f"({_size(b['dense_ring_traffic'])} ring traffic)"
                 + (f", compression {rep['compression']}" if rep["compression"] else ""))
    for var, s in b["sparse"].items():
        if s["bytes"] is not None:
            text = (f"{_size(s['bytes'])} gathered for a global batch of {b['batch_size']} "
                    f"({s['rows_per_example']} row(s) per example, padded to a power of two)")
        elif s["bytes_per_example"] is not None:
            text = (f"{_size(s['bytes_per_example'])} gathered per example of the global batch "
                    f"({s['rows_per_example']} row(s) each, before padding; --batch-size N gives the step's bytes)")
        else:
            text = "rows per example unknown (the ids' shape does not follow the batch)"
        lines.append(f"  sparse {var}: {text}")
    if b["ps_dense_gradients"] or b["ps_sparse"]:
        lines.append(f"  parameter servers: dense gradients {_size(b['ps_dense_gradients'])} pushed, "
                     f"dense variables {_size(b['ps_dense_reads'])} read")
        for var, s in b["ps_sparse"].items():
            per = (f"{_size(s['bytes_per_example'])} per example of the global batch"
                   if s["bytes_per_example"] is not None else "rows per example unknown")
            lines.append(f"    sparse {var}: its rows pushed and read, {per}")
    lines.append(f"passes: {' -> '.join(rep['passes'])}")
    lines.append(f"nodes: {rep['nodes']}")
    return "\n".join(lines) + "\n"


def write_tensorboard(graph_def, logdir):
    """Writes ``graph_def`` as an event file TensorBoard's Graphs tab shows (colour by
    device to see the replicas and the ps); returns the event file's path."""
    from graph_rewriter import protos
    from graph_rewriter.tf_runtime import import_tensorflow
    tf = import_tensorflow("inspect --tensorboard")
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(protos.as_class(graph_def, tf.compat.v1.GraphDef), name="")
        writer = tf.compat.v1.summary.FileWriter(logdir, graph=graph)  # graph mode: not eager
        writer.close()
    events = [os.path.join(logdir, f) for f in os.listdir(logdir) if f.startswith("events.")]
    return max(events, key=os.path.getmtime)


def _esc(text):
    """Text made safe inside a DOT double-quoted string."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"')


def _label(*lines):
    return '"' + "\\n".join(_esc(line) for line in lines) + '"'


def _task_of(device):
    """'/job:worker/replica:0/task:1/device:GPU:0' -> '/job:worker/replica:0/task:1'; a
    device without a job (one machine) -> 'this machine'."""
    head = device.split("/device:")[0]
    return head or "this machine"


def to_dot(rep):
    """A Graphviz (DOT) picture of the report: one box per replica grouped by machine,
    the parameter servers with their variables, accumulators and queues, and the
    communication between them (all-reduce packs, all-gathers, gradients pushed to and
    variables read from the ps). Ops are not drawn: a ResNet has thousands."""
    title = _label("strategy %s: %d replica(s), %d ops" % (rep["strategy"], rep["num_replicas"], rep["nodes"]))
    out = ["digraph graph_rewriter {",
           f"  graph [rankdir=LR, fontname=Helvetica, label={title}];",
           "  node [fontname=Helvetica, shape=box];",
           "  edge [fontname=Helvetica, fontsize=10];"]
    mirrored = [v for v in rep["variables"] if v["placement"] != "ps"]
    mirrored_bytes = sum(v["bytes"] or 0 for v in mirrored)
    by_task = {}
    for i, r in enumerate(rep["replicas"]):
        by_task.setdefault(_task_of(r["device"]), []).append((i, r))
    for t, (task, members) in enumerate(by_task.items()):
        out.append(f"  subgraph cluster_machine_{t} {{")
        out.append(f"    label={_label(task)};")
        for i, r in members:
            label = _label(f"replica {i}", r["device"].split("/device:")[-1],
                           f"{len(mirrored)} mirrored variables, {_size(mirrored_bytes)}")
            out.append(f"    replica_{i} [label={label}];")
        out.append("  }")
    ps_devices = {}
    for v in rep["variables"]:
        if v["placement"] == "ps":
            for d in (v["device"] or "?").split(", "):
                ps_devices.setdefault(d, []).append(v)
    acc_on = {}
    for a in rep["accumulators"]:
        acc_on.setdefault(a["device"], []).append(a)
    queues_on = {}
    for q in rep["queues"]:
        queues_on.setdefault(q["device"], []).append(q)
    for k, dev in enumerate(sorted(set(ps_devices) | set(acc_on) | set(queues_on))):
        names = [v["name"] for v in ps_devices.get(dev, [])]
        shown = names[:8] + ([f"... {len(names) - 8} more"] if len(names) > 8 else [])
        held = sum(v["bytes"] or 0 for v in ps_devices.get(dev, []))
        lines = [_task_of(dev), f"{len(names)} variables, {_size(held)}"]
        lines += shown
        if acc_on.get(dev):
            lines.append(f"{len(acc_on[dev])} accumulators")
        if queues_on.get(dev):
            lines.append(f"{len(queues_on[dev])} queues")
        out.append(f"  ps_{k} [shape=cylinder, label={_label(*lines)}];")
        for i in range(len(rep["replicas"])):
            if acc_on.get(dev):
                out.append(f"  replica_{i} -> ps_{k} [label=\"gradients\"];")
            if names:
                out.append(f"  ps_{k} -> replica_{i} [style=dashed, label=\"variables\"];")
    for p in rep["packs"]:
        label = _label("all-reduce pack %d" % p["index"], "%s, %s" % (p["dtype"], _size(p["bytes"])),
                       "%d gradients" % len(p["gradients"]))
        out.append(f"  pack_{p['index']} [shape=ellipse, label={label}];")
        for i in range(len(rep["replicas"])):
            out.append(f"  replica_{i} -> pack_{p['index']} [dir=both];")
    gathered = [v for v in rep["variables"] if v["sync"] == "allgather rows"]
    for j, v in enumerate(gathered):
        label = _label("all-gather rows", v["name"])
        out.append(f"  gather_{j} [shape=ellipse, label={label}];")
        for i in range(len(rep["replicas"])):
            out.append(f"  replica_{i} -> gather_{j} [dir=both];")
    out.append("}")
    return "\n".join(out) + "\n"
