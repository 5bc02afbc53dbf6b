"""EngineProcess: start, watch and stop the engine process from the front end.

The child is a fresh interpreter (``python -m enginekit.core.engine_core_proc``), never a fork of the
user's process, so a notebook that already initialised CUDA is safe and nothing of the notebook is pickled.
It runs in its own session, so a SIGINT sent to the kernel's process group does not reach it. Its stdin is a
pipe the front end keeps open: when the front end dies, the child reads EOF and exits, even mid-load.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgspec

from enginekit.core.engine_core_proc import EngineProcArgs

logger = logging.getLogger("enginekit.engine_process")

ERROR_TAIL_LINES = 40
PHASE_PREFIX = "enginekit-phase: "


class EngineProcess:
    def __init__(self) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="enginekit-")  # mode 0700: private to this user
        self.proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self._log_thread: threading.Thread | None = None
        self.pidfd: int | None = None
        self.phase = "spawn"  # the child reports each startup phase on its output

    def ipc_address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.run_dir, name)}"

    def start(self, args: EngineProcArgs) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # NOTE: our own session and process group: Jupyter's interrupt signals the kernel's whole group.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "enginekit.core.engine_core_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
        payload = msgspec.msgpack.encode(args)
        assert self.proc.stdin is not None
        self.proc.stdin.write(len(payload).to_bytes(8, "little") + payload)
        self.proc.stdin.flush()
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.proc.pid)
        self._log_thread = threading.Thread(
            target=self._forward_output, name="enginekit-engine-log", daemon=True
        )
        self._log_thread.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_dead(self, timeout: float) -> bool:
        """Block until the process exits or ``timeout``; True if it exited."""
        if self.proc is None:
            return True
        if self.pidfd is not None:
            select.select([self.pidfd], [], [], timeout)
            return self.proc.poll() is not None
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def describe_exit(self) -> str:
        code = self.poll()
        if code is None:
            return "the engine process is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the engine process (pid {self.pid}) was killed by {name}"
        return f"the engine process (pid {self.pid}) exited with code {code}"

    def error_tail(self) -> str:
        if self._log_thread is not None:
            self._log_thread.join(timeout=1.0)
        return "\n".join(self._tail)

    def _forward_output(self) -> None:
        """Engine output goes to the ``enginekit.engine_process`` logger (quiet by default), never a cell."""
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line.startswith(PHASE_PREFIX):
                self.phase = line[len(PHASE_PREFIX) :]
                continue
            self._tail.append(line)
            logger.debug("%s", line)
        self.proc.stdout.close()

    def stop(self, timeout: float) -> None:
        """Wait for a requested exit, then SIGTERM, then SIGKILL; always reaps and cleans up."""
        proc = self.proc
        if proc is not None:
            deadline = time.monotonic() + timeout
            if not self.wait_dead(max(0.0, deadline - time.monotonic())):
                log = logger.warning if timeout > 0 else logger.debug
                log("engine process %d did not exit in %.1fs; terminating", proc.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                if not self.wait_dead(5.0):
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            proc.wait()
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if self._log_thread is not None:
                self._log_thread.join(timeout=2.0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
