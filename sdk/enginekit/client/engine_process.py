"""EngineProcess: start, watch and stop the engine process from the front end.

The child is never a fork of the user's process, so a notebook that already initialised CUDA is safe and
nothing of the notebook is pickled. Two start methods:

- ``"launcher"`` (default on Linux): forked by the shared launcher process, which imported torch once
  (see ``client/launcher.py``); a restart then skips the torch import.
- ``"spawn"``: a fresh interpreter, ``python -m enginekit.core.engine_core_proc``.

Either way the child runs in its own session, so a SIGINT sent to the kernel's process group does not reach
it. Its stdin is a pipe the front end keeps open: when the front end dies, the child reads EOF and exits,
even mid-load. Its output goes to the ``enginekit.engine_process`` logger (quiet by default), never a cell.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
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
    def __init__(self, start_method: str = "launcher") -> None:
        self.run_dir = tempfile.mkdtemp(prefix="enginekit-")  # mode 0700: private to this user
        self.start_method = start_method if hasattr(os, "pidfd_open") else "spawn"
        self.pid = -1
        self.pidfd: int | None = None
        self.phase = "spawn"  # the child reports each startup phase on its output
        self.forward_level = logging.DEBUG
        self.forward_own_levels = False
        self._popen: subprocess.Popen[bytes] | None = None
        self._launcher = None
        self._stdin: int | None = None  # write end of the child's stdin: the parent-death pipe
        self._returncode: int | None = None
        self._poll_lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self._log_thread: threading.Thread | None = None

    def ipc_address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.run_dir, name)}"

    # ---- start --------------------------------------------------------------------------------------
    def start(self, args: EngineProcArgs) -> None:
        # log_level "info"/"debug" asks to see the engine's logs: forward each record at its own level.
        self.forward_own_levels = args.config.log_level != "warning"
        output = self._start_forked() if self.start_method == "launcher" else self._start_spawned()
        payload = msgspec.msgpack.encode(args)
        os.write(self._stdin, len(payload).to_bytes(8, "little") + payload)
        self._log_thread = threading.Thread(
            target=self._forward_output, args=(output,), name="enginekit-engine-log", daemon=True
        )
        self._log_thread.start()

    def _start_spawned(self) -> int:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # NOTE: our own session and process group: Jupyter's interrupt signals the kernel's whole group.
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "enginekit.core.engine_core_proc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
        assert self._popen.stdin is not None and self._popen.stdout is not None
        self._stdin = os.dup(self._popen.stdin.fileno())
        self._popen.stdin.close()
        self.pid = self._popen.pid
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.pid)
        output = os.dup(self._popen.stdout.fileno())
        self._popen.stdout.close()
        return output

    def _start_forked(self) -> int:
        from enginekit.client.launcher import Launcher

        self._launcher = Launcher.shared()
        stdin_read, self._stdin = os.pipe()
        output_read, output_write = os.pipe()
        try:
            self.pid = self._launcher.spawn(stdin_read, output_write)
        except BaseException:
            os.close(output_read)  # no child will write to it; stop() closes our end of stdin
            raise
        finally:
            os.close(stdin_read)
            os.close(output_write)
        self.pidfd = os.pidfd_open(self.pid)
        return output_read

    # ---- liveness -----------------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or ``None`` while running."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> int | None:
        if self._returncode is not None or self.pid < 0:
            return self._returncode
        if self._popen is not None:
            self._returncode = self._popen.poll()
        elif self.pidfd is not None and _readable(self.pidfd, 0):
            self._returncode = self._launcher.exit_status(self.pid)
            if self._returncode is None:  # exited, not yet reaped by the launcher
                time.sleep(0.01)
                self._returncode = self._launcher.exit_status(self.pid)
        return self._returncode

    def is_alive(self) -> bool:
        return self.pid > 0 and self.poll() is None

    def wait_dead(self, timeout: float) -> bool:
        """Block until the process exits or ``timeout``; True if it exited."""
        if self.pid < 0:
            return True
        if self.pidfd is not None:
            _readable(self.pidfd, timeout)
        elif self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)
        deadline = time.monotonic() + 1.0
        while self.poll() is None and _readable(self.pidfd, 0) and time.monotonic() < deadline:
            time.sleep(0.01)  # exited; the launcher reaps it in a moment
        return self.poll() is not None

    def describe_exit(self) -> str:
        code = self.poll()
        if code is None:
            return f"the engine process (pid {self.pid}) is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the engine process (pid {self.pid}) was killed by {name}"
        return f"the engine process (pid {self.pid}) exited with code {code}"

    def error_tail(self) -> str:
        if self._log_thread is not None and self.poll() is not None:
            self._log_thread.join(timeout=1.0)
        return "\n".join(self._tail)

    def _forward_output(self, fd: int) -> None:
        level = self.forward_level
        with open(fd, "rb") as output:
            for raw in output:
                line = raw.decode("utf-8", errors="replace").rstrip()
                if line.startswith(PHASE_PREFIX):
                    self.phase = line[len(PHASE_PREFIX) :]
                    continue
                self._tail.append(line)
                message = line
                if self.forward_own_levels:
                    record = _RECORD.match(line)
                    if record is not None:  # other lines (a traceback) keep the last record's level
                        level = logging.getLevelName(record["level"])
                        message = f"{record['process']} {record['message']}"
                logger.log(level, "%s", message)

    # ---- stop ---------------------------------------------------------------------------------------
    def send_signal(self, signum: int) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                if self.pidfd is not None:
                    signal.pidfd_send_signal(self.pidfd, signum)
                else:
                    os.kill(self.pid, signum)

    def stop(self, timeout: float) -> None:
        """Wait for a requested exit, then SIGTERM, then SIGKILL; always reaps and cleans up."""
        if self.pid > 0 and not self.wait_dead(timeout):
            log = logger.warning if timeout > 0 else logger.debug
            log("engine process %d did not exit in %.1fs; terminating", self.pid, timeout)
            self.send_signal(signal.SIGTERM)
            if not self.wait_dead(5.0):
                self.send_signal(signal.SIGKILL)
                self.wait_dead(10.0)
        if self._popen is not None:
            self._popen.wait()
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None
        if self._log_thread is not None:
            self._log_thread.join(timeout=2.0)
        self.poll()  # record the exit status before the pidfd goes
        if self._launcher is not None and self._returncode is not None:
            self._launcher.forget(self.pid)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        shutil.rmtree(self.run_dir, ignore_errors=True)


# A log line of the engine process, as its logging format writes it (core/engine_core_proc.py).
_RECORD = re.compile(
    r"\S+ \S+ (?P<process>engine\[\d+\]) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<message>.*)"
)


def _readable(fd: int | None, timeout: float) -> bool:
    if fd is None:
        return False
    return bool(select.select([fd], [], [], timeout)[0])
