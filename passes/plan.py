"""plan: analyse the single-device graph and decide, per variable, how it is synchronised.

Leaves the graph unchanged; puts the Plan in the context (or checks a given one).
Every decision and check is the planner's (graph_rewriter/planner.py), which also
rejects graphs that do not train (no variables, or no update that depends on the
batch); this pass runs the analysis, hands it to the planner, and keeps the plan.
"""

from graph_rewriter import planner
from graph_rewriter.analysis import analyze
from graph_rewriter.pass_manager import Pass


class PlanPass(Pass):
    name = "plan"
    provides = frozenset({"plan"})
    after = frozenset({"lower_conds"})   # plans the graph it lowered

    def run(self, graph, ctx):
        analysis = analyze(graph, ctx.options.gradients)
        ctx.plan = planner.plan(graph, analysis, ctx.options, ctx.cluster, ctx.num_replicas,
                                given=ctx.plan, log=ctx.info, aliases=ctx.lowered_statistics)
        return False
