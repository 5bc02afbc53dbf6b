"""The launcher: a small process that has already imported torch and forks engine processes on request.

Importing torch costs seconds; an engine restart should not. The first background engine of a front-end
process starts the launcher (``python -m enginekit.client.launcher``, its own session), which imports torch
and enginekit once — never touching CUDA or running a torch op, so forking it is safe — and then forks one
engine process per request. The front end hands over the child's stdin (its parent-death pipe) and output pipe
as file descriptors; the launcher reaps its children and reports their exit status on request.

The launcher exits when the front end goes away (EOF on its own stdin), and so do the engines it forked
(EOF on theirs), also while they load a model.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading

READY = b"ready"
MAX_MESSAGE = 256
STARTUP_TIMEOUT_S = 120.0


class LauncherError(RuntimeError):
    pass


class Launcher:
    """Front-end handle on the launcher process; one per front-end process, started lazily."""

    _instance: Launcher | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> Launcher:
        with cls._instance_lock:
            if cls._instance is None or not cls._instance.is_alive():
                if cls._instance is not None:
                    cls._instance.close()
                cls._instance = cls()
            return cls._instance

    @classmethod
    def close_shared(cls) -> None:
        """Stop the shared launcher (engines it started keep running until they are shut down)."""
        with cls._instance_lock:
            if cls._instance is not None:
                cls._instance.close()
                cls._instance = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "enginekit.client.launcher", str(theirs.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                close_fds=True,
            )
        finally:
            theirs.close()
        ready, _, _ = select.select([ours], [], [], STARTUP_TIMEOUT_S)
        reply = ours.recv(MAX_MESSAGE) if ready else b""
        if reply != READY:
            self.close()
            raise LauncherError(f"the engine launcher did not start: {self._stderr_tail()}")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, stdin_fd: int, output_fd: int) -> int:
        """Fork an engine process with these as its stdin and stdout/stderr; returns its pid."""
        reply = self._call(b"spawn", [stdin_fd, output_fd])
        if not reply.startswith(b"pid:"):
            raise LauncherError(f"the engine launcher could not fork: {reply!r}")
        return int(reply[4:])

    def exit_status(self, pid: int) -> int | None:
        """``None`` while running, else the exit code (negative: killed by that signal)."""
        reply = self._call(b"status:%d" % pid)
        value = reply.split(b":")[-1]
        return None if value == b"running" else int(value)

    def forget(self, pid: int) -> None:
        """The front end has what it needs about this (exited) child; the launcher may drop its status."""
        with contextlib.suppress(LauncherError):
            self._call(b"forget:%d" % pid)

    def _call(self, message: bytes, fds: list[int] | None = None) -> bytes:
        with self._lock:
            try:
                socket.send_fds(self._socket, [message], fds or [])
                ready, _, _ = select.select([self._socket], [], [], 30.0)
                reply = self._socket.recv(MAX_MESSAGE) if ready else b""
            except OSError as error:
                raise LauncherError(f"the engine launcher is gone: {error}") from error
        if not reply:
            raise LauncherError(f"the engine launcher did not answer: {self._stderr_tail()}")
        return reply

    def _stderr_tail(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "no answer"
        return self.proc.stderr.read().decode(errors="replace")[-2000:] or f"exit code {self.proc.returncode}"

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


atexit.register(Launcher.close_shared)


# ---- the launcher process ---------------------------------------------------------------------------------


def _serve(control: socket.socket) -> None:
    # Preload everything an engine process imports; this is what makes a fork cheaper than a fresh start.
    import gc

    import enginekit.core.engine_core_proc  # noqa: F401  (imports torch, zmq, msgspec, the model)

    gc.collect()
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    statuses: dict[int, int] = {}
    control.send(READY)
    while True:
        readable, _, _ = select.select([control, sys.stdin.fileno(), wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(statuses)
        if sys.stdin.fileno() in readable and not os.read(sys.stdin.fileno(), 4096):
            return  # the front end is gone; the engines see EOF on their own stdin
        if control in readable:
            try:
                message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4)
            except OSError:
                return
            if not message:
                return
            control.send(_handle(message, fds, statuses, control, wake_read, wake_write))


def _handle(message: bytes, fds: list[int], statuses: dict[int, int], *inherited: object) -> bytes:
    if message == b"spawn" and len(fds) == 2:
        pid = os.fork()
        if pid == 0:
            _become_engine(fds[0], fds[1], inherited)
        for fd in fds:
            os.close(fd)
        return b"pid:%d" % pid
    for fd in fds:
        os.close(fd)
    if message.startswith(b"status:"):
        pid = int(message[7:])
        _reap(statuses)
        status = statuses.get(pid)
        return b"status:%d:%s" % (pid, b"running" if status is None else str(status).encode())
    if message.startswith(b"forget:"):
        statuses.pop(int(message[7:]), None)
        return b"ok"
    return b"error:unknown request"


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)


def _become_engine(stdin_fd: int, output_fd: int, inherited: tuple[object, ...]) -> None:
    """In the forked child: detach, take the front end's pipes as stdio, run the engine process."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(stdin_fd, 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(stdin_fd)
        os.close(output_fd)
        for item in inherited:
            if isinstance(item, socket.socket):
                item.close()
            elif isinstance(item, int):
                os.close(item)
        from enginekit.core.engine_core_proc import main

        main()
    finally:
        os._exit(1)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    try:
        _serve(control)
    finally:
        control.close()


if __name__ == "__main__":
    main()
