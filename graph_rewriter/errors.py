"""The one exception every rejected input raises.

A message names the thing that is wrong (file, node, flag, variable), says what was
expected, and where there is one, suggests the fix. The CLI prints it on one line.
"""


class GraphRewriteError(Exception):
    """Raised for every input graph_rewriter rejects; the message is meant for a user."""

    def __init__(self, message, *, hint=None):
        self.message = message
        self.hint = hint
        text = message.rstrip()
        if hint:
            text = f"{text.rstrip('.')}. To fix this, {hint}"
        super().__init__(text)
