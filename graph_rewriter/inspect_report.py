"""What `graph-rewrite inspect` reports about a rewritten graph, as data and as text.

Everything comes from the graph itself: its metadata node (replicas, plan, passes) and
its nodes (devices of variables, the collectives and their keys).
"""

from graph_rewriter.verifier import COLLECTIVES

_ROW_BYTES_NOTE = "per step: rows touched x row bytes"


def _const_value(nodes, name):
    n = nodes.get(name.split(":")[0])
    if n is None or n.op != "Const":
        return None
    t = n.attr["value"].tensor
    vals = list(t.int_val) or list(t.int64_val)
    return vals[0] if vals else None


def report(result):
    """A dict describing ``result`` (a RewriteResult)."""
    md = result.metadata
    plan = md["plan"]
    nodes = {n.name: n for n in result.graph_def.node}
    prefixes = md["replica_prefixes"]
    cuts = {c["variable"]: c for c in plan["cuts"]}
    variables = []
    for v in plan["variables"]:
        cut = cuts.get(v["name"])
        if cut is None:
            sync = "local (same update on every replica)" if v["role"] != "trainable" else "none"
        elif cut["sync"] == "allreduce":
            sync = f"allreduce pack {cut['pack']}"
        else:
            sync = "allgather rows"
        copies = [p + v["name"] for p in prefixes if (p + v["name"]) in nodes]
        variables.append({
            "name": v["name"], "role": v["role"], "dtype": v["dtype"], "shape": v["shape"],
            "bytes": v["bytes"], "sync": sync, "device": nodes[v["name"]].device if v["name"] in nodes else "",
            "copies": len(copies)})
    collectives = []
    for n in result.graph_def.node:
        if n.op not in COLLECTIVES or any(n.name.startswith(p) for p in prefixes[1:]):
            continue
        collectives.append({
            "name": n.name, "op": n.op, "device": n.device,
            "group_size": _const_value(nodes, n.input[1]), "group_key": _const_value(nodes, n.input[2]),
            "instance_key": _const_value(nodes, n.input[3])})
    compression = plan.get("compression")
    wire = {None: 1.0, "fp16": 0.5, "bf16": 0.5}.get(compression, 1.0)
    r = md["num_replicas"]
    dense_bytes = sum(int(p["bytes"] * (wire if p["dtype"] in ("float32", "float64") else 1.0))
                      for p in plan["packs"])
    sparse = [c["variable"] for c in plan["cuts"] if c["sync"] == "allgather"]
    return {
        "strategy": plan["strategy"], "num_replicas": r,
        "replicas": [{"prefix": p, "device": d} for p, d in zip(prefixes, md["replica_devices"])],
        "batch_inputs": md["batch_inputs"],
        "variables": variables,
        "packs": [{"index": i, "dtype": p["dtype"], "bytes": p["bytes"], "gradients": p["cuts"]}
                  for i, p in enumerate(plan["packs"])],
        "collectives": collectives,
        "bytes_per_step_per_replica": {
            "dense_payload": dense_bytes if r > 1 else 0,
            "dense_ring_traffic": int(2 * (r - 1) / r * dense_bytes) if r > 1 else 0,
            "sparse": {v: _ROW_BYTES_NOTE for v in sparse} if r > 1 else {},
        },
        "compression": compression,
        "passes": md["passes"],
        "nodes": len(result.graph_def.node),
    }


def _size(n):
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n}"


def format_report(rep):
    """The report as readable text."""
    lines = [f"strategy:   {rep['strategy']}",
             f"replicas:   {rep['num_replicas']}"]
    for i, rp in enumerate(rep["replicas"]):
        lines.append(f"  replica {i}: {rp['device']}" + (f"  (nodes '{rp['prefix']}*')" if rp["prefix"] else "  (original names)"))
    lines.append(f"batch inputs split across replicas: {', '.join(rep['batch_inputs']) or 'none'}")
    lines.append("variables:")
    width = max([len(v["name"]) for v in rep["variables"]] + [8])
    for v in rep["variables"]:
        shape = "x".join(str(d) for d in v["shape"]) if v["shape"] is not None else "?"
        lines.append(f"  {v['name']:<{width}}  {v['role']:<9} {v['dtype']:<8} {shape:<12} "
                     f"{_size(v['bytes']):>10}  {v['sync']}  on {v['device'] or '?'} x{v['copies']}")
    lines.append(f"packs ({len(rep['packs'])}):")
    for p in rep["packs"]:
        lines.append(f"  pack {p['index']}: {p['dtype']}, {_size(p['bytes'])}, {len(p['gradients'])} gradient(s)")
    lines.append(f"collectives on replica 0 ({len(rep['collectives'])}):")
    for c in rep["collectives"]:
        lines.append(f"  {c['op']:<20} group {c['group_key']} size {c['group_size']} instance "
                     f"{c['instance_key']}  {c['name']}")
    b = rep["bytes_per_step_per_replica"]
    lines.append(f"bytes per step per replica: dense {_size(b['dense_payload'])} of gradients "
                 f"({_size(b['dense_ring_traffic'])} ring traffic)"
                 + (f", compression {rep['compression']}" if rep["compression"] else ""))
    for var, note in b["sparse"].items():
        lines.append(f"  sparse {var}: {note}")
    lines.append(f"passes: {' -> '.join(rep['passes'])}")
    lines.append(f"nodes: {rep['nodes']}")
    return "\n".join(lines) + "\n"
