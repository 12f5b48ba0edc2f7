"""graph_rewriter: rewrites a single-device TensorFlow 1 training GraphDef into the
distributed data-parallel GraphDef that trains it on many devices and machines.

    import graph_rewriter as gr
    result = gr.rewrite("train.pb", devices_per_worker=4)
    with gr.Session(result) as sess:
        sess.run("init")
        sess.run(["loss:0", "train_op"], feed_dict={"x:0": x, "y:0": y})

The public names (the contract: docs/api.md): rewrite, load, Session, start_server,
HeartbeatHook, GraphRewriteError.
TensorFlow is imported lazily, and only to run graphs: rewriting, planning and
inspecting use the TensorFlow protos and op tables that ship with the package
(protos.py, opdefs.py), so `import graph_rewriter` and the CLI stay fast and a machine
without TensorFlow can rewrite.
"""

from graph_rewriter.errors import GraphRewriteError

__version__ = "0.1.0"
__all__ = ["rewrite", "load", "Session", "start_server", "HeartbeatHook", "GraphRewriteError", "Plan", "CostModel"]


def __getattr__(name):
    if name in ("rewrite", "load", "RewriteResult"):
        from graph_rewriter import api as _api
        return getattr(_api, name)
    if name in ("Session", "HeartbeatHook", "start_server"):
        from graph_rewriter.tf_runtime import import_tensorflow
        import_tensorflow(f"graph_rewriter.{name}")
    if name in ("Session", "HeartbeatHook"):
        from graph_rewriter import session as _session
        return getattr(_session, name)
    if name == "start_server":
        from graph_rewriter.server import start_server
        return start_server
    if name == "CostModel":
        from graph_rewriter.cost_model import CostModel
        return CostModel
    if name == "Plan":
        from graph_rewriter.plan import Plan
        return Plan
    raise AttributeError(f"module 'graph_rewriter' has no attribute {name!r}")
