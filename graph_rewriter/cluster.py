"""Cluster specs: where the replicas, the host CPUs and the parameter servers live.

Accepted forms: None (this machine only), a dict {"chief": [...], "worker": [...],
"ps": [...]}, a tf.train.ClusterSpec, JSON text, a path to a JSON file, and the
ecosystem's TF_CONFIG environment variable (used when no spec is given; it names the
task too). The chief, when present, trains like a worker and is worker 0 of the
synchronisation group; "evaluator" tasks are ignored.
"""

import dataclasses
import json
import os
import re
import socket

from graph_rewriter.errors import GraphRewriteError

COMPUTE_JOBS = ("chief", "worker")
KNOWN_JOBS = ("chief", "worker", "ps", "evaluator")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A validated cluster: ``jobs`` maps job name to task addresses; empty means local."""
    jobs: dict
    task: tuple = None  # (job, index) whose graph is built (between-graph), or None

    @property
    def is_local(self):
        return not self.jobs

    @property
    def compute_tasks(self):
        """(job, index) of every task that runs replicas, chief first."""
        out = []
        for job in COMPUTE_JOBS:
            out += [(job, i) for i in range(len(self.jobs.get(job, [])))]
        return out or [("localhost", 0)]

    @property
    def ps_tasks(self):
        return [("ps", i) for i in range(len(self.jobs.get("ps", [])))]

    @property
    def num_workers(self):
        return len(self.compute_tasks)

    def device(self, task, device_type, index):
        """Full device name of device ``index`` of ``device_type`` on ``task``."""
        if self.is_local:
            return f"/device:{device_type}:{index}"
        job, i = task
        return f"/job:{job}/replica:0/task:{i}/device:{device_type}:{index}"

    def ps_device(self, index):
        """The device of parameter-server task ``index`` (the host CPU without a cluster)."""
        if self.is_local or not self.ps_tasks:
            return "/device:CPU:0"
        return f"/job:ps/replica:0/task:{index}/device:CPU:0"

    def as_dict(self):
        return {job: list(addrs) for job, addrs in self.jobs.items()}


def parse_cluster(spec=None, task=None, environ=None):
    """A Cluster from any accepted spec form; ``task`` is None, "job:i" or (job, i)."""
    environ = os.environ if environ is None else environ
    env_spec = env_task = None
    if environ.get("TF_CONFIG"):
        env_spec, env_task = _parse_tf_config(environ["TF_CONFIG"])
        if task is None:
            task = env_task
    if spec is None:
        spec, env_spec = env_spec, None     # TF_CONFIG names the cluster: nothing to compare
    if spec is None:
        if task is not None:
            raise GraphRewriteError(
                f"task {_task_text(task)} was given without a cluster spec",
                hint="pass --cluster (or cluster_spec=) naming the task's job")
        return Cluster(jobs={}, task=None)
    jobs = _jobs_from(spec)
    if env_spec is not None and _jobs_from(env_spec) != jobs:
        raise GraphRewriteError(
            f"the cluster spec given ({json.dumps(jobs, sort_keys=True)}) contradicts TF_CONFIG's "
            f"cluster ({json.dumps(_jobs_from(env_spec), sort_keys=True)})",
            hint="unset TF_CONFIG, or drop the explicit spec and let TF_CONFIG name the cluster")
    cluster = Cluster(jobs=jobs, task=None)
    return dataclasses.replace(cluster, task=parse_task(task, cluster) if task is not None else None)


def _jobs_from(spec):
    if hasattr(spec, "as_dict") and callable(spec.as_dict):  # tf.train.ClusterSpec
        spec = spec.as_dict()
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if text.lstrip().startswith("{"):
            spec = _load_json(text, "cluster spec")
        else:
            if not os.path.isfile(text):
                raise GraphRewriteError(
                    f"cluster spec '{text}' is neither JSON text nor a readable JSON file",
                    hint='pass JSON text such as \'{"worker": ["host:2222"]}\' or the path of a JSON file')
            try:
                with open(text) as f:
                    spec = _load_json(f.read(), text)
            except OSError as e:
                raise GraphRewriteError(f"{text}: cannot read cluster spec: {e.strerror}",
                                        hint="check the file's path and permissions") from None
    if isinstance(spec, dict) and "cluster" in spec and isinstance(spec["cluster"], dict):
        spec = spec["cluster"]  # a TF_CONFIG-shaped document
    if not isinstance(spec, dict):
        raise GraphRewriteError(
            f"cluster spec must be a mapping of job names to address lists, got {type(spec).__name__}",
            hint='write it like {"worker": ["host:2222", ...], "ps": ["host:2223"]}')
    jobs = {}
    seen = {}
    for job, addrs in spec.items():
        if job not in KNOWN_JOBS:
            raise GraphRewriteError(
                f"cluster spec: unknown job '{job}'", hint=f"use the jobs {', '.join(KNOWN_JOBS)}")
        if isinstance(addrs, dict):  # tf.train.ClusterSpec allows {index: address}
            addrs = [addrs[k] for k in sorted(addrs, key=int)]
        if isinstance(addrs, str) or not isinstance(addrs, (list, tuple)):
            raise GraphRewriteError(f"cluster spec: job '{job}' must list addresses, got {addrs!r}",
                                    hint=f'write a list, e.g. "{job}": ["host:2222"]')
        if job == "evaluator":
            continue
        for a in addrs:
            if not isinstance(a, str) or not _ADDRESS.match(a) or not 0 < int(a.rsplit(":", 1)[1]) < 65536:
                raise GraphRewriteError(
                    f"cluster spec: job '{job}' has a bad address {a!r}",
                    hint="write addresses as host:port, e.g. 10.0.0.2:2222")
            if a in seen:
                raise GraphRewriteError(
                    f"cluster spec: address {a} is used by both '{seen[a]}' and '{job}'",
                    hint="give every task its own host:port")
            seen[a] = job
        if addrs:
            jobs[job] = list(addrs)
    if len(jobs.get("chief", [])) > 1:
        raise GraphRewriteError("cluster spec: job 'chief' may have only one task",
                                hint="list the other addresses under 'worker'")
    if not any(jobs.get(j) for j in COMPUTE_JOBS):
        raise GraphRewriteError("cluster spec has no 'worker' or 'chief' tasks: nothing would train",
                                hint="list at least one worker address")
    return jobs


def _load_json(text, what):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphRewriteError(f"{what}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                                hint="fix the JSON (double-quoted strings, no trailing commas)") from None


def _parse_tf_config(text):
    doc = _load_json(text, "TF_CONFIG")
    if not isinstance(doc, dict) or not isinstance(doc.get("cluster"), dict):
        raise GraphRewriteError("TF_CONFIG has no 'cluster' mapping",
                                hint='set it like {"cluster": {"worker": ["h:2222"]}, "task": {"type": "worker", "index": 0}}')
    task = doc.get("task")
    if task is not None:
        if not isinstance(task, dict) or "type" not in task:
            raise GraphRewriteError("TF_CONFIG 'task' must be {\"type\": job, \"index\": i}",
                                    hint='set it like "task": {"type": "worker", "index": 0}')
        task = (task["type"], task.get("index", 0))
    return doc["cluster"], task


def parse_task(task, cluster):
    """(job, index) from "job:i" or a pair, checked against the cluster."""
    if isinstance(task, str):
        job, sep, idx = task.partition(":")
        if not sep or not idx.isdigit():
            raise GraphRewriteError(f"task '{task}' is not JOB:INDEX", hint="write e.g. worker:1")
        task = (job, int(idx))
    if not (isinstance(task, (tuple, list)) and len(task) == 2):
        raise GraphRewriteError(f"task {task!r} is not JOB:INDEX or a (job, index) pair",
                                hint='write e.g. "worker:1" or ("worker", 1)')
    job, idx = task[0], task[1]
    if isinstance(idx, str) and idx.isdigit():
        idx = int(idx)

    if not isinstance(idx, int) or idx < 0:
        raise GraphRewriteError(f"task {job}:{idx}: the index must be a non-negative integer",
                                hint="count the job's tasks from 0, e.g. worker:0")
    if job not in cluster.jobs or idx >= len(cluster.jobs[job]):
        have = ", ".join(f"{j}:0..{len(a) - 1}" for j, a in cluster.jobs.items()) or "none"
        raise GraphRewriteError(f"task {job}:{idx} is not in the cluster (it has {have})",
                                hint="name a task the cluster spec lists, or add its address there")
    return (job, idx)


def _task_text(task):
    return task if isinstance(task, str) else f"{task[0]}:{task[1]}"


def accepts_connections(address, timeout=1.0):
    """True if something accepts a TCP connection at ``address`` ("host:port") within
    ``timeout`` seconds: how a client or a launcher learns that a server listens, without
    asking TensorFlow (whose master waits without end for a task it cannot reach)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False
