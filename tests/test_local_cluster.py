"""LocalCluster's ports and its notion of a started server.

Two failure modes bit the multi-process tests when they ran on two pytest-xdist workers:
a port picked by binding port 0 can be handed by the OS to anyone between the pick and
the server's bind, and a cluster whose port another process already listened on counted
its server as started (the test's client then talked to the other process's server and
hung). free_port() therefore picks outside the OS's ephemeral range, in a slice of its
own per xdist worker, and LocalCluster waits for its own process group to listen.
"""

import contextlib
import os
import socket
import subprocess
import sys

import pytest

from graph_rewriter.errors import GraphRewriteError
from graph_rewriter.local_cluster import (LocalCluster, PortPicker, _ephemeral_range, _worker_slice,
                                          free_port, listens_in_group)


def _listener(port=0):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", port))
    s.listen()
    return s


def test_ports_are_outside_the_ephemeral_range_and_not_repeated():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(not low <= p <= high for p in ports), ports
    assert all(1024 <= p < 65536 for p in ports), ports


def test_each_xdist_worker_has_a_slice_of_its_own():
    slices = [_worker_slice(10000, 32768, {"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "3"})
              for i in range(3)]
    assert slices[0][0] == 10000 and slices[-1][1] <= 32768
    for (_, stop), (start, _) in zip(slices, slices[1:]):
        assert stop <= start, slices
    assert _worker_slice(10000, 32768, {}) == (10000, 32768)
    picker = PortPicker({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"})
    ports = [picker.pick() for _ in range(20)]
    assert all(picker.start >= 10000 and picker.start <= p < picker.stop for p in ports), ports


def test_a_port_something_listens_on_is_skipped():
    picker = PortPicker({})
    taken = picker._next
    try:
        listener = _listener(taken)
    except OSError:   # something listens there already (the other test worker's server): taken too
        listener = contextlib.nullcontext()
    with listener:
        assert picker.pick() != taken


def test_a_slice_with_no_free_port_is_an_error_naming_it():
    with _listener() as s:
        port = s.getsockname()[1]
        picker = PortPicker({})
        picker.start, picker.stop, picker._next = port, port + 1, port
        with pytest.raises(GraphRewriteError, match=rf"no free TCP port among the 1 tried in {port}-{port}"):
            picker.pick()


def test_listening_is_told_apart_by_process_group():
    with _listener() as s:
        port = s.getsockname()[1]
        assert listens_in_group(port, os.getpgid(0))
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
        try:
            assert not listens_in_group(port, other.pid)
        finally:
            other.kill()
            other.wait(timeout=10)
    assert not listens_in_group(port, os.getpgid(0))


@pytest.mark.slow
def test_a_cluster_whose_port_another_process_listens_on_does_not_start():
    """The old readiness check (anything accepts on the port) passed here; the server of
    serve cannot bind, serve gives up, and start() says which task."""
    with _listener() as s:
        port = s.getsockname()[1]
        cluster = LocalCluster(workers=1, start_timeout=90.0)
        cluster.spec = {"worker": [f"localhost:{port}"]}
        try:
            with pytest.raises(GraphRewriteError, match=r"worker:0 exited with status"):
                cluster.start()
        finally:
            cluster.stop()
        assert all(p.poll() is not None for p in cluster.processes.values())
