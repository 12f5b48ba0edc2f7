"""Tests of the place pass alone (after plan, replicate and, for parameter servers,
accumulate): every node without a device gets the device it runs on.

    replica i's ops      --> replica i's device (GPU:k of its worker, or CPU:k)
    ops with no kernel on that device type (summaries) --> replica i's host CPU
    global ops (placeholders) --> this graph's host CPU
    a ps variable and every op using its handle --> its ps task
    nodes a pass already placed (accumulators) --> unchanged
"""

from graph_rewriter import passes
from graph_rewriter.pass_manager import run_passes
from pass_graphs import PS2_WORKERS2, WORKERS2, context, dense, ops, reads, replica_of


def place(graph, ctx, *before):
    return run_passes(graph, ctx, passes.PlanPass(), passes.ReplicatePass(), *before, passes.PlacePass())


def forward_matmuls(graph):
    """Each replica's x @ w (not the gradient's MatMuls): reads x and a read of w."""
    return [n for n in ops(graph, "MatMul")
            if graph.node("x") in reads(n) and any(m.op == "ReadVariableOp" for m in reads(n))]


def placed_ps():
    g = dense()
    ctx = context(PS2_WORKERS2, strategy="ps")
    place(g, ctx, passes.AccumulatePass())
    return g, ctx


def test_every_node_gets_a_device_of_the_cluster():
    """ps strategy, 2 workers, 2 ps: no node is left without a device, and every device is a
    replica's, a host's or a ps task's"""
    g, ctx = placed_ps()
    rm, cluster = ctx.replicas, ctx.cluster
    allowed = set(rm.devices) | set(rm.hosts) | {rm.global_device} | {cluster.ps_device(k) for k in (0, 1)}
    assert {n.device for n in g} <= allowed
    assert not [n.name for n in g if not n.device]


def test_gpu_ops_go_to_their_replicas_gpu_and_cpu_only_ops_to_its_host():
    """
        replica i:  x --> MatMul (GPU:k of replica i's worker) --> loss --> ScalarSummary (its host CPU)
        global:     x, y (Placeholder) --> worker 0's host CPU
    """
    g = dense(summary=True)
    ctx = context(WORKERS2, device_type="GPU", devices_per_worker=2, materialize_replicas=True)
    place(g, ctx)
    rm = ctx.replicas
    assert len(set(rm.devices)) == 4 and all("GPU" in d for d in rm.devices)
    forward = forward_matmuls(g)
    assert sorted(replica_of(ctx, g, n) for n in forward) == [0, 1, 2, 3]
    for n in ops(g, "MatMul"):
        assert n.device == rm.devices[replica_of(ctx, g, n)], n.name
    summaries = ops(g, "ScalarSummary")
    assert len(summaries) == 4
    for n in summaries:
        assert n.device == rm.hosts[replica_of(ctx, g, n)] and "CPU" in n.device
    for name in ("x", "y"):
        assert g.node(name).device == rm.global_device and "CPU" in rm.global_device


def test_a_ps_variable_and_every_op_using_it_go_to_its_ps_task():
    """
        w (ps task of w) --> ReadVariableOp (each replica), ResourceApplyGradientDescent: all on w's ps
        replica i's MatMul reads the value --> replica i's worker
    """
    g, ctx = placed_ps()
    rm = ctx.replicas
    for variable in ("w", "b"):
        var = g.node(variable)
        device = ctx.cluster.ps_device(ctx.plan.variable(variable).ps_task)
        assert var.device == device
        users = [c for c, _ in var.consumers()]
        assert {c.op for c in users} >= {"ReadVariableOp", "ResourceApplyGradientDescent"}
        assert {replica_of(ctx, g, c) for c in users if c.op == "ReadVariableOp"} >= {0, 1}
        assert {c.device for c in users} == {device}
    for n in ops(g, "MatMul"):
        assert n.device == rm.devices[replica_of(ctx, g, n)] and n.device.startswith("/job:worker/")


def test_devices_an_earlier_pass_chose_are_kept():
    """
        replica 1's AccumulatorApplyGradient belongs to replica 1 but stays on the variable's ps
    """
    g, ctx = placed_ps()
    applies = ops(g, "AccumulatorApplyGradient")
    assert sorted(replica_of(ctx, g, n) for n in applies) == [0, 0, 1, 1]
    for n in applies:
        (acc,) = [m for m in reads(n) if m.op == "ConditionalAccumulator"]
        assert n.device == acc.device and n.device.startswith("/job:ps/")


def test_an_original_cpu_pin_becomes_the_replicas_host():
    """
        MatMul pinned to /device:CPU:0 in the single-device graph, GPU replicas:
        replica i's MatMul --> replica i's host CPU (not the GPU, not worker 0's CPU)
    """
    g = dense()
    g.node("MatMul").device = "/device:CPU:0"
    ctx = context(WORKERS2, device_type="GPU")
    place(g, ctx)
    rm = ctx.replicas
    forward = forward_matmuls(g)
    assert len(forward) == 2
    for n in forward:
        assert n.device == rm.hosts[replica_of(ctx, g, n)]
    assert len({n.device for n in forward}) == 2


def test_place_applies_to_every_rewrite_even_one_device():
    """one device, no cluster: everything goes to the local CPU"""
    g = dense()
    ctx = context()
    place(g, ctx)
    assert passes.PlacePass().applies(ctx)
    assert ctx.passes_run[-1] == "place"
    assert {n.device for n in g} == {"/device:CPU:0"}
