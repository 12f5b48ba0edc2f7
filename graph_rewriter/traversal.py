"""Graph walks over a GraphItem: topological order, ancestors, descendants, cycles, and
growing a region by the ancestors only it reads.

v1 while loops are cycles by construction: NextIteration feeds Merge. Those back-edges
(an input of a Merge whose producer is a NextIteration) are the only cycles TensorFlow
allows; every walk here ignores them, and ``find_cycle`` reports any other.
"""

import heapq

from graph_rewriter.errors import GraphRewriteError

_BACK_EDGE_SOURCES = frozenset(("NextIteration", "RefNextIteration"))
_MERGES = frozenset(("Merge", "RefMerge"))


def is_back_edge(producer, consumer):
    return consumer.op in _MERGES and producer.op in _BACK_EDGE_SOURCES


def _forward_inputs(node):
    """Producers of ``node`` (data then control) except loop back-edges."""
    prods = [t.node for t in node.inputs] + list(node.control_inputs)
    if node.op in _MERGES:
        prods = [p for p in prods if p.op not in _BACK_EDGE_SOURCES]
    return prods


def topological_order(graph):
    """Nodes so that producers come before consumers (loop back-edges ignored); among
    the nodes ready at any moment, the one first in the graph's own order goes first.
    Raises GraphRewriteError on a cycle that is not a loop."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    indeg = [0] * len(nodes)
    successors = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        preds = {t.node for t in n.inputs}
        if n.control_inputs:
            preds.update(n.control_inputs)
        if n.op in _MERGES:
            preds = {p for p in preds if p.op not in _BACK_EDGE_SOURCES}
        indeg[i] = len(preds)
        for p in preds:
            successors[index[p]].append(i)
    ready = [i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    order = []
    push, pop = heapq.heappush, heapq.heappop
    while ready:
        i = pop(ready)
        order.append(nodes[i])
        for j in successors[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                push(ready, j)
    if len(order) != len(nodes):
        cycle = find_cycle(graph)
        names = " -> ".join(n.name for n in cycle[:8]) if cycle else "unknown"
        raise GraphRewriteError(
            f"{graph.source}: the graph has a cycle that is not a while loop: {names}",
            hint="only v1 loops (NextIteration -> Merge) may form cycles; check the graph's edges")
    return order


def any_topological_order(graph):
    """Some topological order (loop back-edges ignored), cheaper than
    topological_order's (no priority among ready nodes): what renumbering the IR's
    maintained order needs. On a cycle, topological_order raises naming it."""
    nodes = graph.nodes
    indeg = {}
    ready = []
    for n in nodes:
        d = len(n.inputs) + len(n.control_inputs)
        if n.op in _MERGES:
            d -= sum(1 for t in n.inputs if t.node.op in _BACK_EDGE_SOURCES)
            d -= sum(1 for p in n.control_inputs if p.op in _BACK_EDGE_SOURCES)
        indeg[n] = d
        if d == 0:
            ready.append(n)
    order = []
    push, pop = ready.append, ready.pop
    while ready:
        n = pop()
        order.append(n)
        back = n.op in _BACK_EDGE_SOURCES
        for c in n.readers():
            if back and c.op in _MERGES:
                continue
            d = indeg[c] - 1
            indeg[c] = d
            if d == 0:
                push(c)
    if len(order) != len(indeg):
        return topological_order(graph)   # raises, naming the cycle
    return order


def find_cycle(graph):
    """A list of nodes forming a cycle that is not a loop back-edge, or [] if none."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph.nodes}
    for root in graph.nodes:
        if color[root] != WHITE:
            continue
        stack = [(root, iter(_forward_inputs(root)))]
        path = [root]
        color[root] = GREY
        while stack:
            node, it = stack[-1]
            advanced = False
            for p in it:
                if color[p] == GREY:
                    return path[path.index(p):] + [p]
                if color[p] == WHITE:
                    color[p] = GREY
                    stack.append((p, iter(_forward_inputs(p))))
                    path.append(p)
                    advanced = True
                    break
            if not advanced:
                color[node] = BLACK
                stack.pop()
                path.pop()
    return []


def ancestors(nodes, data_only=False, stop=None):
    """Every node some of ``nodes`` depends on (excluding themselves unless reached),
    following data (and control unless data_only) edges backwards; ``stop(node)`` True
    keeps the walk from going past a node (the node itself is still included)."""
    seen = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        prods = [t.node for t in n.inputs] if data_only else [t.node for t in n.inputs] + list(n.control_inputs)
        for p in prods:
            if p not in seen:
                seen.add(p)
                if stop is None or not stop(p):
                    stack.append(p)
    return seen


def readers_of_indices(indices, values):
    """The readers of a sparse gradient's ``indices`` (Tensor) that use the gradient rather
    than help compute its ``values`` (Tensor): an optimizer's deduplication reads
    Shape(unique indices) for its segment count, and must keep the local indices when a
    pass hands the other readers new ones."""
    return [(c, pos) for c, pos in indices.node.consumers(indices.index) if not reaches(c, values.node)]


def reaches(start, target, limit=32):
    """True if ``target`` depends on ``start`` through at most ``limit`` data edges."""
    frontier, seen = [start], {start}
    for _ in range(limit):
        nxt = []
        for n in frontier:
            if n is target:
                return True
            for c, _ in n.consumers():
                if c not in seen:
                    seen.add(c)
                    nxt.append(c)
        frontier = nxt
        if not frontier:
            return False
    return False


def gradient_readers(values, indices):
    """The readers of a gradient cut (values, and indices when sparse) that consume it,
    leaving out those that help compute the values themselves: an optimizer's
    deduplication reads Shape(unique ids) for its segment count."""
    out = list(values.node.consumers(values.index))
    if indices is not None:
        out += readers_of_indices(indices, values)
    return out


def descendants(nodes, data_only=False):
    """Every node that depends on some of ``nodes`` through data (and control) edges."""
    seen = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        for c in ([c for c, _ in n.consumers()] if data_only else n.readers()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def absorb_exclusive_ancestors(region, keep_out):
    """Grows ``region`` by every ancestor all of whose readers are already in it."""
    region = set(region)
    changed = True
    frontier = list(region)
    while changed:
        changed = False
        candidates = []
        for n in frontier:
            candidates += [t.node for t in n.inputs] + list(n.control_inputs)
        frontier = []
        for p in dict.fromkeys(candidates):
            if p in region or keep_out(p):
                continue
            readers = p.readers()
            if readers and all(r in region for r in readers):
                region.add(p)
                frontier.append(p)
                changed = True
    return region


def unread_ancestors(starts, gone, removable):
    """The ``removable`` nodes among ``starts`` and their ancestors that nobody but nodes
    ``gone`` (or found here) reads, by data or control edge, walking up from ``starts``:
    what dead-code elimination may remove once ``gone`` is removed."""
    gone, found, stack = set(gone), [], list(starts)
    while stack:
        n = stack.pop()
        if (n in gone or not removable(n) or n.control_consumers
                or any(c not in gone for c, _ in n.consumers())):
            continue
        gone.add(n)
        found.append(n)
        stack.extend(t.node for t in n.inputs)
    return found
