"""split_inputs: give each replica its slice of the global batch.

    x (global batch, host CPU) ─> Split(num_split=R) ─┬─:0─> replica 0's readers of x
                                                      └─:1─> replica 1's readers of x

Batch inputs are placeholders with an unknown first dimension and tf.data iterator
outputs (the plan lists them). The split runs on the host CPU where the batch arrives; a
batch whose rows do not divide evenly by R fails the step with TensorFlow's error from
this Split (the Session wrapper checks fed batches first and names the input).

Between-graph, each worker's client feeds its own batches; a worker that reads its
batches from an in-graph tf.data pipeline reads its own shard of the data: a
ShardDataset(num_workers, worker index) goes in front of every batching dataset op, so
worker k batches elements k, k+W, k+2W, ...
"""

from tensorflow.core.framework import attr_value_pb2

from graph_rewriter.op_builder import const, make_op

BATCH_DATASETS = frozenset(("BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
                            "PaddedBatchDatasetV2", "ParallelBatchDataset"))
from graph_rewriter.pass_manager import Pass


class SplitInputsPass(Pass):
    name = "split_inputs"
    requires = frozenset({"replicated", "plan"})
    ensures = frozenset({"inputs_split"})

    def run(self, graph, ctx):
        rm = graph.replicas
        r = rm.num_local
        sharded = self._shard_datasets(graph, ctx) if ctx.cluster.task is not None else False
        if r == 1:
            return sharded
        for name in ctx.plan.batch_inputs:
            x = graph.tensor(name)
            readers = [(c, pos) for c, pos in x.node.consumers(x.index)]
            axis = const(graph, f"{x.node.name}/split_for_replicas/axis", 0, "int32", rm.global_device)
            split = make_op(graph, "Split", f"{x.node.name}/split_for_replicas", [axis, x],
                            attrs={"num_split": r}, device=rm.global_device)
            if rm.template:
                rm.per_replica_outputs.append(split.name)   # replica k reads output k
            for c, pos in readers:
                replica = rm.replica_of(graph, c.name)
                if replica is None:
                    continue  # a global reader (e.g. a summary of the raw input) keeps the batch
                c.set_input(pos, split.output(replica))
        return bool(ctx.plan.batch_inputs) or sharded

    def _shard_datasets(self, graph, ctx):
        workers = ctx.cluster.compute_tasks
        if len(workers) == 1:
            return False
        me = workers.index(ctx.cluster.task)
        host = graph.replicas.global_device
        batching = [n for n in graph if n.op in BATCH_DATASETS]
        for batch in batching:
            source = batch.inputs[0]
            types = batch.attr["output_types"]
            shapes = attr_value_pb2.AttrValue()
            for s in batch.attr["output_shapes"].list.shape:
                element = shapes.list.shape.add()
                element.CopyFrom(s)
                if not s.unknown_rank and element.dim:
                    del element.dim[0]  # the element shape: the batched shape without its first axis
            shard = make_op(graph, "ShardDataset", f"{batch.name}/shard_for_worker",
                            [source, const(graph, f"{batch.name}/num_workers", len(workers), "int64", host),
                             const(graph, f"{batch.name}/worker_index", me, "int64", host)],
                            attrs={"output_types": types, "output_shapes": shapes}, device=host)
            batch.set_input(0, shard.output(0))
        return bool(batching)
