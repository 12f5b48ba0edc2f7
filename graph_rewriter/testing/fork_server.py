"""Starts the test suite's Python client processes by forking one process that has
already imported TensorFlow, instead of starting a new interpreter for each.

Why: a between-graph test starts a client process per worker, and every one spent about
4.5 s of CPU importing TensorFlow before doing a second of work (2 cores, TF 2.21 CPU;
graph_rewriter's own modules are about 0.1 s of it): tests/test_cluster.py alone starts
about 100 such clients and servers. A fork of a process that has imported them (a "zygote", as Android and
multiprocessing's forkserver do it) starts in about 10 ms and shares those pages.

What stays real: each client is its own process with its own pid, session, working
directory, environment, arguments and log files, running the same module or code with
the same interpreter; it talks to real TensorFlow servers. Forking is safe here because
the zygote only imports: TensorFlow starts its runtime threads when a session or an
eager context is first made, which only the children do (``import numpy`` starts
OpenBLAS' pool, which registers its own fork handlers).

What differs from a new interpreter, and how that is handled:

- Environment variables read while TensorFlow is imported (``TF_CPP_MIN_LOG_LEVEL``,
  ``TF_ENABLE_ONEDNN_OPTS``, ``CUDA_VISIBLE_DEVICES``, ...) are the zygote's: a
  command whose environment differs in any of them (``IMPORT_TIME_VARIABLES``,
  ``IMPORT_TIME_PREFIXES``) starts a new interpreter instead, as does any command that
  is not ``python -m module`` or ``python -c code`` with this interpreter.
- The random generators (``random``, numpy's global one) are seeded again from the OS
  in each child, as a new interpreter seeds them; str hashes keep the zygote's seed.
- Output is unbuffered (the zygote runs with PYTHONUNBUFFERED=1).

A child is not the test process's child but the zygote's: ``ForkedProcess`` gives the
``subprocess.Popen`` methods the tests use (``pid``, ``poll``, ``wait``,
``returncode``, ``send_signal``, ``terminate``, ``kill``), its exit status sent by the
zygote. Every child leads its own session (its process group id is its pid, so
``os.killpg(proc.pid, ...)`` ends it as with ``start_new_session=True``), dies with the
zygote (PR_SET_PDEATHSIG), and is killed by the zygote when the test process's
connection for it closes; the zygote dies with the test process. Linux only; elsewhere,
and with ``GRAPH_REWRITER_TEST_FORK=0``, every command starts a new interpreter.

    launcher = Launcher()
    proc = launcher.popen([sys.executable, "-m", "graph_rewriter.worker_client", ...],
                          stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.wait(timeout=300)
    launcher.close()
"""

import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

# Environment variables that take effect while TensorFlow (or numpy) is imported; a
# command that asks for other values than the zygote's gets a new interpreter.
IMPORT_TIME_VARIABLES = ("PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS",
                         "PYTHONDEVMODE", "PYTHONMALLOC", "LD_PRELOAD", "LD_LIBRARY_PATH")
IMPORT_TIME_PREFIXES = ("TF_", "CUDA_", "KERAS_", "OMP_", "OPENBLAS_", "MKL_", "ONEDNN_", "XLA_", "GRPC_")
RUNTIME_VARIABLES = ("TF_CONFIG",)   # read by the code that runs, not at import
# What the zygote imports: the third-party modules that cost the time. Not graph_rewriter
# (about 0.1 s): each child imports this project's modules itself, as a new interpreter
# would, so a module that works only when something else imported a piece first fails
# here as it would for a user.
PRELOAD = ("numpy", "tensorflow")
ENABLE_VARIABLE = "GRAPH_REWRITER_TEST_FORK"
READY_TIMEOUT = 120.0     # the zygote importing TensorFlow
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!I")


def _die_with_parent():
    """Asks Linux to SIGKILL this process when its parent ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _import_environment(env):
    return {k: v for k, v in env.items()
            if k not in RUNTIME_VARIABLES and (k in IMPORT_TIME_VARIABLES or k.startswith(IMPORT_TIME_PREFIXES))}


def _fd_of(stream, default):
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR)
    return stream if isinstance(stream, int) else stream.fileno()


# ----- the test process's side -----------------------------------------------------------

class ForkedProcess:
    """A child of the zygote, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, args, pid, conn, received=b""):
        self.args, self.pid, self._conn = args, pid, conn
        self.returncode = None
        self._buffer = received   # what came after the pid line (a child that has already exited)

    def _read_status(self, timeout):
        """Reads the zygote's "exit <status>" line if it comes within ``timeout`` (None:
        wait); a closed connection without it means the zygote died, and with it the
        child (PR_SET_PDEATHSIG)."""
        if self.returncode is not None:
            return self.returncode
        ready = b"\n" in self._buffer or select.select([self._conn], [], [], timeout)[0]
        while ready:
            if b"\n" in self._buffer:
                self.returncode = int(self._buffer.split()[1])   # "exit <status>"
                break
            data = self._conn.recv(64)
            if not data:
                self.returncode = -signal.SIGKILL
                break
            self._buffer += data
            ready = b"\n" in self._buffer or select.select([self._conn], [], [], timeout)[0]
        if self.returncode is not None:
            self._conn.close()
        return self.returncode

    def poll(self):
        return self._read_status(0)

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status(left)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Starts commands as ``subprocess.Popen`` would, forking the suite's Python clients
    from a zygote it starts on first use (``enabled``: None reads GRAPH_REWRITER_TEST_FORK,
    default on, on Linux)."""

    def __init__(self, enabled=None):
        if enabled is None:
            enabled = os.environ.get(ENABLE_VARIABLE, "1") != "0"
        self.enabled = enabled and sys.platform.startswith("linux")
        self._zygote = None
        self._folder = None
        self._environment = None  # the zygote's environment

    def popen(self, cmd, stdout=None, stderr=None, env=None, cwd=None, start_new_session=False):
        """A forked child if the zygote can run ``cmd`` as a new interpreter would, else
        ``subprocess.Popen``. A forked child always leads its own session."""
        env = dict(os.environ if env is None else env)
        if self.enabled and self._can_fork(cmd, env):
            out = _fd_of(stdout, 1)
            err = out if stderr == subprocess.STDOUT else _fd_of(stderr, 2)
            proc = self._fork(cmd, out, err, env, os.path.abspath(cwd or os.getcwd()))
            for fd, stream in ((out, stdout), (err, stderr)):
                if stream == subprocess.DEVNULL and fd > 2:
                    os.close(fd)
            if proc is not None:
                return proc
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=start_new_session)

    def _can_fork(self, cmd, env):
        if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] not in ("-m", "-c"):
            return False
        return _import_environment(env) == _import_environment(self._zygote_env())

    def _zygote_env(self):
        """The zygote's environment, fixed at first use (a later change to os.environ
        does not make the zygote's imports differ from what the comparison assumes)."""
        if self._environment is None:
            self._environment = dict(os.environ, PYTHONUNBUFFERED="1",
                                     TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
        return self._environment

    def _start_zygote(self):
        self._folder = tempfile.mkdtemp(prefix="gr_zygote_")
        path = os.path.join(self._folder, "socket")
        log = open(os.path.join(self._folder, "zygote.log"), "wb")
        self._zygote = subprocess.Popen([sys.executable, "-m", __name__, path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=self._zygote_env(),
                                        start_new_session=True)
        log.close()
        ready, _, _ = select.select([self._zygote.stdout], [], [], READY_TIMEOUT)
        if not ready or self._zygote.stdout.readline().strip() != b"ready":
            self._stop_zygote()
            return None
        return path

    def _socket_path(self):
        if self._zygote is not None and self._zygote.poll() is None:
            return os.path.join(self._folder, "socket")
        self._stop_zygote()
        return self._start_zygote()

    def _fork(self, cmd, out, err, env, cwd):
        """Asks the zygote for a child; None if the zygote cannot be had (then the caller
        starts an interpreter)."""
        path = self._socket_path()
        if path is None:
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            body = json.dumps({"argv": list(cmd[1:]), "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [out, err])
            line = b""
            while b"\n" not in line:
                ready, _, _ = select.select([conn], [], [], 30.0)
                chunk = conn.recv(64) if ready else b""
                if not chunk:
                    raise OSError("the zygote did not answer")
                line += chunk
        except OSError:
            conn.close()
            return None
        first, rest = line.split(b"\n", 1)
        return ForkedProcess(list(cmd), int(first.split()[1]), conn, rest)

    def _stop_zygote(self):
        if self._zygote is not None:
            if self._zygote.poll() is None:
                os.killpg(self._zygote.pid, signal.SIGKILL)
            self._zygote.wait(timeout=30)
            self._zygote.stdin.close()
            self._zygote.stdout.close()
            self._zygote = None

    def close(self):
        """Ends the zygote, and with it every child still running."""
        self._stop_zygote()
        if self._folder is not None:
            for name in os.listdir(self._folder):
                os.unlink(os.path.join(self._folder, name))
            os.rmdir(self._folder)
            self._folder = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----- the zygote --------------------------------------------------------------------------

def _receive(conn):
    """The request (argv, env, cwd) and the child's stdout and stderr descriptors."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise OSError("a request ended early")
        data += chunk
    return json.loads(data[_HEADER.size:]), fds


def _run_child(request, fds, base_path):
    """In the forked child: becomes the requested process and never returns."""
    import builtins
    import random
    import threading
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        sys.modules["numpy"].random.seed()
        for name in [m for m in sys.modules if m == "graph_rewriter" or m.startswith("graph_rewriter.")]:
            del sys.modules[name]   # the zygote's own package (this module): imported again by the child
        argv = request["argv"]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[0] == "-c":
            sys.path[:] = [""] + extra + base_path
            sys.argv = ["-c"] + argv[2:]
            import types
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            import runpy
            sys.path[:] = [request["cwd"]] + extra + base_path
            sys.argv = [argv[1]] + argv[2:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        getattr(threading, "_shutdown", lambda: None)()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve(path):
    """The zygote: imports PRELOAD, prints "ready", then forks a child per request on
    the Unix socket ``path`` and sends its pid, then its exit status, on the request's
    connection; kills a child whose connection closes first. Ends with its parent (the
    test process) or when its stdin closes."""
    _die_with_parent()
    for name in PRELOAD:
        __import__(name)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = {}   # pid -> the requester's connection
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        conns = {c.fileno(): (pid, c) for pid, c in children.items()}
        ready, _, _ = select.select([listener, wake_r, sys.stdin] + [c for _, c in conns.values()], [], [], 1.0)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            break
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(f"exit {code}\n".encode())
                except OSError:
                    pass
                conn.close()
        for item in ready:
            if isinstance(item, socket.socket) and item is not listener and item.fileno() in conns:
                pid, conn = conns[item.fileno()]
                if pid in children and not conn.recv(64):   # the test process let go of it
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if listener in ready:
            conn, _ = listener.accept()
            try:
                conn.settimeout(30.0)
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for c in children.values():
                    c.close()
                conn.close()
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                _run_child(request, fds, base_path)
            for fd in fds:
                os.close(fd)
            conn.settimeout(None)
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
    for pid in list(children):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
