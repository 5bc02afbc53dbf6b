"""The front end's handle on the launcher: a small process that imported torch once and forks engines.

Importing torch costs seconds; an engine restart should not. The first background engine of a front-end
process starts the launcher (``runtime/launcher_server.py``, its own session), which imports torch and
enginekit once — never initialising CUDA, so forking it is safe — and then forks one engine process per
request, with the front end's current ``os.environ``, working directory and ``sys.path``, applied in the child
before any of the engine runs. Variables that torch and its native libraries read as they load (``CUDA_*``,
``PYTORCH_*``, ``OMP_*``, ``MKL_*``, ``LD_*``, ...) are fixed when the launcher imports torch: when one of them
changes (``CUDA_VISIBLE_DEVICES`` set in a cell before a restart, say), the next start uses a new launcher,
which imports torch again under it, exactly as a freshly spawned engine would.

Engine liveness never depends on the launcher: the front end watches each engine through its pidfd and its
output pipe, and asks the launcher only for the exit code of an engine that has already exited (the launcher
is its parent, so only it can reap it). A launcher that died is replaced at the next start. It holds no GPU
memory (about 260 MB of host memory: torch and enginekit imported) and exits by itself after
``IDLE_TIMEOUT_S`` without engines, when the front end exits, or on ``enginekit.shutdown_launcher()``.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
from typing import Any, ClassVar

import msgspec

from enginekit.interrupts import deferred_interrupts
from enginekit.wire.messages import (
    ExitStatus,
    ForgetRequest,
    LauncherFailure,
    LauncherReady,
    LauncherReply,
    Spawned,
    SpawnRequest,
    StatusRequest,
)

__all__ = ["Launcher", "LauncherError", "engine_environ", "shutdown_launcher"]

MAX_MESSAGE = 1 << 20  # a spawn request carries the whole environment
STARTUP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 600.0
# CUDA_VISIBLE_DEVICES and PYTORCH_CUDA_ALLOC_CONF are read lazily, but only a fresh launcher also shows them
# in /proc/<engine pid>/environ, where tools (and users) look.
IMPORT_TIME_PREFIXES = (
    "CUDA",
    "PYTORCH",
    "TORCH",
    "OMP_",
    "MKL",
    "KMP_",
    "GOMP",
    "LD_",
    "PYTHON",
    "NCCL",
)  # see docs/lifecycle.md: keeps restarts fast for ten idle minutes, then frees the RSS


# OpenMP workers spin at a barrier 300000 times, then sleep: libgomp's own default (it reckons 3 ms; about 10 ms
# on the VMs measured), so an engine process waits as an in-process engine does. That spans every gap between
# one op and the next, the Python between two steps included, and an idle engine still leaves its cores. A
# passive worker, woken by a futex at every op, cost a third of the real model's speed on an idle machine; a
# short spin (10000, about 0.3 ms) still let workers fall asleep inside a step, and the background engine ran
# the real model well below an in-process one at 8 concurrent, against about as fast with the long spin. Beside a busy
# process spinning would stall every op; there the engine runs fewer threads (``core/threads.py``), and one
# thread has no barrier to spin at. It does not starve a notebook's kernel or browser (docs/benchmarks.md, the
# modes section). See docs/benchmarks.md, the thread section. A user's setting of any of these variables wins.
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "300000"}
OPENMP_OVERRIDES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def engine_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment an engine process runs under: ``environ`` with the OpenMP defaults it lacks."""
    if any(name in environ for name in OPENMP_OVERRIDES):
        return dict(environ)
    return {**environ, **OPENMP_DEFAULTS}


class LauncherError(RuntimeError):
    """The launcher could not start, fork or answer; the message carries its error output."""


class Launcher:
    """One per front-end process, started lazily by ``shared()`` and replaced when it has died."""

    command: ClassVar[list[str]] = [sys.executable, "-m", "enginekit.runtime.launcher_server"]
    _instance: ClassVar[Launcher | None] = None
    _retired: ClassVar[list[Launcher]] = []  # replaced, kept until their engines have stopped
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> Launcher:
        """The launcher for the current environment; a dead one, or one started under other import-time
        variables, is replaced (an engine must see the environment a spawned one would)."""
        with cls._instance_lock:
            current = cls._instance
            if current is None or not current.is_alive() or current.environ != import_time_environ():
                if current is not None:
                    cls._retire(current)
                cls._instance = current = cls()
            return current

    @classmethod
    def engine_stopped(cls, launcher: Launcher) -> None:
        """One engine of ``launcher`` has stopped; a replaced launcher with none left is closed."""
        with cls._instance_lock:
            launcher.num_engines -= 1
            if launcher in cls._retired and launcher.num_engines <= 0:
                cls._retired.remove(launcher)
                launcher.close()

    @classmethod
    def _retire(cls, launcher: Launcher) -> None:
        if launcher.num_engines > 0 and launcher.is_alive():
            cls._retired.append(launcher)  # it alone can report its engines' exit codes
        else:
            launcher.close()

    @classmethod
    def close_shared(cls) -> None:
        """Stop every launcher; engines they started keep running and are watched as before."""
        with cls._instance_lock:
            launchers = [launcher for launcher in (cls._instance, *cls._retired) if launcher is not None]
            cls._instance, cls._retired = None, []
        for launcher in launchers:
            launcher.close()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.environ = import_time_environ()
        self.num_engines = 0
        self._unanswered = (
            0  # requests whose reply was never read (a timeout, a Ctrl-C): read before the next
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        try:
            # NOTE: a Ctrl-C inside Popen (while it waits for the exec) would leave a child nobody reaps.
            with deferred_interrupts():
                self.proc = subprocess.Popen(
                    [*self.command, str(theirs.fileno()), str(IDLE_TIMEOUT_S)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=[theirs.fileno()],
                    env=engine_environ(dict(os.environ)),
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as error:
            ours.close()
            raise LauncherError(f"the engine launcher could not be started: {error}") from error
        except BaseException:  # a Ctrl-C, raised once Popen returned
            ours.close()
            self._abandon()
            raise
        finally:
            theirs.close()
        try:
            reply = self._receive(STARTUP_TIMEOUT_S)
        except BaseException:  # a Ctrl-C while the launcher imports torch: nobody will use it
            self._abandon()
            raise
        if not isinstance(reply, LauncherReady):
            tail = self._stderr_tail(wait=True)
            self.close()
            raise LauncherError(f"the engine launcher did not start: {tail}")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self, stdin_fd: int, output_fd: int) -> int:
        """Fork an engine process with these as its stdin and stdout/stderr; returns its pid."""
        request = SpawnRequest(engine_environ(dict(os.environ)), os.getcwd(), list(sys.path))
        reply = self._call(request, [stdin_fd, output_fd], CALL_TIMEOUT_S)
        if not isinstance(reply, Spawned):
            raise LauncherError(f"the engine launcher could not fork: {_describe(reply)}")
        with self._instance_lock:
            self.num_engines += 1
        return reply.pid

    def exit_status(self, pid: int, timeout: float = 2.0) -> int | None:
        """``None`` while running, else the exit code (negative: killed by that signal)."""
        reply = self._call(StatusRequest(pid), [], timeout)
        if not isinstance(reply, ExitStatus):
            raise LauncherError(f"the engine launcher gave no exit status: {_describe(reply)}")
        return reply.returncode

    def forget(self, pid: int) -> None:
        """The front end has what it needs about this (exited) child; the launcher may drop its status."""
        with contextlib.suppress(LauncherError):
            self._call(ForgetRequest(pid), [], 2.0)

    def _call(self, request: Any, fds: list[int], timeout: float) -> LauncherReply:
        with self._lock:
            # NOTE: the launcher answers every request in order; a reply left unread (a call that timed out or
            # was interrupted) would otherwise be taken as the answer to this one.
            while self._unanswered:
                if self._receive(timeout) is None:
                    raise LauncherError(
                        f"the engine launcher did not answer: {self._stderr_tail(wait=False)}"
                    )
                self._unanswered -= 1
            try:
                socket.send_fds(self._socket, [msgspec.msgpack.encode(request)], fds)
            except OSError as error:
                raise LauncherError(f"the engine launcher is gone: {error}") from error
            self._unanswered += 1
            reply = self._receive(timeout)
            if reply is not None:
                self._unanswered -= 1
        if reply is None:
            raise LauncherError(f"the engine launcher did not answer: {self._stderr_tail(wait=False)}")
        return reply

    def _receive(self, timeout: float) -> LauncherReply | None:
        try:
            ready, _, _ = select.select([self._socket], [], [], timeout)
            data = self._socket.recv(MAX_MESSAGE) if ready else b""
        except OSError:
            return None
        if not data:
            return None
        try:
            return msgspec.msgpack.decode(data, type=LauncherReply)
        except msgspec.MsgspecError:
            return LauncherFailure(f"unreadable reply {data[:60]!r}")

    def _stderr_tail(self, *, wait: bool) -> str:
        if wait:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
        if self.proc.poll() is None or self.proc.stderr is None or self.proc.stderr.closed:
            return "no answer (the launcher is still running)"
        text = self.proc.stderr.read().decode(errors="replace").strip()
        return text[-2000:] or f"it exited with code {self.proc.returncode} and no error output"

    def _abandon(self) -> None:
        """Kill and reap a launcher whose start was interrupted (it has forked nothing yet), and close its pipes."""
        with contextlib.suppress(OSError):
            self._socket.close()
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stderr):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # EOF: the launcher exits
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def import_time_environ() -> dict[str, str]:
    """The variables torch and its native libraries read as they load or initialise, which a fork inherits
    as they were when the launcher imported torch (so a change needs a new launcher)."""
    return {name: value for name, value in os.environ.items() if name.startswith(IMPORT_TIME_PREFIXES)}


def shutdown_launcher() -> None:
    """Stop the launcher process that forks background engines, freeing its memory now.

    Running engines are not affected; the next engine start launches a new one (paying the torch import once).
    """
    Launcher.close_shared()


def _describe(reply: LauncherReply | None) -> str:
    return reply.message if isinstance(reply, LauncherFailure) else repr(reply)
