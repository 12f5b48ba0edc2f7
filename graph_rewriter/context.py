"""The explicit configuration a rewrite carries through its passes (no globals).

``Options`` (graph_rewriter/options.py) holds what the user asked for, validated once;
``RewriteContext`` carries it with the cluster and a log function to every pass, with
the products passes hand on (the plan, the replica map) and the timings.
"""

import dataclasses
import typing

from graph_rewriter.options import Options


@dataclasses.dataclass
class RewriteContext:
    """What passes read, and the products they hand on to each other and to the export.

    ``options``, ``cluster`` and ``log`` are the input. Every product a pass hands on
    is a field declared here, with its type, set by the one pass that ``provides`` it
    and read by the passes that ``require`` it (the pass manager checks that order):
    - ``lowered_statistics`` ({name: name}): provided by lower_conds when it runs; the
      batch statistics in a v2 cond's function (``call:function:node``) it inlined, each
      to its inlined node's name. The plan pass reads it when set (the option may name
      a statistic either way);
    - ``plan`` (graph_rewriter.plan.Plan): provided by the plan pass;
    - ``replicas`` (graph_rewriter.replicas.ReplicaMap): provided by replicate; which
      node belongs to which replica, the per-replica outputs the batch split adds and
      the tensors later passes put between a replica's value and its readers (the export
      and the verifier take it from here, never from the graph).
    """
    options: Options
    cluster: object
    plan: object = None
    lowered_statistics: dict = None
    log: typing.Callable = None
    replicas: object = None
    timings: list = dataclasses.field(default_factory=list)  # (pass name, seconds, modified)
    passes_run: list = dataclasses.field(default_factory=list)

    @property
    def num_replicas(self):
        return self.options.devices_per_worker * self.cluster.num_workers

    @property
    def num_local_replicas(self):
        """The replicas this graph holds: all of them in-graph, one task's between-graph."""
        return self.options.devices_per_worker if self.cluster.task is not None else self.num_replicas

    def info(self, message):
        if self.log is not None:
            self.log(message)


PRODUCTS = frozenset(("lowered_statistics", "plan", "replicas"))   # the fields above that passes provide
