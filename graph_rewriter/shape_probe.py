"""The shape probe: TensorFlow's shape inference on a few tensors of the IR.

Kept apart from the analysis because it is the one place that builds a TensorFlow graph:
the GraphDef carries no output shapes, so the question is put to TensorFlow's own shape
inference on a scratch tf.Graph holding the tensors' ancestors. Two questions:

- ``rows_per_example``: how many rows a sparse gradient holds per example of the batch
  (the batch dimension set to 1 and then 2). The planner records the answer in the plan
  (``CutPlan.rows_per_example``).
- ``static_shapes``: the static shapes of a few outputs (is it a scalar? is its first
  dimension the batch?), for the merge_outputs pass, which merges a user's outputs in
  the graph as ``Session`` merges them in Python.

TensorFlow is imported here when it is installed and not yet imported (the CLI does
not import it otherwise). Without TensorFlow, both answer "unknown": rows per example
unknown in the plan, outputs left to ``Session`` to merge.
"""

from graph_rewriter import protos, tf_runtime
from graph_rewriter.traversal import ancestors


def rows_per_example(tensor, batch_inputs, max_nodes=2000):
    """How many rows ``tensor`` (a sparse gradient's indices) holds per example of the
    batch, or None when that is not a fixed number.

    Batch inputs have a first dimension of None, so TensorFlow's shape inference is run
    twice on the tensor's ancestors (a few ops even in a large model), imported into a
    scratch tf.Graph with the batch dimension set to 1 and to 2: rows that grow by
    exactly the count at 1 are that many per example (ids [batch, k] give k). Indices an
    optimizer deduplicated (Unique) count as their input: an upper bound."""
    while tensor.node.op in ("Unique", "Identity") and tensor.node.inputs:
        tensor = tensor.node.inputs[0]
    region = ancestors([tensor.node]) | {tensor.node}
    if len(region) > max_nodes:
        return None
    batch_nodes = {t.node.name for t in batch_inputs}
    one, two = (_static_rows(tensor, region, batch_nodes, b) for b in (1, 2))
    if one is None or two is None or two != 2 * one:
        return None
    return one


def _tensorflow():
    """TensorFlow, or None when it is not installed."""
    return tf_runtime.import_tensorflow("shape inference") if tf_runtime.installed() else None


def _static_rows(tensor, region, batch_nodes, batch):
    tf = _tensorflow()
    if tf is None:
        return None
    gd = _graph_def(tensor.node.graph, region, batch_nodes, batch, controls=True)
    scratch = tf.Graph()
    try:
        with scratch.as_default():
            tf.compat.v1.import_graph_def(protos.as_class(gd, tf.compat.v1.GraphDef), name="")
        shape = scratch.get_tensor_by_name(tensor.name).shape
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
        return None
    if shape.rank is None or shape.rank == 0 or shape[0] is None:
        return None
    return int(shape[0])


def static_shapes(tensors, max_nodes=20000):
    """{tensor: its static shape as a tuple (None for an unknown dimension)} for the
    tensors (of one GraphItem) whose rank shape inference knows; a tensor of unknown
    rank is left out. One scratch graph holds the data ancestors of them all (control
    edges do not change shapes); more than ``max_nodes`` of them, or a region TensorFlow
    cannot import, gives {} (nothing known) rather than a long import."""
    tensors = list(tensors)
    tf = _tensorflow() if tensors else None
    if tf is None:
        return {}
    region = ancestors([t.node for t in tensors], data_only=True) | {t.node for t in tensors}
    if len(region) > max_nodes:
        return {}
    gd = _graph_def(tensors[0].node.graph, region, (), None, controls=False)
    scratch = tf.Graph()
    try:
        with scratch.as_default():
            tf.compat.v1.import_graph_def(protos.as_class(gd, tf.compat.v1.GraphDef), name="")
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
        return {}
    out = {}
    for t in tensors:
        shape = scratch.get_tensor_by_name(t.name).shape
        if shape.rank is not None:
            out[t] = tuple(shape.as_list())
    return out


def _graph_def(graph, region, batch_nodes, batch, controls):
    """A GraphDef of the ``region`` of ``graph`` (with its function library); the batch
    inputs among ``batch_nodes`` get a first dimension of ``batch``."""
    gd = protos.graph_pb2.GraphDef()
    if graph.library is not None:
        gd.library.CopyFrom(graph.library)
    for n in [n for n in graph if n in region]:   # import_graph_def takes any order
        nd = gd.node.add(name=n.name, op=n.op)
        nd.input.extend(t.name if t.index else t.node.name for t in n.inputs)
        if controls:
            nd.input.extend("^" + c.name for c in n.control_inputs)
        for k, v in n.attr.items():
            nd.attr[k].CopyFrom(v)
        if n.name in batch_nodes:
            shapes = [nd.attr["shape"].shape] if "shape" in nd.attr else list(nd.attr["output_shapes"].list.shape)
            for s in shapes:
                if s.dim and s.dim[0].size < 0:
                    s.dim[0].size = batch
    return gd
