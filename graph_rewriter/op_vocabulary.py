"""The op vocabulary: which TensorFlow op types do what to a variable or a gradient.

The analysis and the passes recognise ops by type, never by node name, so the sets of
op names (and the small predicates over them) live here, in one place, with no other
dependency: a pass that asks "does this op only read the variable?" imports the answer
from here rather than from the analysis. TensorFlow has several spellings of one
operation (ref and resource variables, v1 control flow's Ref* forms, the V2 ops), so
each set lists all of them.
"""

# Ops that create a variable, and its kind.
VARIABLE_OPS = {"VarHandleOp": "resource", "VariableV2": "ref", "Variable": "ref"}
# Ops that hand a variable (handle or ref) through unchanged.
PASS_THROUGH = frozenset((
    "Identity", "RefIdentity", "Enter", "RefEnter", "Switch", "RefSwitch", "Exit", "RefExit",
    "Merge", "RefMerge", "NextIteration", "RefNextIteration"))
# Ops that take a variable but only read it. Every other op taking a variable handle,
# or a variable ref through a ref argument, is taken to write it.
READERS = frozenset((
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "IsVariableInitialized", "_ReadVariablesOp", "DestroyResourceOp"))
FUNCTION_CALLS = frozenset((
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall"))
DENSE_ASSIGNS = frozenset((
    "Assign", "AssignAdd", "AssignSub",
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"))
INCREMENTS = frozenset(("AssignAdd", "AssignAddVariableOp", "CountUpTo", "ResourceCountUpTo"))
LINEAR_SCATTERS = frozenset(("ScatterAdd", "ScatterSub", "ResourceScatterAdd", "ResourceScatterSub"))
# Element-wise ops (broadcasting allowed): the walk from an assigned value back to the
# gradient passes through these while only one of their inputs depends on the batch.
ELEMENTWISE = frozenset((
    "Identity", "Snapshot", "StopGradient", "Cast", "Neg", "Reciprocal", "Mul", "MulNoNan",
    "RealDiv", "Div", "DivNoNan", "AddV2", "Add", "Sub", "Square", "Sqrt", "Rsqrt", "Abs",
    "Sign", "Maximum", "Minimum", "Exp", "Log", "Pow", "Tanh", "Sigmoid", "ClipByValue",
    "SquaredDifference"))
SHARDABLE_USERS = frozenset((
    "ReadVariableOp", "ResourceGather", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMax", "ResourceScatterMin",
    "VarIsInitializedOp", "VariableShape"))


def shardable_user(node):
    """True if a use of a variable handle can be rewritten for a variable split by rows
    (passes/shard_variables.py)."""
    return node.op in SHARDABLE_USERS or node.op.startswith(("ResourceApply", "ResourceSparseApply"))


PLACEHOLDERS = frozenset(("Placeholder", "PlaceholderV2", "PlaceholderWithDefault"))
ITERATOR_GET_NEXT = frozenset(("IteratorGetNext", "IteratorGetNextSync"))
# TF1 queue-based input (tf.train.batch, shuffle_batch, the input producers): a batch is
# dequeued many elements at a time; QueueRunner threads run the enqueues.
QUEUE_BATCH_DEQUEUES = frozenset(("QueueDequeueManyV2", "QueueDequeueUpToV2", "QueueDequeueMany",
                                  "QueueDequeueUpTo"))
QUEUES = frozenset(("FIFOQueueV2", "RandomShuffleQueueV2", "PaddingFIFOQueueV2", "PriorityQueueV2",
                    "FIFOQueue", "RandomShuffleQueue", "PaddingFIFOQueue", "PriorityQueue"))


def input_kind(op):
    """How a batch input's op gets its rows: "iterator" and "queue" are drawn, a
    "placeholder" is fed."""
    if op in ITERATOR_GET_NEXT:
        return "iterator"
    return "queue" if op in QUEUE_BATCH_DEQUEUES else "placeholder"
SAVER_OPS = frozenset(("SaveV2", "RestoreV2", "Save", "Restore", "RestoreSlice", "SaveSlices",
                       "MergeV2Checkpoints"))
RESTORE_OPS = frozenset(("RestoreV2", "Restore", "RestoreSlice"))


# Ops that post-process gradients between the backward pass and the updates, and that
# the walk from an update back to the backward pass goes through: element-wise math,
# predicates, and the v1 cond routing (Switch) into a conditional apply. Not Merge: the
# gradient of a cond's branch leaves it through one, and is made there.
POST_PROCESSING = ELEMENTWISE | frozenset((
    "Switch", "RefSwitch", "Select", "SelectV2", "IsFinite", "IsNan",
    "IsInf", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Floor", "Ceil", "Round", "Rint", "Reciprocal", "Inv",
    "ZerosLike", "OnesLike", "Xdivy", "Xlogy", "Softplus", "Erf"))

# the collective ops the rewrite emits or meets (their keys pair replicas up at run time)
COLLECTIVES = frozenset(("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2",
                         "CollectiveBcastRecvV2", "CollectiveReduce", "CollectiveGather",
                         "CollectiveAllToAllV2", "CollectiveReduceScatterV2"))
# Random ops that draw a tensor of the shape their first input gives (then, for
# RandomGamma and RandomPoissonV2, one per parameter). The stateful ones take their
# seeds from the attributes seed and seed2 (both 0: a random seed per kernel); the
# stateless ones from an input.
STATELESS_RANDOM_DRAWS = frozenset((
    "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
    "StatelessRandomUniformInt", "StatelessRandomUniformFullInt", "StatelessRandomUniformV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2"))
RANDOM_DRAWS = STATELESS_RANDOM_DRAWS | frozenset((
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
    "RandomGamma", "RandomPoissonV2"))
