"""TF1 SavedModels in and out: a directory holding saved_model.pb (or .pbtxt), one
MetaGraphDef per tag set, and the variables/ checkpoint and assets/ next to it.

Reading picks the MetaGraphDef of a tag set (``tag``) and refuses a TF2 SavedModel,
whose computation lives in tf.functions the rewrite cannot see into. Writing puts the
rewritten MetaGraphDef in a new directory with the input's variables/ and assets/
copied unchanged: the rewritten graph keeps the original variable names and Saver, so
that checkpoint restores into it.

Nothing here imports TensorFlow beyond its protobuf messages (graph_io builds the
GraphItem from the MetaGraphDef returned here).
"""

import os
import shutil
import tempfile

from google.protobuf import message as pb_message
from google.protobuf import text_format

from graph_rewriter import opdefs, protos
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.protos import graph_pb2, meta_graph_pb2, op_def_pb2, saved_model_pb2

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
# what a SavedModel directory holds besides saved_model.pb, copied unchanged on output
COPIED_DIRS = ("variables", "assets", "assets.extra")
# an output path with one of these suffixes is a graph file, any other a SavedModel
# directory (graph_io's binary, .meta and text suffixes)
GRAPH_SUFFIXES = (".pb", ".meta", ".pbtxt", ".pbtext", ".txt", ".prototxt")

TF1_INSTEAD = ("pass a TF1 graph instead: build the model with tf.compat.v1 in graph mode and "
               "pass the .meta written by tf.compat.v1.train.export_meta_graph(), or a SavedModel "
               "written by tf.compat.v1.saved_model.Builder with a train tag")


def saved_model_dir(path):
    """The SavedModel directory ``path`` names (the directory itself, or the folder of
    its saved_model.pb/.pbtxt), or None when ``path`` is not a SavedModel."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in SAVED_MODEL_FILES):
            return path
        return None
    if os.path.basename(path) in SAVED_MODEL_FILES and os.path.isfile(path):
        return os.path.dirname(path) or "."
    return None


def is_saved_model_output(path):
    """Whether a result saved to ``path`` is written as a SavedModel directory (when its
    input was a SavedModel): any path without a graph file's suffix."""
    return os.path.splitext(os.fspath(path).rstrip("/\\"))[1].lower() not in GRAPH_SUFFIXES


def parse_tags(tag):
    """The tag set a ``tag`` option names ("train", "serve,gpu"), as a frozenset."""
    return frozenset(t.strip() for t in tag.split(",") if t.strip())


def read_meta_graph(path, tag=None):
    """The MetaGraphDef of the SavedModel at ``path`` (its directory or its
    saved_model.pb) whose tag set is ``tag``; without ``tag``, its only one."""
    path = os.fspath(path)
    directory = saved_model_dir(path)
    if os.path.isdir(path):
        file = next(os.path.join(directory, f) for f in SAVED_MODEL_FILES
                    if os.path.isfile(os.path.join(directory, f)))
    else:
        file = path
    saved = _parse(file)
    if not saved.meta_graphs:
        raise GraphRewriteError(f"{file}: the SavedModel holds no MetaGraphDef",
                                hint="pass a SavedModel written by tf.compat.v1.saved_model.Builder")
    meta = _select(saved, tag, path)
    check_tf1_meta_graph(meta, path)
    return meta


def _parse(file):
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise GraphRewriteError(f"{file}: cannot read: {e.strerror}",
                                hint="check the file's permissions") from None
    saved = saved_model_pb2.SavedModel()
    try:
        if file.endswith(".pbtxt"):
            text_format.Parse(data.decode("utf-8"), saved)
        else:
            saved.ParseFromString(data)
    except (pb_message.DecodeError, text_format.ParseError, UnicodeDecodeError, ValueError) as e:
        raise GraphRewriteError(
            f"{file}: not a SavedModel: {str(e).splitlines()[0][:120].rstrip('.')}",
            hint="pass the directory tf.compat.v1.saved_model.Builder wrote, or its saved_model.pb") from None
    return saved


def _tag_sets(saved):
    return ", ".join("{" + ",".join(sorted(mg.meta_info_def.tags)) + "}" for mg in saved.meta_graphs)


def _select(saved, tag, label):
    """The MetaGraphDef of ``saved`` whose tag set is ``tag`` (the only one when None)."""
    if tag is None:
        if len(saved.meta_graphs) == 1:
            return saved.meta_graphs[0]
        raise GraphRewriteError(
            f"{label}: the SavedModel holds {len(saved.meta_graphs)} MetaGraphDefs, tagged "
            f"{_tag_sets(saved)}, and no tag says which one to rewrite",
            hint="choose one with --tag (tag= in rewrite()), e.g. --tag "
                 + ",".join(sorted(saved.meta_graphs[0].meta_info_def.tags)))
    wanted = parse_tags(tag)
    for mg in saved.meta_graphs:
        if frozenset(mg.meta_info_def.tags) == wanted:
            return mg
    raise GraphRewriteError(
        f"{label}: no MetaGraphDef of the SavedModel is tagged {{{','.join(sorted(wanted))}}}; "
        f"its tag sets are {_tag_sets(saved)}",
        hint="pass one of those tag sets to --tag (comma-separated tags, e.g. serve,gpu)")


def check_tf1_meta_graph(meta, label):
    """Refuses a TF2 SavedModel's MetaGraphDef (it has an object graph): its graph only
    calls tf.functions, so there is no training step in it to rewrite."""
    if meta.HasField("object_graph_def"):
        raise GraphRewriteError(
            f"{label}: a TF2 SavedModel (written by tf.saved_model.save): its computation lives "
            "in tf.functions that its graph only calls (StatefulPartitionedCall), so there is no "
            "TF1 training graph to rewrite", hint=TF1_INSTEAD)


# ----- writing ------------------------------------------------------------------------

def check_output_dir(path):
    """Refuses a SavedModel output ``path`` that cannot be written: one that exists and
    is a file or a non-empty directory, or whose folder does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.listdir(path):
            raise GraphRewriteError(
                f"{path}: is a directory that is not empty; a SavedModel is written into a new "
                "or empty directory", hint="give a new directory name, or remove this one first")
    elif os.path.exists(path):
        raise GraphRewriteError(
            f"{path}: is a file; the input is a SavedModel, so the output is a SavedModel directory",
            hint="give a new directory name, or a .pb, .pbtxt or .meta file name for a graph file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise GraphRewriteError(f"{path}: cannot write: folder '{folder}' does not exist",
                                hint="create the folder first, or write somewhere else")


def write_saved_model(path, meta_graph, source_dir):
    """Writes a SavedModel directory at ``path``: saved_model.pb holding ``meta_graph``
    (the rewritten MetaGraphDef) and ``source_dir``'s variables/ and assets/ copied
    unchanged. Built in a temporary sibling directory and renamed into place, so a failed
    or interrupted run leaves nothing at ``path``."""
    path = os.path.normpath(os.fspath(path))
    check_output_dir(path)
    saved = saved_model_pb2.SavedModel(saved_model_schema_version=1)
    saved.meta_graphs.add().CopyFrom(meta_graph)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        tmp = tempfile.mkdtemp(prefix=".graph-rewrite-", suffix=".tmp", dir=folder)
    except OSError as e:
        raise GraphRewriteError(f"{path}: cannot write: {e.strerror}",
                                hint="write somewhere this process may create files") from None
    try:
        with open(os.path.join(tmp, "saved_model.pb"), "wb") as f:
            f.write(saved.SerializeToString(deterministic=True))
        for name in COPIED_DIRS:
            src = os.path.join(source_dir, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(tmp, name))
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)   # an empty directory at path (check_output_dir) is replaced
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise GraphRewriteError(f"{path}: cannot write: {e.strerror}",
                                    hint="check the disk space and the folder's permissions") from None
        raise
    return path


def meta_graph_with(meta_graph, graph_def):
    """A MetaGraphDef of ``meta_graph``'s parts (tags, signatures, saver, collections,
    assets) and ``graph_def``. Its list of the ops the graph uses, when it has one, is
    made again for ``graph_def`` (the rewrite adds ops, collectives among them)."""
    out = meta_graph_pb2.MetaGraphDef()
    if meta_graph is not None:
        out.CopyFrom(meta_graph)
    out.graph_def.CopyFrom(protos.as_class(graph_def, graph_pb2.GraphDef))   # ours or TensorFlow's class
    if out.meta_info_def.HasField("stripped_op_list"):
        out.meta_info_def.stripped_op_list.CopyFrom(stripped_op_list(graph_def))
    return out


def stripped_op_list(graph_def):
    """The OpList of the registered ops ``graph_def`` uses, in its nodes and in the library
    functions they call (directly or through PartitionedCall's ``f``), sorted by name: what
    tf.compat.v1.train.export_meta_graph records as ``stripped_op_list``."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    used, pending = set(), []

    def use(node):
        names = [node.op]
        if node.op in ("PartitionedCall", "StatefulPartitionedCall"):
            names.append(node.attr["f"].func.name)
        for name in names:
            if name not in used and name in functions:
                pending.append(functions[name])
            used.add(name)

    for node in graph_def.node:
        use(node)
    while pending:
        for node in pending.pop().node_def:
            use(node)
    found = (opdefs.registered_op(op) for op in sorted(used - set(functions)))
    return op_def_pb2.OpList(op=[od for od in found if od is not None])
