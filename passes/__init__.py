"""The rewrite passes, one module each. A pass reads the IR and the rewrite context
(options, cluster, plan) and never another pass's module; the pipeline module of
graph_rewriter puts them in order."""

from graph_rewriter.passes.saver import SaverPass
from graph_rewriter.passes.lower_conds import LowerCondsPass
from graph_rewriter.passes.plan import PlanPass
from graph_rewriter.passes.replicate import ReplicatePass
from graph_rewriter.passes.split_inputs import SplitInputsPass
from graph_rewriter.passes.normalizers import NormalizersPass
from graph_rewriter.passes.loop_bounds import LoopBoundsPass
from graph_rewriter.passes.gather_rows import GatherRowsPass
from graph_rewriter.passes.product_heads import ProductHeadsPass
from graph_rewriter.passes.row_moves import RowMovesPass
from graph_rewriter.passes.batch_statistics import BatchStatisticsPass
from graph_rewriter.passes.random_draws import RandomDrawsPass
from graph_rewriter.passes.loss_sums import LossSumsPass
from graph_rewriter.passes.invariant_terms import InvariantTermsPass
from graph_rewriter.passes.mirror_variables import MirrorVariablesPass
from graph_rewriter.passes.micro_batches import MicroBatchesPass
from graph_rewriter.passes.allreduce import AllReducePass
from graph_rewriter.passes.allgather import AllGatherPass
from graph_rewriter.passes.communication import CommunicationPass
from graph_rewriter.passes.accumulate import AccumulatePass
from graph_rewriter.passes.sync_queues import SyncQueuesPass
from graph_rewriter.passes.shard_variables import ShardVariablesPass
from graph_rewriter.passes.row_defaults import RowDefaultsPass
from graph_rewriter.passes.merge_outputs import MergeOutputsPass
from graph_rewriter.passes.meta_graph import MetaGraphPass
from graph_rewriter.passes.heartbeat import HeartbeatPass
from graph_rewriter.passes.record_incarnations import RecordIncarnationsPass
from graph_rewriter.passes.step_sequence import StepSequencePass
from graph_rewriter.passes.place import PlacePass
from graph_rewriter.passes.metadata import MetadataPass

__all__ = ["SaverPass", "LowerCondsPass", "PlanPass", "ReplicatePass", "SplitInputsPass", "NormalizersPass", "LoopBoundsPass", "GatherRowsPass", "ProductHeadsPass", "RowMovesPass", "BatchStatisticsPass", "RandomDrawsPass",
           "MirrorVariablesPass",
           "MicroBatchesPass",
           "AllReducePass", "AllGatherPass", "CommunicationPass", "AccumulatePass", "SyncQueuesPass",
           "ShardVariablesPass", "LossSumsPass", "InvariantTermsPass", "RowDefaultsPass", "MergeOutputsPass", "MetaGraphPass", "HeartbeatPass", "RecordIncarnationsPass",
           "StepSequencePass", "PlacePass", "MetadataPass"]
