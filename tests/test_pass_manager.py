"""Tests of the pass manager: order, declared contracts, verification between passes,
errors that name the pass and the passes before it, timings, logging and dumps.

The passes are tiny and defined here; they mutate a three-node graph:

    a (Const) --> b (Identity) --> c (Identity)
"""

import os

import pytest

from graph_rewriter import graph_io
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.context import RewriteContext
from graph_rewriter.options import Options
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GraphItem
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.pass_manager import Pass, PassManager, PassResult
from graph_rewriter.verifier import verify


def small_graph():
    g = GraphItem()
    a = const(g, "a", 1.0, "float32").node
    b = make_op(g, "Identity", "b", [a.output()])
    make_op(g, "Identity", "c", [b.output()])
    return g


def make_ctx(log=None):
    return RewriteContext(options=Options(), cluster=parse_cluster(None), log=log)


def make_pass(name, requires=(), provides=(), after=(), run=None, modified=True, applies=True):
    """A Pass subclass instance; ``run(graph, ctx)`` defaults to adding a node named
    after the pass (so each pass visibly changes the graph)."""

    def default_run(self, graph, ctx):
        graph.add_node(f"{name}_node", "NoOp")
        return modified

    cls = type(f"{name.title()}Pass", (Pass,), {
        "name": name, "requires": frozenset(requires), "provides": frozenset(provides),
        "after": frozenset(after), "applies": lambda self, ctx: applies,
        "run": (lambda self, graph, ctx: run(graph, ctx)) if run else default_run})
    return cls()


class CountingVerifier:
    """A fake verifier: records the nodes present at each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, graph, ctx):
        self.calls.append(sorted(n.name for n in graph))


def test_passes_run_in_the_given_order():
    seen = []

    def recorder(name):
        def run(graph, ctx):
            seen.append((name, sorted(n.name for n in graph)))
            graph.add_node(f"{name}_node", "NoOp")
            return True
        return make_pass(name, run=run)

    g = small_graph()
    ctx = make_ctx()
    result = PassManager([recorder("third"), recorder("first"), recorder("second")]).run(g, ctx)
    assert [name for name, _ in seen] == ["third", "first", "second"]
    assert seen[1][1] == ["a", "b", "c", "third_node"]  # each pass sees the ones before it
    assert ctx.passes_run == ["third", "first", "second"]
    assert isinstance(result, PassResult) and result.graph is g and result.modified
    assert [n.name for n in g.nodes][-3:] == ["third_node", "first_node", "second_node"]


def test_result_reports_unmodified_when_no_pass_changed_anything():
    g = small_graph()
    result = PassManager([make_pass("look", run=lambda graph, ctx: False),
                          make_pass("peek", run=lambda graph, ctx: False)]).run(g, make_ctx())
    assert result.modified is False


def test_check_order_accepts_products_provided_earlier_or_initially():
    pm = PassManager([make_pass("plan", provides={"plan"}),
                      make_pass("replicate", requires={"plan"}, provides={"replicas"}),
                      make_pass("place", requires={"replicas", "plan"}, after={"replicate"})])
    assert pm.check_order() == {"plan", "replicas"}
    late = PassManager([make_pass("replicate", requires={"plan"}, provides={"replicas"})])
    assert late.check_order(initial={"plan"}) == {"plan", "replicas"}
    with pytest.raises(GraphRewriteError, match="'replicate' requires plan"):
        late.check_order()


def test_check_order_names_the_pass_the_missing_product_and_the_passes_before_it():
    pm = PassManager([make_pass("plan", provides={"plan"}),
                      make_pass("mirror", requires={"plan"}),
                      make_pass("allreduce", requires={"replicas", "plan"}),
                      make_pass("replicate", requires={"plan"}, provides={"replicas"})])
    with pytest.raises(GraphRewriteError) as err:
        pm.check_order()
    message = str(err.value)
    assert "'allreduce'" in message
    assert "requires replicas," in message  # plan is provided by the plan pass, before it
    assert "plan, mirror" in message
    assert "replicate" not in message


def test_check_order_refuses_a_pass_before_one_it_must_run_after():
    """allreduce and micro_batches require the same products; only allreduce's declared
    constraint (it reduces the micro-batch mean) says which goes first."""
    from graph_rewriter import passes
    wrong = PassManager([passes.PlanPass(), passes.ReplicatePass(), passes.AllReducePass(),
                         passes.MicroBatchesPass()])
    with pytest.raises(GraphRewriteError, match="'allreduce' must run after micro_batches") as err:
        wrong.check_order()
    assert "move micro_batches before 'allreduce'" in str(err.value)
    PassManager([passes.PlanPass(), passes.ReplicatePass(), passes.MicroBatchesPass(),
                 passes.AllReducePass()]).check_order()
    # a constraint on a pass the pipeline does not run binds nothing
    PassManager([passes.PlanPass(), passes.ReplicatePass(), passes.AllReducePass()]).check_order()


def test_the_rewrite_pipeline_satisfies_every_declaration():
    from graph_rewriter.api import pipeline
    passes = pipeline()
    assert PassManager(passes).check_order() == {"lowered_statistics", "plan", "replicas"}
    names = [p.name for p in passes]
    for p in passes:   # every constraint names a pass of the pipeline (no stale name)
        assert set(p.after) <= set(names), p.name


def test_check_order_refuses_undeclared_and_twice_provided_products():
    with pytest.raises(GraphRewriteError, match="'x' declares product analysis"):
        PassManager([make_pass("x", requires={"analysis"})]).check_order()
    with pytest.raises(GraphRewriteError, match="'again' provides plan, which an earlier pass"):
        PassManager([make_pass("plan", provides={"plan"}),
                     make_pass("again", provides={"plan"})]).check_order()


def test_a_pipeline_out_of_order_runs_nothing():
    g = small_graph()
    ctx = make_ctx()
    pm = PassManager([make_pass("late", requires={"replicas"}),
                      make_pass("early", provides={"replicas"})])
    with pytest.raises(GraphRewriteError, match="'late' requires replicas.*none"):
        pm.run(g, ctx)
    assert [n.name for n in g.nodes] == ["a", "b", "c"] and ctx.passes_run == []


def test_passes_the_plan_does_not_need_are_skipped_and_logged():
    lines = []
    g = small_graph()
    ctx = make_ctx(log=lines.append)
    PassManager([make_pass("first"), make_pass("unneeded", applies=False),
                 make_pass("last")]).run(g, ctx)
    assert ctx.passes_run == ["first", "last"]
    assert "unneeded_node" not in g
    assert any(line.startswith("pass unneeded") and "skipped" in line for line in lines), lines
    assert [name for name, _, _ in ctx.timings if name != "verify"] == ["first", "last"]


def test_verifier_runs_before_the_pipeline_and_after_each_pass():
    verifier = CountingVerifier()
    g = small_graph()
    pm = PassManager([make_pass("one"), make_pass("two"), make_pass("three")], verifier=verifier)
    pm.run(g, make_ctx())
    base = ["a", "b", "c"]
    assert verifier.calls == [base, sorted(base + ["one_node"]), sorted(base + ["one_node", "two_node"]),
                              sorted(base + ["one_node", "two_node", "three_node"])]


def test_a_pass_that_leaves_the_graph_alone_is_not_verified_again():
    verifier = CountingVerifier()
    idle = make_pass("idle", run=lambda graph, ctx: False)
    pm = PassManager([make_pass("one"), idle, make_pass("two")], verifier=verifier)
    pm.run(small_graph(), make_ctx())
    base = ["a", "b", "c"]
    assert verifier.calls == [base, sorted(base + ["one_node"]), sorted(base + ["one_node", "two_node"])]


def test_without_verify_each_the_verifier_runs_once_at_the_end():
    verifier = CountingVerifier()
    PassManager([make_pass("one"), make_pass("two")], verifier=verifier,
                verify_each=False).run(small_graph(), make_ctx())
    assert verifier.calls == [sorted(["a", "b", "c", "one_node", "two_node"])]


def test_an_invalid_input_is_rejected_before_any_pass_runs():
    """
        a (Const) --> b (Identity) --> c (Identity);  c is colocated with 'ghost'
    """
    g = small_graph()
    g.node("c").set_colocation(["ghost"])
    ran = []
    pm = PassManager([make_pass("one", run=lambda graph, ctx: ran.append(1))], verifier=verify)
    with pytest.raises(GraphRewriteError, match="'c'.*'ghost'"):
        pm.run(g, make_ctx())
    assert ran == []


def _dangle_colocation(graph, ctx):
    """Colocates c with 'victim', a node the graph does not have."""
    graph.node("c").set_colocation(["victim"])
    return True


def _make_cycle(graph, ctx):
    """a -> b -> c becomes a -> b -> c -> b (b now also reads c: not a while loop)."""
    graph.node("b").add_input(graph.node("c").output())
    return True


@pytest.mark.parametrize("breaker, problem", [(_dangle_colocation, "victim"), (_make_cycle, "cycle")])
def test_a_pass_that_breaks_the_graph_is_named_with_the_passes_before_it(breaker, problem):
    pm = PassManager([make_pass("first"), make_pass("second"), make_pass("breaker", run=breaker),
                      make_pass("never")], verifier=verify)
    ctx = make_ctx()
    with pytest.raises(GraphRewriteError) as err:
        pm.run(small_graph(), ctx)
    message = str(err.value)
    assert "'breaker'" in message and "first, second" in message and problem in message
    assert "never" not in message and ctx.passes_run == ["first", "second", "breaker"]


def test_an_unexpected_exception_in_a_pass_becomes_a_graph_rewrite_error():
    def boom(graph, ctx):
        return {}["missing key"]

    pm = PassManager([make_pass("first"), make_pass("boom", run=boom), make_pass("never")])
    ctx = make_ctx()
    with pytest.raises(GraphRewriteError) as err:
        pm.run(small_graph(), ctx)
    message = str(err.value)
    assert "'boom'" in message and "first" in message and "KeyError" in message and "missing key" in message
    assert isinstance(err.value.__cause__, KeyError)
    assert ctx.passes_run == ["first"]


def test_a_graph_rewrite_error_in_a_pass_keeps_its_message_and_hint():
    def reject(graph, ctx):
        raise GraphRewriteError("variable 'w' has two gradients", hint="pass gradients=")

    pm = PassManager([make_pass("analyze"), make_pass("plan", run=reject)])
    with pytest.raises(GraphRewriteError) as err:
        pm.run(small_graph(), make_ctx())
    assert err.value.message.startswith("pass 'plan' (after analyze): ")
    assert "variable 'w' has two gradients" in err.value.message
    assert err.value.hint == "pass gradients="


def test_first_pass_failure_says_no_pass_ran_before_it():
    def reject(graph, ctx):
        raise GraphRewriteError("nothing to do")

    with pytest.raises(GraphRewriteError, match="pass 'only' .*no other pass"):
        PassManager([make_pass("only", run=reject)]).run(small_graph(), make_ctx())


def test_timings_are_recorded_and_logged():
    lines = []
    ctx = make_ctx(log=lines.append)
    PassManager([make_pass("one"), make_pass("two", modified=False)],
                verifier=CountingVerifier()).run(small_graph(), ctx)
    passes = [(name, modified) for name, _, modified in ctx.timings if name != "verify"]
    assert passes == [("one", True), ("two", False)]
    assert [name for name, _, _ in ctx.timings].count("verify") == 3
    assert all(isinstance(seconds, float) and seconds >= 0 for _, seconds, _ in ctx.timings)
    pass_lines = [line for line in lines if line.startswith("pass ")]
    assert len(pass_lines) == 2
    assert "one" in pass_lines[0] and "ms" in pass_lines[0] and "changed" in pass_lines[0]
    assert "two" in pass_lines[1] and "unchanged" in pass_lines[1]
    assert "4 nodes" in pass_lines[0] and "5 nodes" in pass_lines[1]


def test_no_log_function_is_fine():
    ctx = make_ctx(log=None)
    PassManager([make_pass("one")]).run(small_graph(), ctx)
    assert [name for name, _, _ in ctx.timings] == ["one"]


def test_dump_after_writes_the_graph_after_that_pass(tmp_path):
    lines = []
    pm = PassManager([make_pass("one"), make_pass("two"), make_pass("three")],
                     dump_after=["two"], dump_dir=str(tmp_path))
    pm.run(small_graph(), make_ctx(log=lines.append))
    assert os.listdir(tmp_path) == ["after_two.pbtxt"]
    path = tmp_path / "after_two.pbtxt"
    assert path.read_text().lstrip().startswith("node {")
    dumped = graph_io.load_graph(str(path))
    assert [n.name for n in dumped] == ["a", "b", "c", "one_node", "two_node"]
    assert dumped.node("c").inputs[0].node.name == "b"
    assert any(str(path) in line for line in lines)


def test_dump_after_all_writes_every_pass(tmp_path):
    PassManager([make_pass("one"), make_pass("two")], dump_after=["all"],
                dump_dir=str(tmp_path)).run(small_graph(), make_ctx())
    assert sorted(os.listdir(tmp_path)) == ["after_one.pbtxt", "after_two.pbtxt"]
    assert "two_node" not in graph_io.load_graph(str(tmp_path / "after_one.pbtxt"))
    assert "two_node" in graph_io.load_graph(str(tmp_path / "after_two.pbtxt"))


def test_dump_after_an_unknown_pass_lists_the_passes(tmp_path):
    with pytest.raises(GraphRewriteError) as err:
        PassManager([make_pass("plan"), make_pass("replicate")], dump_after=["replicat"],
                    dump_dir=str(tmp_path))
    message = str(err.value)
    assert "'replicat'" in message and "plan, replicate" in message
    assert os.listdir(tmp_path) == []
