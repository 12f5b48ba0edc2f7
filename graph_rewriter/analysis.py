"""What a data-parallel rewrite must know about a plain single-device training GraphDef.

Found from op types, OpDef argument names and graph structure, never from node names,
with two exceptions. The backward pass, and a forward op's part of it, are found by the
name scopes tf.gradients gives them, ``<scope>/<op>_grad/`` with ``<scope>`` its own
("gradients", "gradients_1", or what its ``name`` says; see in_gradients_scope,
named_gradient_scopes and gradient_scopes). A sparse_placeholder's three placeholders
are found by the names it gives them (see _sparse_inputs). Neither depends on the order
of the GraphDef's nodes or on a prefix on every name (tests/test_graph_form.py):

- variables (resource and ref) and every op that writes one;
- batch inputs: placeholders with an unknown first dimension, tf.data iterator outputs,
  and the batch's SparseTensors (split by their rows, not their entries);
- the replica-variant nodes: those whose value depends on a batch input;
- gradient cuts: for every variable update that depends on the batch, the tensor (dense)
  or (values, indices) pair (sparse) through which the batch reaches it. Averaging a cut
  across replicas makes every replica apply the update one device would apply on the
  global batch. Cuts come from, in order:
    1. fused optimizer ops (Apply*, ResourceApply*, SparseApply*...): their ``grad`` or
       ``delta`` argument, plus ``indices`` for the sparse ones;
    2. scatter updates (the scatter-based sparse SGD and Adam paths): the deduplicated
       (UnsortedSegmentSum, Unique) pair when the optimizer deduplicated, otherwise the
       scatter's own (updates, indices) when the scatter is linear (add/sub);
    3. plain assign ops (Keras Nadam, BatchNorm moving averages, hand-written optimizers):
       the tensor reached by walking back from the assigned value through element-wise
       ops that have a single batch-dependent input; the walk stops at the op that
       produced the gradient (a reduction, a matmul, an AddN, ...);
    4. explicit hints (``gradients={variable: tensor}``) for custom optimizers.
  An update that writes the batch's rows into a variable (MoCo's queue of keys) is no
  cut: the forward tensors holding the rows that its ops read are gathered from every
  replica for them (gathered_rows), and the update is then the same on every replica.
  A batch-dependent update that none of these explains is an error naming the variable.
- roles: trainable (read by the batch computation and updated through a cut), optimizer
  slot, step counter (an integer counter bumped by a constant), state (BatchNorm moving
  statistics: updated from the batch but not read by it), other;
- the init op and each variable's initializer, the saver's nodes, the input pipeline.
"""

import collections
import dataclasses
import functools
import re

from graph_rewriter.protos import types_pb2

from graph_rewriter import dtypes, opdefs
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.invariant_terms import find_invariant_terms
from graph_rewriter.ir import Tensor
from graph_rewriter.op_builder import dtype_of
from graph_rewriter.op_vocabulary import (
    DENSE_ASSIGNS, ELEMENTWISE, FUNCTION_CALLS, INCREMENTS, ITERATOR_GET_NEXT, LINEAR_SCATTERS,
    PASS_THROUGH, PLACEHOLDERS, POST_PROCESSING, QUEUE_BATCH_DEQUEUES, QUEUES, RANDOM_DRAWS, READERS,
    RESTORE_OPS, SAVER_OPS, STATELESS_RANDOM_DRAWS, VARIABLE_OPS)
from graph_rewriter.traversal import (absorb_exclusive_ancestors, ancestors, descendants, is_back_edge,
                                      topological_order)

HINTS_COLLECTION = "graph_rewriter_gradients"


@dataclasses.dataclass
class Variable:
    """A variable of the graph: its creating node and what the analysis learned of it."""
    node: object
    kind: str                     # "resource" | "ref"
    dtype: int                    # base DataType enum
    shape: list                   # static shape (-1 for unknown dims) or None if unknown rank
    role: str = "other"           # "trainable" | "slot" | "step" | "state" | "other"
    trainable: bool = False
    slot_of: str = None           # the trainable variable an optimizer slot belongs to
    writers: list = dataclasses.field(default_factory=list)
    initializer: object = None    # the assign that gives its initial value

    @property
    def name(self):
        return self.node.name

    def step_writes(self, saver_nodes):
        """Its writes in a training step: not its initializer's, nor a Saver's restore
        (``saver_nodes``)."""
        return [w for w in self.writers if w is not self.initializer and w not in saver_nodes]

    @property
    def num_elements(self):
        if self.shape is None or any(d < 0 for d in self.shape):
            return None
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self):
        n = self.num_elements
        return None if n is None else n * dtype_size(self.dtype)


@dataclasses.dataclass
class GradientCut:
    """Where the batch reaches a variable's update: averaged across replicas by the rewrite.

    kind: "dense" (values only), or "sparse" (values + indices, IndexedSlices rows).
    deduplicated: sparse indices are unique per replica (the optimizer summed duplicates
      with Unique + UnsortedSegmentSum), so the gathered rows must be summed again.
    linear: the sparse update is a linear scatter (add/sub) that may see duplicates.
    source: how it was found (fused-op, scatter, assign-walk, hint).
    """
    values: Tensor
    indices: Tensor = None
    kind: str = "dense"
    variable: str = None          # the trainable (or state) variable the cut feeds
    variables: list = dataclasses.field(default_factory=list)  # every variable written from it
    deduplicated: bool = False
    linear: bool = False
    source: str = "fused-op"
    role: str = "gradient"        # "gradient" | "state"
    # Set when the cut was moved back from where the updates receive the gradient to
    # where the backward pass produces it: the tensors the updates received, and the op
    # types of the post-processing between (clipping, unscaling, all-finite conds, ...).
    received: list = dataclasses.field(default_factory=list)
    post_processing: list = dataclasses.field(default_factory=list)
    # The ops nothing reads whose run applies this update, when they differ between cuts
    # (a GAN's discriminator and generator train ops, each run at steps of its own).
    train_ops: list = None
    # A state whose value is a sum or a count over the batch's rows: "sum" (the
    # replicas' values add up to one device's); a state of a row per row of a static
    # batch (a stateful RNN's): "rows" (each replica keeps its own, one device's is
    # their concatenation); None: averaged (a batch mean).
    combine: str = None
    # A later update of a variable an earlier cut updates too (a BatchNorm applied twice:
    # a GAN's discriminator on real and fake rows, a Keras model called on a tensor):
    # "<variable>/update_<k>", its name in the plan; None: the variable's.
    name: str = None
    # A state whose value is computed from another state's average on the way to that
    # state's update (weight normalization's data-dependent init: the bias -mean * scale
    # from the scale that the gain is assigned, itself from the averaged variance): the
    # keys of those cuts, averaged first (another pack); None: none.
    after: list = None

    @property
    def key(self):
        """The cut's name in the plan: its variable's, or ``name`` for a later update."""
        return self.name or self.variable


@dataclasses.dataclass
class Analysis:
    variables: dict               # name -> Variable, in graph order
    cuts: list                    # GradientCut, in graph order of their values' producers
    batch_inputs: list            # Tensor: the batch data, split (or drawn) per replica
    broadcast_inputs: list        # Tensor: fed or read once, the same for every replica
    variant: set                  # nodes whose value depends on a batch input (cuts applied)
    init_ops: list                # NoOp nodes that run variable initializers
    saver_nodes: set              # nodes of the Saver's save/restore subgraphs
    input_pipeline: set           # tf.data dataset and iterator nodes
    step_counters: list           # names of step-counter variables
    # batch inputs with a static first dimension: tensor name -> that dimension (None for
    # an iterator output without one, drawn with the rest of its element). Each replica
    # takes its own batch of them (see _find_inputs).
    static_batch: dict = dataclasses.field(default_factory=dict)
    # groups of cut variables whose gradients meet in post-processing before the updates
    # (a global norm couples every gradient it reads): they must be averaged alike
    coupled: list = dataclasses.field(default_factory=list)
    # Tensor: a loss's divisor that is a sum over the batch's values (a count of tokens, a
    # sum of weights): each replica's differs, and one device divides by their total
    normalizers: list = dataclasses.field(default_factory=list)
    # seeded random ops that draw one value per row of the batch (dropout's mask): every
    # replica's clone would draw what one device draws for the first rows
    batch_draws: list = dataclasses.field(default_factory=list)
    # names of constants and fills with one row per row of the batch that the batch's
    # values do not decide (an RNN's zero initial state, which a script feeds with the
    # last step's final state): each replica computes its own rows, so a value fed by the
    # name would reach replica 0 alone (passes/row_defaults.py)
    row_defaults: list = dataclasses.field(default_factory=list)
    # names of sums over the batch's rows (Sum over every axis, L2Loss) that a loss adds up
    # undivided by a count of rows: their gradient is summed over the replicas, not averaged
    loss_sums: list = dataclasses.field(default_factory=list)
    # names of forward products in which rows of the batch meet other rows (in-batch
    # negatives: every query against every document): a replica sees its own rows only
    row_products: list = dataclasses.field(default_factory=list)
    # the forward ops downstream of those products, which every replica can compute over
    # every replica's rows (graph_rewriter/product_heads.py: ProductHead), or None; and
    # why they cannot when there are products (a sentence), or None
    product_head: object = None
    product_head_obstacle: str = None
    # names of forward ops that move the batch's rows within it (mixup's reversed or
    # shuffled batch): a replica moves its own rows only
    moved_rows: list = dataclasses.field(default_factory=list)
    # those of them that rank the rows (a top_k of the rows' losses: hard example
    # mining), whose head every replica can compute over every replica's rows as an
    # in-batch product's (graph_rewriter/product_heads.py)
    ranked_rows: list = dataclasses.field(default_factory=list)
    # names of seeded draws of one sample per row from the row's own values
    # (tf.random.categorical(logits): a policy's actions): a replica's clone draws for its
    # rows what one device draws for the batch's first rows
    sampled_rows: list = dataclasses.field(default_factory=list)
    # the other moves and those draws that every replica can compute over every
    # replica's rows: rows that come from the batch alone, draws from any rows
    # (graph_rewriter/row_moves.py: RowMoves), or None; and {name: why not} for the others
    row_moves: object = None
    row_move_obstacles: dict = dataclasses.field(default_factory=dict)
    # {loop: [the ops stacking its values over the rows]} for the forward while loops
    # over the batch's rows that run a seeded stateful random op (tf.map_fn's per-image
    # augmentation: a v1 loop by its LoopCond, a v2 one by its While): a replica's loop
    # draws for its rows what one device draws for the batch's first rows. Those row_moves
    # computes over every replica's rows list their stacks ([] where it cannot: why in
    # row_move_obstacles)
    looped_draws: dict = dataclasses.field(default_factory=dict)
    # names of forward ops that take rows of the batch by their position in it (its halves
    # by tf.split(h, 2, 0), h[:n]): a replica's batch is a shard, its halves not the batch's
    positioned_rows: list = dataclasses.field(default_factory=list)
    # names of variables whose update reads a nonlinear function of several gradients,
    # computed after the backward pass, which the rewrite could not average apart (a
    # gradient surgery over gradients batched by tf.vectorized_map): _split_joins
    unsplit_joins: list = dataclasses.field(default_factory=list)
    # names of backward-pass sums over the batch's rows (a weight's gradient) whose value
    # the step differentiates again (GradNorm's gradient norms in a loss, MAML's inner
    # step on the whole batch): each replica's is its own rows' (_find_regradients)
    regradients: list = dataclasses.field(default_factory=list)
    # names of backward-pass values per row of the batch (a gradient with respect to an
    # input or an activation) of a mean over the rows, that the step uses by their scale
    # (a gradient penalty of the mean's input gradients): a replica's is R times one
    # device's per row (_find_row_gradients)
    row_gradients: list = dataclasses.field(default_factory=list)
    # names of forward statistics over the batch's rows that training uses other than
    # linearly (BatchNorm in training mode, a center loss): each replica's is its shard's
    batch_statistics: list = dataclasses.field(default_factory=list)
    # those of batch_statistics that the gradients do not read, that only state updates
    # store (weight normalization's init, a moving range of the activations), for the note
    stored_statistics: list = dataclasses.field(default_factory=list)
    # maxima and minima over the batch's rows that only bound while loops (dynamic_rnn's
    # longest sequence): each replica's loops run to its own rows' bound (a plan note)
    loop_bounds: list = dataclasses.field(default_factory=list)
    # the loop bounds computed outside every loop (dynamic_rnn's): those the replicas can
    # reduce to the batch's
    outer_loop_bounds: list = dataclasses.field(default_factory=list)
    # the outer loop bounds whose loops run a seeded stateful random op (a dropout per time
    # step): it draws once per step, so its stream follows one device's only when every
    # replica runs the batch's bound (passes/loop_bounds.py)
    drawing_loop_bounds: list = dataclasses.field(default_factory=list)
    # [(tensor, [(reader, input position)])]: forward tensors holding the replica's rows
    # that updates of state variables write into them (MoCo's queue of keys, a cache of
    # the last batch), and the update ops that read them: every replica gathers every
    # replica's rows for those readers (passes/gather_rows.py), so its update is one
    # device's, the same on every replica
    gathered_rows: list = dataclasses.field(default_factory=list)
    # the variables those updates write (the queue, its pointer): mirrored
    row_state_variables: list = dataclasses.field(default_factory=list)
    # (variable, new value) of the variables assigned rows of the batch that the rewrite
    # cannot gather (an update that also reads a statistic over the rows): refused
    rows_into_state: list = dataclasses.field(default_factory=list)
    # names of forward means over rows that a condition on the batch's values selects
    # (tf.boolean_mask): each replica divides by its own count of them
    selected_means: list = dataclasses.field(default_factory=list)
    # the batch statistics that synchronised batch statistics cannot all-reduce, each
    # with the reason (name -> sentence): a max of the rows, a BatchNorm in a function
    statistics_obstacles: dict = dataclasses.field(default_factory=dict)
    # batch statistics that are sums over the rows (a Sum, a MatMul contracting them) ->
    # [(op name, input position, [Shape or Size of a batch tensor])] where a value of the
    # statistic alone meets a count of the batch's rows (``/ tf.cast(tf.shape(h)[0],
    # ...)``): synced, the statistic is the whole batch's, and there the count must be too
    statistics_row_counts: dict = dataclasses.field(default_factory=dict)
    # SparseTensor batch inputs: (indices, values, dense_shape) Tensors, each also in
    # batch_inputs. Their first axis counts entries, not rows: each replica takes the
    # entries of its rows, re-numbered (passes/split_inputs.py; see _sparse_inputs)
    sparse_inputs: list = dataclasses.field(default_factory=list)
    # (placeholder, reader, argument) for fed batch inputs a sparse op reads as a
    # SparseTensor's indices that are in no SparseTensor found (an unnamed sparse_placeholder)
    unpaired_sparse: list = dataclasses.field(default_factory=list)
    # (cut key, AddN node, [input positions]): a dense gradient's terms computed from
    # variables and constants alone (weight decay's), the same on every replica
    # (graph_rewriter/invariant_terms.py)
    invariant_terms: list = dataclasses.field(default_factory=list)

    @property
    def trainable(self):
        return [v for v in self.variables.values() if v.trainable]

    def cut_of(self, variable_name):
        for c in self.cuts:
            if c.variable == variable_name:
                return c
        return None


def _name_later_updates(cuts):
    """Every cut after the first of one variable (in graph order) gets a name of its own,
    "<variable>/update_<k>", so the plan tells its packs and accumulators apart."""
    seen = {}
    for cut in cuts:
        k = seen[cut.variable] = seen.get(cut.variable, -1) + 1
        cut.name = f"{cut.variable}/update_{k}" if k else None


def dtype_size(dt):
    return {
        types_pb2.DT_HALF: 2, types_pb2.DT_BFLOAT16: 2, types_pb2.DT_FLOAT: 4,
        types_pb2.DT_DOUBLE: 8, types_pb2.DT_INT32: 4, types_pb2.DT_INT64: 8,
        types_pb2.DT_INT8: 1, types_pb2.DT_UINT8: 1, types_pb2.DT_INT16: 2,
        types_pb2.DT_BOOL: 1, types_pb2.DT_COMPLEX64: 8, types_pb2.DT_COMPLEX128: 16,
    }.get(opdefs.base_dtype(dt), 4)


def _shape_of(attr_shape):
    if attr_shape.unknown_rank:
        return None
    return [d.size for d in attr_shape.dim]


def analyze(graph, hints=None):
    """The Analysis of a GraphItem (cached per graph version when no hints are given).

    ``hints`` maps variable names to gradient tensor names ("grad:0"), or to a pair
    ("values:0", "indices:0") for a sparse gradient: the cut for that variable's updates.
    A MetaGraphDef collection ``graph_rewriter_gradients`` of "variable=tensor" strings
    supplies the same hints from inside the file.
    """
    hints = dict(_collection_hints(graph), **(hints or {}))
    key = ("analysis", tuple(sorted((k, str(v)) for k, v in hints.items())))
    return graph.cached(key, lambda g: _Analyzer(g, hints).run())


def _collection_hints(graph):
    out = {}
    mg = graph.meta_graph
    if mg is None or HINTS_COLLECTION not in mg.collection_def:
        return out
    for item in mg.collection_def[HINTS_COLLECTION].bytes_list.value:
        text = item.decode()
        var, sep, grad = text.partition("=")
        if not sep:
            raise GraphRewriteError(
                f"collection '{HINTS_COLLECTION}': entry '{text}' is not 'variable=tensor'")
        parts = grad.split(",")
        out[var.strip()] = parts[0].strip() if len(parts) == 1 else tuple(p.strip() for p in parts)
    return out


def variable_of(tensor):
    """The variable node a handle or ref tensor refers to (through Identity, Enter,
    Switch, ...), or None if it does not come from a variable of this graph."""
    node = tensor.node
    for _ in range(1000):
        if node.op in VARIABLE_OPS:
            return node
        if node.op in PASS_THROUGH and node.inputs:
            node = node.inputs[0].node
            continue
        return None
    return None


class _Analyzer:
    def __init__(self, graph, hints):
        self.g = graph
        self.hints = hints

    # ---- driver -------------------------------------------------------------------
    def run(self):
        g = self.g
        self.order = topological_order(g)
        self.position = {n: i for i, n in enumerate(self.order)}
        self.gradient_scopes = named_gradient_scopes(self.order)
        self._named_backward = None   # (any node in a tf.gradients scope: _from_backward)
        self._backward_names = {}     # {node name: in a backward pass} (_in_backward)
        self._regradient_sources = None   # (_differentiated_again)
        self.functions = {f.signature.name: f for f in g.library.function} if g.library is not None else {}
        self.variables = self._find_variables()
        self._find_writers()
        self.saver_nodes = self._find_saver_nodes()
        self.input_pipeline = self._find_input_pipeline()
        batch, broadcast = self._find_inputs()
        # Replica-variant means "depends on the data". Without a splittable batch input
        # (only static batch sizes), the data still tells gradients from other updates.
        seeds = batch or [t for t in broadcast if _rank(t) != 0]
        variant0 = variant_nodes(seeds, set())
        self._unsplit_joins = []
        cuts = self._find_cuts(seeds, variant0)
        gathered_rows, regions, rows_into_state = self._find_row_gathers(seeds, variant0, cuts)
        explained = {var for var, _ in regions}
        cuts = [c for c in cuts if c.variable not in explained]   # (a queue's assign-walk "statistic")
        cut_tensors = set()
        for c in cuts:
            cut_tensors.add(c.values)
            if c.indices is not None:
                cut_tensors.add(c.indices)
        variant = variant_nodes(seeds, cut_tensors)
        variant -= {n for _, region in regions for n in region}   # the same on every replica, gathered
        self._check_updates_invariant(variant)
        self._assign_roles(cuts, {t.node for t in seeds})
        # {id(state cut): its readers on the way to its update}, read twice below
        update_readers = {id(c): statistic_update_readers(c.values, c.variables) for c in cuts if c.role == "state"}
        _check_updates_found(cuts, update_readers)
        variant |= _read_per_replica(cuts, cut_tensors, variant, update_readers)
        self._check_cuts_independent(cuts, variant)
        init_ops = self._find_initializers()
        cuts.sort(key=lambda c: self.position[c.values.node])
        _name_later_updates(cuts)
        _order_states(cuts, self.position, update_readers)   # (by the keys _name_later_updates gives)
        _set_train_ops(cuts, self.variables, self.saver_nodes)
        coupled = self._coupled(cuts, variant)
        normalizers = self._find_normalizers(seeds, variant0)
        batch_draws = self._find_batch_draws(seeds, variant0)
        row_defaults = self._find_row_defaults(seeds, variant0)
        loss_sums = self._find_loss_sums(seeds, variant0, cuts)
        row_products = self._find_row_products(seeds, variant0)
        training = _Lazy(lambda: _value_ancestors_of(
            c.values.node for c in cuts if c.role == "gradient"))
        moved_rows = self._find_moved_rows(seeds, variant0, training)
        regradients = self._find_regradients(seeds, variant0)
        row_gradients = self._find_row_gradients(seeds, variant0, cut_tensors, loss_sums)
        sampled_rows = self._find_sampled_rows(seeds, variant0, training)
        positioned_rows, differentiated_rows = (
            [name for name in found if name not in moved_rows]   # (a gather by a shuffle moves the rows)
            for found in self._find_positioned_rows(seeds, variant0, training))
        # (a statistic a state update stores non-linearly counts too: weight normalization's
        # data-dependent init assigns its gain 1 / sqrt(var) of the batch, no gradient
        # reading it; the ops the updates' values are computed by)
        stored = _Lazy(lambda: _value_ancestors_of(
            self.g.node(name.rsplit(":", 1)[0]) for c in cuts if c.role == "state"
            for name in c.received or [c.values.name]))
        batch_statistics = self._find_batch_statistics(seeds, variant0, training, normalizers, loss_sums, stored)
        bounded = {name: self._bounded_loops(self.g.node(name)) for name in batch_statistics
                   if ":" not in name}   # (not "call:function:node", one in a function)
        loop_bounds = [name for name in batch_statistics if bounded.get(name)]
        batch_statistics = [name for name in batch_statistics if name not in loop_bounds]
        # (a bound computed inside a v1 loop, once per step, is left to the replica: an
        # all-reduce of it would run in the loop's frame)
        outer_loop_bounds = [name for name in loop_bounds if not loop_frames(self.g.node(name))]
        drawing_loop_bounds = [name for name in outer_loop_bounds if self._loops_draw(bounded[name])]
        selected_means = self._find_selected_means(variant0, training)
        ranked_rows = [n for n in moved_rows if self.g.node(n).op in _RANKINGS]
        # (a loss normalizer the head computes again is the whole batch's there: below;
        # so are a sum of the loss in it, ListNet's over the batch's softmax, and a
        # statistic over the rows, attention pooling's sum of the rows by their softmax)
        # (rows taken by their position start a head too: computed over every replica's
        # rows, in one device's order, the positions are one device's; where such a head
        # cannot be computed, the products' and rankings' own may still be; those only
        # differentiated through do not: a head hands each replica the gradient of its
        # own rows' share, and DP-SGD clips each microbatch's gradient, which a share's
        # clip is not)
        head_elsewhere = {**dict.fromkeys(loop_bounds, "a loop bound"),
                          **dict.fromkeys(selected_means, "a mean over selected rows"),
                          **dict.fromkeys(batch_draws, "a random draw per row")}
        product_head, head_obstacle = self._find_product_head(
            row_products + ranked_rows + positioned_rows, seeds, variant0, head_elsewhere)
        if product_head is None and positioned_rows and row_products + ranked_rows:
            product_head, head_obstacle = self._find_product_head(
                row_products + ranked_rows, seeds, variant0, head_elsewhere)
        if product_head is not None:
            normalizers, head_obstacle = _normalizers_beside(product_head, normalizers)
            product_head = None if head_obstacle else product_head
        if product_head is not None:
            loss_sums = [name for name in loss_sums if name not in product_head.head]
            # (a head computes over every replica's rows: its own constants stay its own)
            row_defaults = [name for name in row_defaults
                            if not any(c.name in product_head.head for c, _ in self.g.node(name).consumers())]
            batch_statistics = [name for name in batch_statistics if name not in product_head.head]
        row_moves, move_obstacles, looped_draws = self._find_row_moves(
            [n for n in moved_rows + sampled_rows if n not in ranked_rows and self.g.node(n).op not in _ROW_ARGS
             and n not in (product_head.head if product_head else ())],
            self._find_looped_draws(variant0, training, batch_draws,
                                    {loop for name in loop_bounds for loop in bounded[name]}),
            seeds, variant0, {**{t.node.name: "a loss normalizer" for t in normalizers},
                              **dict.fromkeys(batch_statistics, "a batch statistic"),
                              **dict.fromkeys(batch_draws, "a random draw per row")})
        obstacles = {name: reason for name in batch_statistics
                     for reason in [self._sync_obstacle(name, selected_means)] if reason is not None}
        row_counts = {}
        for name in batch_statistics:
            if name not in obstacles and self.g.node(name).op in _SUMMED_STATISTICS:
                met, reason = self._row_counts_met(self.g.node(name), {t.node for t in seeds}, variant0)
                if reason is not None:
                    obstacles[name] = reason
                elif met:
                    row_counts[name] = met
        invariant_terms = find_invariant_terms(
            cuts, variant, self.variables, {name for c in cuts if c.combine == "rows" for name in c.variables})
        for cut in cuts:
            # a statistic adding a loss sum up reads the scaled sum (passes/loss_sums.py):
            # R times the replica's rows, so the replicas' mean is one device's total
            if cut.combine == "sum" and summed_op(cut.values).name in loss_sums:
                cut.combine = None
        return Analysis(
            coupled=coupled, normalizers=normalizers, batch_draws=batch_draws, row_defaults=row_defaults,
            loss_sums=loss_sums,
            row_products=row_products, product_head=product_head, product_head_obstacle=head_obstacle,
            moved_rows=moved_rows, ranked_rows=ranked_rows, sampled_rows=sampled_rows, row_moves=row_moves,
            row_move_obstacles=move_obstacles, looped_draws=looped_draws,
            positioned_rows=positioned_rows + differentiated_rows, unsplit_joins=self._unsplit_joins,
            regradients=regradients, row_gradients=row_gradients,
            batch_statistics=batch_statistics,
            stored_statistics=[name for name in batch_statistics
                               if ":" not in name and self.g.node(name) not in training.value],
            loop_bounds=loop_bounds, outer_loop_bounds=outer_loop_bounds, drawing_loop_bounds=drawing_loop_bounds,
            rows_into_state=rows_into_state, gathered_rows=gathered_rows,
            row_state_variables=sorted({var for var, _ in regions}),
            selected_means=selected_means, statistics_obstacles=obstacles, statistics_row_counts=row_counts,
            variables=self.variables, cuts=cuts, batch_inputs=batch, sparse_inputs=self.sparse_inputs, unpaired_sparse=self.unpaired_sparse,
            broadcast_inputs=broadcast, static_batch=self.static_batch, variant=variant, init_ops=init_ops,
            invariant_terms=invariant_terms,
            saver_nodes=self.saver_nodes, input_pipeline=self.input_pipeline,
            step_counters=[v.name for v in self.variables.values() if v.role == "step"])

    # ---- variables and their writers ------------------------------------------------
    def _find_variables(self):
        out = {}
        for n in self.order:
            kind = VARIABLE_OPS.get(n.op)
            if kind is None:
                continue
            shape = _shape_of(n.attr["shape"].shape) if "shape" in n.attr else None
            out[n.name] = Variable(node=n, kind=kind, dtype=n.attr["dtype"].type, shape=shape)
        out = {name: out[name] for name in self.g.names() if name in out}
        meta = self.g.meta_graph
        self.declared_trainable = None
        if meta is not None and "trainable_variables" in meta.collection_def:
            from graph_rewriter.protos import variable_pb2
            names = set()
            for raw in meta.collection_def["trainable_variables"].bytes_list.value:
                vd = variable_pb2.VariableDef()
                vd.ParseFromString(raw)
                names.add(vd.variable_name.split(":")[0])
            self.declared_trainable = names
        return out

    def _find_writers(self):
        """Every (writer node, variable, input position) of the graph."""
        self.writes = []  # (node, Variable, position)
        for n in self.order:
            for var_node, pos in written_variables(n, self.g.library):
                var = self.variables[var_node.name]
                var.writers.append(n)
                self.writes.append((n, var, pos))

    # ---- the saver and the input pipeline -------------------------------------------
    def _find_saver_nodes(self):
        """The Saver's save and restore ops and everything downstream of them. A restore
        that no save op shares its file name with is no Saver's:
        ``tf.compat.v1.train.init_from_checkpoint`` (BERT's warm start) reads a variable's
        initial value from a checkpoint with one, run by the init op."""
        seeds = [n for n in self.order if n.op in SAVER_OPS and n.op not in RESTORE_OPS]
        seeds += saver_restores(self.order)
        if not seeds:
            return set()
        region = set(seeds)
        stack = list(seeds)
        while stack:  # everything downstream of save/restore (restore assigns, restore_all)
            n = stack.pop()
            for c in list(dict.fromkeys(c for c, _ in n.consumers())) + list(n.control_consumers):
                if c not in region:
                    region.add(c)
                    stack.append(c)
        return absorb_exclusive_ancestors(region, keep_out=lambda n: n.op in VARIABLE_OPS)

    def _find_input_pipeline(self):
        """tf.data: dataset ops, iterators, their initializers and what only they read.
        TF1 queues: the queues batch dequeues draw from, and the queues feeding those
        (a producer's file names or slices), with every op on them and what only those
        read."""
        seeds = {n for n in self.order
                 if "Dataset" in n.op or n.op in ITERATOR_GET_NEXT or n.op == "MakeIterator"
                 or n.op.startswith(("Iterator", "AnonymousIterator", "OneShotIterator",
                                     "MultiDeviceIterator"))}
        seeds |= _input_queue_ops(self.order)
        if not seeds:
            return set()
        seeds |= _queue_reports(seeds)
        return absorb_exclusive_ancestors(seeds, keep_out=lambda n: n.op in VARIABLE_OPS)

    def _find_inputs(self):
        """Batch inputs (split across replicas) and broadcast inputs (shared by all).

        Inputs whose first dimension is unknown are the batch. A graph with none has
        static batches: then every output of an iterator or a queue's DequeueMany, and
        every plain placeholder of rank >= 1 whose first dimension is the batch size (the
        first dimension most static inputs share; the earliest wins a tie), is a batch
        input taken per replica (``self.static_batch``); other placeholders (a
        [num_classes] weight vector) are broadcast. A PlaceholderWithDefault stays
        broadcast (its default has its shape) unless its default is a constant or a fill
        of as many rows as its static first dimension (an RNN's initial state, fed with the
        last step's final state: ``placeholder_with_default(cell.zero_state(BATCH, ...),
        [BATCH, size])``): then it is a placeholder like the others. A placeholder the input pipeline alone reads
        (a queue's enqueue, a dataset's source) is no input of the step."""
        found = []   # (tensor, "dynamic" | "placeholder" | "iterator" | "broadcast", first dim)
        for n in self.order:
            if n.op in PLACEHOLDERS:
                if not n.consumers() or n in self.input_pipeline:
                    continue   # unread, or fed to the input pipeline (a queue's enqueue, a dataset)
                shape = _shape_of(n.attr["shape"].shape) if "shape" in n.attr else None
                if shape and shape[0] == -1:
                    found.append((Tensor(n, 0), "dynamic", None))
                elif shape and (n.op != "PlaceholderWithDefault" or _default_rows(n) == shape[0]):
                    found.append((Tensor(n, 0), "placeholder", shape[0]))
                else:
                    found.append((Tensor(n, 0), "broadcast", None))
            elif n.op in ITERATOR_GET_NEXT:
                shapes = [_shape_of(s) for s in n.attr["output_shapes"].list.shape] if "output_shapes" in n.attr else []
                types = list(n.attr["output_types"].list.type) if "output_types" in n.attr else []
                # a batch whose other components have a dynamic first dimension has it in a
                # component of unknown rank too (a tf.py_func's output): Dataset.batch
                # gave every component the batch's rows (not a serialized SparseTensor, a
                # variant: see _sparse_inputs)
                batched = any(shape and shape[0] == -1 for shape in shapes)
                for i, shape in enumerate(shapes):
                    if not n.consumers(i):
                        continue
                    if (shape and shape[0] == -1) or (
                            batched and shape is None and i < len(types) and types[i] != types_pb2.DT_VARIANT):
                        found.append((Tensor(n, i), "dynamic", None))
                    else:
                        found.append((Tensor(n, i), "iterator", shape[0] if shape else None))
            elif n.op in QUEUE_BATCH_DEQUEUES:
                # DequeueMany(n) takes exactly n elements (a static batch when n is a
                # constant); DequeueUpTo fewer at the end (a dynamic one)
                count = n.inputs[1].node
                rows = (dtypes.int_scalar(count.attr["value"].tensor)
                        if "UpTo" not in n.op and count.op == "Const" else None)
                for i in range(len(n.attr["component_types"].list.type)):
                    if any(c not in self.input_pipeline for c, _ in n.consumers(i)):
                        found.append((Tensor(n, i), "dynamic" if rows is None else "iterator", rows))
        self.static_batch = {}
        self.sparse_inputs, self.unpaired_sparse = [], []
        if any(kind == "dynamic" for _, kind, _ in found):
            self.sparse_inputs, serialized = self._sparse_inputs(found)
            entries = {t for triple in self.sparse_inputs for t in triple} | serialized
            batch = [t for t, kind, _ in found if kind == "dynamic" and t not in entries]
            broadcast = [t for t, kind, _ in found if kind != "dynamic" and t not in entries]
            return batch + [t for triple in self.sparse_inputs for t in triple], broadcast
        sizes = [dim for _, kind, dim in found if kind in ("placeholder", "iterator") and dim is not None]
        size = max(sizes, key=lambda d: (sizes.count(d), -sizes.index(d))) if sizes else None
        batch, broadcast = [], []
        for t, kind, dim in found:
            if kind == "iterator" or (kind == "placeholder" and dim == size):
                batch.append(t)
                self.static_batch[t.name] = dim
            else:
                broadcast.append(t)
        return batch, broadcast

    def _sparse_inputs(self, found):
        """The batch's SparseTensors, as (indices, values, dense_shape) Tensors, when the
        batch's first dimension is dynamic (split across the replicas):

        - tf.compat.v1.sparse_placeholder(name=p): the placeholders ``p/indices`` (int64,
          [None, rank]) and ``p/values`` ([None]), and ``p/shape`` (int64 [rank], a
          Placeholder or the PlaceholderWithDefault it makes when given a shape). Only
          the names tie the three together (an embedding lookup reads the indices' first
          column and the values, never the shape), so an unnamed sparse_placeholder is
          three unrelated inputs;
        - a tf.data pipeline's SparseTensor (tf.io.VarLenFeature): the iterator hands it
          over as one variant, the whole batch serialized, which a DeserializeSparse
          turns into the three tensors; that DeserializeSparse joins the input pipeline
          (it runs once, on the host) and its outputs are the batch input.

        Split by rows, these would hand replica k the k-th slice of the entries, whose
        row numbers and dense shape are the whole batch's. Returns the triples and the
        iterator outputs that only those DeserializeSparse ops read (no input of the step
        any more)."""
        g, out, deserialized = self.g, [], set()
        fed = {t.node.name for t, _, _ in found}
        for t, kind, _ in found:
            n = t.node
            if kind != "dynamic" or n.op != "Placeholder" or not n.name.endswith("/indices"):
                continue
            prefix = n.name[:-len("indices")]
            values, shape = (g.node(prefix + s) if prefix + s in g else None for s in ("values", "shape"))
            dims = _shape_of(n.attr["shape"].shape)
            if (values is None or shape is None or values.name not in fed or values.op != "Placeholder"
                    or n.attr["dtype"].type != types_pb2.DT_INT64 or len(dims) != 2
                    or _shape_of(values.attr["shape"].shape) != [-1]
                    or shape.op not in PLACEHOLDERS or shape.attr["dtype"].type != types_pb2.DT_INT64
                    or _shape_of(shape.attr["shape"].shape) not in (None, [-1], [dims[1]])):
                continue
            out.append((t, Tensor(values, 0), Tensor(shape, 0)))
        for n in self.order:
            if n.op != "DeserializeSparse" or n.inputs[0].node.op not in ITERATOR_GET_NEXT:
                continue
            source = n.inputs[0]
            shapes = source.node.attr["output_shapes"].list.shape
            shape = _shape_of(shapes[source.index]) if source.index < len(shapes) else None
            if shape is None or shape == [3]:   # one SparseTensor (not a batch of serialized ones)
                self.input_pipeline.add(n)
                deserialized.add(n)
                out.append(tuple(Tensor(n, i) for i in range(3)))
        self.unpaired_sparse = self._unpaired_sparse(found, {t for triple in out for t in triple})
        serialized = {n.inputs[0] for n in deserialized}
        return out, {t for t in serialized if all(c in deserialized for c, _ in t.node.consumers(t.index))}

    def _unpaired_sparse(self, found, paired):
        """[(placeholder, reader, argument)]: fed batch inputs that a sparse op reads as a
        SparseTensor's indices (CTCLoss's labels_indices, SparseReshape's input_indices,
        ...; embedding_lookup_sparse's SparseSegment op their first column as its
        segment_ids) but that are in no SparseTensor found (an unnamed sparse_placeholder). Split
        by rows, their entries would be misnumbered: the planner refuses them when it
        splits the batch."""
        dynamic = {t for t, kind, _ in found if kind == "dynamic" and t.node.op in PLACEHOLDERS} - paired
        out = []
        for n in self.order if dynamic else ():
            if "Sparse" not in n.op and not n.op.startswith("CTC"):
                continue
            slices = opdefs.input_arg_slices(n)
            if n.op.startswith("SparseSegment") and "segment_ids" in slices:
                # tf.nn.embedding_lookup_sparse: the segments are the indices' first column
                source = n.inputs[slices["segment_ids"][0]]
                while source.node.op in ("StridedSlice", "Slice", "Cast", "Identity", "Reshape", "Squeeze"):
                    source = source.node.inputs[0]
                if source in dynamic and len(_shape_of(source.node.attr["shape"].shape) or ()) == 2:
                    out.append((source.node.name, n.name, "segment_ids (its first column)"))
                continue
            for arg, (pos, count) in slices.items():
                prefix = arg[:-len("indices")]
                if (arg.endswith("indices") and count == 1 and n.inputs[pos] in dynamic
                        and any(prefix + other in slices for other in ("values", "shape", "dense_shape"))):
                    out.append((n.inputs[pos].node.name, n.name, arg))
        return out

    # ---- gradient cuts ---------------------------------------------------------------
    def _find_cuts(self, batch, variant0):
        cuts = {}          # key tensor(s) -> GradientCut
        explained = set()  # writer nodes whose batch dependence a cut explains

        def add(cut, writer, var):
            key = (cut.values, cut.indices)
            existing = cuts.get(key)
            if existing is None:
                cuts[key] = cut
                existing = cut
            if var.name not in existing.variables:
                existing.variables.append(var.name)
            explained.add(writer)
            explained.add((writer, var.name))   # a call (a v2 cond) writes several
            return existing

        self._apply_hints(add, variant0)
        # 1 and 2: fused optimizer ops and scatter updates.
        for n, var, pos in self.writes:
            if n not in variant0 or n in explained:
                continue
            slices = opdefs.input_arg_slices(n)
            grad_arg = "grad" if "grad" in slices else "delta" if "delta" in slices else None
            if grad_arg is not None and ("var" in slices):
                var_pos = slices["var"][0]
                primary = self.variables[variable_of(n.inputs[var_pos]).name]
                values = n.inputs[slices[grad_arg][0]]
                indices = n.inputs[slices["indices"][0]] if "indices" in slices else None
                if indices is None:
                    cut = GradientCut(values=values, kind="dense", variable=primary.name, source="fused-op")
                else:
                    cut = self._sparse_cut(values, indices, primary.name, linear=False)
                add(cut, n, primary)
                continue
            if "indices" in slices and "updates" in slices:
                values = n.inputs[slices["updates"][0]]
                indices = n.inputs[slices["indices"][0]]
                if not self._from_backward(values):
                    continue   # rows written into state (a center loss's centers): _find_row_gathers
                dedup = _dedup_pair(indices)
                if dedup is not None:
                    cut = GradientCut(values=dedup[0], indices=dedup[1], kind="sparse",
                                      deduplicated=True, source="scatter")
                elif n.op in LINEAR_SCATTERS:
                    cut = GradientCut(values=values, indices=indices, kind="sparse", linear=True,
                                      source="scatter")
                else:
                    continue  # left for the final check to report
                add(cut, n, var)
        # 3: plain assigns, walked back to the gradient.
        cut_tensors = {t for key in cuts for t in key if t is not None}
        variant_mid = variant_nodes(batch, cut_tensors)
        for n, var, pos in self.writes:
            if (n, var.name) in explained or n not in variant_mid:
                continue
            if n.op in DENSE_ASSIGNS:
                value = n.inputs[opdefs.input_position(n, "value")]
            elif n.op in FUNCTION_CALLS or opdefs.op_def(n.op) is None:
                # A conditional update (Keras BatchNorm's smart_cond around its moving
                # averages): the batch reaches the body through one data input.
                dts = opdefs.input_dtypes(n)
                live = [(i, t) for i, t in enumerate(n.inputs)
                        if dts[i] != opdefs.DT_RESOURCE and (t.node in variant_mid or t in batch)]
                if len(live) > 1:
                    # A v2 cond around a whole optimizer (skip the step on overflow):
                    # only the inputs its body writes this variable from count.
                    feeding = _call_inputs_feeding(n, self.g.library, pos)
                    live = [(i, t) for i, t in live if feeding is None or i in feeding]
                if len(live) != 1:
                    continue  # left for the final check to report
                value = live[0][1]
            else:
                continue
            if value.node not in variant_mid and value not in batch:
                continue
            grad = _walk_to_gradient(value, variant_mid, batch)
            add(GradientCut(values=grad, kind="dense", source="assign-walk"), n, var)
        cuts = self._hoist(cuts, batch, variant0)
        cuts = self._split_joins(cuts, batch, variant0)
        # Cuts found through scatters and assigns name their variable: the one the batch
        # computation reads (the trainable one), else the first written.
        out = list(cuts.values())
        for cut in out:
            if cut.variable is None:
                cut.variable = self._primary_variable(cut, variant_mid)
        self._check_one_optimizer(out)
        return out

    # ---- moving cuts back to the backward pass ------------------------------------------
    def _hoist(self, cuts, batch, variant0):
        """Moves every cut from where an update receives its gradient to where the
        backward pass produces it, so that what runs in between (global-norm and
        per-tensor clipping, loss-scale unscaling, all-finite checks and the conditional
        apply they drive, weight decay) runs on averaged gradients and decides the same
        on every replica, as one device does.

        Walking back from each cut through post-processing ops (element-wise math,
        predicates, v1 cond routing, the densification of IndexedSlices) ends at
        "stops": tensors made by other ops (a MatMul, a reduction, an AddN: what backprop
        and statistics produce). The stops that depend on no other stop are averaged
        first; a stop that still depends on the batch once they are (a batch variance
        next to its mean) is averaged too. Each cut then moves to the one averaged stop
        it reaches; a cut that reaches none (a loss scale updated from the all-finite
        check of every gradient) needs no averaging of its own. Hints stay as given."""
        walks = {}
        for key, cut in cuts.items():
            if cut.source == "hint":
                continue
            walk = _PostProcessingWalk(variant0, batch)
            if cut.kind == "sparse":
                stops = walk.sparse(cut.values, cut.indices, cut.deduplicated)
            else:
                stops = walk.dense(cut.values)
            moved = stops != {key} and not walk.affine
            walks[key] = (stops if moved else {key}, walk.ops if moved else set())
        if all(stops == {key} for key, (stops, _) in walks.items()):
            return cuts       # no post-processing anywhere: every cut stays
        averaged = self._averaged_stops(walks, cuts, batch, variant0)
        out = {}
        for key, cut in cuts.items():
            if key not in walks:
                out.setdefault(key, cut)
                continue
            stops, ops = walks[key]
            if stops == {key} and key in averaged:
                out.setdefault(key, cut)
                continue
            reached = [k for k in stops if k in averaged]
            if not reached:
                continue      # the batch reaches these writes only through other cuts
            if len(reached) > 1:
                out.setdefault(key, cut)   # several backward outputs meet: keep the join
                continue
            values, indices = new_key = reached[0]
            moved = out.get(new_key)
            if moved is None:
                moved = out[new_key] = dataclasses.replace(
                    cut, values=values, indices=indices, kind="sparse" if indices is not None else "dense",
                    deduplicated=indices is not None and _dedup_pair(indices) is not None,
                    linear=False, variables=[], received=[], post_processing=[])
            elif moved.variable is None:
                moved.variable = cut.variable
            for name in cut.variables:
                if name not in moved.variables:
                    moved.variables.append(name)
            moved.received = sorted(set(moved.received) | {t.name for t in key if t is not None})
            moved.post_processing = sorted(set(moved.post_processing) | ops)
        return out

    def _split_joins(self, cuts, batch, variant0):
        """Moves a cut that is no tensor of the backward pass, but a nonlinear function of
        several of its gradients computed after it, to each of those gradients. Gradient
        surgery (PCGrad: each task's gradients flattened into one vector, projected on
        the others' where they conflict, summed and unflattened) reshapes, concatenates,
        slices and reduces the gradients, which the element-wise walk of _hoist does not
        pass: the cut stayed where the update reads it, and the replicas averaged their
        projections, which differ from the projection of the averages one device makes.
        Only tf.gradients' scope names tell the backward pass from what follows it, so a
        graph without them keeps its cuts; so does a cut whose walk meets the batch's rows
        (per-example gradients, a batch statistic) or only linear ops (averaging
        commutes with them)."""
        if not self._names_backward():
            return cuts
        out = {}
        for key, cut in cuts.items():
            if cut.source == "hint" or cut.kind != "dense" or self._in_backward(cut.values.node):
                out.setdefault(key, cut)
                continue
            found = _backward_sources(cut.values, variant0, batch, self._in_backward)
            if found is None:
                out.setdefault(key, cut)
                continue
            stops, ops = found
            owners = {t: self._gradient_variable(t) for t in stops}
            if None in owners.values():
                # (a tensor that is no one variable's gradient: gradients tf.vectorized_map
                # batched over tasks): the cut stays, and the plan notes it
                out.setdefault(key, cut)
                self._unsplit_joins.extend(v for v in cut.variables if v not in self._unsplit_joins)
                continue
            for values in sorted(stops, key=lambda t: self.position.get(t.node, 0)):
                moved = out.get((values, None))
                if moved is None:
                    moved = out[(values, None)] = dataclasses.replace(
                        cut, values=values, indices=None, variable=owners[values], variables=[],
                        linear=False, received=[], post_processing=[])
                for name in cut.variables:
                    if name not in moved.variables:
                        moved.variables.append(name)
                moved.received = sorted(set(moved.received) | set(cut.received) | {cut.values.name})
                moved.post_processing = sorted(set(moved.post_processing) | set(cut.post_processing) | ops)
        return out

    def _gradient_variable(self, tensor):
        """Which variable a tensor of the backward pass is the gradient of, or None:
        tf.gradients builds the gradient of an op's inputs under "<scope>/<op>_grad/",
        so it is the one variable that op reads; an
        AddN of a variable's gradients from several reads is that of its first input."""
        for _ in range(64):
            name = tensor.node.name
            if "_grad/" not in name:
                if tensor.node.op not in ("AddN", "Identity") or not tensor.node.inputs:
                    return None
                tensor = tensor.node.inputs[0]
                continue
            parts = name[:name.index("_grad/")].split("/")
            for k in range(1, len(parts)):
                forward = self.g.get("/".join(parts[k:]))
                if forward is None:
                    continue
                read = {v.name for v in (variable_of(t.node.inputs[0] if t.node.op == "ReadVariableOp" else t)
                                         for t in forward.inputs) if v is not None} & set(self.variables)
                if len(read) != 1:
                    return None
                name = read.pop()
                shape = self.variables[name].shape
                # (its shape: a gradient batched by tf.vectorized_map has another rank)
                return name if shape is not None and static_rank(tensor) == len(shape) else None
            return None
        return None

    def _averaged_stops(self, walks, cuts, batch, variant0):
        """The stops to average: those downstream of no other stop, then any stop that
        still depends on the batch once those are averaged (until none does)."""
        keys = set()
        for key, cut in cuts.items():
            keys |= walks[key][0] if key in walks else {key}
        nodes = {}        # a sparse key's ids always depend on the batch: its rows decide
        for k in keys:
            nodes.setdefault(k[0].node, set()).add(k)
        last = max(self.position.get(n, 0) for n in nodes)
        downstream = set()
        for n in nodes:   # stops reached from another stop
            for d in _descendants_within([n], variant0, self.position, last):
                if d is not n and d in nodes:
                    downstream |= nodes[d]
        averaged = keys - downstream
        while True:
            tensors = {t for k in averaged for t in k if t is not None}
            variant = variant_nodes(batch, tensors)
            more = {k for k in keys - averaged if k[0].node in variant or k[0] in batch}
            if not more:
                return averaged
            # the earliest first: a later one may depend on it
            first = min(more, key=lambda k: self.position.get(k[0].node, 0))
            averaged.add(first)

    def _apply_hints(self, add, variant0):
        for var_name, grad in self.hints.items():
            var = self.variables.get(var_name)
            if var is None:
                raise GraphRewriteError(
                    f"gradient hint names variable '{var_name}', which is not a variable of "
                    f"{self.g.source}", hint="use the variable op's name, e.g. 'dense/kernel'")
            try:
                if isinstance(grad, (tuple, list)):
                    values, indices = (self.g.tensor(grad[0]), self.g.tensor(grad[1]))
                    cut = GradientCut(values=values, indices=indices, kind="sparse", variable=var_name,
                                      deduplicated=_dedup_pair(indices) is not None, source="hint")
                else:
                    cut = GradientCut(values=self.g.tensor(grad), kind="dense", variable=var_name, source="hint")
            except GraphRewriteError as e:
                raise GraphRewriteError(f"gradient hint for variable '{var_name}': {e}") from None
            # The hint is the gradient of the updates it reaches. A variable two train ops
            # train has a second update, which receives the other train op's gradient:
            # the analysis finds that one as usual.
            reached = descendants([cut.values.node] + ([cut.indices.node] if cut.indices is not None else []))
            writers = [n for n in var.writers if n in reached]
            if not writers:
                updates = [n.name for n in var.writers if n in variant0]   # those a gradient reaches
                raise GraphRewriteError(
                    f"gradient hint for variable '{var_name}' names '{cut.values.name}', which reaches "
                    f"no update of it (its updates: {', '.join(repr(u) for u in updates[:3]) or 'none'})",
                    hint="name a tensor the variable's update is computed from: the gradient the "
                         "backward pass produces for it")
            for n in writers:
                add(cut, n, var)

    def _sparse_cut(self, values, indices, var_name, linear):
        dedup = _dedup_pair(indices)
        if dedup is not None and dedup[0] == values:
            return GradientCut(values=values, indices=indices, kind="sparse", variable=var_name,
                               deduplicated=True, source="fused-op")
        return GradientCut(values=values, indices=indices, kind="sparse", variable=var_name,
                           linear=linear, source="fused-op")

    def _primary_variable(self, cut, variant):
        if cut.kind == "sparse":
            gathered = _gathered_variable(cut.indices, cut.variables)
            if gathered is not None and gathered.name in self.variables:
                if gathered.name not in cut.variables:
                    cut.variables.insert(0, gathered.name)
                return gathered.name
        for name in cut.variables:
            if _read_by_variant(self.variables[name].node, variant):
                return name
        return cut.variables[0]

    def _check_one_optimizer(self, cuts):
        """A variable may receive several gradients (a multi-task script's train ops, each
        minimizing its own loss over a shared encoder; two optimizers over one variable):
        each becomes a cut of its own (``_name_later_updates``) and is averaged apart. Each
        must reach a write of its variable: one that does not was given the wrong variable
        (the analysis cannot tell whose gradient it is), and averaging it under that name
        would be silently wrong."""
        by_var = {}
        for cut in cuts:
            if cut.role == "gradient" and cut.source != "assign-walk":
                by_var.setdefault(cut.variable, []).append(cut)
        for name, several in by_var.items():
            if len(several) < 2:
                continue
            writers = set(self.variables[name].writers)
            for cut in several:
                if not writers & descendants([cut.values.node]):
                    other = next(c for c in several if c is not cut)
                    raise GraphRewriteError(
                        f"variable '{name}' receives two different gradients (through "
                        f"'{other.values.node.name}' and '{cut.values.node.name}'), and the "
                        f"second reaches no update of it: graph_rewriter cannot tell which "
                        f"variable it is the gradient of",
                        hint="name its gradient with gradients={variable: tensor}")

    def _check_cuts_independent(self, cuts, variant):
        """No cut may depend on another cut's average: the collective that averages it
        would wait for its own result (a cycle), or average a value that is already
        global. Every reader of a gradient cut reads its average; a statistic's (state)
        cut is read averaged only on the way to its update, so only gradient cuts count."""
        by_node = {}
        for c in cuts:
            by_node.setdefault(c.values.node, []).append(c)
        if not by_node:
            return
        last = max(self.position[n] for n in by_node)
        for c in cuts:
            if c.role != "gradient":
                continue
            readers = [r for r, _ in c.values.node.consumers(c.values.index)]
            reached = _descendants_within(readers, None, self.position, last)
            for n in sorted(reached, key=self.position.__getitem__):   # the first, as the error names it
                for other in by_node.get(n, ()):
                    if other is not c:
                        raise GraphRewriteError(
                            f"the gradient of variable '{other.variable}' ('{other.values.name}') is "
                            f"computed from the gradient of variable '{c.variable}' "
                            f"('{c.values.name}'): averaging both across replicas would average "
                            "an average, and graph_rewriter cannot tell which one the backward "
                            "pass produced",
                            hint="name each variable's gradient as the backward pass produces it: "
                                 "rewrite(..., gradients={'%s': 'tensor:0', ...})" % other.variable)

    def _coupled(self, cuts, variant):
        """Groups of cuts whose averaged gradients meet before the updates (a global norm,
        an all-finite check): the nodes downstream of each cut, up to the variable writes,
        are claimed by the first cut that reaches them; a cut reaching a claimed node joins
        that cut's group."""
        writers = {n for n, _, _ in self.writes}
        parent = list(range(len(cuts)))

        def root(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner = {}
        for i, c in enumerate(cuts):
            stack = [r for r, _ in c.values.node.consumers(c.values.index)]
            while stack:
                n = stack.pop()
                if n in variant:
                    continue
                o = owner.get(n)
                if o is not None:
                    parent[root(i)] = root(o)
                    continue
                owner[n] = i
                if n not in writers:
                    stack.extend(r for r, _ in n.consumers())
        groups = {}
        for i, c in enumerate(cuts):
            groups.setdefault(root(i), []).append(c.variable)
        return [g for g in groups.values() if len(g) > 1]

    def _find_row_gathers(self, seeds, variant0, cuts):
        """Updates that write rows of the batch into a variable that is no gradient's:
        MoCo's queue of keys, ``assign(queue, tf.concat([keys, queue], 0)[:K])`` or
        ``scatter_update(queue, ptr + tf.range(n), keys)`` with ``ptr += n``, a cache of
        the last batch. One device's variable then holds every row of the batch, which
        no average of the replicas' values gives (a queue's "statistic" is no mean).
        Each such update's region (the ops between the forward pass, or the batch
        inputs, and the write; none of the backward pass's, which a hand-written
        optimizer's update has) reads forward tensors, its frontier; when every one holds
        the replica's rows, gathering every replica's rows for the region makes the
        update one device's, the same on every replica. Other updates whose frontier is
        among those tensors (the queue's pointer, advanced by the gathered row count)
        are explained alike. Returns (gathered_rows, [(variable, region)],
        rows_into_state: the writes of rows whose frontier also holds other values)."""
        seed_nodes = {t.node for t in seeds}
        gradient_cuts = [c for c in cuts if not self._state_like(c)]
        cut_variables = {v for c in gradient_cuts for v in c.variables}
        # (not a v2 cond's call writing in its functions; not a state of a row per row of a
        # static batch, which each replica keeps its own rows of: _holds_row_states)
        candidates = [(n, var) for n, var, _ in self.writes
                      if n in variant0 and var.name not in cut_variables and var.node not in self.saver_nodes
                      and n.op not in _FUNCTIONAL and not in_gradients_scope(n.name, self.gradient_scopes)
                      and not self._row_shaped(var)]
        rows = [(n, var) for n, var in candidates if _holds_rows(_written_value(n), seed_nodes)]
        if not rows:
            return [], [], []
        training = _value_ancestors_of(c.values.node for c in gradient_cuts)

        def region_of(write):
            region, frontier, stack = {write}, set(), list(write.inputs)
            while stack:
                t = stack.pop()
                m = t.node
                if m in seed_nodes:   # (a batch input written as it is: a cache of the last batch)
                    frontier.add(t)
                elif m not in variant0:
                    continue
                elif m in training:
                    frontier.add(t)
                elif m not in region:
                    region.add(m)
                    stack.extend(m.inputs)
            return region, frontier

        def backward(region):   # an optimizer written by hand, whose gradient is not found
            return any(in_gradients_scope(m.name, self.gradient_scopes) for m in region)

        gathered, regions, refused = set(), [], []
        for n, var in rows:
            region, frontier = region_of(n)
            if backward(region):
                continue
            odd = [t for t in frontier if not _holds_rows(t, seed_nodes)]
            if odd:
                refused.append((var.name, _written_value(n).name))
                continue
            gathered |= frontier
            regions.append((var.name, region))
        if regions:
            for n, var in candidates:
                if (n, var) in rows:
                    continue
                region, frontier = region_of(n)
                if frontier and frontier <= gathered and not backward(region):
                    regions.append((var.name, region))
        members = {m for _, region in regions for m in region}
        out = []
        for t in sorted(gathered, key=lambda t: (self.position[t.node], t.index)):
            readers = sorted({(c.name, pos) for c, pos in t.node.consumers(t.index) if c in members})
            out.append((t.name, readers))
        return out, regions, refused

    def _names_backward(self):
        """True if some node is in a tf.gradients scope (a graph whose backward pass was
        renamed has none, and the walks that tell it by its names do not apply)."""
        if self._named_backward is None:
            self._named_backward = any(in_gradients_scope(m.name, self.gradient_scopes) for m in self.order)
        return self._named_backward

    def _in_backward(self, node):
        # (asked hundreds of thousands of times on a large graph; the pattern search is
        # most of the analysis' time without the cache)
        name = node.name
        found = self._backward_names.get(name)
        if found is None:
            found = self._backward_names[name] = in_backward(name, self.gradient_scopes)
        return found

    def _from_backward(self, tensor, limit=4096):
        """True if ``tensor`` is computed from the backward pass (a gradient, as an
        optimizer's sparse update is), not from the forward pass and the batch alone.
        Only tf.gradients' scope names tell: in a graph without them (renamed) every
        update counts as from the backward pass, as before."""
        if not self._names_backward():
            return True
        return _search_back(tensor.node, lambda m: in_gradients_scope(m.name, self.gradient_scopes),
                            lambda m: [t.node for t in m.inputs], limit) is not None

    def _state_like(self, cut):
        """True if ``cut`` is what _assign_roles makes a state: a plain assign of one
        variable from batch data, or of several from a value the backward pass does not
        compute (batch renormalization moves its moving_mean and its renorm_mean towards
        the one batch mean; an optimizer written in plain ops, Keras Nadam, updates its
        slots from a gradient)."""
        return cut.source == "assign-walk" and (
            len(cut.variables) == 1 or not self._from_backward(cut.values)) and (
            self.declared_trainable is None or not set(cut.variables) & set(self.declared_trainable))

    def _holds_row_states(self, cut):
        """True if a state cut writes a state of a row per row of a static batch: every
        variable it writes has rank 2 or more and the static batch as its first
        dimension, and the value is no reduction over the rows (a stateful RNN's
        state, Keras' ``LSTM(stateful=True)`` assigning its final state into ``[batch,
        units]`` variables after every step). One device's variable holds the rows of
        its batch of R x B; replica k's copy holds its own rows of it, which no
        exchange between the replicas gives (the mean of the replicas' states mixes
        unrelated streams)."""
        rank = static_rank(cut.values)
        return all(self._row_shaped(self.variables[name]) and rank in (None, len(self.variables[name].shape))
                   for name in cut.variables) and summed_op(cut.values).op not in _STATISTICS

    def _row_shaped(self, var):
        """True if a variable has rank 2 or more and a static batch as its first
        dimension: a row per row of a replica's batch."""
        return (var.shape is not None and len(var.shape) >= 2
                and var.shape[0] in set(self.static_batch.values()) - {None})

    def _check_updates_invariant(self, variant):
        """Every write to a variable must now be the same on every replica."""
        for n, var, pos in self.writes:
            if n not in variant:
                continue
            bad = [t for t in n.inputs if t.node in variant]
            why = f"its input '{bad[0].name}'" if bad else "an input"
            # (a rate or a scale, not the indices a custom sparse update computes with tf.range)
            count = (_row_count_only(bad[0], variant)
                     if bad and dtypes.as_dtype(dtype_of(bad[0])).is_floating else None)
            if count is not None:
                raise GraphRewriteError(
                    f"the update '{n.name}' of variable '{var.name}' reads '{bad[0].name}', computed from the "
                    f"batch's count of rows ('{count.name}', a {count.op}): each replica counts its own "
                    f"shard's rows, a share of one device's count, and would update with a different value "
                    f"(a learning rate scaled by the batch size)",
                    hint="compute it from the global batch size as a constant (a Python number, "
                         "tf.constant), which every replica then reads alike")
            condition = _batch_condition(n, variant)
            if condition is not None:
                raise GraphRewriteError(
                    f"the update '{n.name}' of variable '{var.name}' runs under a condition computed "
                    f"from the batch ('{condition.name}', the predicate of the cond or loop it runs "
                    f"in): each replica would decide on its own rows where one device decides on the "
                    f"whole batch, and the replicas' copies of the variable would part",
                    hint="condition the update on the gradients, which every replica sees averaged "
                         "(tf.math.is_finite(tf.linalg.global_norm(grads)) to skip a step that "
                         "overflows, as loss scaling does), or on a variable")
            if var.name in self.hints:
                raise GraphRewriteError(
                    f"the gradients= hint for variable '{var.name}' ({self.hints[var.name]!r}) does not "
                    f"make its update '{n.name}' ({n.op}) the same on every replica: {why} still "
                    f"depends on the batch beside the hinted tensor",
                    hint="name the tensor the update receives as its gradient (or the backward "
                         "pass's output it is computed from), not the loss or an input")
            raise GraphRewriteError(
                f"cannot find the gradient of variable '{var.name}': it is updated by "
                f"'{n.name}' ({n.op}), and {why} depends on the batch in a way graph_rewriter "
                f"does not recognise",
                hint="name the gradient with rewrite(..., gradients={'%s': 'tensor:0'})" % var.name)

    # ---- normalizers -----------------------------------------------------------------
    def _find_normalizers(self, seeds, variant0):
        """The divisors of a loss normalised by a sum over the batch's values: the
        masked mean of a sequence model, ``reduce_sum(xent * mask) / reduce_sum(mask)``,
        and ``tf.compat.v1.losses`` with ``weights`` (SUM_BY_NONZERO_WEIGHTS divides by
        the count of non-zero weights). A divisor counts when it is a ``Sum`` over every
        axis (``axis=None``), through casts and arithmetic with constants, whose value depends on a
        batch input's values (not only its shape: ``tf.shape(x)[0]`` is the same on every
        replica) and on no trainable variable (or, dividing a Sum over every axis, on one
        only through ops no gradient goes through: self-paced learning divides the sum of
        the losses it keeps by their count, ``reduce_sum(cast(loss < t))``), and whose
        dividend depends on one. Each replica would divide by its own shard's sum, and
        averaging the replicas' gradients would weight the shards alike, not by their
        counts."""
        seed_nodes = {t.node for t in seeds}
        trainable = {v.node for v in self.variables.values() if v.trainable}
        # counts: divisor -> (a sum over the batch's values, free of trainable variables,
        # free of them along the paths a gradient goes through)
        out, counts = [], {}

        def is_count(divisor, dividend):
            if divisor not in counts:
                # (the ancestor walks only for a Sum over every axis: each walks most of
                # the forward graph, and a transformer divides by hundreds of other values)
                total = _the_sum(divisor.node)
                if total is None or not _sums_every_axis(total):
                    counts[divisor] = (False, False, False)
                else:
                    reached = _value_ancestors(divisor.node)
                    counts[divisor] = (bool(reached & seed_nodes), not reached & trainable,
                                       not _differentiable_ancestors(divisor.node) & trainable)
            summed, variable_free, gradient_free = counts[divisor]
            if not summed or variable_free or not gradient_free:
                return summed and variable_free
            # (a count of rows a comparison of the losses keeps divides a sum of them:
            # not a value the graph goes on to normalise further, as Sinkhorn's codes)
            total = _the_sum(dividend.node)
            return total is not None and _sums_every_axis(total)

        # (every division by the sum is looked at, not the first one: the backward pass
        # divides the loss's gradient by it too, and comes first in some graphs' order,
        # those with v2 while loops among them)
        for n in self.order:
            if n.op not in _DIVISIONS or n not in variant0 or len(n.inputs) != 2:
                continue
            divisor = n.inputs[1]
            if divisor in out or divisor.node not in variant0 or not dtypes.as_dtype(
                    dtype_of(divisor)).is_floating:
                continue
            if is_count(divisor, n.inputs[0]) and _value_ancestors(n.inputs[0].node) & trainable:
                out.append(divisor)
        return out

    # ---- random draws, one value per row ----------------------------------------------
    def _find_batch_draws(self, seeds, variant0):
        """Seeded random ops that draw one value per row of the batch: dropout's mask
        (``tf.nn.dropout`` draws ``random_uniform(tf.shape(x))``; with ``noise_shape=
        [tf.shape(x)[0], 1]`` one per row), noise added to activations, a random flip per
        image. The replicas' clones keep the seeds, so every replica would draw the
        numbers one device draws for the batch's first rows. A draw counts when the first
        entry of its shape is the row count of a tensor computed from the batch
        (``tf.shape(x)``, its first element packed or concatenated with others) or, with
        static batches (TensorFlow folds ``tf.shape(x)`` into a constant), a constant
        equal to the static batch, whose draw meets the batch's data. A stateful op with
        seed = seed2 = 0 is left alone: each kernel draws from a random seed of its own,
        so the replicas' draws differ already. A draw in a v1 while loop (a
        DropoutWrapper's per-step mask) counts as well: the pass enters its frames.

        A draw in a function of a v2 cond (an If or Case: ``tf.layers.dropout(x,
        training=flag)`` with control flow v2) or while loop counts when its shape's rows
        are an argument's that the call passes from the batch; it is named
        ``call:function:node``, the others by their node's name."""
        seed_nodes = {t.node for t in seeds}
        static = set(self.static_batch.values()) - {None}
        out = []
        reached = None   # (variant0 | seed_nodes, made once: NASNet has 384 conds)
        for n in self.order:
            if n.op in _FUNCTIONAL and n in variant0 and self.g.library is not None:
                if reached is None:
                    reached = variant0 | seed_nodes
                out += _called_draws(n, self.functions, reached, static)
            if not _is_seeded_draw(n) or not n.inputs:
                continue
            rows = _leading_rows(n.inputs[0])
            if rows is not None:
                counts = rows.node in variant0 or rows.node in seed_nodes
            else:
                first = _leading_constant(n.inputs[0])
                counts = first is not None and first in static and _meets(n, variant0)
            if counts:
                out.append(n.name)
        return out

    def _find_row_defaults(self, seeds, variant0):
        """Initial states: floating-point values of a row per row of the batch and a
        state's width or more (rank 2 and up) that the batch's values do not decide. A
        recurrent language model (TensorFlow's PTB tutorial, char-rnn) feeds such a
        tensor by its name with the last step's final state. Two forms, outside the
        backward pass:

        - a Fill whose shape is built with a row count first, of a tensor computed from
          the batch (``cell.zero_state(tf.shape(x)[0], tf.float32)`` concatenates
          ``expand_dims(rows, 0)`` and the width; ``tf.zeros([tf.shape(x)[0], n])``
          packs them) or, with static batches (where TensorFlow folds the count into a
          constant), with the static batch first (``cell.zero_state(BATCH, ...)``), and
          which meets the batch's data;
        - with static batches, a uniform Const whose first dimension is the static
          batch (``tf.zeros([BATCH, n])``) and which meets the batch's data.

        Not a state: a ones_like or zeros_like of a value (a Fill of a tensor's whole
        shape; a Const so named: a loss's labels or weights); ops inside a v1 while
        loop or cond (a Const there has a control input on the loop's or cond's pivot,
        a Fill's shape comes from a Switch), whose values live in one frame or branch;
        the default of a placeholder_with_default (a batch input: split_inputs gives it
        every replica's default)."""
        seed_nodes = {t.node for t in seeds}
        static = set(self.static_batch.values()) - {None}
        rows_region = variant0 | seed_nodes
        out = []
        for n in self.order:
            if n.op == "Const":
                if not static:
                    continue
                value = n.attr["value"].tensor
                dims = value.tensor_shape.dim
                if len(dims) < 2 or dims[0].size not in static or value.tensor_content \
                        or n.name.rsplit("/", 1)[-1].startswith(("zeros_like", "ones_like")):
                    continue
            elif n.op != "Fill":
                continue
            if n.control_inputs or n in self.input_pipeline or in_backward(n.name, self.gradient_scopes) \
                    or not dtypes.as_dtype(dtype_of(n.output(0))).is_floating:
                continue
            if n.op == "Const":
                counts = _meets(n, rows_region)
            elif _built_shape_length(n.inputs[0]) >= 2:
                rows = _leading_rows(n.inputs[0])
                if rows is not None:
                    counts = rows.node in rows_region
                else:
                    counts = _leading_int(n.inputs[0]) in static and _meets(n, rows_region)
                counts = counts and not _in_frame_or_branch(n)
            else:
                counts = False
            # (the default of a placeholder_with_default: split_inputs gives the batch
            # input every replica's default)
            if counts and not all(c.op == "PlaceholderWithDefault" for c, _ in n.consumers()):
                out.append(n.name)
        return out

    # ---- losses summed over the batch -------------------------------------------------
    def _find_loss_sums(self, seeds, variant0, cuts=()):
        """Sums over the batch's rows that a loss adds up, not divided by a count of
        them: ``tf.reduce_sum(tf.square(p - y))``, ``tf.nn.l2_loss(p - y)``, a
        ``tf.compat.v1.losses`` loss with ``reduction=SUM``, and a sum divided by a
        constant that is not a count of the rows. One device's gradient is the sum of
        the replicas' gradients of their shards' sums; averaging them divides it by R.

        A ``Sum`` over every axis (or an ``L2Loss``) of a value computed from the batch's
        rows one by one (``_reaches_rows``: not only from a mean over them) and a
        variable, with a backward pass (a statistic has none), counts when the gradient
        that enters its backward pass (``gradient_entries``) depends neither on the batch
        (a mean divides by ``tf.shape(x)[0]`` or ``tf.size(x)``; a normalizer by a sum of
        a mask) nor, with static batches, on a constant multiple of the static batch or
        its reciprocal (``reduce_sum(x) / BATCH``, which a model built for R x BATCH
        divides by R x BATCH). Then everything between the sum and the loss is linear in
        it, with coefficients the same on every replica. And the backward pass its
        gradient enters computes a gradient the rewrite averages (a cut's value is in
        its tf.gradients scope): a sum whose gradient is taken with respect to the batch
        itself (``tf.gradients(tf.reduce_sum(D(x)), x)``, a gradient penalty's per-row
        input gradients) is no loss, and each replica's rows' gradients are one
        device's as they are; scaled by R, the penalty was R^2 times one device's."""
        variables = {v.node for v in self.variables.values()}
        static = {b for b in self.static_batch.values() if b and b > 1}
        candidates = {}
        for n in self.order:
            if n in variant0 and (n.op == "L2Loss" or (n.op == "Sum" and _sums_every_axis(n))) \
                    and dtypes.as_dtype(dtype_of(n.output(0))).is_floating:
                candidates[n.name] = n
        if not candidates:
            return []
        entries = gradient_entries(self.g.nodes, candidates)
        seed_nodes = {t.node for t in seeds}
        # the backward passes whose gradients the rewrite averages (None: a hint's cut,
        # which may be anywhere, keeps every sum)
        averaged = None if any(c.source == "hint" for c in cuts) else {
            scope for c in cuts if c.role == "gradient" for scope in self._origin_scopes(c.values)}
        out = []
        for name, node in candidates.items():
            found = entries.get(name)
            if not found or not _value_ancestors(node.inputs[0].node) & variables \
                    or not _reaches_rows(node.inputs[0], seed_nodes):
                continue
            grads = {t for t, _ in found}
            if any(t.node in variant0 or _counts_rows(t.node, static) for t in grads):
                continue
            if averaged is not None and not {self._backward_scope(t.node.name) for t in grads} & averaged:
                continue
            out.append(name)
        return out

    def _origin_scopes(self, tensor):
        """The tf.gradients scopes of the backward nodes a cut's value comes from: its
        own, or, for a cut where the update reads it after affine post-processing (a
        gradient divided by the loss scale), those its walk back outside any backward
        pass meets first."""
        start = tensor.node
        reached = {start} if self._in_backward(start) else ancestors([start], data_only=True, stop=self._in_backward)
        return {self._backward_scope(n.name) for n in reached if self._in_backward(n)}

    def _backward_scope(self, name):
        """The tf.gradients scope a backward node is in ("gradients_1/", "grads/",
        "SGD/gradients/" for a Keras optimizer's), or None."""
        for scope in self.gradient_scopes:
            if name.startswith(scope):
                return scope
        m = _GRADIENTS_SCOPE.search(name)
        return name[:m.end()] if m is not None else None

    # ---- rows that meet other rows -----------------------------------------------------
    def _find_row_products(self, seeds, variant0):
        """Forward products of two tensors that both keep the batch's rows, over their
        features: ``tf.matmul(queries, documents, transpose_b=True)``, the logits of a
        contrastive loss with in-batch negatives, of a [rows, rows] shape, and the same
        written otherwise (``tf.matmul(q, tf.transpose(d))``, tf.einsum, tf.tensordot,
        ``q[:, None] * d[None]``, pairwise distances by expand_dims: row_axes.py). Each
        replica would compute it over its own shard, so every row would meet R times
        fewer rows than on one device: product_heads computes its head over every
        replica's rows, or the plan says so."""
        from graph_rewriter.row_axes import MEETING_OPS, meets_rows
        seed_nodes, holds = {t.node for t in seeds}, {}
        follow = functools.cache(_rows_follow(strict=True, limit=_ROWS_LIMIT))   # (a step per node, once)
        # (the nodes any walk back could find a batch input from, found once: most of a
        # deep model's values hold no rows, and each walk that finds none goes to its limit)
        reaching = _Lazy(lambda: _reaching(self.order, seed_nodes, follow))

        def holds_rows(t):   # (by node: _reaches_rows walks back from the node)
            if t.node not in holds:
                holds[t.node] = t.node in reaching.value and _reaches_rows(
                    t, seed_nodes, strict=True, follow=follow)
            return holds[t.node]
        return [n.name for n in self.order
                if n.op in MEETING_OPS and n in variant0 and not in_gradients_scope(n.name, self.gradient_scopes)
                and meets_rows(n, holds_rows)]

    def _find_product_head(self, meeting, seeds, variant0, elsewhere):
        """The head of the in-batch products and rankings of rows (``meeting``: their
        names; graph_rewriter/product_heads.py), which every replica can compute over
        every replica's rows, or why not."""
        if not meeting:
            return None, None
        from graph_rewriter import product_heads
        return product_heads.find(self.order, [self.g.node(n) for n in meeting], {t.node for t in seeds},
                                  variant0, self.gradient_scopes, elsewhere)

    def _find_row_moves(self, moves, loops, seeds, variant0, elsewhere):
        """The moves of the batch's rows (``moves``: their names) and the loops over them
        (``loops``: {name: the nodes to start from}) that every replica can compute over
        every replica's rows (graph_rewriter/row_moves.py), why not for the others, and
        {loop: its stacks of rows}."""
        if not moves and not loops:
            return None, {}, {}
        from graph_rewriter import row_moves
        return row_moves.find(self.order, [self.g.node(n) for n in moves], {t.node for t in seeds}, variant0,
                              self.gradient_scopes, elsewhere, loops)

    def _find_looped_draws(self, variant0, training, batch_draws, bounded):
        """{loop name: [nodes]} of the forward while loops whose count of steps the batch
        decides and that run a seeded stateful random op the random_draws pass does not
        take: tf.map_fn over the rows (a random flip or crop per image) runs one step per
        row, and each step draws from the kernel's state, so a replica's loop over its n
        rows draws what one device draws for the batch's first n. A v1 loop is named by
        its LoopCond (a draw's outermost frame, its condition computed from the batch),
        a v2 one by its While (its cond's result computed from an argument the call
        passes from the batch). The nodes are where graph_rewriter/row_moves.py starts
        the loop's region; none where the count is a constant, a static batch's (each
        replica's batch is its own: the loop is noted). A loop a bound over the rows
        bounds (``bounded``: v1 frame names, v2 While nodes; tf.nn.dynamic_rnn's, a
        decoder's) is none: its steps are not the rows, and the loop_bounds pass makes
        their count one device's."""
        found, conds, taken = {}, None, set(batch_draws)
        static = set(self.static_batch.values()) - {None}
        for n in self.order:
            if not (n.op in _WHILES or n.op in RANDOM_DRAWS) or n.name in taken \
                    or in_gradients_scope(n.name, self.gradient_scopes):
                continue
            frames = _is_stateful_draw(n) and loop_frames(n)
            if frames:
                if conds is None:
                    conds = self._loop_conds(variant0, static)
                cond, over_rows = conds.get(frames[0].attr["frame_name"].s, (None, False))
                if over_rows and cond in training.value and frames[0].attr["frame_name"].s.decode() not in bounded:
                    found.setdefault(cond.name, [cond] if cond in variant0 else [])
            elif n.op in _WHILES and n not in bounded and n in variant0 and n in training.value \
                    and self._unhandled_draws(n, taken):
                if self._while_over_batch(n, variant0):
                    found[n.name] = [n]
                elif any(_static_count(t, static) for t in n.inputs):
                    found[n.name] = []
        return found

    def _loop_conds(self, variant0, static):
        """{v1 frame name: (its LoopCond, True if the batch decides its count of steps)}:
        its condition is computed from the batch, or, with static batches (TensorFlow
        folds tf.map_fn's ``tf.shape(x)[0]`` into a constant), a constant equal to the
        static batch enters the frame of a loop that reads the batch."""
        conds, counted, reading = {}, set(), set()
        for n in self.order:
            if n.op == "LoopCond":
                conds[loop_frames(n)[-1].attr["frame_name"].s] = n
            elif n.op == "Enter" and n.inputs:
                if n.inputs[0].node in variant0:
                    reading.add(n.attr["frame_name"].s)
                elif _static_count(n.inputs[0], static):
                    counted.add(n.attr["frame_name"].s)
        return {frame: (cond, cond in variant0 or (frame in counted and frame in reading))
                for frame, cond in conds.items()}

    def _while_over_batch(self, loop, variant0):
        """True if the v2 While ``loop``'s cond computes its result from an argument
        the call passes from the batch (tf.map_fn's count of rows)."""
        cond = self.functions.get(loop.attr["cond"].func.name)
        if cond is None:
            return False
        args = [a.name for a in cond.signature.input_arg]
        reached = _Body(cond).reached_from({arg for arg, t in zip(args, loop.inputs) if t.node in variant0})
        return any(ref.split(":")[0] in reached for ref in cond.ret.values())

    def _unhandled_draws(self, loop, batch_draws):
        """True if the v2 While ``loop``'s functions run a seeded stateful random op that
        is not a draw of the batch's rows the random_draws pass takes (those are named
        ``call:function:node``), or call a function that runs one."""
        for _, name in called_functions(loop):
            fn = self.functions.get(name)
            if fn is None:
                continue
            if any(_is_stateful_draw(_BodyNode(None, nd.name, nd))
                   and f"{loop.name}:{name}:{nd.name}" not in batch_draws for nd in fn.node_def):
                return True
            if any(self._function_draws(f, {name}) for nd in fn.node_def for f in _called_by(nd)):
                return True
        return False

    def _find_sampled_rows(self, seeds, variant0, training):
        """Seeded draws of samples per row from each row's own values, whose value
        training uses: ``tf.random.categorical(logits, k, seed)`` (a Multinomial: a
        policy gradient's actions, a decoder sampling its own predictions). The kernel
        draws row b from its seeds skipped ahead by b, so a replica's clone draws for its
        rows what one device draws for the batch's first rows. An unseeded one draws
        from a seed of its own on every replica already, and is left alone."""
        seed_nodes = {t.node for t in seeds}
        return [n.name for n in self.order
                if n.op in _ROW_SAMPLES and n in variant0 and not in_gradients_scope(n.name, self.gradient_scopes)
                and (n.op.startswith("Stateless") or n.attr["seed"].i or n.attr["seed2"].i)
                and _reaches_rows(n.inputs[0], seed_nodes, strict=True) and n in training.value]

    def _find_moved_rows(self, seeds, variant0, training):
        """Forward ops that move the batch's rows within it, whose value training
        uses: a reverse or roll along the rows (mixup's ``lam * x + (1 - lam) *
        tf.reverse(x, [0])`` or ``x[::-1]``), a shuffle of them, a gather of them by
        indices computed from one of those (mixup's ``tf.gather(x,
        tf.random.shuffle(tf.range(n)))``), a top_k (or sort) of a value with one entry
        per row (hard example mining: the mean of the k largest of the rows' losses), a
        running sum along the rows (a Cox model's risk sets; training may only go
        through its backward) or the index of their largest (the hardest row's loss).
        Each replica moves or ranks its own shard's rows, so row i meets other rows than
        on one device: the plan says so."""
        seed_nodes = {t.node for t in seeds}
        out = []
        for n in self.order:
            if n.op not in _ROW_MOVES or n not in variant0 or in_gradients_scope(n.name, self.gradient_scopes):
                continue
            if n.op in ("ReverseV2", "Roll"):
                moves = _const_axes_hold_rows(n.inputs[2 if n.op == "Roll" else 1], n.inputs[0])
            elif n.op == "StridedSlice":   # x[::-1]
                strides = n.inputs[3].node
                moves = strides.op == "Const" and dtypes.int_values(strides.attr["value"].tensor)[:1] == [-1] \
                    and not n.attr["ellipsis_mask"].i and not n.attr["new_axis_mask"].i & 1
            elif n.op == "RandomShuffle":
                moves = True
            elif n.op in _ROW_SCANS or n.op in _ROW_ARGS:   # along a constant axis: the rows'
                moves = _const_axes_hold_rows(n.inputs[1], n.inputs[0])
            elif n.op in _RANKINGS:   # ranks the rows of a [rows] value (maybe a reshape) together
                moves = static_rank(n.inputs[0]) == 1 or (n.op in _ROW_SOFTMAXES
                                                          and _rows_last(n.inputs[0], seed_nodes))
            else:   # a gather of the rows themselves, by moved indices
                moves = ((n.op == "Gather" or _is_const(n.inputs[2], 0))
                         and not ("batch_dims" in n.attr and n.attr["batch_dims"].i)
                         and _computed_from_moves(n.inputs[1]))
            # (a ranking may rank a reshape's entries; a scan or an argmax runs along the rows
            # themselves, a score per row maybe sliced from a column: s[:, 0])
            along = n.op in _ROW_SCANS or n.op in _ROW_ARGS
            strict = along or n.op not in _RANKINGS
            if moves and _reaches_rows(n.inputs[0], seed_nodes, strict=strict, slices=along):
                out.append(n)
        # (a running sum's backward is a running sum of its gradient, which reads none of
        # its values: it counts where the gradients go through its backward)
        differentiated = self._differentiated(
            {n.name: n for n in out if n not in training.value and n.op in _ROW_SCANS}, training)
        return [n.name for n in out if n in training.value or n.name in differentiated]

    def _differentiated(self, unread, training):
        """The names of the ``unread`` ops ({name: node}: forward ops whose value no
        gradient reads) whose backward the gradients go through: a member of its
        tf.gradients scope is among ``training``'s value ancestors."""
        if not unread:
            return set()
        return {name for (name, _), members in gradient_scopes(self.order, unread).items()
                if any(m in training.value for m in members)}

    def _find_positioned_rows(self, seeds, variant0, training):
        """Forward ops that take rows of the batch by their position in it, whose value
        training uses: a split along the rows (the batch's halves, ``tf.split(h, 2, 0)``,
        where the input pipeline put two views of the examples; not one that splits
        back a concatenation along the rows made in the graph: _split_pieces), a slice
        of some of the rows (``h[:n]``, ``h[0]``, ``h[::2]``; ``h[::-1]`` is a move), a
        gather along the rows by indices the batch's values do not decide
        (``tf.gather(h, [0, 1])``, ``tf.range(0, n, 2)``; a top_k's are a ranking), a
        reshape grouping them by position (a prototypical network's support embeddings,
        ``tf.reshape(h, [n_way, -1, d])``, class by class). A
        replica's batch is a contiguous shard of the batch, so its halves are not the
        batch's halves: the plan says so. Training uses the op where the gradients read
        its value, or where they go through its backward alone (returned apart: those
        the product head does not compute). A SparseTensor's components count entries, and
        its dense shape is no rows: they are not looked at."""
        sparse = {t for triple in self.sparse_inputs for t in triple}
        seed_nodes = {t.node for t in seeds if t not in sparse}
        static = set(self.static_batch.values()) - {None}
        candidates = {}
        for n in self.order:
            if n.op not in _POSITIONAL or n not in variant0 or in_gradients_scope(n.name, self.gradient_scopes):
                continue
            value = n.inputs[1] if n.op == "Split" else n.inputs[0]
            if n.op == "GatherV2":   # (by indices the batch's values do not decide: positions)
                takes = _int_const(n.inputs[2]) == [0] and not (_value_ancestors(n.inputs[1].node)
                                                               | {n.inputs[1].node}) & seed_nodes
            elif n.op == "Split":
                takes = _split_axis(n) == 0 and not _split_pieces(n, _rows_follow(True, 4096), 4096)
            elif n.op == "SplitV":
                takes = _split_axis(n, n.inputs[2], n.inputs[0]) == 0
            elif n.op == "Slice":
                takes = _first_int(n.inputs[1]) != 0 or _first_int(n.inputs[2]) != -1
            elif n.op == "Reshape":
                takes = _groups_rows(n, static)
            else:
                takes = _slices_rows(n)
            if takes and _reaches_rows(value, seed_nodes, strict=True):
                candidates[n.name] = n
        # (a gather of microbatch i's losses from tf.reshape(losses, [M, -1]), as
        # DP-SGD's optimizer differentiates them one by one, or a mean of the first
        # rows' losses: their backward reads only the op's shape, not its value, yet
        # decides which rows each gradient comes from)
        unread = {name: n for name, n in candidates.items() if n not in training.value}
        differentiated = self._differentiated(unread, training)
        return ([name for name in candidates if name not in unread],
                [name for name in candidates if name in differentiated])

    def _find_regradients(self, seeds, variant0):
        """Sums over the batch's rows that a backward pass computes (a weight's gradient,
        ``x^T dy``, a convolution filter's; a bias's, BiasAddGrad) and that leave it into
        what a gradient reads:
        GradNorm's norms of each task's gradient in the loss that trains the task
        weights, MAML's inner step ``w - lr * dL/dw`` on the whole batch before the
        outer loss. A weight's gradient is averaged where it reaches its update; one the
        step differentiates again is each replica's own rows' gradient, whose norm (or
        step) is not one device's, and no average of the results makes it so."""
        if not self._names_backward():
            return []
        seed_nodes = {t.node for t in seeds}
        out = []
        for n in self.order:
            if n not in variant0 or not self._in_backward(n):
                continue
            if n.op == "MatMul":
                # (x^T dy: the rows of the forward input x, and of the backward's dy, which
                # the shapes then make rows too; the walk to the rows does not pass dy's ops)
                found = (n.attr["transpose_a"].b and not n.attr["transpose_b"].b
                         and _reaches_rows(n.inputs[0], seed_nodes, strict=True))
            elif n.op in ("BiasAddGrad", "Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                          "DepthwiseConv2dNativeBackpropFilter"):
                found = True    # (sums of dy, times the input's patches, over the rows)
            else:
                continue
            if found and self._differentiated_again(n):
                out.append(n.name)
        return out

    def _differentiated_again(self, node):
        """True if a value of the backward pass leaves it (through its own ops) into ops
        outside any backward pass whose values a backward pass reads: a loss computed
        from the gradient (GradNorm's norms) or weights stepped by it (MAML's fast
        weights) that tf.gradients differentiates. Post-processing that ends in the
        updates (clipping, an optimizer by hand, a Keras optimizer's IdentityN) is read
        by no backward op; an update's effect on later reads is a control edge, which
        the walk does not follow (SAM's ascent)."""
        if self._regradient_sources is None:
            self._regradient_sources = self._backward_nodes_read_again()
        return node in self._regradient_sources

    def _backward_nodes_read_again(self):
        """The backward-pass nodes from which a path of data edges, first through
        backward ops and then through forward ones only, reaches a forward op that a
        backward op reads. Two walks back over the data edges, once per analysis (a walk
        forward from each candidate cost NASNet's analysis three seconds)."""
        inside = self._in_backward
        # forward ops that reach a backward reader through forward ops only
        leaving = {}
        stack = [n for n in self.order if not inside(n) and any(inside(c) for c, _ in n.consumers())]
        for n in stack:
            leaving[n] = None
        while stack:
            n = stack.pop()
            for t in n.inputs:
                m = t.node
                if m not in leaving and not inside(m):
                    leaving[m] = None
                    stack.append(m)
        # backward ops that reach one of those through backward ops
        sources = {}
        stack = [n for n in self.order if inside(n) and any(c in leaving for c, _ in n.consumers())]
        for n in stack:
            sources[n] = None
        while stack:
            n = stack.pop()
            for t in n.inputs:
                m = t.node
                if m not in sources and inside(m):
                    sources[m] = None
                    stack.append(m)
        return sources

    def _find_row_gradients(self, seeds, variant0, cut_tensors, loss_sums):
        """Gradients with respect to the batch's rows (an input's, an activation's) that
        leave the backward pass into the step, where the step uses their scale: of a
        mean over the rows, or of a loss sum the rewrite counts R times (loss_sums), a
        replica's is R times one device's per row. Its loss divides by its own N / R
        rows; the averaged weight gradients make up for that, nothing makes up for
        these. A gradient penalty on ``tf.gradients(tf.reduce_mean(D(x)), x)``, K-FAC's
        output-gradient factor from the loss's gradients times a constant batch size.
        Not listed where the use does not see the scale: times a count of the rows
        first (the replica's count makes the product one device's, as K-FAC's own
        normalizer does), its sign (FGSM), its division by its own norm per row; nor
        a gradient of a sum no loss is (``tf.reduce_sum(D(x))``, K-FAC's sampled loss),
        which is one device's per row. Divided by its norm over the rows (the batch's,
        whatever its scale) it is listed as the rows meeting."""
        if not self._names_backward():
            return []
        seed_nodes = {t.node for t in seeds}
        static = {b for b in self.static_batch.values() if b and b > 1}
        scaled = {}   # {tf.gradients scope: its gradients are R times one device's per row}
        out = []
        for n in self.order:
            if n not in variant0 or not self._in_backward(n):
                continue
            leaving = sorted({c.inputs[pos] for c, pos in n.consumers() if not self._in_backward(c)},
                             key=lambda t: t.index)
            for t in leaving:
                if t in cut_tensors or not _holds_row_gradient(t, seed_nodes, self._in_backward):
                    continue
                use = _row_gradient_use(t, self._in_backward, variant0, static, cut_tensors)
                if use == "meets":
                    out.append(t.name)
                    continue
                if use != "scaled":
                    continue
                scope = self._backward_scope(n.name)
                if scope not in scaled:
                    scaled[scope] = any(self._means_rows(y, seed_nodes, variant0, static, loss_sums)
                                        for y in self._scope_ys(scope))
                if scaled[scope]:
                    out.append(t.name)
        return out

    def _scope_ys(self, scope):
        """The forward ops a tf.gradients scope differentiates: those whose backward
        reads its default initial gradients (``<scope>grad_ys_<i>``, ones of each y's
        shape). A scope given its grad_ys has none."""
        out = []
        for n in self.order:
            if not n.name.startswith(scope) or not _GRAD_YS.fullmatch(n.name[len(scope):]):
                continue
            for c, _ in n.consumers():
                rest = c.name[len(scope):]
                if "_grad/" in rest:
                    y = self.g.get(rest[:rest.rindex("_grad/")])
                    if y is not None and y not in out:
                        out.append(y)
        return out

    def _means_rows(self, node, seed_nodes, variant0, static, loss_sums, depth=0):
        """True if a differentiated value is, through ops linear in it, a mean over the
        batch's rows (a Mean whose axes hold them, a value divided by a count of them
        or by a sum over them, a loss normalizer) or a loss sum the rewrite scales."""
        if depth > 32:
            return False
        if node.name in loss_sums:
            return True
        if node.op == "Mean":
            return (_reaches_rows(node.inputs[0], seed_nodes)
                    and (_const_axes_hold_rows(node.inputs[1], node.inputs[0]) or _sums_every_axis(node)))
        if node.op in ("RealDiv", "Div", "DivNoNan"):
            divisor = node.inputs[1]
            if divisor.node in variant0 or _counts_rows(divisor.node, static):
                return True
            inputs = node.inputs[:1]
        elif node.op in ("Identity", "Snapshot", "Cast", "Neg", "AddV2", "Add", "Sub", "AddN", "Mul"):
            inputs = node.inputs
        else:
            return False
        return any(self._means_rows(t.node, seed_nodes, variant0, static, loss_sums, depth + 1)
                   for t in inputs if t.node in variant0)

    def _find_batch_statistics(self, seeds, variant0, training, normalizers, loss_sums, stored):
        """Forward statistics over the batch's rows (a reduction whose constant axes
        hold the rows, a product of two batch tensors contracting the rows, a
        FusedBatchNorm in training mode) that training uses, or a state update stores,
        other than linearly: in an op with the rows (BatchNorm's ``x - mean``, a center loss's
        ``h - reduce_mean(h, 0)``) or a non-linear one (``square(reduce_mean(h, 0) -
        t)``) whose value the gradients read. Each replica computes the statistic over
        its own shard, and the mean of non-linear functions of the shards' statistics is
        not the function of one device's. A FusedBatchNorm in a function of a v2 cond
        (Keras' BatchNormalization behind its learning phase) is named
        ``call:function:node``. A statistic that reaches the loss linearly,
        the mean loss itself, a sum or a mean by hand (divided by a count of rows or a
        normalizer the rewrite syncs), stays one device's and is not listed. So does one
        a state update stores linearly (a count, a moving mean); one it stores through a
        non-linear op (``stored``: the ops computing the updates' values; weight
        normalization's data-dependent init, a gain 1 / sqrt(var)) is listed, and so is a
        Max or Min that one stores (quantization-aware training's moving range of the
        activations): the replicas' average of their maxima is not the batch's maximum.
        Where a resource variable's read after such an update feeds the forward pass, the
        statistic reaches training only through the update's control edge, not among
        ``training``'s value ancestors."""
        seed_nodes = {t.node for t in seeds}
        sums = (_the_sum(t.node) for t in normalizers)   # the normalizers' own, synced
        handled = {total.name for total in sums if total is not None} | set(loss_sums)
        divisors = set(normalizers)
        out = []
        for n in self.order:
            if n.name in handled or n not in variant0 or in_gradients_scope(n.name, self.gradient_scopes):
                continue
            if n.op in _FUNCTIONAL:
                if n in training.value:   # (a Keras model's first call, on its Input, may train nothing)
                    out += _called_batch_norms(n, self.functions, variant0)
                continue
            if n.op in _FUSED_BATCH_NORMS:
                # normalises its input, computed from the batch, over every axis but the
                # channels', the rows' among them
                found = (n.attr["is_training"].b if "is_training" in n.attr else True) and n in training.value
            elif n.op == "Max" and _only_sizes_fixed_bincounts(n):
                continue   # (tf.math.bincount's size, max(labels) + 1, clamped to a constant)
            elif n.op in _STATISTICS:
                found = (_const_axes_hold_rows(n.inputs[1], n.inputs[0]) and _reaches_rows(
                    n.inputs[0], seed_nodes, strict=True, slices=True)
                    or _reduces_moved_rows(n, seed_nodes)) and (
                    n in training.value or n in stored.value if n.op in _NON_LINEAR_STATISTICS
                    else _used_non_linearly(n, seed_nodes, divisors, training, self.gradient_scopes, stored))
            elif n.op in _COUNTED_STATISTICS:
                # rows summed by their ids (a class's count of labels in the batch,
                # unsorted_segment_sum(ones_like(labels), labels, C), or its features'
                # sum), the bins of the rows' values, the counts of their unique values
                # (not tf.gradients' own: it densifies a sparse gradient's sum so)
                ids = n.inputs[1] if "Segment" in n.op else n.inputs[0]
                found = not in_backward(n.name, self.gradient_scopes) and _reaches_rows(ids, seed_nodes) and (
                    n.op != "UniqueWithCounts" or bool(n.consumers(2))) and _used_non_linearly(
                    n, seed_nodes, divisors, training, self.gradient_scopes, stored)
            elif n.op == "MatMul" and n.attr["transpose_a"].b and not n.attr["transpose_b"].b:
                # a sum over the rows of products of their features: a covariance or
                # cross-correlation of the batch (Barlow Twins' C = z_a^T z_b / n)
                found = _contracts_rows(n, seed_nodes) and _used_non_linearly(
                    n, seed_nodes, divisors, training, self.gradient_scopes, stored)
            else:
                continue
            if found:
                out.append(n.name)
        return out

    def _bounded_loops(self, stat):
        """The loops ``stat``, a Max or Min over the batch's rows, bounds, when it reaches
        nothing but their conditions: through scalar arithmetic and comparisons into a v1
        LoopCond (the loop's frame name), or into a v2 While's argument that its cond
        compares and its body hands back unchanged (the While node: tf.while_loop's
        maximum_iterations is such an argument, which the backward pass also reads as
        its accumulators' capacity and its own loop's bound); [] otherwise.
        tf.nn.dynamic_rnn bounds its loop by the batch's longest sequence so: the
        statistic decides how many steps the loop runs, not what a step computes."""
        if stat.op not in ("Max", "Min"):
            return []
        stack, seen, loops = [stat], {stat}, []
        while stack:
            for c, pos in stack.pop().consumers():
                if c.op == "LoopCond":
                    loops.append(loop_frames(c)[-1].attr["frame_name"].s.decode())
                elif c.op in _WHILES and in_gradients_scope(c.name, self.gradient_scopes):
                    continue   # a v2 loop's backward While: it runs the steps the forward ran
                elif c.op in _WHILES:
                    if not self._while_bound(c, pos):
                        return []
                    loops.append(c)
                elif c.op == "EmptyTensorList" and pos == 1:
                    continue   # a capacity: the v2 backward pass's accumulators, one per step at most
                elif c.op not in _BOUND_ARITHMETIC:
                    return []
                elif c not in seen:
                    seen.add(c)
                    stack.append(c)
        return loops

    def _loops_draw(self, loops):
        """True if one of ``loops`` (v1 frame names, v2 While nodes) runs a seeded
        stateful random op: it draws once per step the loop runs, from a state that the
        next step and the next run go on from (a DropoutWrapper's mask per time step)."""
        frames = {loop for loop in loops if isinstance(loop, str)}
        if frames and any(_is_stateful_draw(n) and frames & {e.attr["frame_name"].s.decode() for e in loop_frames(n)}
                          for n in self.order):
            return True
        return any(self._function_draws(loop.attr[key].func.name, set())
                   for loop in loops if not isinstance(loop, str) for key in ("cond", "body"))

    def _function_draws(self, name, seen):
        """True if the function ``name``, or one it calls, runs a seeded stateful random op."""
        fn = self.functions.get(name)
        if fn is None or name in seen:
            return False
        seen.add(name)
        for nd in fn.node_def:
            if _is_stateful_draw(_BodyNode(None, nd.name, nd)):
                return True
            if any(self._function_draws(f, seen) for f in _called_by(nd)):
                return True
        return False

    def _while_bound(self, loop, pos):
        """True if input ``pos`` of the v2 While ``loop`` only bounds it: its cond reads
        the argument through comparisons and logic into its result, its body returns it
        unchanged and reads it nowhere else, and only the backward pass reads the loop's
        output of it."""
        cond, body = (self.functions.get(loop.attr[key].func.name) for key in ("cond", "body"))
        if cond is None or body is None or pos >= len(body.signature.input_arg):
            return False
        arg = body.signature.input_arg[pos].name
        if body.ret.get(body.signature.output_arg[pos].name) != arg or any(
                i.split(":")[0] == arg for nd in body.node_def for i in nd.input):
            return False
        reading, stack = {}, [cond.signature.input_arg[pos].name]
        for nd in cond.node_def:
            for i in nd.input:
                reading.setdefault(i.split(":")[0], []).append(nd)
        seen = set()
        while stack:
            for nd in reading.get(stack.pop(), []):
                if nd.op not in _BOUND_ARITHMETIC:
                    return False
                if nd.name not in seen:
                    seen.add(nd.name)
                    stack.append(nd.name)
        # (TensorFlow hands each of the loop's outputs on through an Identity)
        readers, stack = [], list(loop.consumers(pos))
        while stack:
            c, _ = stack.pop()
            if c.op == "Identity" and not in_gradients_scope(c.name, self.gradient_scopes):
                stack.extend(c.consumers(0))
            else:
                readers.append(c)
        return all(in_gradients_scope(c.name, self.gradient_scopes) for c in readers)

    def _find_selected_means(self, variant0, training):
        """Forward means over rows that a condition on the batch's values selects: the
        loss of the labelled rows only, ``reduce_mean(tf.boolean_mask(xent, labels >= 0))``
        (a gather by the indices of a ``Where``, or a DynamicPartition, through ops that
        keep rows apart). One device divides by the batch's count of selected rows; each
        replica divides by its shard's, and the replicas' means would be averaged alike
        whatever their counts (passes/normalizers.py divides by the replicas' mean count
        instead). Only means whose backward pass tf.gradients built (gradient_entries)."""
        found = {}
        for n in self.order:
            if n.op == "Mean" and n in variant0 and not in_gradients_scope(n.name, self.gradient_scopes) \
                    and dtypes.as_dtype(n.attr["T"].type).is_floating:
                select = _row_selection(n.inputs[0], variant0)
                if select is not None and select in training.value:
                    found[n.name] = n
        # the rewrite scales the gradient where it enters the mean's backward pass
        entries = gradient_entries(self.order, found) if found else {}
        return [name for name in found if name in entries]

    def _sync_obstacle(self, name, selected_means):
        """Why the batch statistic ``name`` cannot be synchronised across the replicas
        (passes/batch_statistics.py), or None: a Mean over the rows, or a sum over them
        (a Sum, a MatMul contracting them), whose backward pass reads its gradient from
        one tensor (or that has none), or a FusedBatchNorm in the graph whose reserve
        spaces only its backward FusedBatchNormGrads read."""
        if ":" in name:
            call, function, _ = name.split(":", 2)
            return (f"it is inside the function '{function}' that '{call}' calls, which the rewrite does not "
                    "lower to the graph's own ops (it lowers a v2 cond, an If, whose branch functions have no "
                    "control outputs, with its backward If on the same predicate); compute the statistic in "
                    "the graph itself (call the layer with training=True)")
        n = self.g.node(name)
        if n.op in _FUSED_BATCH_NORMS:
            return fused_batch_norm_obstacle(n)
        if n.op == "UniqueWithCounts":
            return ("it counts the unique values of the replica's rows, whose number differs from replica to "
                    "replica; count them in a fixed number of classes, with tf.math.unsorted_segment_sum("
                    "tf.ones_like(ids, tf.float32), ids, num_classes) or tf.reduce_sum(tf.one_hot(ids, "
                    "num_classes), 0), which are synchronised")
        if n.op in _SORTED_SEGMENTS:
            return ("its number of segments is the batch's largest segment id plus one, and a segment's rows may "
                    "lie on several replicas; pool them with tf.math.unsorted_segment_sum and a constant number "
                    "of segments, which is synchronised")
        if n.op in _COUNTED_STATISTICS and _fixed_size(n.inputs[2 if "Segment" in n.op else 1]) is None:
            what = "number of segments" if "Segment" in n.op else "size (minlength = maxlength)"
            return (f"its {what} is computed from the batch, so the replicas' shapes may differ; give it a "
                    "constant one")
        extreme = n.op in _EXTREMES
        if n.op != "Mean" and n.op not in _SUMMED_STATISTICS and not extreme:
            return (f"it is a {n.op} over the rows; only means (tf.nn.moments, a BatchNorm's statistics), "
                    "sums over the rows (a Sum, a MatMul contracting them, a segment sum, a bincount), maxima "
                    "and minima with no gradient, and fused BatchNorms are synchronised")
        if name in selected_means:
            return "it is also a mean over rows a condition selects, which the normalizers pass scales"
        scopes = gradient_scopes(self.order, {name: n})
        if extreme and scopes:
            return (f"it is a {n.op} over the rows with a gradient (its backward pass routes it to the rows that "
                    f"reach the {n.op.lower()}), which is not synchronised; stop its gradient (tf.stop_gradient, "
                    "as tf.reduce_logsumexp does) or drop the option")
        if scopes and not gradient_entries(self.order, {name: n}):
            return "its backward pass reads the gradient from more than one tensor"
        if not scopes:   # its backward under a scope not named "gradients": its forward alone would be synced
            unread = next((m.name for m in self.order if m.name.startswith(f"{name}_grad/")
                           or f"/{name}_grad/" in m.name), None)
            if unread is not None:
                return (f"its backward pass ('{unread}') is in a name scope the rewrite does not read as "
                        "tf.gradients' ('gradients', 'gradients_1', ...); leave tf.gradients' name at its default")
        return None

    def _row_counts_met(self, stat, seed_nodes, variant0, limit=4096):
        """([(op name, input position, [shape reads])], None) where a value computed
        from the sum over the rows ``stat`` and values free of the batch meets a count of
        the batch's rows (Barlow Twins' ``C = z_a^T z_b / tf.cast(tf.shape(z_a)[0],
        tf.float32)``), or (None, obstacle). Synced, the statistic is the whole batch's,
        and one device divides it by the whole batch's count of rows: there the rewrite
        counts every replica's rows (passes/batch_statistics.py). Where a value of the replica's own
        rows meets a count (a sum of the rows' distances to the statistic divided by
        ``tf.shape(h)[0]``: a mean by hand) the replica's count is right and stays. A
        count that meets both at once, a row-reduced value plus one of the statistic
        alone, is refused."""
        below, stack = {stat}, [stat]
        while stack and len(below) < limit:
            for c, _ in stack.pop().consumers():
                if c not in below and not in_gradients_scope(c.name, self.gradient_scopes) and c.op not in _SHAPE_ONLY:
                    below.add(c)
                    stack.append(c)
        counts = {}

        def count_reads(t):
            """The reads of a batch tensor's shape a count of rows ``t`` is computed from
            (nothing else of the batch), or None if ``t`` is no such count."""
            if t not in counts:
                reads, seen, stack = [], {t.node}, [t.node]
                while stack:
                    n = stack.pop()
                    if n in seed_nodes or n in below or len(seen) > limit:
                        reads = None   # a value of the batch, not only its shape
                        break
                    if n.op in _SHAPE_ONLY:
                        if n.op != "Rank" and n.inputs and _reaches_rows(n.inputs[0], seed_nodes):
                            reads.append(n)
                        continue
                    for i in n.inputs:
                        if i.node not in seen and not is_back_edge(i.node, n):
                            seen.add(i.node)
                            stack.append(i.node)
                counts[t] = reads or None
            return counts[t]

        whole, met = {stat}, []   # whole: the statistic's values that hold no replica's own rows
        for d in sorted(below - {stat}, key=self.position.get):
            mine = [t for t in d.inputs if t.node in below]
            others = [(pos, t) for pos, t in enumerate(d.inputs) if t.node not in below]
            found = [(pos, count_reads(t)) for pos, t in others if t.node in variant0 and count_reads(t)]
            if all(t.node in whole for t in mine) and all(
                    t.node not in variant0 or count_reads(t) for _, t in others):
                whole.add(d)
                for pos, reads in found:
                    odd = [n for n in reads if n.op not in ("Shape", "Size")
                           or not _reaches_rows(n.inputs[0], seed_nodes, strict=True)]
                    if odd:
                        return None, (f"'{d.name}' meets it with a count of the batch's rows taken by {odd[0].op} "
                                      f"'{odd[0].name}' of a tensor whose first axis may not be the rows; count "
                                      "them by tf.shape(x)[0] or tf.size(x) of the batch's rows, or use a "
                                      "constant batch size")
                    met.append((d.name, pos, sorted(n.name for n in reads)))
            elif found and any(t.node in whole or not _reaches_rows(t, seed_nodes) and _holds_whole(t.node, whole)
                               for t in mine):
                return None, (f"'{d.name}' meets a count of the batch's rows with a sum over the replica's rows "
                              "plus a value of the statistic alone: one device's count is right for the one, "
                              "the replica's for the other; divide each by its count apart")
        return met, None

    # ---- roles ------------------------------------------------------------------------
    def _assign_roles(self, cuts, batch_nodes):
        for cut in cuts:
            primary = self.variables[cut.variable]
            # A plain assign of one variable from batch data, with no optimizer slots, is
            # state (BatchNorm's moving statistics), even when the forward pass reads it
            # (Keras BatchNorm behind a learning-phase cond reads it in inference mode).
            # An optimizer written in plain ops (Keras Nadam) updates slots from the same cut.
            if self._state_like(cut):
                for name in cut.variables:
                    self.variables[name].role = "state"
                cut.role = "state"
                # a state fed from the backward pass accumulates gradients (NVIDIA BERT's
                # accumulators): averaged like them, even a bias's (a Sum over the rows)
                cut.combine = (None if in_gradients_scope(cut.values.node.name, self.gradient_scopes)
                               else "rows" if self._holds_row_states(cut)
                               else batch_combine(cut.values, batch_nodes))
            else:
                primary.role, primary.trainable = "trainable", True
                cut.role = "gradient"
            for name in cut.variables:
                other = self.variables[name]
                if name != cut.variable and other.role == "other":
                    other.role, other.slot_of = "slot", cut.variable
        for n, var, pos in self.writes:  # slots of fused ops: their non-"var" variable args
            slices = opdefs.input_arg_slices(n)
            if "var" not in slices or ("grad" not in slices and "delta" not in slices):
                continue
            primary = variable_of(n.inputs[slices["var"][0]])
            if var.node is not primary and var.role == "other":
                var.role, var.slot_of = "slot", primary.name
        for var in self.variables.values():
            if var.role == "other" and _is_step_counter(var):
                var.role = "step"
        if self.declared_trainable is not None:
            for var in self.variables.values():
                var.trainable = var.name in self.declared_trainable

    # ---- initialization ------------------------------------------------------------------
    def _find_initializers(self):
        for var in self.variables.values():
            for w in var.writers:
                if w.op not in ("Assign", "AssignVariableOp") or w in self.saver_nodes:
                    continue
                value = w.inputs[opdefs.input_position(w, "value")]
                if is_pure_initial_value(value.node):
                    var.initializer = w
                    break
        initializers = {v.initializer for v in self.variables.values() if v.initializer is not None}
        init_ops = [n for n in self.order
                    if n.op == "NoOp" and any(c in initializers for c in n.control_inputs)]
        # A variable initialized from another's value (an ExponentialMovingAverage's
        # shadow: initialized_value(), a tf.cond on the other being initialized) has no
        # pure initial value; its initializer is the assign an init op runs.
        # tf.compat.v1.train.init_from_checkpoint (BERT's warm start) gives a variable a
        # second assign, from a RestoreV2 of the checkpoint, and makes the init op run it
        # instead of the assign from the initial value: the one an init op runs wins.
        run_by_init = {c for op in init_ops for c in op.control_inputs}
        for var in self.variables.values():
            if var.initializer is None or var.initializer not in run_by_init:
                var.initializer = next((w for w in var.writers if w in run_by_init
                                        and w.op in ("Assign", "AssignVariableOp")), var.initializer)
        return init_ops


# ----- helpers shared by the analysis and the passes --------------------------------------

def saver_restores(nodes):
    """The restore ops among ``nodes`` that belong to a Saver: those that share their file
    name with a save op. A restore without one reads a variable's initial value from a
    checkpoint (``tf.compat.v1.train.init_from_checkpoint``) and is run by the init op."""
    nodes = list(nodes)
    saves = [n for n in nodes if n.op in SAVER_OPS and n.op not in RESTORE_OPS]
    named = ancestors(saves, data_only=True) if saves else set()
    return [n for n in nodes if n.op in RESTORE_OPS and n.inputs and n.inputs[0].node in named]


def variant_nodes(seeds, cuts):
    """Nodes whose value depends, through data edges, on a seed tensor; a tensor in
    ``cuts`` stops the dependence (the rewrite replaces it by its cross-replica mean)."""
    variant = set()
    stack = []
    for t in seeds:
        for c, pos in t.node.consumers(t.index):
            if c not in variant:
                variant.add(c)
                stack.append(c)
    while stack:
        n = stack.pop()
        for c, pos in n.consumers():
            if c in variant:
                continue
            if cuts and c.inputs[pos] in cuts:
                continue
            variant.add(c)
            stack.append(c)
    return variant


def _read_per_replica(cuts, cut_tensors, variant, update_readers):
    """What the forward pass computes from a batch statistic (a state cut's values) and
    nothing else of the batch: the rewrite gives the average only to the statistic's
    update, so these keep each replica's own value (a loss that a counter also adds up)."""
    out, stack = set(), []
    for cut in cuts:
        if cut.role != "state":
            continue
        updates = set(update_readers[id(cut)])
        for c, pos in cut.values.node.consumers(cut.values.index):
            if (c, pos) not in updates and c not in variant and c not in out:
                out.add(c)
                stack.append(c)
    while stack:
        for c, pos in stack.pop().consumers():
            if c not in variant and c not in out and c.inputs[pos] not in cut_tensors:
                out.add(c)
                stack.append(c)
    return out


def _order_states(cuts, position, update_readers):
    """Sets each state cut's ``after``: the state cuts whose averaged value reaches its
    own value on the way to their updates (the allreduce pass gives those readers the
    average: ``update_readers``, by id of cut), so the planner packs it after them;
    packed together, the pack's collective would wait for its own result."""
    states = [c for c in cuts if c.role == "state"]
    if len(states) < 2:
        return
    by_node = {}
    for c in states:
        by_node.setdefault(c.values.node, []).append(c)
    last = max(position[n] for n in by_node)
    for c in states:
        readers = [r for r, _ in update_readers[id(c)]]
        for n in _descendants_within(readers, None, position, last):
            for other in by_node.get(n, ()):
                if other is not c and c.key not in (other.after or ()):
                    other.after = (other.after or []) + [c.key]


def statistic_update_readers(tensor, variables):
    """The readers of a batch statistic (a state cut's values) that lead to the update of
    its moving average (an assign to one of ``variables``, by name), as (reader, input
    position). The forward pass reads the same tensor (BatchNorm normalises with it) and
    must keep the replica's own statistic. Each reader's descendants are searched
    nearest first, up to 256 of them: an update is a few ops from its statistic, and a
    depth-first search could spend the bound in the forward pass before reaching it
    (batch renormalization's statistic, read by its correction and then its updates)."""
    targets = set(variables)
    out = []
    for c, pos in tensor.node.consumers(tensor.index):
        frontier, seen, hit = collections.deque([c]), {c}, False
        while frontier and not hit and len(seen) < 256:
            n = frontier.popleft()
            if n.op in DENSE_ASSIGNS or n.op in FUNCTION_CALLS:
                if any(v is not None and v.name in targets for v in map(variable_of, n.inputs)):
                    hit = True
                    break
            for d, _ in n.consumers():
                if d not in seen:
                    seen.add(d)
                    frontier.append(d)
        if hit:
            out.append((c, pos))
    return out


def _row_count_only(tensor, variant, limit=256):
    """The Shape, Size or ShapeN through which alone ``tensor`` depends on the batch (a
    learning rate ``base * tf.cast(tf.shape(x)[0], tf.float32) / 256``), else None: every
    path back from it through the nodes that vary between replicas ends at one of those."""
    found, stack, seen = None, [tensor.node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return None
        if n.op in ("Shape", "ShapeN", "Size"):
            found = found or n
            continue
        inputs = [t.node for t in n.inputs if t.node in variant]
        if not inputs:
            return None   # a batch input itself, or a value that varies otherwise
        stack.extend(inputs)
    return found


def _batch_condition(write, variant):
    """The predicate of the cond a variable's ``write`` runs in, if the write varies
    between replicas through it alone: a v1 cond's Switch of a value the same on every
    replica by a predicate that is not, or a v2 cond's (If, Case) predicate or branch
    index. None otherwise."""
    if write.op in _CONDS:
        return _strip_identity(write.inputs[0]) if write.inputs[0].node in variant else None
    for t in write.inputs:
        if (t.node in variant and t.node.op in ("Switch", "RefSwitch")
                and t.node.inputs[0].node not in variant and t.node.inputs[1].node in variant):
            return _strip_identity(t.node.inputs[1])
    return None


def _check_updates_found(cuts, update_readers):
    """Every state cut must reach its update: its average is read on the way there
    alone, and one whose update the search did not find would be computed for nothing
    while every replica updated the moving average from its own rows."""
    for c in cuts:
        if c.role == "state" and not update_readers[id(c)]:
            raise GraphRewriteError(
                f"cannot find how the statistic '{c.values.name}' reaches the update of variable "
                f"'{c.variable}': graph_rewriter looks for the update among the 256 ops nearest "
                "the statistic's readers",
                hint="compute the moving average's update from the statistic in a few ops, as "
                     "tf.compat.v1.train.ExponentialMovingAverage and the BatchNorm layers do")


def _set_train_ops(cuts, variables, saver_nodes):
    """Each cut's train ops (the ops nothing reads downstream of its variable's updates,
    its initializer and the Saver's restore aside, and not counting reads nothing uses),
    kept only when they differ between cuts: the planner packs gradients of different
    train ops apart, since running one of them would otherwise compute the others'
    gradients for the pack it all-reduces."""
    found = {}
    twice = {c.variable for c in cuts if c.name}   # variables updated by several cuts
    for c in cuts:
        var = variables[c.variable]
        updates = var.step_writes(saver_nodes)
        if c.variable in twice:
            below = descendants([c.values.node])   # this cut's updates only
            updates = [w for w in updates if w in below]
        found[c.key] = sorted({n.name for n in descendants(updates) | set(updates)
                               if not n.readers() and n.op not in READERS and n.op not in PASS_THROUGH})
    if len({tuple(r) for r in found.values()}) > 1:
        for c in cuts:
            c.train_ops = found[c.key]


def _input_queue_ops(order):
    """Every op on a queue a batch dequeue (QUEUE_BATCH_DEQUEUES) draws from, or on a
    queue whose elements reach such a queue's enqueues (tf.train.batch's queue is filled
    from an input producer's queue of slice indices or file names): the queues, the
    enqueues and closes their QueueRunners run, dequeues, sizes, readers."""
    stack = [n.inputs[0].node for n in order if n.op in QUEUE_BATCH_DEQUEUES]
    found = set()
    while stack:
        queue = stack.pop()
        if queue in found or queue.op not in QUEUES:
            continue
        found.add(queue)
        for user in queue.readers():
            found.add(user)
            if user.op.startswith("QueueEnqueue"):
                stack.extend(n for n in enqueued_from(user) if n.op in QUEUES)
    return found


def _queue_reports(pipeline):
    """What is computed from the queues' sizes alone (the fraction_of_N_full summary
    tf.train.batch adds): it exists once, like the queues."""
    out = set()
    stack = [n for n in pipeline if n.op.startswith(("QueueSize", "QueueIsClosed"))]
    while stack:
        for c in stack.pop().readers():
            if c not in out and c not in pipeline and all(
                    t.node in pipeline or t.node in out or t.node.op == "Const" for t in c.inputs):
                out.add(c)
                stack.append(c)
    return out


def is_input_queue(node):
    """A queue of the script's own, not one of the rewrite's (sync_queues' token and
    barrier queues, whose shared_names ps_state.shared_name makes)."""
    from graph_rewriter.ps_state import SHARED_PREFIX
    return node.op in QUEUES and not (
        "shared_name" in node.attr and node.attr["shared_name"].s.startswith(SHARED_PREFIX.encode()))


def enqueues_fed_values(enqueue):
    """Whether an enqueue's values come from a feed: the script's own thread runs it, not
    a QueueRunner, and each worker's client feeds its own."""
    return any(n.op in PLACEHOLDERS for n in enqueued_from(enqueue))


def enqueued_from(enqueue):
    """What an enqueue's values are computed from (data edges; not past a queue, whose
    elements a dequeue or a reader takes, nor past a variable)."""
    return ancestors([t.node for t in enqueue.inputs[1:]], data_only=True,
                     stop=lambda n: n.op in QUEUES or n.op in VARIABLE_OPS) | {t.node for t in enqueue.inputs[1:]}


def is_pure_initial_value(node):
    """True if a value depends on no variable, placeholder, iterator, queue or checkpoint:
    what an initializer computes (constants, random ops, arithmetic on them)."""
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        if (n.op in VARIABLE_OPS or n.op in PLACEHOLDERS or n.op in SAVER_OPS
                or n.op in ITERATOR_GET_NEXT or n.op in QUEUE_BATCH_DEQUEUES):
            return False
        for t in n.inputs:
            if t.node not in seen:
                seen.add(t.node)
                stack.append(t.node)
    return True


_DIVISIONS = frozenset(("RealDiv", "Div", "DivNoNan"))
# Ops whose output's value depends on their input's shape only.
_SHAPE_ONLY = frozenset(("Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike"))


def _value_ancestors(node):
    """Every node ``node``'s value depends on through data edges, not looking past ops
    whose value is their input's shape (Shape, Size, OnesLike, ...). A v1 loop's
    values depend on its body through the back edges (NextIteration into Merge): they
    are followed, as a loop's output computed from a variable in its body depends on
    that variable."""
    return _value_ancestors_of([node])


# ops whose gradient to their inputs is none or zero: comparisons, predicates, rounding
_NO_GRADIENT = frozenset(("StopGradient", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual",
                          "IsFinite", "IsNan", "IsInf", "LogicalAnd", "LogicalOr", "LogicalNot", "ArgMax",
                          "ArgMin", "Sign", "Floor", "Ceil", "Round"))


def _differentiable_ancestors(node):
    """The nodes ``node``'s value depends on through data edges that a gradient goes
    through: _value_ancestors, not looking past the ops of _NO_GRADIENT either."""
    return _value_ancestors_of([node], _SHAPE_ONLY | _NO_GRADIENT)


def _value_ancestors_of(nodes, stops=_SHAPE_ONLY):
    """The union of _value_ancestors over ``nodes``, in one walk (not looking past the
    ops in ``stops``)."""
    stack = list(nodes)
    seen = set(stack)
    while stack:
        n = stack.pop()
        if n.op in stops:
            continue
        for t in n.inputs:
            if t.node not in seen:
                seen.add(t.node)
                stack.append(t.node)
    return seen


# Where tf.gradients puts the backward pass of op X: "<scope>gradients[_k]/X_grad/..."
# (TensorFlow's gradients_util opens a name scope op.name + "_grad" per forward op).
# (the "/" before it is looked behind, not matched: tf_keras' legacy optimizers call
# tf.gradients inside their own "gradients" scope, "SGD/gradients/gradients/...", and
# finditer must find the inner scope after the outer one)
_GRADIENTS_SCOPE = re.compile(r"(?:^|(?<=/))gradients(?:_\d+)?/")


def in_gradients_scope(name, scopes=()):
    """True if a node's name puts it in a backward pass tf.gradients built: under its
    default scope ("gradients", "gradients_1", ...) or under one of ``scopes``, the
    other scopes the graph's tf.gradients calls opened (named_gradient_scopes)."""
    if "_grad/" not in name:
        return False
    return _GRADIENTS_SCOPE.search(name) is not None or any(
        name.startswith(s) or "/" + s in name for s in scopes)


def in_backward(name, scopes=()):
    """True if a node is in a backward pass tf.gradients built, its aggregation and its
    seed included ("gradients/AddN", "gradients/Fill"), not only an op's "_grad/" scope."""
    return _GRADIENTS_SCOPE.search(name) is not None or any(name.startswith(s) or "/" + s in name for s in scopes)


def named_gradient_scopes(nodes):
    """The scopes tf.gradients opened under a name of the script's choosing
    (``tf.gradients(loss, params, name="grads")`` gives "grads/"), as a tuple of
    "<scope>/" strings; the default ones ("gradients/", "gradients_1/", ...) are left
    to in_gradients_scope's pattern. A scope counts when a node in it is named
    "<scope>/<op>_grad/..." for an op of the graph, as tf.gradients names every
    op's backward (or "<prefix><scope>/<op>_grad/" for "<prefix><op>": a graph imported
    under a prefix)."""
    nodes = list(nodes)
    names = {n.name for n in nodes}
    scopes = set()
    for n in nodes:
        k = n.name.find("_grad/")
        if k < 0 or _GRADIENTS_SCOPE.search(n.name[:k + 1]) is not None:
            continue
        found = _forward_of_scope(n.name[:k], names, names)
        if found is not None:
            scopes.add(n.name[:found[1] + 1])
    return tuple(sorted(scopes))


def gradient_entries(nodes, sums):
    """{name: [(gradient tensor, (reader, input position))]} for the ``sums`` (name ->
    node, each a Sum, an L2Loss or a Mean): where the gradient of the sum enters its
    backward pass, in every gradients scope the graph has for it. The backward pass of
    a Sum or Mean broadcasts that gradient to the summed value's shape (Reshape, then
    Tile or BroadcastTo); an L2Loss's multiplies the summed value by it. It is the one
    floating-point input the scope's ops read from outside it that is not the sum's
    own input or output (a Mean's backward reads its output's shape). A scope whose
    inputs do not fit is left out."""
    out = {}
    for (name, scope), members in gradient_scopes(nodes, sums).items():
        inside = set(members)
        own = set(sums[name].inputs)
        readers = [(t, (n, pos)) for n in members for pos, t in enumerate(n.inputs)
                   if t.node not in inside and t not in own and t.node is not sums[name]
                   and dtypes.as_dtype(dtype_of(t)).is_floating]
        if len({t for t, _ in readers}) == 1:
            out.setdefault(name, []).extend(readers)
    return out


def gradient_scopes(nodes, named):
    """{(name, scope): [node]}: the backward passes tf.gradients built for the forward
    ops ``named`` (name -> node), each scope's members among ``nodes``. Nothing but the
    name scope tells which ops are a forward op's backward (with static shapes a Mean's
    broadcast reads only constants), so this reads the names: tf.gradients opens a
    scope of its own ("gradients", "gradients_1", or what its ``name`` says) and in it
    one per forward op, the op's whole name and "_grad/" ("gradients/model/Sum_grad/"
    for "model/Sum"). A graph imported under a prefix (import_graph_def(name="import"))
    has the prefix in front of both ("import/gradients/Sum_grad/" for "import/Sum").
    ``nodes`` is every node of the graph: a scope belongs to the longest op name of the
    graph that fits it, named or not ("gradients/l2_normalize/Sum_grad/" is the backward
    of "l2_normalize/Sum", not of a named "Sum"); callers may pass only the nodes they
    look through, and the named ops count among the graph's."""
    nodes = list(nodes)
    names = {n.name for n in nodes} | set(named)
    scopes = {}
    for n in nodes:
        k = n.name.find("_grad/")
        while k >= 0:
            found = _forward_of_scope(n.name[:k], named, names)
            if found is not None:
                scopes.setdefault((found[0], n.name[:k + len("_grad/")]), []).append(n)
            k = n.name.find("_grad/", k + 1)
    return scopes


def _forward_of_scope(head, named, names):
    """(op, j): the op of ``named`` whose backward scope is ``head + "_grad/"``, and
    where the scope tf.gradients opened ends (``head[j]`` is its "/"): head is
    "<scope>/<op>", or "<prefix><scope>/<op>" for the op "<prefix><op>"; the longest
    op name of the graph (``names``) that fits wins, and of one op name the one under
    the scope's prefix (a replica's "replica_1/bn/mean" for "replica_1/gradients/bn/mean",
    not replica 0's "bn/mean"). None if it is not one of ``named``."""
    slashes = [j for j, ch in enumerate(head) if ch == "/"]
    for j in slashes:
        op = head[j + 1:]
        for candidate in [head[:i + 1] + op for i in reversed(slashes) if i < j] + [op]:
            if candidate in names:
                return (candidate, j) if candidate in named else None
    return None


FUSED_BATCH_NORM_GRADS = frozenset(("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"))
BATCH_NORM_AXES = {"NHWC": [0, 1, 2], "NCHW": [0, 2, 3], "NDHWC": [0, 1, 2, 3], "NCDHW": [0, 2, 3, 4]}


def dead_zeros_like(n):
    """A ZerosLike whose value nobody reads: tf.gradients makes one for each output of a
    multi-output op that gets no gradient (a FusedBatchNorm's reserve spaces), and
    leaves it unread (replicate may make its other replicas' copies control inputs)."""
    return n.op == "ZerosLike" and not n.consumers()


def fused_batch_norm_obstacle(n):
    """Why the FusedBatchNorm ``n`` (in training mode) cannot be replaced by its
    synchronised ops, or None: its reserve spaces (outputs 3 on) must be read only by
    the FusedBatchNormGrads of its backward pass (of the same input, in training mode),
    whose placeholder outputs (3 on) nobody reads (or unread ZerosLikes of them)."""
    fmt = n.attr["data_format"].s.decode() if "data_format" in n.attr else "NHWC"
    if fmt not in BATCH_NORM_AXES:
        return f"its data_format {fmt} is not one of {', '.join(BATCH_NORM_AXES)}"
    for c, pos in n.consumers():
        index = c.inputs[pos].index
        if index < 3 or dead_zeros_like(c):
            continue
        if c.op not in FUSED_BATCH_NORM_GRADS or pos < 3:
            return f"'{c.name}' ({c.op}) reads its reserve space {index - 2}"
        if c.inputs[1] != n.inputs[0] or not c.attr["is_training"].b:
            return f"its backward '{c.name}' is not of the same input in training mode"
        if any(r.inputs[p].index >= 3 for r, p in c.consumers()):
            return f"something reads the reserve-space outputs of its backward '{c.name}'"
    return None


_REDUCTIONS = frozenset(("Sum", "Mean", "Max", "Min", "Prod", "ArgMax", "ArgMin", "All", "Any"))


# Ops that may move rows or mix a batch tensor's rows with other rows along the first
# axis (nce_loss slices its sampled classes' weights off a concatenation with the labels'):
# a value they give need not have the batch's rows as its own first axis.
_MOVES_ROWS = frozenset(("ConcatV2", "Pack", "Unpack", "StridedSlice", "Slice", "Pad", "PadV2", "Tile",
                         "Transpose", "Reshape", "Squeeze", "ExpandDims"))


def _written_value(write):
    """The tensor a variable's write stores: an assign's value, a scatter's updates."""
    slices = opdefs.input_arg_slices(write)
    for arg in ("value", "updates", "delta"):
        if arg in slices:
            return write.inputs[slices[arg][0]]
    return write.inputs[-1]


def _holds_rows(tensor, batch_nodes, limit=4096):
    """True if ``tensor`` holds rows of a batch input, each computed from its own row
    (through ops that keep rows apart, concatenations and slices of them, a MatMul's left
    operand, a reduction whose constant axes leave the first, a gather's indices): a
    queue of keys, ``tf.concat([keys, queue], 0)[:K]``, does; a statistic over the rows
    (a mean, a sum, a FusedBatchNorm's batch mean and variance) does not. Walks tensors,
    not nodes: of a FusedBatchNorm's outputs only ``y`` holds the rows."""
    def follow(t):
        n = t.node
        if n.op in _FUSED_BATCH_NORMS:
            return n.inputs[:1] if t.index == 0 else []
        if n.op in _REDUCTIONS:
            axes = n.inputs[1].node if len(n.inputs) > 1 else None
            keeps_rows = axes is not None and axes.op == "Const" and all(
                v > 0 for v in dtypes.int_values(axes.attr["value"].tensor))
            return [n.inputs[0]] if keeps_rows else []
        if n.op == "MatMul":
            return n.inputs[:1] if not n.attr["transpose_a"].b else []
        if n.op in ("GatherV2", "Gather", "ResourceGather"):
            return [n.inputs[1]]
        if n.op in ("Split", "SplitV"):   # parts of rows are rows
            return [n.inputs[1] if n.op == "Split" else n.inputs[0]]
        return list(n.inputs) if n.op in _ROW_LOCAL else []
    return _search_back(tensor, lambda t: t.node in batch_nodes, follow, limit) is not None


_GRAD_YS = re.compile(r"grad_ys_\d+")
# the backward ops of element-wise activations: their output holds the rows their
# forward input holds (ReluGrad(dy, features), TanhGrad(y, dy))
_ACTIVATION_GRADS = frozenset(("ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SoftplusGrad",
                               "SoftsignGrad", "TanhGrad", "SigmoidGrad", "SqrtGrad", "RsqrtGrad"))


def _holds_row_gradient(tensor, seed_nodes, in_backward, limit=4096):
    """True if a backward-pass value holds a value per row of the batch (a gradient
    with respect to an input or an activation): walking back through the backward ops
    that keep rows apart (element-wise ones, activations' gradients, a MatMul's left
    operand ``dy w^T``, a reshape to a forward operand's shape) it meets a forward
    value that holds the rows, strictly (_reaches_rows). A weight's gradient ``x^T dy``
    contracts them, a bias's sums them."""
    forward = _rows_follow(True, limit)

    def follow(n):
        if not in_backward(n):
            return forward(n)
        if n.op == "MatMul":
            return [] if n.attr["transpose_a"].b else [n.inputs[0].node]
        if n.op == "Reshape" and n.inputs[1].node.op == "Shape":
            # (a broadcasting op's gradient, summed by BroadcastGradientArgs' axes and
            # reshaped to its forward operand's shape: rows where that operand has them)
            return [n.inputs[1].node.inputs[0].node]
        if n.op in ELEMENTWISE or n.op in _ACTIVATION_GRADS or n.op == "AddN":
            return [t.node for t in n.inputs]
        return []
    return _search_back(tensor.node, lambda n: n in seed_nodes, follow, limit) is not None


def _row_gradient_use(tensor, in_backward, variant0, static, cut_tensors, limit=256):
    """How the step uses a per-row gradient that leaves the backward pass, following it
    through element-wise ops: "meets" where its norm over the batch's rows divides it,
    "scaled" where anything sees its scale, "free" where every use is its product with
    a count of the rows, its sign, its division by its own norm per row (the norm's own
    ops included), or a weight's gradient (the cuts' post-processing)."""
    use, stack, seen = "free", [tensor], set()
    while stack and len(seen) < limit:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        consumers = t.node.consumers(t.index)
        norms, norm_ops = {}, set()
        for c, pos in consumers:
            other = _normalizer_operand(c, pos)
            if other is not None:
                norms[c], ops = _own_norm(other, t.node)
                if norms[c] == "batch":
                    return "meets"
                if norms[c] == "rows":
                    norm_ops |= ops
        for c, pos in consumers:
            if in_backward(c) or c.op == "Sign" or c in norm_ops or norms.get(c) == "rows":
                continue
            if c.op in ("Mul", "MulNoNan") and len(c.inputs) == 2 and (
                    _row_count_only(c.inputs[1 - pos], variant0) is not None
                    or _counts_rows(c.inputs[1 - pos].node, static)):
                continue
            if c.op not in ELEMENTWISE and c.op not in ("Select", "SelectV2", "ClipByValue"):
                use = "scaled"
            elif c.output(0) not in cut_tensors:
                stack.append(c.output(0))
    return use


def _normalizer_operand(c, pos):
    """The operand that may normalise the one at ``pos`` of ``c``: a quotient's
    divisor, a product's reciprocal (``x * rsqrt(sum(x^2))``, tf.nn.l2_normalize)."""
    if c.op in ("RealDiv", "Div", "DivNoNan") and pos == 0:
        return c.inputs[1]
    if c.op in ("Mul", "MulNoNan") and len(c.inputs) == 2 and \
            _strip_identity(c.inputs[1 - pos]).node.op in ("Rsqrt", "Reciprocal", "Inv"):
        return c.inputs[1 - pos]
    return None


def _own_norm(tensor, source, limit=256):
    """("rows", its ops) if ``tensor`` is computed from ``source`` through a reduction
    that keeps the rows apart (its norm per row, ``tf.norm(g, axis=1)``), ("batch", ...)
    if through one over them (its norm over the batch), else (None, ...); walking back
    through element-wise ops. Its ops: the nodes between ``source`` and ``tensor``."""
    found, stack, seen, parents = None, [(tensor.node, False)], set(), {}
    while stack and len(seen) < limit:
        n, reduced = stack.pop()
        if (n, reduced) in seen:
            continue
        seen.add((n, reduced))
        if n is source:
            found = found or ("rows" if reduced else None)
            continue
        if n.op in _REDUCTIONS and len(n.inputs) > 1:
            if _const_axes_hold_rows(n.inputs[1], n.inputs[0]) or n.op == "Sum" and _sums_every_axis(n):
                if source in _value_ancestors(n):
                    return "batch", set()
                continue
            if _int_const(n.inputs[1]) is None:
                continue
            nexts = [(n.inputs[0].node, True)]
        elif n.op in ELEMENTWISE:
            nexts = [(t.node, reduced) for t in n.inputs]
        else:
            continue
        for m in nexts:
            parents.setdefault(m[0], set()).add(n)
            stack.append(m)
    ops, stack = set(), [source]   # (the nodes on the way down from source)
    while stack:
        for m in parents.get(stack.pop(), ()):
            if m not in ops:
                ops.add(m)
                stack.append(m)
    return found, ops


def _search_back(node, found, follow, limit):
    """The first node ``found`` accepts, walking back from ``node`` along the nodes
    ``follow(n)`` gives, each visited once, at most ``limit`` of them; or None (nodes
    or tensors alike)."""
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if found(n):
            return n
        stack.extend(follow(n))
    return None


_ROWS_LIMIT = 4096   # nodes _reaches_rows visits at most


def _reaches_rows(tensor, batch_nodes, limit=_ROWS_LIMIT, strict=False, slices=False, follow=None):
    """True if a value is computed from the rows of a batch input one by one along some
    path: through ops that keep rows apart, a reduction whose constant axes leave the
    first one, a MatMul's left operand (not transposed), a gather's indices. False when
    every path to the batch passes a mean or sum over the rows or a product that
    contracts them (``reduce_sum(square(reduce_mean(h, 0) - t))``, a loss on the batch's
    mean features, is no sum over the rows). ``strict``: not through ops that may move
    rows (_MOVES_ROWS), so the value's first axis is the batch's rows; a Reshape that
    keeps its first axis (_keeps_first_axis: tf_keras' and tf.layers' Flatten) is no
    such op; with ``slices``, nor is a slice that keeps every row in order on axis 0
    (``s[:, 0]``, a score per row). ``follow``: _rows_follow(strict, limit, slices),
    made by the caller to share among many walks (memoized)."""
    return _search_back(tensor.node, lambda n: n in batch_nodes, follow or _rows_follow(strict, limit, slices),
                        limit) is not None


def _reaching(nodes, found, follow):
    """The nodes from which a walk back along ``follow`` (from ``nodes``) reaches a node
    of ``found``, with no limit: a walk from any other node finds none."""
    consumers = {}
    for n in nodes:
        for m in follow(n):
            consumers.setdefault(m, []).append(n)
    out, stack = set(found), list(found)
    while stack:
        for n in consumers.get(stack.pop(), ()):
            if n not in out:
                out.add(n)
                stack.append(n)
    return out


def _rows_follow(strict, limit, slices=False):
    """_reaches_rows' step back from a node: the inputs through which it keeps rows."""
    def follow(n):
        if n.op in _REDUCTIONS:
            axes = n.inputs[1].node if len(n.inputs) > 1 else None
            if axes is not None and axes.op == "Const" and 0 not in dtypes.int_values(axes.attr["value"].tensor) \
                    and all(v >= 0 for v in dtypes.int_values(axes.attr["value"].tensor)):
                return [n.inputs[0].node]
        elif n.op == "MatMul":
            if not n.attr["transpose_a"].b:
                return [n.inputs[0].node]
        elif n.op in ("GatherV2", "Gather", "ResourceGather"):
            return [n.inputs[1].node]
        elif n.op == "Split" and strict:
            return _split_pieces(n, follow, limit)
        elif n.op in _ROW_LOCAL and not (strict and n.op in _MOVES_ROWS and not _keeps_first_axis(n)
                                         and not _concats_features(n)
                                         and not (slices and _keeps_rows_in_order(n))):
            return [t.node for t in n.inputs]
        return []
    return follow


def _normalizers_beside(head, normalizers):
    """(the loss normalizers left to the normalizers pass, why the head cannot be
    computed or None). A normalizer the head computes (a RankNet's count of ordered
    pairs, ``reduce_sum(mask)``, copied from every replica's rows) is the whole batch's
    there, one device's: no replica's to average, when the head, its copies and their
    backward are all that read it."""
    inside = set(head.head) | set(head.copied_ops)
    readers = {name: {reader for reader, _ in found} for name, found in head.copied}
    left = []
    for t in normalizers:
        if t.node.name not in inside:
            left.append(t)
            continue
        consumers = [c for c, _ in t.node.consumers(t.index)]
        # (and the head's backward: the gradient of loss / count reads the count)
        backward = {m.name for members in gradient_scopes(consumers, dict.fromkeys(head.head)).values()
                    for m in members}
        if not {c.name for c in consumers} <= inside | readers.get(t.name, set()) | backward:
            return normalizers, f"'{t.name}', a loss normalizer in it, is also read elsewhere"
    return left, None


def _split_pieces(split, follow, limit):
    """The tensors a ``tf.split(h, k, 0)`` splits back apart: SimCLR's two views, put
    through one encoder as ``tf.concat([view_1, view_2], 0)``, come out as ``tf.split(h,
    2, 0)``. The nodes of the ConcatV2 of k tensors along axis 0 that ``h`` is computed
    from row by row (along ``follow``, the strict walk); each part of the split holds
    the rows of one of them, on every replica its own shard's, when they have as many
    rows (two views of one batch); [] when there is no such concatenation. A split
    along another axis keeps every row in every part: its input."""
    k = split.attr["num_split"].i
    a = _split_axis(split)
    if a is None:
        return []
    if a > 0:
        return [split.inputs[1].node]   # along the features: each part keeps every row

    def pieces(n):
        values = n.inputs[:-1]
        return n.op == "ConcatV2" and len(values) == k and _is_const(n.inputs[-1], 0)

    def walk(n):
        return [] if n.op == "Split" else follow(n)   # (nested splits: not followed)

    concat = _search_back(split.inputs[1].node, pieces, walk, limit)
    return [t.node for t in concat.inputs[:-1]] if concat is not None else []


_POSITIONAL = frozenset(("Split", "SplitV", "Slice", "StridedSlice", "Reshape", "GatherV2"))


def _int_const(tensor):
    """The values of a constant integer tensor (through Identity), or None."""
    n = _strip_identity(tensor).node
    return list(dtypes.int_values(n.attr["value"].tensor)) if n.op == "Const" else None


def _first_int(tensor):
    """The first entry of an integer vector that is a constant or a Pack whose first
    input is one (``h[:, :n]``'s begin, end and strides), or None."""
    n = _strip_identity(tensor).node
    if n.op == "Pack" and n.inputs:
        tensor = n.inputs[0]
    values = _int_const(tensor)
    return values[0] if values else None


def _built_shape_length(shape):
    """The length of a shape vector built of pieces: a Pack of its entries, or a
    ConcatV2 of two or more vectors (a constant counted by its length, any other piece,
    ``expand_dims(rows, 0)``, as one); 0 when it is not built so (a tensor's whole
    Shape, as ones_like and zeros_like take it)."""
    n = _strip_identity(shape).node
    if n.op == "Pack" and n.attr["axis"].i == 0:
        return len(n.inputs)
    if n.op != "ConcatV2" or len(n.inputs) < 3:
        return 0
    total = 0
    for piece in n.inputs[:-1]:
        p = _strip_identity(piece).node
        dims = p.attr["value"].tensor.tensor_shape.dim if p.op == "Const" else None
        total += dims[0].size if dims else 1
    return total


def _default_rows(placeholder):
    """The first dimension of a PlaceholderWithDefault's default when that is a Const or
    a Fill of a constant shape, or None."""
    t = _strip_identity(placeholder.inputs[0]) if placeholder.inputs else None
    if t is None:
        return None
    if t.node.op == "Const":
        dims = t.node.attr["value"].tensor.tensor_shape.dim
        return dims[0].size if dims else None
    return _leading_int(t.node.inputs[0]) if t.node.op == "Fill" else None


def _in_frame_or_branch(node, limit=2000):
    """True if a data ancestor of ``node`` is a v1 cond's Switch or a v1 loop's Enter
    (so ``node`` computes in a branch or a loop frame), or if it has more than ``limit``
    ancestors (too far to tell: counted as one)."""
    seen, stack = {node}, [node]
    while stack:
        for t in stack.pop().inputs:
            p = t.node
            if p in seen:
                continue
            if p.op in ("Switch", "RefSwitch", "Enter", "RefEnter") or len(seen) > limit:
                return True
            seen.add(p)
            stack.append(p)
    return False


def _leading_int(shape):
    """The first entry of a shape vector built of constants (a Const, a Pack or a
    ConcatV2 that starts with one: ``cell.zero_state(4, ...)`` concatenates [4] and the
    state's size), or None."""
    n = _strip_identity(shape).node
    if n.op == "ConcatV2" and len(n.inputs) >= 3:
        return _first_int(n.inputs[0])
    return _first_int(shape)


def _split_axis(split, axis=None, value=None):
    """The axis a Split (or SplitV, given its axis and value) splits along, made
    non-negative, or None when it is not a constant (or negative of an unknown rank)."""
    axis = split.inputs[0] if axis is None else axis
    value = split.inputs[1] if value is None else value
    values = _int_const(axis)
    if values is None or len(values) != 1:
        return None
    a = values[0]
    if a < 0:
        rank = static_rank(value)
        return None if rank is None else a + rank
    return a


def _slices_rows(strided_slice):
    """True if a StridedSlice takes some of its input's rows by position (``h[:n]``,
    ``h[0]``, ``h[::2]``), not all of them in order (``h[:, 0]``), nor reversed
    (``h[::-1]``: a move of the rows)."""
    n = strided_slice
    if n.attr["ellipsis_mask"].i & 1 or n.attr["new_axis_mask"].i & 1:
        return False   # (axis 0 left whole, or a new axis first)
    if n.attr["shrink_axis_mask"].i & 1:
        return True
    stride = _first_int(n.inputs[3])
    if stride == -1:
        return False
    whole_begin = n.attr["begin_mask"].i & 1 or _first_int(n.inputs[1]) == 0
    return stride != 1 or not whole_begin or not n.attr["end_mask"].i & 1


def _rows_last(tensor, seed_nodes):
    """True if the last axis of ``tensor`` holds the batch's rows (tf.nn.softmax(x,
    axis=0) transposes them there): a softmax over it normalises the rows together."""
    from graph_rewriter.row_axes import rows_axis
    rank = static_rank(tensor)
    return rank is not None and rank >= 2 and rows_axis(
        tensor, lambda t: _reaches_rows(t, seed_nodes, strict=True)) == rank - 1


def _reduces_moved_rows(n, seed_nodes):
    """True if a reduction over constant axes reduces the axis that holds the batch's
    rows after transposes and element-wise ops (row_axes.rows_axis): SwAV's Sinkhorn
    sums a [classes, rows] matrix over axis 1."""
    from graph_rewriter.row_axes import rows_axis
    axes, rank = _int_const(n.inputs[1]), static_rank(n.inputs[0])
    if not axes or rank is None or not _reaches_rows(n.inputs[0], seed_nodes):
        return False
    a = rows_axis(n.inputs[0], lambda t: _reaches_rows(t, seed_nodes, strict=True), elementwise=True)
    return a is not None and rank > 0 and any(v % rank == a for v in axes)


def _concats_features(n):
    """True for a ConcatV2 along a constant axis other than the rows' (K-FAC's
    homogeneous coordinate, ``tf.concat([a, tf.ones_like(a[:, :1])], -1)``): each
    row of its output is the same row of every input, in order."""
    if n.op != "ConcatV2":
        return False
    axis = _int_const(n.inputs[-1])
    if not axis or len(axis) != 1:
        return False
    if axis[0] >= 0:
        return axis[0] > 0
    rank = next((r for r in (static_rank(t) for t in n.inputs[:-1]) if r is not None), None)
    return rank is not None and axis[0] + rank > 0


def _keeps_rows_in_order(n):
    """True for a StridedSlice that keeps every row, in order, on axis 0 (``s[:, 0]``)."""
    from graph_rewriter.row_axes import sliced_axis
    return n.op == "StridedSlice" and sliced_axis(n, 0) == 0


def _groups_rows(reshape, static=()):
    """True for a Reshape to ``[k, ...]`` with a constant k > 0 (``[n_way, -1, d]``): the
    input's rows, taken in order, go into k groups by their position in the batch. So
    does ProGAN's and StyleGAN's minibatch standard deviation, ``[tf.minimum(4,
    tf.shape(x)[0]), -1, ...]`` (row i joins the rows i + M, i + 2M, ...). With a static
    batch B (``static``), ``[B, -1]`` keeps the rows (TensorFlow's CIFAR-10 tutorial
    flattens its features so): none."""
    first = _leading_group_count(reshape.inputs[1])
    return first is not None and first > 0 and first not in static and not _keeps_first_axis(reshape)


def _leading_group_count(shape):
    """The first entry of a shape vector when it is a constant, packed or not
    (_first_int), or a constant clamped by ``tf.minimum`` (a group size no larger than
    the batch); else None."""
    n = _strip_identity(shape).node
    if n.op == "Pack" and n.inputs and _strip_identity(n.inputs[0]).node.op == "Minimum":
        return next((v[0] for v in map(_int_const, _strip_identity(n.inputs[0]).node.inputs) if v), None)
    return _first_int(shape)


def _keeps_first_axis(reshape):
    """True for a Reshape to ``[-1, d, ...]`` with constant d's or to ``[tf.shape(x)[0],
    ...]`` of its own input x (what Flatten builds, with static and with unknown inner
    dimensions): its input's rows, split or grouped in order, are its rows, so on
    every replica its first axis holds that replica's shard of one device's value, as
    for the input itself."""
    if reshape.op != "Reshape":
        return False
    shape = reshape.inputs[1]
    if _leading_constant(shape) == -1:
        return all(d > 0 for d in list(dtypes.int_values(_strip_identity(shape).node.attr["value"].tensor))[1:])
    rows = _leading_rows(shape)
    return rows is not None and rows == reshape.inputs[0]


# Forward ops that move a tensor's rows within it (along axis 0, for the first two).
# (a softmax over a [rows] value normalises the rows together: ListNet's, the batch as
# the list; computed in a head as a ranking is)
_ROW_SOFTMAXES = frozenset(("Softmax", "LogSoftmax"))
# (a running sum along the rows reads the rows before each: a Cox model's partial
# likelihood sums each row's risk set by tf.cumsum of the rows sorted by time, computed
# in a head as a ranking is; the index of the largest row reads them all: hard example
# mining's argmax of the rows' losses, only noted)
_ROW_SCANS = frozenset(("Cumsum", "Cumprod", "CumulativeLogsumexp"))
_ROW_ARGS = frozenset(("ArgMax", "ArgMin"))
_RANKINGS = frozenset(("TopKV2", "TopK")) | _ROW_SOFTMAXES | _ROW_SCANS
_ROW_SAMPLES = frozenset(("Multinomial", "StatelessMultinomial"))
# v2 conds: their first input is the predicate or the branch index, not an argument
_CONDS = frozenset(("If", "StatelessIf", "Case", "StatelessCase"))
_ROW_MOVES = frozenset(("ReverseV2", "Roll", "RandomShuffle", "GatherV2", "Gather", "StridedSlice")) | _RANKINGS \
    | _ROW_ARGS
_FUSED_BATCH_NORMS = frozenset(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"))
_STATISTICS = frozenset(("Mean", "Sum", "Max", "Min", "Prod"))
# what a loop bound may pass through on its way to a loop's condition (_bounded_loops)
_BOUND_ARITHMETIC = frozenset(("Maximum", "Minimum", "Cast", "Identity", "Enter", "Less", "LessEqual", "Greater",
                               "GreaterEqual", "LogicalAnd", "LogicalOr", "LogicalNot"))
_WHILES = frozenset(("While", "StatelessWhile"))
_NON_LINEAR_STATISTICS = frozenset(("Max", "Min", "Prod"))
# statistics synced by the replicas' maximum or minimum, when no gradient goes through them
_EXTREMES = frozenset(("Max", "Min"))
# statistics over the rows counted by the rows' values (a class's count of labels)
# (and the rows pooled by their segment ids: a graph network's readout, tf.math.segment_sum of
# the nodes of a batch of graphs by each node's graph, a multiple-instance model's bags)
_SORTED_SEGMENTS = frozenset(("SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd"))
_COUNTED_STATISTICS = frozenset(("UnsortedSegmentSum", "DenseBincount", "Bincount", "UniqueWithCounts",
                                 "UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd")) | _SORTED_SEGMENTS
# statistics the replicas sync by summing theirs: a sum over the rows, a product contracting
# them, the counted ones but the counts of unique values (where their size is fixed)
_SUMMED_STATISTICS = frozenset(("Sum", "MatMul", "UnsortedSegmentSum", "DenseBincount", "Bincount"))


class _Lazy:
    """A value computed on first use (the ancestors of the gradients, needed only when a
    graph has a candidate)."""

    def __init__(self, compute):
        self._compute, self._value = compute, None

    @property
    def value(self):
        if self._value is None:
            self._value = self._compute()
        return self._value


def _computed_from_moves(tensor, limit=256):
    """True if a value (a gather's indices) is computed from a reverse, roll or shuffle
    (``tf.random.shuffle(tf.range(n))``), within ``limit`` ancestors."""
    return _search_back(tensor.node, lambda n: n.op in ("ReverseV2", "Roll", "RandomShuffle"),
                        lambda n: [] if n.op in _SHAPE_ONLY else [t.node for t in n.inputs], limit) is not None


def _is_const(tensor, value):
    n = tensor.node
    return n.op == "Const" and list(dtypes.int_values(n.attr["value"].tensor)) == [value]


def _const_axes_hold_rows(axes, value):
    """True if a constant ``axes`` tensor names axis 0 of ``value`` (a negative axis
    counts when value's rank is known)."""
    n = axes.node
    if n.op != "Const":
        return False
    values = list(dtypes.int_values(n.attr["value"].tensor))
    if 0 in values:
        return True
    if any(v < 0 for v in values):
        rank = static_rank(value)
        return rank is not None and any(v + rank == 0 for v in values)
    return False


def _holds_whole(node, whole, limit=4096):
    """True if ``node``'s value adds one of the ``whole`` values (a synced statistic's,
    the same on every replica) outside any sum over the rows: ``reduce_sum(err) + c``,
    not ``reduce_sum(square(h - c))``."""
    def follow(n):
        return [] if _sums_rows(n) else [t.node for t in n.inputs]
    return _search_back(node, lambda n: n in whole, follow, limit) is not None


def _sums_rows(n):
    """True for a reduction whose constant axes hold the rows, or a MatMul contracting them."""
    if n.op in _STATISTICS:
        return len(n.inputs) > 1 and _const_axes_hold_rows(n.inputs[1], n.inputs[0])
    return n.op == "MatMul" and n.attr["transpose_a"].b


def _fixed_size(tensor):
    """The value of a bincount's size or a segment sum's number of segments when it is
    fixed, whatever the batch: a constant, or tf.math.bincount's ``minimum(maxlength,
    maximum(minlength, ...))`` with minlength = maxlength; else None."""
    value = _int_const(tensor)
    if value is not None:
        return value
    n = _strip_identity(tensor).node
    if n.op == "Minimum" and len(n.inputs) == 2:
        top = [v for v in map(_int_const, n.inputs) if v is not None]
        inner = next((_strip_identity(t).node for t in n.inputs if _int_const(t) is None), None)
        if len(top) == 1 and inner is not None and inner.op == "Maximum" and top[0] in map(_int_const, inner.inputs):
            return top[0]
    return None


def _only_sizes_fixed_bincounts(stat, limit=16):
    """True if every value computed from ``stat`` (a Max of the batch's values) ends in
    the size of a bincount whose size is fixed (tf.math.bincount(labels, minlength=C,
    maxlength=C) computes max(labels) + 1, then clamps it to C): its value does not
    matter."""
    seen, stack, ends = {stat}, [stat], 0
    while stack:
        for c, pos in stack.pop().consumers():
            if c.op in ("DenseBincount", "Bincount") and pos == 1:
                if _fixed_size(c.inputs[1]) is None:
                    return False
                ends += 1
            elif c.op in ("AddV2", "Add", "Mul", "Maximum", "Minimum", "Cast") and c not in seen:
                seen.add(c)
                stack.append(c)
                if len(seen) > limit:
                    return False
            elif c not in seen:
                return False
    return ends > 0


def _used_non_linearly(stat, seed_nodes, divisors, training, gradient_scopes=(), stored=None, limit=256):
    """True if training uses a value computed from the statistic ``stat`` other than
    linearly: in an op with a value computed from the batch's rows one by one, an op
    not in _LINEAR, or a product or quotient with another value of the batch (other
    than a count of its rows, which is a shape, or a synced normalizer), where the
    gradients read that op's input or output (``training``: the gradients' ancestors;
    ``exp(loss)``, a perplexity only fetched, does not count), or where that op
    computes a state update's value (``stored``: those ops; not the update itself)."""
    seen, stack = {stat}, [stat]
    while stack and len(seen) < limit:
        n = stack.pop()
        for c, pos in n.consumers():
            if c in seen or in_gradients_scope(c.name, gradient_scopes) or c.op in _SHAPE_ONLY:
                continue
            seen.add(c)
            others = [t for i, t in enumerate(c.inputs) if i != pos]
            if c.op in _LINEAR:
                if any(_reaches_rows(t, seed_nodes) for t in others):
                    bad = True
                elif c.op in ("Mul", "RealDiv", "Div", "DivNoNan"):
                    bad = (c.op != "Mul" and pos == 1) or any(
                        t not in divisors and _value_ancestors(t.node) & seed_nodes for t in others)
                else:
                    bad = False
            else:
                bad = True
            if bad:
                if n in training.value or c in training.value or (stored is not None and c in stored.value):
                    return True
                continue
            stack.append(c)
    return False


def _row_selection(tensor, variant0, limit=512):
    """The op that selects the rows ``tensor`` is computed from one by one, by a
    condition on the batch's values (a gather by a ``Where``'s indices, as
    ``tf.boolean_mask`` builds it, or a DynamicPartition), or None."""
    def selects(n):
        if n.op == "DynamicPartition":
            return n in variant0
        if n.op not in ("GatherV2", "Gather"):
            return False
        idx = n.inputs[1].node
        while idx.op in _KEEPS_KIND or idx.op == "StridedSlice":
            idx = idx.inputs[0].node
        return idx.op == "Where" and idx in variant0

    def follow(n):
        if n.op in ("GatherV2", "Gather"):
            return [n.inputs[0].node]
        if n.op in _ROW_LOCAL and n.op not in ("ConcatV2", "Pack", "Tile"):
            return [t.node for t in n.inputs]
        return []
    return _search_back(tensor.node, selects, follow, limit)


def _counts_rows(node, static):
    """True if a value depends on a constant that is a multiple of a static batch size
    in ``static`` or the reciprocal of one (``reduce_sum(x) / BATCH``), or on a constant
    shape holding such a multiple (``tf.compat.v1.losses``' count of present weights,
    a Sum over ones of the batch's static shape)."""
    if not static:
        return False

    def multiple(w):
        return any(w >= b - 1e-6 and abs(w / b - round(w / b)) < 1e-6 for b in static)

    for n in _value_ancestors(node):
        if n.op != "Const":
            continue
        proto = n.attr["value"].tensor
        if dtypes.as_dtype(proto.dtype).is_floating:
            v = dtypes.number(proto)
            if v and v > 0 and (multiple(v) or multiple(1.0 / v)):
                return True
        elif dtypes.as_dtype(proto.dtype).name in ("int32", "int64") and any(
                multiple(v) for v in dtypes.int_values(proto)[:8]):
            return True
    return False


def _static_count(tensor, static):
    """True if ``tensor`` is a constant integer scalar equal to a static batch size in
    ``static`` (tf.map_fn's count of rows, folded)."""
    n = _strip_identity(tensor).node
    if n.op != "Const":
        return False
    proto = n.attr["value"].tensor
    if proto.tensor_shape.dim or dtypes.as_dtype(proto.dtype).name not in ("int32", "int64"):
        return False
    values = list(dtypes.int_values(proto))
    return len(values) == 1 and values[0] in static


def _is_stateful_draw(node):
    """A random op that draws from its kernel's state with fixed seeds: each run of it
    goes on from where the last left off."""
    return node.op in RANDOM_DRAWS and node.op not in STATELESS_RANDOM_DRAWS and any(
        key in node.attr and node.attr[key].i != 0 for key in ("seed", "seed2"))


def _is_seeded_draw(node):
    return node.op in RANDOM_DRAWS and (node.op in STATELESS_RANDOM_DRAWS
                                        or node.attr["seed"].i != 0 or node.attr["seed2"].i != 0)


# Functional control flow (a v2 cond or while loop): the attributes that name the
# functions a call runs, and how many of its inputs come before their arguments (an
# If's predicate, a Case's branch index).
_FUNCTIONAL = {"If": (("then_branch", "else_branch"), 1), "StatelessIf": (("then_branch", "else_branch"), 1),
               "Case": (("branches",), 1), "StatelessCase": (("branches",), 1),
               "While": (("cond", "body"), 0), "StatelessWhile": (("cond", "body"), 0)}


def _called_by(nd):
    """The names of the functions a function body's NodeDef ``nd`` names in its
    attributes (a call, a nested cond's or loop's branches)."""
    return [f.name for value in nd.attr.values()
            for f in (value.list.func if value.HasField("list") else [value.func] if value.HasField("func") else [])]


def called_functions(call):
    """(attribute, function name) of every function a v2 cond or while loop ``call``
    runs, in the call's order."""
    out = []
    for key in _FUNCTIONAL[call.op][0]:
        value = call.attr[key]
        out += [(key, f.name) for f in value.list.func] if value.HasField("list") else [(key, value.func.name)]
    return out


def _called_draws(call, functions, variant, static=()):
    """The seeded draws of the batch's rows in the functions of the v2 cond or while
    loop ``call`` (``call:function:node``): those whose shape's rows are an argument's
    (or computed from one) that the call passes from the batch, or, with static batches
    ``static``, whose shape is a constant whose first entry is one and whose draw meets
    such an argument's values. ``functions``: the library's, by name."""
    skip = _FUNCTIONAL[call.op][1]
    out = []
    for _, name in called_functions(call):
        fn = functions.get(name)
        if fn is None:
            continue
        args = [a.name for a in fn.signature.input_arg]
        from_batch = {arg for arg, t in zip(args, call.inputs[skip:]) if t.node in variant}
        body = _Body(fn)
        reached = body.reached_from(from_batch)
        for nd in fn.node_def:
            node = body.node(nd.name)
            if not _is_seeded_draw(node) or not nd.input:
                continue
            rows = _leading_rows(node.inputs[0])
            if rows is not None:
                counts = rows.node.name in reached
            else:
                first = _leading_constant(node.inputs[0])
                counts = first is not None and first in static and bool(
                    (body.reached_from({nd.name}) - {nd.name}) & reached)
            if counts:
                out.append(f"{call.name}:{name}:{nd.name}")
    return out


def _called_batch_norms(call, functions, variant):
    """The FusedBatchNorms in training mode, of a value the call passes from the batch,
    in the functions of the v2 cond or while loop ``call`` (``call:function:node``)."""
    skip = _FUNCTIONAL[call.op][1]
    out = []
    for _, name in called_functions(call):
        fn = functions.get(name)
        if fn is None or not any(nd.op in _FUSED_BATCH_NORMS for nd in fn.node_def):
            continue
        args = [a.name for a in fn.signature.input_arg]
        reached = _Body(fn).reached_from({arg for arg, t in zip(args, call.inputs[skip:]) if t.node in variant})
        out += [f"{call.name}:{name}:{nd.name}" for nd in fn.node_def
                if nd.op in _FUSED_BATCH_NORMS and nd.name in reached
                and (nd.attr["is_training"].b if "is_training" in nd.attr else True)]
    return out


class _Body:
    """A FunctionDef's body, its nodes read as the analysis reads the graph's (``op``,
    ``attr``, ``inputs`` as tensors with ``node`` and ``index``); an argument is a node
    of op "_Arg". Body inputs are strings: ``node:output_arg:index`` (the index within
    that argument; ``tensor`` gives the flat output position) or an argument's name."""

    def __init__(self, fn):
        self.defs = {nd.name: nd for nd in fn.node_def}
        self._nodes = {}

    def node(self, name):
        if name not in self._nodes:
            self._nodes[name] = _BodyNode(self, name, self.defs.get(name))
        return self._nodes[name]

    def tensor(self, ref):
        parts = ref.split(":")
        if len(parts) != 3:
            return Tensor(self.node(parts[0]), 0)
        nd = self.defs.get(parts[0])
        position = opdefs.output_position(nd, parts[1], int(parts[2])) if nd is not None else None
        return Tensor(self.node(parts[0]), int(parts[2]) if position is None else position)

    def reached_from(self, args):
        """Names of the arguments ``args`` and of the body nodes whose value depends on one."""
        reached, changed = set(args), True
        while changed:
            changed = False
            for nd in self.defs.values():
                if nd.name not in reached and any(
                        not i.startswith("^") and i.split(":")[0] in reached for i in nd.input):
                    reached.add(nd.name)
                    changed = True
        return reached


class _BodyNode:
    __slots__ = ("name", "op", "attr", "_body", "_def")

    def __init__(self, body, name, nd):
        self.name, self._body, self._def = name, body, nd
        self.op = nd.op if nd is not None else "_Arg"
        self.attr = nd.attr if nd is not None else {}

    @property
    def inputs(self):
        refs = [] if self._def is None else [i for i in self._def.input if not i.startswith("^")]
        return [self._body.tensor(r) for r in refs]


def _leading_rows(shape):
    """The tensor whose row count is the first entry of the shape vector ``shape``
    (``tf.shape(x)``; ``[tf.shape(x)[0], 1]``, packed or expanded; a concat starting with either; a
    distribution's ``sample(tf.shape(x)[0])``, which packs the product of its sample
    shape, here one scalar), or None."""
    for _ in range(16):
        t = _strip_identity(shape)
        n = t.node
        if n.op == "Shape":
            return n.inputs[0]
        if n.op == "ShapeN":
            return n.inputs[t.index]
        if (n.op == "Pack" and n.attr["axis"].i == 0 and n.inputs) or (
                n.op == "ExpandDims" and _int_const(n.inputs[1]) in ([0], [-1])):
            # (an RNN cell's zero_state(batch_size) concatenates expand_dims(batch_size, 0)
            # with the state's size)
            scalar = _strip_identity(n.inputs[0]).node
            if scalar.op == "Prod" and _is_scalar_slice(_strip_identity(scalar.inputs[0]).node):
                scalar = _strip_identity(scalar.inputs[0]).node   # (a product of one scalar is itself)
            if scalar.op != "StridedSlice" or not scalar.attr["shrink_axis_mask"].i & 1 or not _starts_at_0(scalar):
                return None
            shape = scalar.inputs[0]
        elif n.op == "ConcatV2" and len(n.inputs) >= 3 and _all_ones(n.inputs[0]):
            # a distribution's sample() draws [1, rows, ...]: [R, rows, ...] holds, replica
            # by replica, what one device draws as [1, R rows, ...] (the same elements in order)
            shape = n.inputs[1]
        elif n.op == "ConcatV2" and len(n.inputs) >= 3:
            shape = n.inputs[0]
        elif n.op == "BroadcastArgs":   # (a distribution's batch shape: its loc's and scale's)
            shape = _broadcast_rows(n)
            if shape is None:
                return None
        elif n.op == "StridedSlice" and not n.attr["shrink_axis_mask"].i and _starts_at_0(n):
            shape = n.inputs[0]
        else:
            return None
    return None


def _all_ones(tensor):
    """True if ``tensor`` is a constant vector of ones (a sample shape of one sample)."""
    n = _strip_identity(tensor).node
    return n.op == "Const" and set(dtypes.int_values(n.attr["value"].tensor)) == {1}


def _broadcast_rows(broadcast):
    """The input of a BroadcastArgs of two shapes whose first entry is the broadcast
    shape's: the longer one, or of two equally long the one whose first entry is a row
    count (the other's is then 1 or the same count); None if neither's is."""
    a, b = broadcast.inputs[0], broadcast.inputs[1]
    lengths = [_shape_length(t) for t in (a, b)]
    if None not in lengths and lengths[0] != lengths[1]:
        return a if lengths[0] > lengths[1] else b
    found = [t for t in (a, b) if _leading_rows(t) is not None]
    return found[0] if found else None


def _shape_length(shape):
    """The length of a shape vector ``tf.shape(x)`` (x's static rank), or None."""
    n = _strip_identity(shape).node
    if n.op == "Shape":
        return static_rank(n.inputs[0])
    if n.op == "Const":
        return len(list(dtypes.int_values(n.attr["value"].tensor)))
    return None


def _is_scalar_slice(n):
    """True if ``n`` is a StridedSlice taking one entry of a shape vector (``shape[0]``)."""
    return n.op == "StridedSlice" and n.attr["shrink_axis_mask"].i == 1 \
        and (_strip_identity(n.inputs[0]).node.op in ("Shape", "ShapeN") or static_rank(n.inputs[0]) == 1)


def _starts_at_0(strided_slice):
    """True if a StridedSlice's first axis starts at 0 and steps by 1 (``shape[0]``,
    ``shape[:2]``; not ``shape[::-1]``)."""
    strides = strided_slice.inputs[3].node
    if strides.op != "Const" or list(dtypes.int_values(strides.attr["value"].tensor))[:1] != [1]:
        return False
    if strided_slice.attr["begin_mask"].i & 1:
        return True
    begin = strided_slice.inputs[1].node
    return begin.op == "Const" and list(dtypes.int_values(begin.attr["value"].tensor))[:1] == [0]


def _leading_constant(shape):
    """The first entry of a constant shape vector, or None."""
    n = _strip_identity(shape).node
    if n.op != "Const":
        return None
    values = list(dtypes.int_values(n.attr["value"].tensor))
    return values[0] if values else None


def _meets(node, region, limit=64):
    """True if a node of ``region`` reads ``node``'s value within ``limit`` nodes."""
    seen, stack = {node}, [node]
    while stack and len(seen) < limit:
        for c, _ in stack.pop().consumers():
            if c in region:
                return True
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return False


def loop_frames(node):
    """The Enter nodes of the v1 while loops ``node`` runs in, outermost first ([]
    outside loops): each gives a frame's name and parallel_iterations. Walks back along
    first inputs (a node's inputs are all in its frame; a Const in a loop body has a
    control input on the loop's pivot), one level out at an Enter, one in at an Exit."""
    frames, depth, n = [], 0, node
    while n is not None:
        if n.op in ("Enter", "RefEnter"):
            if depth == 0:
                frames.append(n)
            else:
                depth -= 1
        elif n.op in ("Exit", "RefExit"):
            depth += 1
        n = n.inputs[0].node if n.inputs else (n.control_inputs[0] if n.control_inputs else None)
    return frames[::-1]


def _the_sum(node):
    """The Sum ``node`` is, through casts and arithmetic with a constant
    (``tf.maximum(count, 1.0)``, ``count + epsilon``), or None."""
    return sum_and_clamps(node)[0]


def sum_and_clamps(node):
    """(the Sum ``node`` is, [the casts and the arithmetic with a constant between them,
    from ``node`` down]), or (None, [...]) when ``node`` is no such Sum."""
    chain = []
    while True:
        if node.op == "Sum":
            return node, chain
        chain.append(node)
        if node.op in ("Cast", "Identity"):
            node = node.inputs[0].node
            continue
        if node.op in ("Maximum", "Minimum", "Add", "AddV2") and len(node.inputs) == 2:
            consts = [t for t in node.inputs if t.node.op == "Const"]
            if len(consts) == 1:
                node = next(t.node for t in node.inputs if t.node.op != "Const")
                continue
        return None, chain


def _sums_every_axis(total):
    """True if a Sum reduces every axis of its input, as ``tf.reduce_sum(x)`` builds it:
    a Range(0, Rank(x)) of axes, or the constant 0, 1, ..., k-1 where k is the input's
    rank (static_rank), or k >= 2 when the graph does not tell the rank (one axis, [0],
    could be the time axis of a time-major [T, B] tensor, whose sum keeps the batch,
    which must not be averaged across replicas)."""
    axes = total.inputs[1].node
    if axes.op == "Range":
        start = axes.inputs[0].node
        return (start.op == "Const" and dtypes.int_scalar(start.attr["value"].tensor) == 0
                and axes.inputs[1].node.op == "Rank")
    if axes.op == "Const":
        values = dtypes.int_values(axes.attr["value"].tensor)
        if not values or list(values) != list(range(len(values))):
            return False
        rank = static_rank(total.inputs[0])
        return len(values) == rank if rank is not None else len(values) >= 2
    return False


# Ops whose output's rank is the largest of their inputs' (broadcasting), beyond ELEMENTWISE.
_BROADCASTING = ELEMENTWISE | frozenset((
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr",
    "LogicalNot", "Select", "SelectV2", "Relu", "ZerosLike", "OnesLike"))


def static_rank(tensor, depth=0, memo=None):
    """The rank of a tensor, from the graph alone (no shape inference), or None: known
    for placeholders, constants and shapes, carried through element-wise ops,
    Fill(Shape(t)), Reshape by a constant shape or a Pack of scalars, StridedSlice, MatMul, reductions over
    constant axes, one_hot, gathers along axis 0, unsorted segment sums, bincounts and
    the cross-entropy ops. Enough to tell the sum of a [batch] weight vector (axes [0],
    every axis) from the sum over the time axis of a time-major [time, batch] mask (axes
    [0], one of two). ``memo`` keeps the ranks found, by tensor and depth (the graph's
    own, _rank_memo, unless one is given): a chain of element-wise ops reading a value
    twice (a layer norm's) is otherwise walked once per path, exponentially."""
    if depth > 40:
        return None
    if memo is None:
        memo = _rank_memo(tensor.node.graph)
    key = (tensor, depth)
    if key not in memo:
        memo[key] = _static_rank(tensor, depth, memo)
    return memo[key]


def _rank_memo(graph):
    """static_rank's memo for ``graph``: kept while the graph does not change (a rank is
    a fact of the graph), so the hundreds of calls of one analysis walk a deep residual
    stream once, not once each; a function body's graph keeps none."""
    cached = getattr(graph, "cached", None)
    return {} if cached is None else cached("static_rank", lambda g: {})


def _static_rank(tensor, depth, memo):
    """static_rank's cases, for one tensor."""
    n = tensor.node
    if n.op in PLACEHOLDERS:
        shape = _shape_of(n.attr["shape"].shape) if "shape" in n.attr else None
        return None if shape is None else len(shape)
    if n.op == "Const":
        return len(n.attr["value"].tensor.tensor_shape.dim)
    if n.op == "MatMul":
        return 2
    if n.op in ("Shape", "Size", "Rank"):   # (a count divides by tf.shape(q)[1], a scalar)
        return 1 if n.op == "Shape" else 0
    if n.op == "Fill" and n.inputs[0].node.op == "Shape":
        return static_rank(n.inputs[0].node.inputs[0], depth + 1, memo)
    if n.op == "Reshape" and n.inputs[1].node.op == "Const":
        dims = n.inputs[1].node.attr["value"].tensor.tensor_shape.dim
        return dims[0].size if len(dims) == 1 and dims[0].size >= 0 else None
    if n.op == "Reshape" and n.inputs[1].node.op == "Pack":   # (to [tf.shape(labels)[0], 1])
        return len(n.inputs[1].node.inputs)
    if n.op == "StridedSlice" and not n.attr["ellipsis_mask"].i:
        rank = static_rank(n.inputs[0], depth + 1, memo)
        return None if rank is None else (
            rank - bin(n.attr["shrink_axis_mask"].i).count("1") + bin(n.attr["new_axis_mask"].i).count("1"))
    if n.op in ("Sum", "Mean", "Max", "Min", "Prod") and n.inputs[1].node.op == "Const":
        rank = static_rank(n.inputs[0], depth + 1, memo)
        if rank is None or n.attr["keep_dims"].b:
            return rank
        axes = {a % rank for a in dtypes.int_values(n.inputs[1].node.attr["value"].tensor)} if rank else set()
        return rank - len(axes)
    if n.op == "SparseSoftmaxCrossEntropyWithLogits":
        return static_rank(n.inputs[1], depth + 1, memo) if tensor.index == 0 else 2
    if n.op == "SoftmaxCrossEntropyWithLogits":
        return 1 if tensor.index == 0 else 2
    if n.op in _BROADCASTING:
        ranks = [static_rank(t, depth + 1, memo) for t in n.inputs]
        return None if not ranks or None in ranks else max(ranks)
    if n.op == "Transpose":
        return static_rank(n.inputs[0], depth + 1, memo)
    if n.op == "ExpandDims":
        rank = static_rank(n.inputs[0], depth + 1, memo)
        return None if rank is None else rank + 1
    if n.op == "OneHot":
        rank = static_rank(n.inputs[0], depth + 1, memo)
        return None if rank is None else rank + 1
    if n.op == "GatherV2" and not n.attr["batch_dims"].i and _int_const(n.inputs[2]) == [0]:
        # tf.gather(params, indices): indices' axes, then params' after the first
        params, indices = (static_rank(t, depth + 1, memo) for t in n.inputs[:2])
        return None if params is None or indices is None else params - 1 + indices
    if n.op in ("Unique", "UniqueWithCounts", "Bincount"):   # (vectors, whatever their input's rank)
        return 1
    if n.op == "DenseBincount":
        return static_rank(n.inputs[0], depth + 1, memo)
    if n.op == "UnsortedSegmentSum":   # [num_segments] + data's axes after the segment ids'
        data, ids = (static_rank(t, depth + 1, memo) for t in n.inputs[:2])
        return None if data is None or ids is None else data - ids + 1
    return None


# Ops that pass a value on unchanged in kind: what they output is a sum, or a count, if
# their input is one.
_KEEPS_KIND = frozenset(("Cast", "Identity", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot"))
# Ops through which a statistic reaches the loss linearly, given their other operands
# do not depend on the batch's values (_used_non_linearly).
_LINEAR = _KEEPS_KIND | frozenset((
    "Neg", "Transpose", "Add", "AddV2", "Sub", "AddN", "Mul", "RealDiv", "Div", "DivNoNan", "Sum", "Mean",
    "CheckNumerics"))
_SUMS = frozenset(("Sum", "Size", "Shape", "ShapeN"))
# Sums over the rows in other forms: the rows' values summed by their ids, their bins'
# counts, a scatter of them that adds the duplicates (tf.math.confusion_matrix, and so
# tf.compat.v1.metrics.mean_iou's running matrix)
_ROW_TOTALS = frozenset(("UnsortedSegmentSum", "DenseBincount", "Bincount", "ScatterNd"))

# Ops whose output keeps its inputs' rows apart (element i of the output's first axis, or
# of a reshape of it, comes from row i of the inputs that have rows): a sum over every
# axis of their output adds up the rows. Reductions and matrix products are handled apart.
_ROW_LOCAL = ELEMENTWISE | _BROADCASTING | _KEEPS_KIND | frozenset((
    "BiasAdd", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "LeakyRelu", "Softmax", "LogSoftmax",
    "Log1p", "Expm1", "Erf", "Sin", "Cos", "Floor", "Round", "AddN", "SoftmaxCrossEntropyWithLogits",
    "SparseSoftmaxCrossEntropyWithLogits", "Transpose", "ConcatV2", "Pack", "Unpack", "StridedSlice",
    "Slice", "Pad", "PadV2", "Tile", "OneHot", "Conv2D", "Conv1D", "DepthwiseConv2dNative", "MaxPool",
    "AvgPool", "FusedBatchNormV3", "FusedBatchNorm", "BatchMatMulV2", "BatchMatMul", "Switch", "Merge",
    "Enter", "Exit"))


def batch_combine(values, batch_nodes):
    """How the replicas' values of a batch statistic make one device's: "sum" when the
    value is a sum over the rows (``tf.reduce_sum``, and TensorFlow's metrics' running
    totals), a count of them (``tf.size``, ``tf.shape(x)[0]``), or a sum in another form
    (_ROW_TOTALS; a matrix product contracting the rows of two batch tensors, VQ-VAE's
    codebook sums ``z^T one_hot(code)``); None (averaged) for anything else, a mean
    above all (BatchNorm's moments). Walks back through casts, reshapes and transposes,
    and a slice of a shape. ``batch_nodes``: the batch inputs."""
    n = summed_op(values)
    if n.op == "MatMul":
        return "sum" if _contracts_rows(n, batch_nodes) else None
    return "sum" if n.op in _SUMS or n.op in _ROW_TOTALS else None


def _contracts_rows(matmul, batch_nodes):
    """True for ``tf.matmul(a, b, transpose_a=True)`` of two tensors whose first axis
    is the batch's rows: the sum over the rows of their products (not the outer
    product of two means over the rows, ``[1, d]`` each)."""
    return matmul.attr["transpose_a"].b and not matmul.attr["transpose_b"].b and all(
        _reaches_rows(t, batch_nodes, strict=True) for t in matmul.inputs)


def summed_op(values):
    """The op a value passes on unchanged in kind (batch_combine's walk back through
    casts, reshapes, transposes and a slice of a shape)."""
    n = values.node
    while n.op in _KEEPS_KIND or n.op == "Transpose" or (
            n.op == "StridedSlice" and n.inputs[0].node.op in ("Shape", "ShapeN")):
        n = n.inputs[0].node
    return n


def _gathered_variable(indices, prefer=()):
    """The variable whose forward gather (embedding lookup) produced these gradient
    indices: TensorFlow's gather gradient reshapes the lookup's ids, and optimizers and
    gradient aggregation pass them through Unique and ConcatV2. When the same ids gather
    from several variables (nce_loss gathers its weights and its biases by the same
    sampled ids), the one named in ``prefer`` (the variables the gradient updates)."""
    stack, seen, first = [indices], set(), None
    while stack:
        t = stack.pop()
        if t in seen or len(seen) > 64:
            continue
        seen.add(t)
        for c, pos in t.node.consumers(t.index):
            if c.op in ("ResourceGather", "GatherV2", "Gather"):
                names = opdefs.input_arg_names(c)
                if names[pos] == "indices":
                    var = variable_of(c.inputs[0])
                    if var is not None and (var.name in prefer or not prefer):
                        return var
                    if var is not None and first is None:
                        first = var
        n = t.node
        if n.op in ("Identity", "Reshape", "Cast", "Unique", "UniqueV2", "Snapshot"):
            stack.append(n.inputs[0])
        elif n.op == "ConcatV2":
            stack.extend(n.inputs[:-1])
    return first


class _PostProcessingWalk:
    """Walks back from a tensor an update receives through post-processing ops to the
    tensors the backward pass produced (the "stops"), following only inputs that depend
    on the batch. A stop is a key of a cut: (values, None) dense, (values, indices)
    sparse. ``ops`` collects the op types walked through."""

    # Ops through which the average is taken as well before as after: the batch reaches
    # them through one input, and they are affine in it (x*c, x/c, x+c, -x, casts).
    AFFINE = frozenset(("Identity", "Snapshot", "StopGradient", "Cast", "Neg", "Mul", "RealDiv",
                        "Div", "AddV2", "Add", "Sub"))

    def __init__(self, variant, batch):
        self.variant, self.batch = variant, batch
        self.ops = set()
        self.affine = True     # every op walked through is affine in its one live input

    def _live(self, t):
        return t.node in self.variant or t in self.batch

    def _walkable(self, n):
        if n.op not in POST_PROCESSING:
            return False
        if n.op in ("Switch", "RefSwitch"):   # a while loop's, not a cond's
            return n.inputs[1].node.op != "LoopCond"
        return True

    def dense(self, start):
        stops, seen, stack = set(), {start}, [start]
        while stack:
            t = stack.pop()
            n = t.node
            if n.op == "UnsortedSegmentSum" and t.index == 0:
                stops |= self._densified(t)
                continue
            if t in self.batch or not self._walkable(n):
                stops.add((t, None))
                continue
            self.ops.add(n.op)
            live = [u for u in n.inputs if self._live(u)]
            if (n.op not in self.AFFINE or len(live) != 1
                    or (n.op in ("RealDiv", "Div") and live[0] is not n.inputs[0])):
                self.affine = False
            for u in live:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return stops

    def _densified(self, t):
        """The dense tensor of IndexedSlices (tf.convert_to_tensor sums the rows into
        their ids): when its rows were post-processed (clipped), the stop is the rows
        the backward pass produced, with their ids."""
        n = t.node
        values, ids = n.inputs[0], n.inputs[1]
        if not self._live(values):
            return {(t, None)}
        inner = self.dense(values)
        if inner == {(values, None)} or not self._live(ids):
            return {(t, None)}
        if self.affine:
            return {(t, None)}
        self.ops.add("UnsortedSegmentSum")
        return {(v, self._unrouted(ids)) for v, _ in inner}

    def _unrouted(self, ids):
        """The ids from before a routing into a cond branch, as the rows were walked
        back: every stop is paired with them; those that are not the rows (a global norm
        that scaled them) are downstream of other stops and are never averaged. (NVIDIA
        BERT's gradient accumulation assigns IndexedSlices in a cond, densified there:
        the ids of the branch it assigns in and of the one it adds in are one tensor.)"""
        while (ids.node.op in ("Identity", "Snapshot", "Switch", "RefSwitch")
               and self._walkable(ids.node)):
            ids = ids.node.inputs[0]
        return ids

    def sparse(self, values, indices, deduplicated):
        """Stops of a sparse cut: its rows walked back (through the optimizer's
        deduplication, when there is post-processing before it), with their ids."""
        raw = _raw_rows(values, indices) if deduplicated else None
        start_values, start_indices = raw if raw is not None else (values, indices)
        stops = self.dense(start_values)
        if stops == {(start_values, None)}:
            return {(values, indices)}
        # the ids were routed like the rows (into a cond branch): take them from before
        start_indices = self._unrouted(start_indices)
        out = set()
        for v, i in stops:
            out.add((v, i if i is not None else start_indices))
        return out


# Ops the average commutes with whatever their inputs: layout (reshapes, slices,
# concatenations, stacks, transposes) and sums.
# (not _LINEAR, the ops statistics pass linearly: _used_non_linearly)
_JOIN_LINEAR = frozenset(("Identity", "IdentityN", "Snapshot", "StopGradient", "Cast", "Neg", "AddV2", "Add", "Sub",
                          "AddN", "Reshape", "ConcatV2", "Concat", "Pack", "Unpack", "StridedSlice", "Slice", "Split",
                          "SplitV", "Squeeze", "ExpandDims", "Transpose", "Sum", "Mean"))


def _backward_sources(start, variant, batch, in_backward, limit=100000):
    """({the backward pass's tensors ``start`` is computed from}, {op types between}) when
    what computes ``start`` from them, outside the backward pass, is nonlinear in them
    (_split_joins); None when the walk meets the batch's rows, a tensor of no backward
    pass, only linear ops, or one backward tensor only."""
    stops, ops, seen, stack = set(), set(), {start}, [start]
    nonlinear = False
    while stack:
        t = stack.pop()
        n = t.node
        if t in batch:
            return None
        if in_backward(n):
            stops.add(t)
            continue
        if n.op in PASS_THROUGH or n.op in FUNCTION_CALLS or opdefs.op_def(n.op) is None or len(seen) > limit:
            return None    # control flow and calls: left to _hoist's walk
        inputs = [n.inputs[t.index]] if n.op == "IdentityN" else n.inputs   # (output k is input k)
        live = [u for u in inputs if u.node in variant or u in batch]
        if not live or n.op in ("Placeholder", "PlaceholderWithDefault"):
            return None    # variant from something else than the backward pass
        ops.add(n.op)
        if n.op in ("Mul", "RealDiv", "Div"):    # linear by a factor the batch does not decide
            linear = len(live) == 1 and (n.op == "Mul" or live[0] is n.inputs[0])
        else:
            linear = n.op in _JOIN_LINEAR
        nonlinear = nonlinear or not linear
        for u in live:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    if not nonlinear or len(stops) < 2:
        return None
    return stops, ops


def rows_reduced(cut):
    """True if a sparse cut's rows are read, before their duplicates are summed, by an op
    that combines rows (the norm of IndexedSlices in clip_by_global_norm): what runs on
    the rows is then not the same on rows already summed per id."""
    stack, seen = [cut.values], set()
    while stack:
        t = stack.pop()
        for c, pos in t.node.consumers(t.index):
            if c in seen:
                continue
            seen.add(c)
            if c.op in ("UnsortedSegmentSum", "Unique", "UniqueV2") or "Apply" in c.op or "Scatter" in c.op:
                continue
            if c.op not in POST_PROCESSING:
                return True
            stack.extend(c.output(i) for i in range(opdefs.num_outputs(c)))
    return False


def _raw_rows(values, indices):
    """(rows, ids) before an optimizer's deduplication (Unique + UnsortedSegmentSum)."""
    t = _strip_identity(indices)
    if t.node.op not in ("Unique", "UniqueV2") or values.node.op != "UnsortedSegmentSum":
        return None
    return values.node.inputs[0], _strip_identity(t.node.inputs[0])


def _descendants_within(starts, region, position, last):
    """``starts`` and the nodes reached from them through data edges inside ``region``
    (None: anywhere), none past the topological position ``last``."""
    out = {n for n in starts if position.get(n, last + 1) <= last}
    stack = list(out)
    while stack:
        n = stack.pop()
        for c, _ in n.consumers():
            if c not in out and (region is None or c in region) and position.get(c, last + 1) <= last:
                out.add(c)
                stack.append(c)
    return out


def _strip_identity(t):
    while t.node.op in ("Identity", "Snapshot") and t.node.inputs:
        t = t.node.inputs[0]
    return t


def _dedup_pair(indices):
    """If ``indices`` are Unique's unique values and an UnsortedSegmentSum sums values by
    Unique's positions (how optimizers deduplicate IndexedSlices), (sum, indices)."""
    t = _strip_identity(indices)
    if t.node.op not in ("Unique", "UniqueV2") or t.index != 0:
        return None
    sums = [c for c, pos in t.node.consumers(1)
            if c.op == "UnsortedSegmentSum" and opdefs.input_arg_names(c)[pos] == "segment_ids"]
    if len(sums) != 1:
        return None
    return Tensor(sums[0], 0), indices


def _walk_to_gradient(value, variant, batch):
    """From an assigned value back through element-wise ops with one batch-dependent
    input, to the tensor that carries the batch into the update (see module doc)."""
    t = value
    for _ in range(10000):
        n = t.node
        if n.op not in ELEMENTWISE:
            return t
        live = [u for u in n.inputs if u.node in variant or u in batch]
        if len(live) != 1:
            return t
        t = live[0]
    return t


def _read_by_variant(var_node, variant):
    """True if a read of the variable feeds a batch-dependent node (the forward pass)."""
    stack = [var_node]
    seen = set()
    while stack:
        n = stack.pop()
        for c, _ in n.consumers():
            if c in seen:
                continue
            seen.add(c)
            if c.op in PASS_THROUGH and c not in variant:
                stack.append(c)
                continue
            if c.op in READERS or c.op in PASS_THROUGH or c.op == "GatherV2" or c.op == "Gather":
                for cc, _ in c.consumers():
                    if cc in variant:
                        return True
            if c in variant and c.op not in DENSE_ASSIGNS:
                return True
    return False


def _rank(t):
    """Static rank of a placeholder or iterator output, or None if unknown."""
    n = t.node
    if "shape" in n.attr:
        shape = _shape_of(n.attr["shape"].shape)
    elif "output_shapes" in n.attr and t.index < len(n.attr["output_shapes"].list.shape):
        shape = _shape_of(n.attr["output_shapes"].list.shape[t.index])
    else:
        return None
    return None if shape is None else len(shape)


def _is_step_counter(var):
    if var.dtype not in (types_pb2.DT_INT32, types_pb2.DT_INT64) or var.shape not in ([], None):
        return False
    return any(w.op in INCREMENTS for w in var.writers)


def written_variables(node, library):
    """[(variable node, input position)] that ``node`` writes: every op taking a
    variable's handle or a ref argument writes it, except readers and pass-throughs; a
    function call writes the handles its body writes."""
    if node.op in READERS or node.op in PASS_THROUGH or node.op in VARIABLE_OPS or not node.inputs:
        return []
    dts = opdefs.input_dtypes(node)
    refs = opdefs.input_is_ref(node)
    is_call = node.op in FUNCTION_CALLS or (library is not None and opdefs.op_def(node.op) is None)
    written_args = _function_written_args(node, library) if is_call else None
    out = []
    for pos, t in enumerate(node.inputs):
        if pos >= len(dts):
            break
        if dts[pos] != opdefs.DT_RESOURCE and not (pos < len(refs) and refs[pos]):
            continue
        var_node = variable_of(t)
        if var_node is None or (written_args is not None and pos not in written_args):
            continue
        out.append((var_node, pos))
    return out


def _function_written_args(node, library):
    """Input positions of a function-call node whose resource the called body writes."""
    if library is None:
        return set()
    fn_names = []
    for key in ("body", "cond", "then_branch", "else_branch", "f"):
        if key in node.attr and node.attr[key].HasField("func"):
            fn_names.append(node.attr[key].func.name)
    if "branches" in node.attr:
        fn_names += [f.name for f in node.attr["branches"].list.func]
    if not fn_names:
        fn_names = [node.op]
    offset = 1 if node.op in _CONDS else 0
    written = set()
    index, memo = _library_index(node, library)
    for name in fn_names:
        args = memo.get(name)
        if args is None:
            args = memo[name] = _body_written_args(name, index, set())
        for i in args:
            written.add(i + offset)
    return written


def _call_inputs_feeding(node, library, resource_pos):
    """Input positions of a function call (a v2 cond) whose values reach, in any called
    body, an op that writes the resource passed at ``resource_pos``; None if a body
    is not in the library."""
    if library is None:
        return None
    fn_names = [node.attr[k].func.name for k in ("then_branch", "else_branch", "f")
                if k in node.attr and node.attr[k].HasField("func")]
    if "branches" in node.attr:
        fn_names += [f.name for f in node.attr["branches"].list.func]
    offset = 1 if node.op in _CONDS else 0
    index, _ = _library_index(node, library)
    out = set()
    for name in fn_names:
        fn = index.get(name)
        if fn is None:
            return None
        args = {a.name: i for i, a in enumerate(fn.signature.input_arg)}
        if not 0 <= resource_pos - offset < len(fn.signature.input_arg):
            return None
        var_arg = fn.signature.input_arg[resource_pos - offset].name
        by_name = {nd.name: nd for nd in fn.node_def}
        stack = [nd for nd in fn.node_def if nd.op not in READERS and nd.op not in PASS_THROUGH
                 and any(i.split(":")[0] == var_arg for i in nd.input)]
        seen = {nd.name for nd in stack}
        while stack:
            nd = stack.pop()
            for inp in nd.input:
                base = inp.lstrip("^").split(":")[0]
                if base in args:
                    out.add(args[base] + offset)
                elif base in by_name and base not in seen:
                    seen.add(base)
                    stack.append(by_name[base])
    return out


def _library_index(node, library):
    """({name: FunctionDef}, memo of each body's written arguments) for ``library``,
    cached on the node's graph until it changes: a linear search of the library per
    call node was quadratic in large Keras graphs."""
    def build(_):
        return {f.signature.name: f for f in library.function}, {}
    if library is node.graph.library:
        return node.graph.cached("function_index", build)
    return build(None)


def _body_written_args(fn_name, index, visiting):
    fn = index.get(fn_name)
    if fn is None or fn_name in visiting:
        return set()
    visiting.add(fn_name)
    args = {a.name: i for i, a in enumerate(fn.signature.input_arg)}
    written = set()
    for nd in fn.node_def:
        if nd.op in READERS or nd.op in PASS_THROUGH:
            continue
        for inp in nd.input:
            base = inp.split(":")[0]
            if base in args and fn.signature.input_arg[args[base]].type == opdefs.DT_RESOURCE:
                if nd.op in FUNCTION_CALLS or opdefs.op_def(nd.op) is None:
                    continue  # nested calls: conservatively treated as readers here
                written.add(args[base])
    return written
