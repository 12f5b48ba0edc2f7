"""Runs passes in order, checks their declared contracts, verifies the graph between them.

A pass is a small object with a ``name`` and a declared contract:
- ``requires``/``provides``: the context products it reads and the ones it sets
  (fields of RewriteContext: ``plan``, ``replicas``);
- ``after``: the passes that must have run before it when both run (its reason for
  each is in its docstring), torch.fx-style ordering constraints;
- ``applies(ctx)``: whether this rewrite needs it, decided from the plan, the options
  and the cluster once the plan exists; ``applies_to(graph, ctx)``, for a pass whose
  need may show in the graph alone (a v2 cond that takes rows by position), narrows it.
``run(graph, ctx)`` mutates the GraphItem and returns whether it changed anything; it
keeps nothing on ``self``. The pass manager knows nothing about any one pass: it refuses
an order that breaks a declaration, skips the passes the plan does not need, runs the
verifier before the pipeline and after every pass, times each pass, dumps the graph
after the passes asked for, and names the failing pass and the passes before it in any
error.
"""

import os
import time

from graph_rewriter import graph_io
from graph_rewriter.context import PRODUCTS
from graph_rewriter.errors import GraphRewriteError


class Pass:
    """Base class: subclasses set name/requires/provides/after and implement run()
    (and applies(), when a rewrite may not need them)."""
    name = "pass"
    requires = frozenset()   # context products read
    provides = frozenset()   # context products set
    after = frozenset()      # names of passes that must run first, when both run

    def applies(self, ctx):
        """Whether this rewrite needs the pass (ctx.plan is set by then)."""
        return True

    def applies_to(self, graph, ctx):
        """Whether this rewrite of ``graph`` needs the pass: applies(ctx) unless a pass
        looks at the graph too. A pass skipped is not listed in the graph's metadata."""
        return self.applies(ctx)

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
        """Refuses an order that breaks a declaration: a product required before the
        pass that provides it, a product two passes provide, a pass before one it must
        run after. ``initial``: products the context holds before the first pass."""
        have = set(initial)
        position = {p.name: i for i, p in enumerate(self.passes)}
        for i, p in enumerate(self.passes):
            unknown = (set(p.requires) | set(p.provides)) - PRODUCTS
            if unknown:
                raise GraphRewriteError(
                    f"pass '{p.name}' declares product {', '.join(sorted(unknown))}, which "
                    "RewriteContext does not have", hint=f"products are: {', '.join(sorted(PRODUCTS))}")
            missing = set(p.requires) - have
            if missing:
                before = ", ".join(q.name for q in self.passes[:i]) or "none"
                raise GraphRewriteError(
                    f"pass '{p.name}' requires {', '.join(sorted(missing))}, which no earlier "
                    f"pass provides (passes before it: {before})",
                    hint="put the pass that provides it first")
            again = set(p.provides) & have
            if again:
                raise GraphRewriteError(
                    f"pass '{p.name}' provides {', '.join(sorted(again))}, which an earlier "
                    "pass already provides", hint="one pass provides each product")
            late = sorted(a for a in p.after if position.get(a, -1) > i)
            if late:
                raise GraphRewriteError(
                    f"pass '{p.name}' must run after {', '.join(late)}, which this pipeline "
                    f"runs later", hint=f"move {', '.join(late)} before '{p.name}'")
            have |= set(p.provides)
        return have

    def run(self, graph, ctx, initial=frozenset()):
        self.check_order(initial)
        if self.verifier is not None and self.verify_each:
            self._verify(graph, ctx, None, [])
        done = []
        changed = False
        for p in self.passes:
            if not p.applies_to(graph, ctx):
                ctx.info(f"pass {p.name:<18} skipped: this plan does not need it")
                continue
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
        last = next((p for p in reversed(self.passes) if p.name in done), None)
        if self.verifier is not None and not self.verify_each:
            self._verify(graph, ctx, last, done)
        if self.verify_final is not None and last is not None:
            self._verify(graph, ctx, last, done, self.verify_final)
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
        graph_io.write_atomic(path, graph_io.serialize(graph_io.to_graph_def(graph, ctx.replicas), path))
        ctx.info(f"wrote the graph after pass {p.name} to {path}")


def run_passes(graph, ctx, *passes, verify_each=True):
    """Runs ``passes`` on ``graph`` as a rewrite runs them (declarations checked, the graph
    verified before and after each), starting from the products ``ctx`` already holds:
    how a test runs one pass alone, or a pass with only the passes it requires."""
    from graph_rewriter.verifier import check_collectives_run, verify, verify_changes
    # (a product a pass of these provides is its to check and complete: the plan pass
    # takes a given plan)
    initial = {name for name in PRODUCTS if getattr(ctx, name) is not None}
    initial -= {name for p in passes for name in p.provides}
    return PassManager(passes, verifier=verify, verify_changes=verify_changes, verify_each=verify_each,
                       verify_final=check_collectives_run).run(graph, ctx, initial)
