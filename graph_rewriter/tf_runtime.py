"""Importing TensorFlow only where its runtime is needed: quietly, and with an error that
says how to install it.

Rewriting, planning and inspecting need TensorFlow's protos and op registry, which ship
with graph_rewriter (protos.py, opdefs.py); running graphs (Session, serve, demo) and
TensorFlow's shape inference (shape_probe.py) need TensorFlow itself, which costs about
4 s to import.
"""

import os
import sys

from graph_rewriter.errors import GraphRewriteError

INSTALL_HINT = ("install TensorFlow: pip install 'graph-rewriter[cpu]' (or '[gpu]'), "
                "or the TensorFlow you already use")


def imported():
    """True if TensorFlow has been imported in this process. A ``None`` entry in
    sys.modules (what blocks an import, as the tests do) counts as not imported."""
    return sys.modules.get("tensorflow") is not None


def installed():
    """True if TensorFlow can be imported (without importing it)."""
    if "tensorflow" in sys.modules:
        return imported()
    import importlib.util
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def import_tensorflow(needed_for):
    """TensorFlow, imported quietly; a GraphRewriteError naming ``needed_for`` ("serve",
    "running a rewritten graph") when it is not installed."""
    if not installed():
        raise GraphRewriteError(f"{needed_for} needs TensorFlow, which is not installed",
                                hint=INSTALL_HINT)
    import_tensorflow_quietly()
    return sys.modules["tensorflow"]


def import_tensorflow_quietly():
    """Imports TensorFlow with its start-up log lines (printed by C++ before logging is
    configured, so TF_CPP_MIN_LOG_LEVEL cannot silence them) kept off stderr, which is
    reserved for the command's own one-line messages."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if imported():
        return
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        import tensorflow  # noqa: F401  (stderr is not a real file: nothing to redirect)
        return
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    sys.stderr.flush()
    os.dup2(devnull, fd)
    try:
        import tensorflow  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)
