"""saver: the graph has a Saver, and the rewrite knows its SaverDef.

A checkpoint is how a TF1 user keeps a run (``Saver.save``, CheckpointSaverHook,
MonitoredTrainingSession's restore). The rewritten graph keeps the original graph's
Saver nodes (global, on the chief's host) with the original variable names, so its
checkpoints restore into the single-device graph and the other way round. This pass,
the first of the pipeline, makes sure there is one to keep:

- the input's MetaGraphDef names its Saver (``saver_def``): nothing to do;
- the graph has a Saver's nodes but no SaverDef (a .pb, or a MetaGraphDef exported with
  ``tf.compat.v1.train.export_meta_graph``, which leaves it empty): the SaverDef is read
  off the nodes by the names TF's Saver gives them (``graph_io.saver_def_of_nodes``:
  ``<scope>/restore_all``, ``<scope>/Const``, ``<scope>/control_dependency``, or
  ``<scope>/Identity`` for a sharded Saver);
- there is no Saver: one is built over the graph's global variables (the MetaGraphDef's
  ``variables`` collection, or every variable of a GraphDef), as
  ``tf.compat.v1.train.Saver()`` would build it: ``save/SaveV2`` and ``save/RestoreV2``
  with the variables' names, sorted.

The SaverDef goes on the IR's MetaGraphDef (``graph.meta_graph``, made if the input was
a GraphDef): the metadata records it, ``RewriteResult.saver()`` uses it, and a .meta
output carries it. The later passes see an ordinary Saver: the variable passes keep the
restore writing every replica, the parameter-server shards and their readers.
"""

from graph_rewriter import dtypes
from graph_rewriter import graph_io
from graph_rewriter.op_builder import const, make_op, own_op, shape_attr
from graph_rewriter.op_vocabulary import VARIABLE_OPS
from graph_rewriter.pass_manager import Pass
from graph_rewriter.protos import meta_graph_pb2, saver_pb2
from graph_rewriter.protos import variable_pb2


class SaverPass(Pass):
    name = "saver"

    def run(self, graph, ctx):
        meta = graph.meta_graph
        if meta is not None and meta.HasField("saver_def") and meta.saver_def.restore_op_name:
            return False
        saver_def = graph_io.saver_def_of_nodes({n.name: n.op for n in graph.nodes})
        changed = False
        if saver_def is None:
            variables = _global_variables(graph)
            if not variables:
                return False   # the plan pass rejects a graph without variables, by name
            saver_def = build_saver(graph, variables)
            changed = True
            ctx.info(f"saver: the graph has none; added '{saver_def.restore_op_name}' over "
                     f"{len(variables)} variable(s)")
        if graph.meta_graph is None:
            graph.meta_graph = meta_graph_pb2.MetaGraphDef()
        graph.meta_graph.saver_def.CopyFrom(saver_def)
        return changed


def _global_variables(graph):
    """The variable nodes a default Saver saves: the ``variables`` collection's, else all."""
    meta = graph.meta_graph
    names = None
    if meta is not None and "variables" in meta.collection_def:
        names = []
        for raw in meta.collection_def["variables"].bytes_list.value:
            vd = variable_pb2.VariableDef.FromString(raw)
            names.append(vd.variable_name.split(":")[0])
    nodes = [n for n in graph.nodes if n.op in VARIABLE_OPS]
    if names is not None:
        wanted = set(names)
        nodes = [n for n in nodes if n.name in wanted]
    return sorted(nodes, key=lambda n: n.name)


def build_saver(graph, variables):
    """Adds tf.compat.v1.train.Saver()'s V2 nodes over ``variables`` (nodes, by name);
    returns their SaverDef."""
    scope = graph.unique_name("save")
    names = [v.name for v in variables]
    # a ref variable's dtype attr is DT_*_REF (the base type + 100)
    base = [v.attr["dtype"].type % 100 for v in variables]
    filename = make_op(graph, "PlaceholderWithDefault", f"{scope}/Const",
                       [const(graph, f"{scope}/filename", "model", "string")],
                       attrs={"shape": shape_attr([])})
    tensor_names = const(graph, f"{scope}/SaveV2/tensor_names", names, "string")
    slices = const(graph, f"{scope}/SaveV2/shape_and_slices", [""] * len(names), "string")
    values = []
    for v, dt in zip(variables, base):
        if v.op == "VarHandleOp":
            # the variable's own read (<name>/Read/ReadVariableOp), as TF's Saver uses it
            read = own_op(v, "Read/ReadVariableOp", "ReadVariableOp") or make_op(
                graph, "ReadVariableOp", f"{scope}/Read_{len(values)}", [v.output(0)],
                attrs={"dtype": dtypes.as_dtype(dt)})
            values.append(read.output(0))
        else:
            values.append(v.output(0))
    save = make_op(graph, "SaveV2", f"{scope}/SaveV2", [filename.output(0), tensor_names, slices, values])
    saved = make_op(graph, "Identity", f"{scope}/control_dependency", [filename.output(0)],
                    control_inputs=[save], colocate_with=[filename])
    restore = make_op(graph, "RestoreV2", f"{scope}/RestoreV2",
                      [filename.output(0),
                       const(graph, f"{scope}/RestoreV2/tensor_names", names, "string"),
                       const(graph, f"{scope}/RestoreV2/shape_and_slices", [""] * len(names), "string")],
                      attrs={"dtypes": [dtypes.as_dtype(dt) for dt in base]})
    assigns = []
    for k, (v, dt) in enumerate(zip(variables, base)):
        value = restore.output(k)
        if v.op == "VarHandleOp":
            assigns.append(make_op(graph, "AssignVariableOp", f"{scope}/AssignVariableOp_{k}",
                                   [v.output(0), value], attrs={"dtype": dtypes.as_dtype(dt)}))
        else:
            assigns.append(make_op(graph, "Assign", f"{scope}/Assign_{k}", [v.output(0), value],
                                   attrs={"use_locking": True}, type_attrs={"T": dt},
                                   colocate_with=[v]))
    restore_all = graph.add_node(graph.unique_name(f"{scope}/restore_all"), "NoOp", control_inputs=assigns)
    return saver_pb2.SaverDef(
        filename_tensor_name=f"{filename.name}:0", save_tensor_name=f"{saved.name}:0",
        restore_op_name=restore_all.name, max_to_keep=5, keep_checkpoint_every_n_hours=10000.0,
        version=saver_pb2.SaverDef.V2)


