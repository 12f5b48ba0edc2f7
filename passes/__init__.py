"""The rewrite passes, one module each. A pass reads the IR and the rewrite context
(options, cluster, plan) and never another pass's module; the pipeline module of
graph_rewriter puts them in order."""

from passes.plan import PlanPass
from passes.replicate import ReplicatePass
from passes.split_inputs import SplitInputsPass
from passes.mirror_variables import MirrorVariablesPass
from passes.micro_batches import MicroBatchesPass
from passes.allreduce import AllReducePass
from passes.allgather import AllGatherPass
from passes.accumulate import AccumulatePass
from passes.sync_queues import SyncQueuesPass
from passes.shard_variables import ShardVariablesPass
from passes.merge_summaries import MergeSummariesPass
from passes.place import PlacePass
from passes.metadata import MetadataPass

__all__ = ["PlanPass", "ReplicatePass", "SplitInputsPass", "MirrorVariablesPass", "MicroBatchesPass",
           "AllReducePass", "AllGatherPass", "AccumulatePass", "SyncQueuesPass", "ShardVariablesPass", "MergeSummariesPass",
           "PlacePass", "MetadataPass"]
