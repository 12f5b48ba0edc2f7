"""start_server: a TensorFlow server configured for what ``rewrite`` emits.

What the configuration holds, and what TensorFlow's MultiWorkerMirroredStrategy sets
that it leaves out on purpose, is in docs/deployment.md ("Server configuration").
"""

import tensorflow as tf

from graph_rewriter.cluster import parse_cluster
from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.incarnations import publish
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


def start_server(cluster_spec, task, *, device_type="GPU", devices_per_worker=1, communication="auto",
                 start=True):
    """Starts (and returns) the tf.distribute.Server for ``task`` of ``cluster_spec``,
    configured by ``server_config``, holding its incarnation number
    (graph_rewriter/incarnations.py) before it serves anyone. Every server of a cluster should be given the same
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
            config=config, start=False)
    except (tf.errors.OpError, ValueError, RuntimeError) as e:
        raise GraphRewriteError(
            f"cannot start the server for {job}:{index} at {cluster.jobs[job][index]}: "
            f"{str(e).splitlines()[0]}", hint="check that the port is free and the address is this machine's") from None
    # its number, before anyone can reach it: how graphs and serve tell this server's
    # incarnation from a restarted one's (graph_rewriter/incarnations.py)
    publish(server, cluster)
    if start:
        server.start()
    return server
