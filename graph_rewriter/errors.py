"""The one exception every rejected input raises.

A message names the thing that is wrong (file, node, flag, variable), says what was
expected, and where there is one, suggests the fix. The CLI prints it on one line.
"""


class GraphRewriteError(Exception):
    """Raised for every input graph_rewriter rejects; the message is meant for a user."""

    def __init__(self, message, *, hint=None):
        self.message = message
        self.hint = hint
        super().__init__(message if not hint else f"{message}. To fix this, {hint}")
