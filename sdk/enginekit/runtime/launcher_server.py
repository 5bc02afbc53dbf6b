"""The launcher process: import torch and enginekit once, then fork engine processes on request.

``python -m enginekit.runtime.launcher_server CONTROL_FD IDLE_TIMEOUT_S``. Requests and replies are wire
messages (``SpawnRequest``, ``StatusRequest``, ``ForgetRequest``) on a unix SEQPACKET socket; a spawn request
carries the child's stdin and output pipes as file descriptors. The launcher reaps its children and keeps
their exit codes until the front end has read them. It exits when the front end goes away (EOF on its own
stdin), and after ``IDLE_TIMEOUT_S`` seconds with no engine running.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

import msgspec

from enginekit.wire.messages import (
    ExitStatus,
    ForgetRequest,
    LauncherFailure,
    LauncherReady,
    LauncherRequest,
    Spawned,
    SpawnRequest,
    StatusRequest,
)

MAX_MESSAGE = 1 << 20
MAX_FDS = 4


class LauncherServer:
    def __init__(self, control: socket.socket, idle_timeout: float) -> None:
        self.control = control
        self.idle_timeout = idle_timeout
        self.statuses: dict[int, int] = {}  # exited children -> exit code, until forgotten
        self.running: set[int] = set()
        self.decoder = msgspec.msgpack.Decoder(LauncherRequest)
        self.wake_read, self.wake_write = os.pipe()

    def serve(self) -> None:
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._send(LauncherReady(os.getpid()))
        stdin = sys.stdin.fileno()
        while True:
            timeout = None if self.running else self.idle_timeout
            readable, _, _ = select.select([self.control, stdin, self.wake_read], [], [], timeout)
            if not readable:
                return  # idle for idle_timeout: free our memory; the front end starts a new launcher
            if self.wake_read in readable:
                os.read(self.wake_read, 4096)
                self._reap()
            if stdin in readable and not os.read(stdin, 4096):
                return  # the front end is gone; the engines see EOF on their own stdin
            if self.control in readable and not self._serve_one():
                return

    def _serve_one(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, MAX_FDS)
        except OSError:
            return False
        if not data:
            return False
        try:
            request = self.decoder.decode(data)
        except msgspec.MsgspecError as error:
            _close_all(fds)
            self._send(LauncherFailure(f"unreadable request: {error}"))
            return True
        if isinstance(request, SpawnRequest) and len(fds) == 2:
            self._send(self._spawn(request, fds))
            return True
        _close_all(fds)
        if isinstance(request, StatusRequest):
            self._reap()
            self._send(ExitStatus(request.pid, self.statuses.get(request.pid)))
        elif isinstance(request, ForgetRequest):
            self._send(ExitStatus(request.pid, self.statuses.pop(request.pid, None)))
        else:
            self._send(LauncherFailure(f"a spawn request needs 2 file descriptors, got {len(fds)}"))
        return True

    def _spawn(self, request: SpawnRequest, fds: list[int]) -> Spawned | LauncherFailure:
        import torch

        if torch.cuda.is_initialized():
            _close_all(fds)
            # NOTE: a forked child cannot use CUDA that its parent initialised; never hand one out.
            return LauncherFailure("the launcher has initialised CUDA, so it cannot fork engines safely")
        try:
            pid = os.fork()
        except OSError as error:
            _close_all(fds)
            return LauncherFailure(f"fork failed: {error}")
        if pid == 0:
            _become_engine(request, fds[0], fds[1], [self.control, self.wake_read, self.wake_write])
        _close_all(fds)
        self.running.add(pid)
        return Spawned(pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.running.discard(pid)
            self.statuses[pid] = os.waitstatus_to_exitcode(status)

    def _send(self, reply: Any) -> None:
        try:
            self.control.send(msgspec.msgpack.encode(reply))
        except OSError:
            pass  # the front end is gone; the stdin EOF ends the loop


def _become_engine(
    request: SpawnRequest, stdin_fd: int, output_fd: int, inherited: list[socket.socket | int]
) -> None:
    """In the forked child: detach, take the front end's pipes and environment, run the engine process."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(stdin_fd, 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        _close_all([stdin_fd, output_fd])
        for item in inherited:
            if isinstance(item, socket.socket):
                item.close()
            else:
                os.close(item)
        os.environ.clear()
        os.environ.update(request.environ)
        os.chdir(request.cwd)
        sys.path[:] = request.sys_path
        from enginekit.runtime.engine_main import main

        main()
    except BaseException:
        traceback.print_exc()  # into the front end's error tail
    finally:
        os._exit(1)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    idle_timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
    # Preload everything an engine process imports; this is what makes a fork cheaper than a fresh start.
    import enginekit.runtime.engine_main  # noqa: F401  (imports torch, zmq, msgspec, the model)

    gc.collect()
    gc.freeze()
    try:
        LauncherServer(control, idle_timeout).serve()
    finally:
        control.close()


if __name__ == "__main__":
    main()
