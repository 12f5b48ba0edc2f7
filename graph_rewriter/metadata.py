"""The metadata a rewritten graph carries in itself (one Const node of JSON), so that one
file holds everything the Session wrapper and `graph-rewrite inspect` need."""

import json

from graph_rewriter.errors import GraphRewriteError

METADATA_NODE = "graph_rewriter/metadata"
METADATA_FORMAT = "graph_rewriter.metadata/1"


def decode_metadata(tensor):
    """The metadata dict held by the metadata node's value (a TensorProto)."""
    return json.loads(tensor.string_val[0].decode("utf-8"))


def read_metadata_of(graph):
    """The metadata dict of a rewritten GraphItem."""
    return decode_metadata(graph.node(METADATA_NODE).attr["value"].tensor)


def read_metadata(graph_def, source="graph"):
    """The metadata dict of a rewritten GraphDef; a clear error if it has none."""
    for node in reversed(graph_def.node):
        if node.name == METADATA_NODE:
            try:
                doc = decode_metadata(node.attr["value"].tensor)
            except (IndexError, ValueError) as e:
                raise GraphRewriteError(f"{source}: its graph_rewriter metadata is damaged ({e})",
                                        hint="rewrite the original graph again") from None
            if doc.get("format") != METADATA_FORMAT:
                raise GraphRewriteError(
                    f"{source}: written by an incompatible graph_rewriter (metadata format "
                    f"{doc.get('format')!r}, expected {METADATA_FORMAT!r})",
                    hint="rewrite the original graph with this version of graph_rewriter")
            return doc
    raise GraphRewriteError(
        f"{source} was not written by graph-rewrite (it has no '{METADATA_NODE}' node)",
        hint="rewrite the graph first, or pass the file that `graph-rewrite IN OUT` wrote")
