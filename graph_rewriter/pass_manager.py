"""Runs passes in order, checks their declared contracts, verifies the graph between them.

A pass is a small object with a ``name``, the properties it ``requires`` and those it
``ensures``; ``run(graph, ctx)`` mutates the GraphItem and returns whether it changed
anything. The pass manager knows nothing about any one pass: it checks that every
requirement is ensured by an earlier pass (or holds initially), runs the verifier
before the pipeline and after every pass, times each pass, dumps the graph after the
passes asked for, and names the failing pass and the passes before it in any error.
"""

import os
import time

from graph_rewriter import graph_io
from graph_rewriter.errors import GraphRewriteError


class Pass:
    """Base class: subclasses set name/requires/ensures and implement run()."""
    name = "pass"
    requires = frozenset()
    ensures = frozenset()

    def run(self, graph, ctx):
        raise NotImplementedError

    def __repr__(self):
        return f"<pass {self.name}>"


class PassResult:
    __slots__ = ("graph", "modified")

    def __init__(self, graph, modified):
        self.graph = graph
        self.modified = modified


class PassManager:
    def __init__(self, passes, verifier=None, verify_each=True, dump_after=(), dump_dir=".",
                 verify_changes=None, verify_final=None):
        self.passes = list(passes)
        self.verifier = verifier
        # checks that hold only of the finished graph (every replica's collective runs)
        self.verify_final = verify_final
        # after a pass, what it changed is enough to check (the graph was valid before it)
        self.verify_changes = verify_changes or verifier
        self.verify_each = verify_each
        self.dump_after = set(dump_after)
        self.dump_dir = dump_dir
        names = [p.name for p in self.passes]
        unknown = self.dump_after - set(names) - {"all"}
        if unknown:
            raise GraphRewriteError(
                f"--dump-after names pass '{sorted(unknown)[0]}', which this pipeline does not run",
                hint=f"the passes are: {', '.join(names)}")

    def check_order(self, initial=frozenset()):
        """Every pass's requirements must be ensured by a pass before it."""
        have = set(initial)
        for i, p in enumerate(self.passes):
            missing = set(p.requires) - have
            if missing:
                before = ", ".join(q.name for q in self.passes[:i]) or "none"
                raise GraphRewriteError(
                    f"pass '{p.name}' requires {', '.join(sorted(missing))}, which no earlier "
                    f"pass ensures (passes before it: {before})")
            have |= set(p.ensures)
        return have

    def run(self, graph, ctx, initial=frozenset()):
        self.check_order(initial)
        if self.verifier is not None and self.verify_each:
            self._verify(graph, ctx, None, [])
        done = []
        changed = False
        for p in self.passes:
            start = time.perf_counter()
            version = graph.version
            try:
                modified = p.run(graph, ctx)
            except GraphRewriteError as e:
                raise GraphRewriteError(self._where(p, done) + e.message, hint=e.hint) from None
            except Exception as e:  # a bug in a pass: still one clear error, never a traceback
                raise GraphRewriteError(
                    f"{self._where(p, done)}internal error {type(e).__name__}: {e}",
                    hint="please report this with the input graph") from e
            seconds = time.perf_counter() - start
            changed = changed or bool(modified)
            done.append(p.name)
            ctx.passes_run.append(p.name)
            ctx.timings.append((p.name, seconds, bool(modified)))
            ctx.info(f"pass {p.name:<18} {seconds * 1000:9.1f} ms  "
                     f"{'changed' if modified else 'unchanged':9}  {len(graph)} nodes")
            if self.verifier is not None and self.verify_each and graph.version != version:
                self._verify(graph, ctx, p, done, self.verify_changes)  # (a pass that changed nothing needs none)
            if p.name in self.dump_after or "all" in self.dump_after:
                self._dump(graph, ctx, p)
        if self.verifier is not None and not self.verify_each:
            self._verify(graph, ctx, self.passes[-1] if self.passes else None, done)
        if self.verify_final is not None and self.passes:
            self._verify(graph, ctx, self.passes[-1], done, self.verify_final)
        return PassResult(graph, changed)

    def _where(self, p, done):
        return f"pass '{p.name}' (after {', '.join(done) or 'no other pass'}): "

    def _verify(self, graph, ctx, p, done, verifier=None):
        start = time.perf_counter()
        try:
            (verifier or self.verifier)(graph, ctx)
        except GraphRewriteError as e:
            if p is None:
                raise
            raise GraphRewriteError(
                f"the graph after pass '{p.name}' (passes run: {', '.join(done)}) fails "
                f"verification: {e.message}", hint=e.hint) from None
        ctx.timings.append(("verify", time.perf_counter() - start, False))

    def _dump(self, graph, ctx, p):
        path = os.path.join(self.dump_dir, f"after_{p.name}.pbtxt")
        graph_io.write_atomic(path, graph_io.serialize(graph_io.to_graph_def(graph), path))
        ctx.info(f"wrote the graph after pass {p.name} to {path}")
