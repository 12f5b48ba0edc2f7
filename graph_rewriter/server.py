"""start_server: a TensorFlow server configured for what ``rewrite`` emits.

What the configuration holds, and what TensorFlow's MultiWorkerMirroredStrategy sets
that it leaves out on purpose, is in docs/deployment.md ("Server configuration").
"""

import socket
import threading
import time

import tensorflow as tf

from graph_rewriter.cluster import parse_cluster
from graph_rewriter.collectives import GROUP_FORMING_INSTANCE, group_key, host_group, replica_group
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.options import COMMUNICATIONS


def server_config(cluster, device_type="GPU", devices_per_worker=1, communication="auto"):
    """The ConfigProto a server of this cluster needs: CPU device count for CPU replicas,
    the collective group leader, enough inter-op threads that replicas waiting in
    collectives cannot starve the ops they wait for, and with ``communication="nccl"``
    NCCL for every GPU collective (``experimental.collective_nccl``: TensorFlow then
    uses NCCL even where a collective's hint says "auto" or "ring"). "auto" and "ring"
    leave it off, TensorFlow's default: a collective uses NCCL only if the graph asks
    (its ``communication_hint`` is "nccl"), the ring otherwise."""
    if communication not in COMMUNICATIONS:
        raise GraphRewriteError(f"unknown communication {communication!r} for the server",
                                hint=f"use one of {', '.join(COMMUNICATIONS)}")
    if communication == "nccl" and device_type != "GPU":
        raise GraphRewriteError(
            f"communication 'nccl' runs on GPUs, but the server's replicas are {device_type} devices",
            hint="use communication 'auto' or 'ring' with --device-type CPU")
    config = tf.compat.v1.ConfigProto()
    if device_type == "CPU":
        config.device_count["CPU"] = devices_per_worker
    leader_job, leader_index = cluster.compute_tasks[0]
    config.experimental.collective_group_leader = f"/job:{leader_job}/replica:0/task:{leader_index}"
    config.inter_op_parallelism_threads = max(4, devices_per_worker * cluster.num_workers + 2)
    if communication == "nccl":
        config.experimental.collective_nccl = True
    return config


def server_groups(cluster, device_type, devices_per_worker):
    """The collective groups rewritten graphs of this cluster use: every replica (each
    compute task's ``devices_per_worker`` devices), and the compute tasks' host CPUs
    (the workers' barriers; also the replicas of a graph with one CPU replica per
    worker). Groups of one member need no forming."""
    groups = []
    for devices in (replica_group(cluster, device_type, devices_per_worker), host_group(cluster)):
        if len(devices) > 1 and devices not in groups:
            groups.append(devices)
    return groups


LEADER_POLL_SECONDS = 2.0    # how often a follower checks its group leader's incarnation
LEADER_STABLE_SECONDS = 2.0  # a leader must keep one incarnation this long before forming


def leader_incarnation(server, cluster):
    """The incarnation of the collective group leader's CPU:0 (it changes when the
    leader's server restarts), or None if it cannot be read now."""
    job, index = cluster.compute_tasks[0]
    host, port = cluster.jobs[job][index].rsplit(":", 1)
    try:
        # TensorFlow's ListDevices retries an unreachable task for minutes: ask only a
        # leader that accepts connections
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return None
    config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{job}/task:{index}"])
    name = cluster.device((job, index), "CPU", 0)
    try:
        with tf.compat.v1.Session(server.target, config=config) as sess:
            for device in sess.list_devices():
                if device.name == name:
                    return device.incarnation
    except (tf.errors.OpError, RuntimeError):
        pass
    return None


def form_groups(server, cluster, device_type="GPU", devices_per_worker=1, log=None, on_leader_restart=None):
    """Forms this server's collective groups (``server_groups``) in a background thread
    that waits, without a deadline, until every member's server has started.

    Why: TensorFlow forms a group the first time a collective uses it, and if the step
    doing so is cancelled before every member has joined (a worker started alone, a
    client killed or timed out during its init), the group leader records the group as
    cancelled for the rest of its life; every later collective of that group then
    aborts the server's collectives for good. Formed here, by the long-lived server
    process itself, a group is complete before any client's step uses it, and a
    cancelled step only cancels its own instances, which leaves no trace.

    A member other than the leader (compute task 0) forms its groups once the leader has
    kept one incarnation for LEADER_STABLE_SECONDS. With ``on_leader_restart``, it then
    watches the leader: a leader whose server restarted has forgotten the groups this
    server remembers, so every collective would fail; ``on_leader_restart(message)`` is
    called (serve's supervised server exits, and its supervisor starts a fresh one)."""
    job, index = cluster.task
    mine = f"/job:{job}/replica:0/task:{index}/"
    leader = (job, index) == cluster.compute_tasks[0]
    steps = []
    for g, devices in enumerate(server_groups(cluster, device_type, devices_per_worker)):
        graph = tf.Graph()
        with graph.as_default():
            ops = []
            for device in devices:
                if device.startswith(mine):
                    with tf.device(device):
                        ops.append(tf.raw_ops.CollectiveReduceV2(
                            input=tf.zeros([1]), group_size=len(devices), group_key=group_key(devices),
                            instance_key=GROUP_FORMING_INSTANCE + g, ordering_token=[], merge_op="Add",
                            final_op="Id", communication_hint="auto", timeout_seconds=0.0))
        if ops:
            steps.append((graph, ops, len(devices)))
    if not steps:
        return None

    def stable_leader():
        seen, since = None, time.monotonic()
        while True:
            now = leader_incarnation(server, cluster)
            if now is None or now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= LEADER_STABLE_SECONDS:
                return seen
            time.sleep(0.5)

    def form():
        incarnation = None if leader else stable_leader()
        for graph, ops, size in steps:
            try:
                with tf.compat.v1.Session(server.target, graph=graph) as sess:
                    sess.run(ops)
                if log:
                    log(f"formed the collective group of {size} devices")
            except tf.errors.OpError as e:   # e.g. a GPU group on a machine without GPUs
                if log:
                    log(f"could not form the collective group of {size} devices: "
                        f"{' '.join(e.message.split())[:300]}")
        while on_leader_restart is not None and not leader:
            time.sleep(LEADER_POLL_SECONDS)
            now = leader_incarnation(server, cluster)
            if now is not None and now != incarnation:
                job0, index0 = cluster.compute_tasks[0]
                on_leader_restart(f"the collective group leader {job0}:{index0} restarted, so this "
                                  "server's collective groups are gone there")
                return

    thread = threading.Thread(target=form, name="graph_rewriter-form-groups", daemon=True)
    thread.start()
    return thread

def start_server(cluster_spec, task, *, device_type="GPU", devices_per_worker=1, communication="auto",
                 start=True, log=None, on_leader_restart=None):
    """Starts (and returns) the tf.distribute.Server for ``task`` of ``cluster_spec``,
    configured by ``server_config``, and forms its collective groups in the background
    (``form_groups``). Every server of a cluster should be given the same
    ``communication``: each resolves a collective's implementation on its own."""
    cluster = parse_cluster(cluster_spec, task)
    if cluster.is_local or cluster.task is None:
        raise GraphRewriteError("start_server needs a cluster spec and a task in it, e.g. worker:0 "
                                "(or a TF_CONFIG environment variable naming both)",
                                hint="pass the cluster spec and task='worker:0' (--cluster, --task), "
                                     "or set TF_CONFIG")
    job, index = cluster.task
    config = server_config(cluster, device_type, devices_per_worker, communication)
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(cluster.jobs), job_name=job, task_index=index,
            config=config, start=start)
    except (tf.errors.OpError, ValueError, RuntimeError) as e:
        raise GraphRewriteError(
            f"cannot start the server for {job}:{index} at {cluster.jobs[job][index]}: "
            f"{str(e).splitlines()[0]}", hint="check that the port is free and the address is this machine's") from None
    if start and (job, index) in cluster.compute_tasks:
        form_groups(server, cluster, device_type, devices_per_worker, log=log,
                    on_leader_restart=on_leader_restart)
    return server
