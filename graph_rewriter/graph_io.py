"""Reading and writing graphs: GraphDef or MetaGraphDef, binary or text, from an object,
bytes or a path; into a GraphItem and back out, deterministically and atomically.

The edge strings of the serialized form ("x:1", "^x", "loc:@x") are parsed here on load
and printed here on export; nothing else in the project sees them.
"""

import os
import re
import tempfile

from google.protobuf import message as pb_message
from google.protobuf import text_format

from graph_rewriter import protos, saved_model, tf_runtime
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GraphItem, Node
from graph_rewriter.protos import graph_pb2, meta_graph_pb2
from graph_rewriter.replica_export import write_replicated_nodes
from graph_rewriter.wire import SHORT, VARINTS, attrs_bytes, colocation_entry, encode_varint, string_field, varint

_NODE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-/>]*$")
TEXT_SUFFIXES = (".pbtxt", ".pbtext", ".txt", ".prototxt")
META_SUFFIXES = (".meta",)


# ----- reading ------------------------------------------------------------------------

def load_graph(source, name=None, tag=None):
    """A GraphItem from a GraphDef, MetaGraphDef, tf.Graph, bytes, or a path to a graph
    file or a TF1 SavedModel (its directory or its saved_model.pb).

    ``name`` labels the source in error messages (defaults to the path or the type).
    ``tag`` ("train", "serve,gpu") picks a SavedModel's MetaGraphDef by its tag set.
    """
    if isinstance(source, GraphItem):
        return source
    if isinstance(source, (str, os.PathLike)) and saved_model.saved_model_dir(source) is not None:
        path = os.fspath(source)
        return _item_from_meta(saved_model.read_meta_graph(path, tag), name or path)
    label = name or (os.fspath(source) if isinstance(source, (str, os.PathLike)) else None)
    if tag is not None:
        raise GraphRewriteError(
            f"tag {tag!r} picks a MetaGraphDef of a SavedModel, but the input "
            f"{label or type(source).__name__} is not a SavedModel",
            hint="drop the tag, or pass a SavedModel directory (one holding saved_model.pb)")
    if protos.is_message(source, "tensorflow.GraphDef"):
        gd = graph_pb2.GraphDef()
        gd.CopyFrom(protos.as_class(source, graph_pb2.GraphDef))
        return graph_item_from_graph_def(gd, name or "<GraphDef>")
    if protos.is_message(source, "tensorflow.MetaGraphDef"):
        mg = meta_graph_pb2.MetaGraphDef()
        mg.CopyFrom(protos.as_class(source, meta_graph_pb2.MetaGraphDef))
        return _item_from_meta(mg, name or "<MetaGraphDef>")
    if _is_tf_graph(source):
        return _item_from_meta(protos.as_class(_meta_graph_of(source), meta_graph_pb2.MetaGraphDef),
                               name or "<tf.Graph>")
    if hasattr(source, "as_graph_def") and callable(source.as_graph_def):
        return graph_item_from_graph_def(protos.as_class(source.as_graph_def(), graph_pb2.GraphDef),
                                         name or f"<{type(source).__name__}>")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _load_bytes(bytes(source), name or "<bytes>", None)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        data = read_file(path)
        return _load_bytes(data, name or path, path)
    raise GraphRewriteError(
        f"cannot load a graph from a {type(source).__name__}: expected a GraphDef, "
        "MetaGraphDef, tf.Graph, bytes, or a path to a .pb, .pbtxt or .meta file or a "
        "SavedModel directory", hint="pass one of those, e.g. graph.as_graph_def()")


def _is_tf_graph(source):
    if not tf_runtime.imported():   # no tf.Graph can exist: do not import it to ask
        return False
    from tensorflow.python.framework import ops
    return isinstance(source, ops.Graph)


def _meta_graph_of(graph):
    """A live tf.Graph as a MetaGraphDef: its GraphDef (as_graph_def()), its collections
    and, when the graph has a Saver, that Saver's SaverDef, so that a .meta or SavedModel
    output keeps them as an exported .meta input would."""
    import tensorflow as tf
    with graph.as_default():   # export_meta_graph refuses to run eagerly
        return tf.compat.v1.train.export_meta_graph(
            graph=graph, graph_def=graph.as_graph_def(), saver_def=_saver_def_of(graph))


def _saver_def_of(graph):
    """The SaverDef of ``graph``'s Saver: the first in its "savers" collection, else the
    one its nodes show (saver_def_of_nodes); None when it has none."""
    for saver in graph.get_collection("savers"):
        if hasattr(saver, "as_saver_def"):
            return saver.as_saver_def()
    return saver_def_of_nodes({op.name: op.type for op in graph.get_operations()})


def saver_def_of_nodes(ops):
    """The SaverDef of the first Saver a graph's nodes show (``ops``: node name -> op
    type), by the names tf.compat.v1.train.Saver gives them: <scope>/restore_all, the
    filename <scope>/Const, the save tensor <scope>/control_dependency, or
    <scope>/Identity when sharded; None when there is none."""
    from graph_rewriter.protos import saver_pb2
    for name in ops:
        if name != "restore_all" and not name.endswith("/restore_all"):
            continue
        scope = name[:-len("restore_all")]
        if scope + "Const" not in ops:
            continue
        types = {t for op_name, t in ops.items() if op_name.startswith(scope)}
        sharded = "ShardedFilename" in types
        for save in (("Identity", "control_dependency") if sharded else ("control_dependency",)):
            if scope + save in ops:
                return saver_pb2.SaverDef(
                    filename_tensor_name=scope + "Const:0", save_tensor_name=scope + save + ":0",
                    restore_op_name=name, sharded=sharded, max_to_keep=5,
                    keep_checkpoint_every_n_hours=10000,
                    version=saver_pb2.SaverDef.V2 if "SaveV2" in types else saver_pb2.SaverDef.V1)
    return None


def read_file(path):
    if not os.path.exists(path):
        raise GraphRewriteError(f"{path}: no such file", hint="check the path (and the working directory)")
    if os.path.isdir(path):
        raise GraphRewriteError(
            f"{path}: is a directory, expected a graph file (.pb, .pbtxt, .meta) or a SavedModel "
            "directory (one holding saved_model.pb)",
            hint="pass the graph file inside it, or a directory tf.compat.v1.saved_model.Builder wrote")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise GraphRewriteError(f"{path}: cannot read: {e.strerror}",
                                hint="check the file's permissions") from None


def _load_bytes(data, label, path):
    if not data:
        raise GraphRewriteError(f"{label}: is empty, expected a serialized GraphDef or MetaGraphDef",
                                hint="pass a file written by tf.io.write_graph or "
                                     "tf.compat.v1.train.export_meta_graph")
    suffix = os.path.splitext(path)[1].lower() if path else ""
    looks_text = suffix in TEXT_SUFFIXES or (suffix not in (".pb", ".meta") and _looks_like_text(data))
    meta_first = suffix in META_SUFFIXES
    attempts = []
    if looks_text:
        attempts += [("text", meta_first), ("text", not meta_first)]
    attempts += [("binary", meta_first), ("binary", not meta_first)]
    if not looks_text and _looks_like_text(data):
        attempts += [("text", False), ("text", True)]
    problems = []
    for form, as_meta in attempts:
        msg = meta_graph_pb2.MetaGraphDef() if as_meta else graph_pb2.GraphDef()
        try:
            if form == "text":
                text_format.Parse(data.decode("utf-8"), msg)
            else:
                msg.ParseFromString(data)
        except (pb_message.DecodeError, text_format.ParseError, UnicodeDecodeError, ValueError) as e:
            problems.append(f"{form} {'MetaGraphDef' if as_meta else 'GraphDef'}: {str(e).splitlines()[0][:120].rstrip('.')}")
            continue
        gd = msg.graph_def if as_meta else msg
        why = _not_a_graph(gd)
        if why:
            problems.append(f"{form} {'MetaGraphDef' if as_meta else 'GraphDef'}: {why}")
            continue
        return _item_from_meta(msg, label) if as_meta else graph_item_from_graph_def(msg, label)
    detail = problems[0] if problems else "unrecognised content"
    raise GraphRewriteError(
        f"{label}: not a TensorFlow GraphDef or MetaGraphDef (binary or text): {detail}",
        hint="pass a file written by tf.io.write_graph or tf.compat.v1.train.export_meta_graph")


def _looks_like_text(data):
    head = data[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\n\r\t" for c in text)


def _not_a_graph(gd):
    """Why a parsed GraphDef is not a real graph (random bytes often parse), or None."""
    if not gd.node:
        return "it has no nodes"
    for nd in gd.node[:2000]:
        if not nd.op or not _NODE_NAME.match(nd.name):
            return "it decodes as a protobuf message, but its entries are not graph nodes (no valid name and op)"
    return None


def _item_from_meta(mg, label):
    saved_model.check_tf1_meta_graph(mg, label)
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(mg.graph_def)
    if not gd.node:
        raise GraphRewriteError(f"{label}: the graph is empty (no nodes)",
                                hint="pass the graph after building the model and its optimizer")
    item = graph_item_from_graph_def(gd, label)
    meta = meta_graph_pb2.MetaGraphDef()
    meta.CopyFrom(mg)
    meta.ClearField("graph_def")
    item.meta_graph = meta
    return item


def graph_item_from_graph_def(gd, source="<GraphDef>"):
    """Builds a GraphItem that takes ownership of ``gd`` (its NodeDefs become the nodes'
    attr protos)."""
    item = GraphItem.from_node_defs(gd.node, source, _colocation_names)
    item.versions = gd.versions if gd.HasField("versions") else None
    item.library = gd.library if gd.HasField("library") else None
    return item


def _colocation_names(attr_value):
    names = []
    for s in attr_value.list.s:
        s = s.decode("utf-8", "replace")
        names.append(s[5:] if s.startswith("loc:@") else s)
    return names


# ----- writing ------------------------------------------------------------------------

def to_graph_def(item, replicas=None):
    """The GraphDef of ``item``: nodes in the item's order, edge strings printed
    (``replicas``: the rewrite's ReplicaMap, which says whether replica 1 is a template
    to write once per replica).

    Built as serialized bytes and parsed once (protobuf's C code does the object
    building): each node's attributes are serialized once per attr proto, which clones
    share, so exporting sixteen replicas costs little more than the strings that differ.
    """
    return graph_pb2.GraphDef.FromString(graph_def_bytes(item, replicas))


def graph_def_bytes(item, replicas=None):
    """The serialized GraphDef of ``item`` (deterministic: same item, same bytes), as the
    bytearray it was assembled in: a bytes copy would double the export's peak memory
    for a graph of hundreds of megabytes. A graph whose replica 1 is a template
    (ReplicaMap.template) is written with every replica (replica_export)."""
    out = bytearray()   # grown in place: no list of pieces and joined copy (peak memory)
    if replicas is not None and replicas.template:
        write_replicated_nodes(item, replicas, out, nodes_bytes)
    else:
        nodes_bytes(item.nodes, out, item.attr_bytes_cache())
    if item.library is not None:
        lib = item.library.SerializeToString(deterministic=True)
        out += b"\x12" + varint(len(lib)) + lib
    if item.versions is not None:
        ver = item.versions.SerializeToString(deterministic=True)
        out += b"\x22" + varint(len(ver)) + ver
    return out


def nodes_bytes(nodes, out, attr_bytes=None):
    """Appends ``nodes`` as GraphDef node fields to the bytearray ``out``. ``attr_bytes``
    caches serialized attribute protos (id -> (bytes, the proto kept alive)) within one
    export: clones share their original's proto."""
    if attr_bytes is None:
        attr_bytes = {}
    op_bytes, device_bytes = {}, {}
    inputs = {}         # Tensor read more than once -> its serialized input field
    controls = {}       # Node -> its serialized "^name" input field
    colocations = {}    # tuple of targets -> the serialized _class attr entry
    varints = VARINTS
    for node in nodes:
        d = node.node_def
        cached = attr_bytes.get(id(d))
        if cached is None or cached[1] is not d:
            cached = attr_bytes[id(d)] = (attrs_bytes(d), d)
        op = op_bytes.get(node.op)
        if op is None:
            op = op_bytes[node.op] = string_field(b"\x12", node.op)
        dev = device_bytes.get(node.device)
        if dev is None:
            dev = device_bytes[node.device] = string_field(b"\x22", node.device) if node.device else b""
        name = node.name.encode("utf-8")
        size = len(name)
        body = [b"\x0a", varints[size] if size < SHORT else encode_varint(size), name, op]
        for t in node.inputs:
            field = inputs.get(t)
            if field is None:
                p = t.node
                field = string_field(b"\x1a", p.name if t.index == 0 else f"{p.name}:{t.index}")
                if p.num_consumers > 1:
                    inputs[t] = field
            body.append(field)
        for c in node.control_inputs:
            field = controls.get(c)
            if field is None:
                field = controls[c] = string_field(b"\x1a", "^" + c.name)
            body.append(field)
        body.append(dev)
        body.append(cached[0])
        if node.colocate_with:
            key = tuple(node.colocate_with)
            entry = colocations.get(key)
            if entry is None:
                entry = colocations[key] = _colocation_entry(key)
            body.append(entry)
        data = b"".join(body)
        size = len(data)
        out += b"\x0a"
        out += varints[size] if size < SHORT else encode_varint(size)
        out += data


def _colocation_entry(targets):
    """The ``_class`` attr entry of colocation targets (Nodes, or unresolved names)."""
    return colocation_entry([t.name if isinstance(t, Node) else t for t in targets])


def to_meta_graph_def(item):
    mg = meta_graph_pb2.MetaGraphDef()
    if item.meta_graph is not None:
        mg.CopyFrom(item.meta_graph)
    mg.graph_def.CopyFrom(to_graph_def(item))
    return mg


def serialize(message, path=None):
    """Deterministic bytes for a proto: text format for text suffixes, binary otherwise."""
    if path and os.path.splitext(path)[1].lower() in TEXT_SUFFIXES:
        return text_format.MessageToString(message).encode("utf-8")
    return message.SerializeToString(deterministic=True)


def write_atomic(path, data):
    """Writes ``data`` to ``path`` through a temporary file in the same folder and a rename,
    so an interrupted run never leaves a partial file and a failed one leaves none."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise GraphRewriteError(f"{path}: cannot write: folder '{folder}' does not exist",
                                hint="create the folder first, or write somewhere else")
    if os.path.isdir(path):
        raise GraphRewriteError(f"{path}: is a directory, expected a file name to write",
                                hint="give a file name (.pb, .pbtxt or .meta) for the output")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".graph-rewrite-", suffix=".tmp", dir=folder)
    except OSError as e:
        raise GraphRewriteError(f"{path}: cannot write: {e.strerror}",
                                hint="write somewhere this process may create files") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise GraphRewriteError(f"{path}: cannot write: {e.strerror}",
                                    hint="check the disk space and the folder's permissions") from None
        raise
