"""``dtrain`` command lines run from a warm interpreter: the tests' stand-in for ``python -m dtrain.cli``.

A ``dtrain run`` in a fresh interpreter imports torch twice before its first step: once in the command's
own process and once in the forkserver its workers fork from (about 8 CPU-seconds together, more than
most test runs train). Here one helper process per test process (the *zygote*) imports what the command
and its workers import, starts the workers' forkserver once, and then forks a child per command line; the
child runs ``dtrain.cli.main(ARGS)`` as the command would, its stdout and stderr in files the test reads,
its exit status the command's. Its workers fork from the zygote's forkserver and write to the child's
stdout and stderr (``dtrain.launch.forkserver.LauncherStdio``), so a test reads what a user would see.

What differs from a fresh interpreter: nothing is imported at the start (each module is the one the zygote
imported, before any command ran), and the workers' forkserver is shared by the test process's commands.
The tests of the command's own start-up (flags refused before any import, the interrupt handlers, the
workers' process tree) start a real ``python -m dtrain.cli`` instead.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

_LEN = struct.Struct("!I")
COLD = os.environ.get("DTRAIN_TESTS_COLD") == "1"  # every command in a fresh interpreter (to compare)


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    head = _read(sock, _LEN.size)
    if head is None:
        return None
    body = _read(sock, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# ---------------------------------------------------------------------------------------------- the zygote


# what the command imports besides its workers' modules: its own, and what it uses once the workers are done
# (the run's report and curves.png); imported here once instead of in every command's child
AFTER_THE_RUN = (
    "dtrain.cli",
    "dtrain.strategies.builtin",
    "dtrain.training.checkpointing",
    "dtrain.observe.report",
    "matplotlib.pyplot",
)


# the transformers architectures the tests build (hf:gpt2, hf:llama): imported once by the forkserver instead of
# in each worker of such a run (seconds each); the forkserver skips them where transformers is not installed
TRANSFORMERS = ("transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama")


def serve(fd: int) -> None:
    """The zygote's loop: import, start the forkserver, then fork a child per ``start`` request."""
    import importlib

    from dtrain.launch.forkserver import PRELOAD, prestart

    os.environ.setdefault("MPLBACKEND", "Agg")  # what the run's curves.png is drawn with (dtrain.observe.report)
    for name in (*PRELOAD, *AFTER_THE_RUN):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    prestart((*PRELOAD, *TRANSFORMERS))  # the workers fork with transformers' models loaded (several suites use them)
    sock = socket.socket(fileno=fd)
    while True:
        msg = _recv(sock)
        if msg is None:  # the test process is gone
            os._exit(0)
        if msg[0] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(*msg[1:])
            _send(sock, ("started", pid))
        elif msg[0] == "wait":
            _, status = os.waitpid(msg[1], 0)
            _send(sock, ("exited", os.waitstatus_to_exitcode(status)))


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str | None) -> None:
    """In the forked child: the command's descriptors, environment, directory and arguments; run; exit."""
    import atexit as _atexit
    import random
    import traceback
    from multiprocessing import forkserver, resource_tracker

    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        o = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        e = o if err is None else os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(o, 1)
        os.dup2(e, 2)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["dtrain", *argv]
        random.seed()
        # the forkserver is the zygote's child, not this process's: it is running (``ensure_running``'s
        # ``waitpid`` would fail here); a request reaches it by its address, as from any process
        server = forkserver._forkserver

        def running() -> None:
            resource_tracker.ensure_running()

        server.ensure_running = running  # type: ignore[method-assign]
        forkserver.ensure_running = running
        from dtrain.cli import main

        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        _atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


# ---------------------------------------------------------------------------------------------- the tests' side

_lock = threading.Lock()
_zygote: dict[str, Any] = {}


def _connection() -> socket.socket:
    """The zygote of this test process, started on first use."""
    if _zygote.get("pid") != os.getpid():
        ours, theirs = socket.socketpair()
        here = str(Path(__file__).parent)
        code = f"import sys; sys.path.insert(0, {here!r}); import _warm; _warm.serve({theirs.fileno()})"
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        _zygote.update(pid=os.getpid(), proc=proc, sock=ours)
        atexit.register(_close, proc, ours)
    sock: socket.socket = _zygote["sock"]
    return sock


def _close(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
    sock.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()


class WarmProcess:
    """A command line running in a child of the zygote; the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, merge: bool = False) -> None:
        self.args = [sys.executable, "-m", "dtrain.cli", *args]
        self.pid: int
        self.returncode: int | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="dtrain-warm-")
        self._out = os.path.join(self._dir.name, "stdout")
        self._err = None if merge else os.path.join(self._dir.name, "stderr")
        with _lock:
            sock = _connection()
            sock.settimeout(120)
            _send(
                sock, ("start", list(args), dict(os.environ if env is None else env), os.getcwd(), self._out, self._err)
            )
            reply = _recv(sock)
        if reply is None or reply[0] != "started":
            raise RuntimeError(f"the warm interpreter did not start {args}: {reply!r}")
        self.pid = reply[1]

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; past ``timeout`` seconds, :class:`subprocess.TimeoutExpired` (the child runs on)."""
        if self.returncode is not None:
            return self.returncode
        with _lock:
            sock = _zygote["sock"]
            sock.settimeout(None)
            _send(sock, ("wait", self.pid))
            sock.settimeout(timeout)
            try:
                reply = _recv(sock)
            except TimeoutError:
                self.kill()  # the zygote's wait then returns: read its reply before the next request
                sock.settimeout(60)
                _recv(sock)
                self.returncode = -9
                raise subprocess.TimeoutExpired(
                    self.args, timeout or 0, self._text(self._out), self._text(self._err)
                ) from None
        if reply is None:
            raise RuntimeError(f"the warm interpreter ended while {self.args} ran")
        self.returncode = int(reply[1])
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    @staticmethod
    def _text(path: str | None) -> str:
        if path is None:
            return ""
        try:
            return Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait, then (stdout, stderr); with ``merge``, stderr is in stdout and the second is ``""``."""
        self.wait(timeout)
        out, err = self._text(self._out), self._text(self._err)
        self._dir.cleanup()
        return out, err


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, dtrain.cli, *args], capture_output=True, text=True, timeout=...)`` warm."""
    p = WarmProcess(list(args), env)
    out, err = p.communicate(timeout)
    return subprocess.CompletedProcess(p.args, p.returncode or 0, out, err)
