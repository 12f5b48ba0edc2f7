"""Tests of the verifier: a valid graph passes, and each invariant broken by a minimal
hand-built graph (sketched above each case) raises a GraphRewriteError naming the node."""

import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, types_pb2

import graph_rewriter as gr
from graph_rewriter import collectives, graph_io
from graph_rewriter.cluster import parse_cluster
from graph_rewriter.context import RewriteContext
from graph_rewriter.options import Options
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.ir import GraphItem, Tensor
from graph_rewriter.op_builder import const, make_op
from graph_rewriter.replicas import ReplicaMap
from graph_rewriter.verifier import verify

tf1 = tf.compat.v1


def small_training_graph():
    """x[None,4] @ w[4,1] - y -> square -> mean = loss; GradientDescent "train_op"; "init"."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        w = tf1.get_variable("w", [4, 1], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y), name="loss")
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op")
        assert tf1.global_variables_initializer().name == "init"
    return g.as_graph_def()


def cpu_ctx(devices=2, cluster=None):
    return RewriteContext(options=Options(devices_per_worker=devices, device_type="CPU"),
                          cluster=parse_cluster(cluster))


def gpu_ctx(devices=2, cluster=None):
    return RewriteContext(options=Options(devices_per_worker=devices, device_type="GPU"),
                          cluster=parse_cluster(cluster))


def rejects(graph, node, ctx=None, match=None):
    """Asserts verify() fails with a message naming ``node`` (and matching ``match``)."""
    with pytest.raises(GraphRewriteError) as err:
        verify(graph, ctx)
    message = str(err.value)
    assert f"'{node}'" in message, message
    if match:
        assert match in message, message
    return message


def chain(device=""):
    """a (Const) --> b (Identity) --> c (Identity), all on ``device``."""
    g = GraphItem()
    a = const(g, "a", 1.0, "float32", device).node
    b = make_op(g, "Identity", "b", [a.output()], device=device)
    make_op(g, "Identity", "c", [b.output()], device=device)
    return g


# ----- valid graphs ---------------------------------------------------------------------

def test_a_valid_graph_passes_and_returns_a_topological_order():
    g = chain("/device:CPU:0")
    order = verify(g, cpu_ctx())
    assert [n.name for n in order] == ["a", "b", "c"]
    g = graph_io.load_graph(small_training_graph())
    assert len(verify(g, gpu_ctx())) == len(g)
    assert len(verify(g)) == len(g)


@pytest.mark.parametrize("device", ["", "/cpu:0", "/device:CPU:1", "/device:CPU:*",
                                    "/job:localhost/replica:0/task:0/device:CPU:0"])
def test_valid_device_strings_pass_for_cpu_replicas(device):
    verify(chain(device), cpu_ctx())


def test_gpu_replicas_may_use_their_host_cpu():
    g = chain("/device:GPU:1")
    g.node("a").device = "/device:CPU:0"
    verify(g, gpu_ctx())


def test_cluster_devices_pass():
    g = chain("/job:worker/replica:0/task:1/device:CPU:0")
    verify(g, cpu_ctx(cluster={"worker": ["localhost:1111", "localhost:1112"]}))


def test_a_library_function_is_a_known_op():
    """
        a (Const) --> f (MyFunction, defined by the graph's library)
    """
    g = GraphItem()
    a = const(g, "a", 1.0, "float32").node
    g.library = function_pb2.FunctionDefLibrary()
    fn = g.library.function.add()
    fn.signature.name = "MyFunction"
    fn.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
    fn.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
    g.add_node("f", "MyFunction", [a.output()])
    verify(g)
    g.add_node("g", "Identity", [Tensor(g.node("f"), 1)])
    rejects(g, "g", match="'f:1'")


def test_the_output_of_rewrite_passes_verify():
    result = gr.rewrite(small_training_graph(), devices_per_worker=2, device_type="CPU")
    g = graph_io.load_graph(result.graph_def)
    md = result.metadata
    ctx = cpu_ctx()
    ctx.replicas = ReplicaMap(prefixes=md["replica_prefixes"], devices=md["replica_devices"],
                              hosts=md["host_devices"], global_device=md["host_devices"][0])
    order = verify(g, ctx)
    assert len(order) == len(g)
    ops = {n.op for n in g}
    assert "CollectiveReduceV2" in ops  # the collective checks had something to check
    assert "replica_1/loss" in g and g.node("replica_1/loss").device == "/device:CPU:1"


# ----- edges and ops --------------------------------------------------------------------

def test_input_index_beyond_the_producers_outputs():
    """
        a (Const, 1 output) --a:1--> b (Identity)
    """
    g = GraphItem()
    a = const(g, "a", 1.0, "float32").node
    g.add_node("b", "Identity", [Tensor(a, 1)])
    rejects(g, "b", match="'a:1'")


def test_input_from_a_node_of_another_graph():
    """
        other graph: x (Const)
        this graph:  a (Const) --> b (Identity), then b is rewired to read x
    """
    other = GraphItem()
    x = const(other, "x", 1.0, "float32").node
    g = chain()
    g.node("b").set_input(0, x.output())
    rejects(g, "b", match="not in the graph")


def test_unknown_op_type():
    """
        a (Const) --> z (NoSuchOpAnywhere)
    """
    g = GraphItem()
    a = const(g, "a", 1.0, "float32").node
    g.add_node("z", "NoSuchOpAnywhere", [a.output()])
    rejects(g, "z", match="NoSuchOpAnywhere")


def test_unknown_op_without_inputs():
    """
        z (NoSuchOpAnywhere)     (read by nothing, reads nothing)
    """
    g = GraphItem()
    g.add_node("z", "NoSuchOpAnywhere")
    rejects(g, "z", match="NoSuchOpAnywhere")


def test_cycle_not_through_a_loop():
    """
        a (Const) --> b (AddN) --> c (Identity)
                      ^               |
                      `---------------'        (c feeds b: a cycle with no NextIteration)
    """
    g = GraphItem()
    a = const(g, "a", 1.0, "float32").node
    b = make_op(g, "AddN", "b", [[a.output()]])
    c = make_op(g, "Identity", "c", [b.output()])
    b.add_input(c.output())
    with pytest.raises(GraphRewriteError, match="cycle") as err:
        verify(g)
    # The cycle is printed as "b -> c -> b" (or from c): both nodes are named.
    assert {"b", "c"} <= set(err.value.message.rsplit(": ", 1)[1].split(" -> ")), err.value.message


# ----- devices --------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["CPU0", "/job:worker/task:x/device:CPU:0",
                                    "/device:CPU:0/extra", "/device:CPU:one"])
def test_malformed_device_string(device):
    """
        a --> b [device = <malformed>] --> c
    """
    g = chain()
    g.node("b").device = device
    rejects(g, "b", cpu_ctx(), match="not a TensorFlow device name")
    rejects(g, "b")  # malformed even without a cluster to check against


def test_device_index_beyond_devices_per_worker():
    """
        a [CPU:0] --> b [CPU:2] --> c [CPU:0]      with devices_per_worker=2 (CPU:0, CPU:1)
    """
    g = chain("/device:CPU:0")
    g.node("b").device = "/device:CPU:2"
    rejects(g, "b", cpu_ctx(devices=2), match="devices_per_worker=2")
    verify(g, cpu_ctx(devices=3))


def test_gpu_device_when_replicas_are_cpus():
    """
        a [CPU:0] --> b [GPU:0] --> c [CPU:0]      with device_type=CPU
    """
    g = chain("/device:CPU:0")
    g.node("b").device = "/device:GPU:0"
    rejects(g, "b", cpu_ctx(), match="GPU")
    verify(g, gpu_ctx())


def test_job_not_in_the_cluster():
    """
        a [worker:0] --> b [/job:ps/task:0] --> c [worker:0]   cluster: worker only
    """
    g = chain("/job:worker/replica:0/task:0/device:CPU:0")
    g.node("b").device = "/job:ps/replica:0/task:0/device:CPU:0"
    ctx = cpu_ctx(cluster={"worker": ["localhost:1111"]})
    rejects(g, "b", ctx, match="'ps'")


def test_task_not_in_the_cluster():
    """
        a [worker:0] --> b [worker:1] --> c [worker:0]   cluster: one worker
    """
    g = chain("/job:worker/replica:0/task:0/device:CPU:0")
    g.node("b").device = "/job:worker/replica:0/task:1/device:CPU:0"
    rejects(g, "b", cpu_ctx(cluster={"worker": ["localhost:1111"]}), match="task 1")


def test_a_job_on_a_local_rewrite():
    """
        a --> b [/job:worker/task:0] --> c      no cluster: this machine only
    """
    g = chain()
    g.node("b").device = "/job:worker/replica:0/task:0/device:CPU:0"
    rejects(g, "b", cpu_ctx(), match="job")


# ----- colocation -----------------------------------------------------------------------

def test_colocation_with_a_missing_node():
    """
        a --> b --> c       c: _class = ["loc:@ghost"], and no node 'ghost'
    """
    g = chain()
    g.node("c").set_colocation(["ghost"])
    rejects(g, "c", match="'ghost'")


def test_colocation_with_a_node_no_longer_in_the_graph():
    """
        a --> b --> c       c colocated with d, then d is removed from the graph
    """
    g = chain()
    d = g.add_node("d", "NoOp")
    g.node("c").set_colocation([d])
    verify(g)
    del g._nodes["d"]  # a removal that forgot the colocation (see test_ir)
    rejects(g, "c", match="'d'")


def test_colocation_loaded_from_a_graph_def():
    """
        a (NoOp) with _class = ["loc:@missing"], as read from a file
    """
    gd = text_format.Parse(
        'node { name: "a" op: "NoOp" attr { key: "_class" value { list { s: "loc:@missing" } } } }',
        graph_pb2.GraphDef())
    rejects(graph_io.load_graph(gd), "a", match="'missing'")


# ----- collectives ----------------------------------------------------------------------

def _reduce(g, scope, device, size, group, instance, v1=False):
    """x_scope (Const) --> scope/all_reduce (CollectiveReduce[V2]) on ``device``."""
    x = const(g, f"x_{scope}", [1.0, 2.0], "float32", device)
    if v1:
        return make_op(g, "CollectiveReduce", f"{scope}/all_reduce", [x], device=device,
                       attrs={"group_size": size, "group_key": group, "instance_key": instance,
                              "merge_op": "Add", "final_op": "Id", "subdiv_offsets": [0]}).name
    return collectives.all_reduce_mean(g, scope, x, size, group, instance, device).name


@pytest.mark.parametrize("v1", [False, True], ids=["V2", "V1"])
def test_collective_group_with_two_sizes(v1):
    """
        x_r0 [CPU:0] --> r0/all_reduce (group 7, size 2, instance 1)
        x_r1 [CPU:1] --> r1/all_reduce (group 7, size 3, instance 1)
    """
    g = GraphItem()
    _reduce(g, "r0", "/device:CPU:0", 2, 7, 1, v1)
    second = _reduce(g, "r1", "/device:CPU:1", 3, 7, 1, v1)
    rejects(g, second, match="size 3")


def test_two_collectives_with_one_key_on_one_device():
    """
        x_r0 [CPU:0] --> r0/all_reduce (group 7, size 2, instance 1)
        x_r1 [CPU:0] --> r1/all_reduce (group 7, size 2, instance 1)    same device
    """
    g = GraphItem()
    first = _reduce(g, "r0", "/device:CPU:0", 2, 7, 1)
    second = _reduce(g, "r1", "/device:CPU:0", 2, 7, 1)
    message = rejects(g, second)
    assert f"'{first}'" in message


def test_more_members_than_the_group_size():
    """
        x_r0 [CPU:0] --> r0/all_reduce (group 7, size 2, instance 1)
        x_r1 [CPU:1] --> r1/all_reduce (group 7, size 2, instance 1)
        x_r2 [CPU:2] --> r2/all_reduce (group 7, size 2, instance 1)   a third member
    """
    g = GraphItem()
    _reduce(g, "r0", "/device:CPU:0", 2, 7, 1)
    _reduce(g, "r1", "/device:CPU:1", 2, 7, 1)
    verify(g, cpu_ctx(devices=3))
    third = _reduce(g, "r2", "/device:CPU:2", 2, 7, 1)
    rejects(g, third, cpu_ctx(devices=3), match="2 members")


def test_a_group_spanning_more_devices_than_its_size():
    """
        x_r0 [CPU:0] --> r0/all_reduce (group 7, size 2, instance 1)
        x_r1 [CPU:1] --> r1/all_reduce (group 7, size 2, instance 1)
        x_r2 [CPU:2] --> r2/all_reduce (group 7, size 2, instance 2)   a third device
    """
    g = GraphItem()
    _reduce(g, "r0", "/device:CPU:0", 2, 7, 1)
    _reduce(g, "r1", "/device:CPU:1", 2, 7, 1)
    third = _reduce(g, "r2", "/device:CPU:2", 2, 7, 2)
    with pytest.raises(GraphRewriteError, match="group 7") as err:
        verify(g)
    assert any(f"'{name}'" in str(err.value) for name in ("r0/all_reduce", "r1/all_reduce", third)), \
        f"the message names no node of the group: {err.value}"


def test_separate_groups_and_instances_pass():
    """
        r0, r1: group 7 size 2 instance 1 on CPU:0, CPU:1
        s0, s1: group 7 size 2 instance 2 on CPU:0, CPU:1
        t0:     group 9 size 1 instance 1 on CPU:0
    """
    g = GraphItem()
    for scope, device, instance in (("r0", 0, 1), ("r1", 1, 1), ("s0", 0, 2), ("s1", 1, 2)):
        _reduce(g, scope, f"/device:CPU:{device}", 2, 7, instance)
    _reduce(g, "t0", "/device:CPU:0", 1, 9, 1)
    verify(g, cpu_ctx())


# ----- replica isolation ------------------------------------------------------------------

def _replicated_ctx():
    """A context whose ReplicaMap says nodes under replica_1/ are replica 1's."""
    ctx = cpu_ctx()
    ctx.replicas = ReplicaMap(prefixes=["", "replica_1/"],
                              devices=["/device:CPU:0", "/device:CPU:1"],
                              hosts=["/device:CPU:0", "/device:CPU:0"],
                              global_device="/device:CPU:0")
    return ctx


def _loop_entry(g, prefix, frame, device):
    c = const(g, f"{prefix}c", 0.0, "float32", device).node
    return g.add_node(f"{prefix}while/Enter", "Enter", [c.output()], device=device,
                      attrs={"frame_name": frame, "T": _type_attr(tf.float32)})


def _type_attr(dtype):
    return attr_value_pb2.AttrValue(type=dtype.as_datatype_enum)


def test_loop_frame_shared_between_replicas():
    """
        replica 0:  c           --> while/Enter           (frame "while")
        replica 1:  replica_1/c --> replica_1/while/Enter (frame "while")   the same frame
    """
    g = GraphItem()
    _loop_entry(g, "", "while", "/device:CPU:0")
    _loop_entry(g, "replica_1/", "while", "/device:CPU:1")
    ctx = _replicated_ctx()
    message = rejects(g, "replica_1/while/Enter", ctx, match="'while'")
    assert "'while/Enter'" in message


def test_loop_frames_unique_per_replica_pass():
    """
        replica 0:  c           --> while/Enter           (frame "while")
        replica 1:  replica_1/c --> replica_1/while/Enter (frame "replica_1/while")
    """
    g = GraphItem()
    _loop_entry(g, "", "while", "/device:CPU:0")
    _loop_entry(g, "replica_1/", "replica_1/while", "/device:CPU:1")
    ctx = _replicated_ctx()
    verify(g, ctx)
    ctx.replicas = None
    g.node("replica_1/while/Enter").set_attr("frame_name", "while")
    verify(g, ctx)  # not replicated: the verifier cannot tell replicas apart


def _var(g, name, shared_name, device, container=""):
    attrs = {"dtype": _type_attr(tf.float32), "shared_name": shared_name}
    if container:
        attrs["container"] = container
    node = g.add_node(name, "VarHandleOp", attrs=attrs, device=device)
    node.set_attr("shape", _shape_attr())
    return node


def _shape_attr():
    a = attr_value_pb2.AttrValue()
    a.shape.dim.add(size=2)
    return a


def test_shared_name_shared_between_replicas_on_one_device():
    """
        v           [CPU:0] (VarHandleOp, shared_name "v")    replica 0
        replica_1/v [CPU:0] (VarHandleOp, shared_name "v")    replica 1: aliases v
    """
    g = GraphItem()
    _var(g, "v", "v", "/device:CPU:0")
    _var(g, "replica_1/v", "v", "/device:CPU:0")
    ctx = _replicated_ctx()
    message = rejects(g, "replica_1/v", ctx, match="shared_name")
    assert "'v'" in message


@pytest.mark.parametrize("second", [("v", "/device:CPU:1", ""), ("replica_1/v", "/device:CPU:0", ""),
                                    ("v", "/device:CPU:0", "other_container")],
                         ids=["other device", "other name", "other container"])
def test_shared_names_that_do_not_alias_pass(second):
    """
        v           [CPU:0] (shared_name "v")
        replica_1/v [device] (shared_name, container as given)   no aliasing
    """
    shared_name, device, container = second
    g = GraphItem()
    _var(g, "v", "v", "/device:CPU:0")
    _var(g, "replica_1/v", shared_name, device, container)
    ctx = _replicated_ctx()
    verify(g, ctx)
