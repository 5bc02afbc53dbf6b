"""EngineProcess: start, watch and stop one engine process from the front end.

The child is never a fork of the user's process, so a notebook that already initialised CUDA is safe and
nothing of the notebook is pickled. Two start methods:

- ``"launcher"`` (default on Linux): forked by the shared launcher, which imported torch once
  (``runtime/launcher.py``); a restart then skips the torch import.
- ``"spawn"``: a fresh interpreter, ``python -m enginekit.runtime.engine_main``.

Either way the child runs in its own session, so a SIGINT sent to the kernel's process group does not reach
it. Its stdin is a pipe the front end keeps open: when the front end dies, the child reads EOF and exits,
even mid-load. Its output goes to the ``enginekit.engine_process`` logger (quiet by default), never a cell.
Liveness comes from the child's pidfd, never from the launcher; the exit code of a forked child is asked of
the launcher once the child has exited, and is "unknown" if the launcher is gone by then.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

from enginekit.runtime.launcher import Launcher, LauncherError, engine_environ
from enginekit.wire.messages import LAST_WORDS, EngineProcArgs
from enginekit.wire.serial import write_frame

logger = logging.getLogger("enginekit.engine_process")

ERROR_TAIL_LINES = 40
UNKNOWN_STATUS = "unknown"


class EngineProcess:
    def __init__(self, start_method: str = "launcher") -> None:
        self.start_method = start_method if hasattr(os, "pidfd_open") else "spawn"
        self.pid = -1
        self.pidfd: int | None = None
        self.phase = "startup"  # updated from the engine's phase reports
        self.forward_own_levels = False
        self._popen: subprocess.Popen[bytes] | None = None
        self._launcher: Launcher | None = None
        self._stdin: int | None = None  # write end of the child's stdin: the parent-death pipe
        self._returncode: int | str | None = None  # exit code, UNKNOWN_STATUS, or None while running
        self._status_lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self._log_thread: threading.Thread | None = None
        self._stopped = False

    # ---- start --------------------------------------------------------------------------------------
    def start(self, args: EngineProcArgs) -> None:
        """Start the child and hand it its arguments; raises ``OSError`` or ``LauncherError``."""
        # log_level "info"/"debug" asks to see the engine's logs: forward each record at its own level.
        self.forward_own_levels = args.config.log_level != "warning"
        output = self._start_forked() if self.start_method == "launcher" else self._start_spawned()
        self._log_thread = threading.Thread(
            target=self._forward_output, args=(output,), name="enginekit-engine-log", daemon=True
        )
        self._log_thread.start()
        assert self._stdin is not None
        write_frame(self._stdin, args)

    def _start_spawned(self) -> int:
        env = engine_environ({**os.environ, "PYTHONUNBUFFERED": "1"})
        # NOTE: our own session and process group: Jupyter's interrupt signals the kernel's whole group.
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "enginekit.runtime.engine_main"],
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
        stdin_read, self._stdin = os.pipe()
        output_read, output_write = os.pipe()
        try:
            self.pid = self._fork(stdin_read, output_write)
            self.pidfd = os.pidfd_open(self.pid)
        except BaseException:
            os.close(output_read)  # no child will write to it; stop() closes our end of stdin
            raise
        finally:
            os.close(stdin_read)
            os.close(output_write)
        return output_read

    def _fork(self, stdin_read: int, output_write: int) -> int:
        """Fork through the shared launcher; a launcher found dead on the way is replaced once."""
        for attempt in range(2):
            launcher = Launcher.shared()
            try:
                pid = launcher.spawn(stdin_read, output_write)
            except LauncherError:
                if attempt or launcher.is_alive():
                    raise
                continue
            self._launcher = launcher
            return pid
        raise AssertionError("unreachable")

    # ---- liveness -----------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        if self.pid < 0:
            return False
        if self.pidfd is not None:
            return not readable(self.pidfd, 0)
        return self._popen is not None and self._popen.poll() is None

    def wait_dead(self, timeout: float) -> bool:
        """Block until the process exits or ``timeout``; True if it exited."""
        if self.pid < 0:
            return True
        if self.pidfd is not None:
            return readable(self.pidfd, timeout)
        if self._popen is None:
            return True  # stopped already: its pidfd is closed
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)
        return self._popen.poll() is not None

    def returncode(self) -> int | str | None:
        """The exit code (negative: killed by that signal), ``"unknown"``, or ``None`` while running.

        Never blocks for long: a forked child's code comes from the launcher (a local round trip).
        """
        with self._status_lock:
            if self._returncode is None and not self.is_alive() and self.pid > 0:
                self._returncode = self._read_returncode()
            return self._returncode

    def _read_returncode(self) -> int | str:
        if self._popen is not None:
            return self._popen.wait()
        launcher = self._launcher
        if launcher is None or not launcher.is_alive():
            return UNKNOWN_STATUS
        deadline = time.monotonic() + 1.0
        while True:
            try:
                code = launcher.exit_status(self.pid, timeout=1.0)
            except LauncherError:
                return UNKNOWN_STATUS
            if code is not None:
                return code
            if time.monotonic() > deadline:
                return UNKNOWN_STATUS
            time.sleep(0.005)  # exited, not yet reaped by the launcher

    def describe_exit(self) -> str:
        code = self.returncode()
        if code is None:
            return f"the engine process (pid {self.pid}) is still running"
        if code == UNKNOWN_STATUS:
            return (
                f"the engine process (pid {self.pid}) exited; its exit status is unknown because the "
                "launcher that started it is gone"
            )
        assert isinstance(code, int)
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the engine process (pid {self.pid}) was killed by {name}"
        if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):  # how it exits after stopping for a signal
            name = signal.Signals(code - 128).name
            return f"the engine process (pid {self.pid}) exited with code {code}: it stopped for {name}"
        return f"the engine process (pid {self.pid}) exited with code {code}"

    def error_tail(self) -> str:
        if self._log_thread is not None and not self.is_alive():
            self._log_thread.join(timeout=1.0)
        return "\n".join(self._tail)

    def _forward_output(self, fd: int) -> None:
        level = logging.DEBUG
        with open(fd, "rb") as output:
            for raw in output:
                line = raw.decode("utf-8", errors="replace").rstrip()
                self._tail.append(line)
                if line.startswith(LAST_WORDS):
                    continue  # its EngineDead, repeated for the front end (wire.messages.last_words): no log
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
        """Wait for a requested exit, then SIGTERM, then SIGKILL; always reaps and cleans up (once)."""
        if self._stopped:
            return
        self._stopped = True
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
        self.returncode()  # record the exit status before the pidfd goes
        if self._launcher is not None:
            if isinstance(self._returncode, int):
                self._launcher.forget(self.pid)
            Launcher.engine_stopped(self._launcher)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


# A log line of the engine process, as its logging format writes it (runtime/engine_main.py). Used to forward
# each record at its own level; the protocol never travels on this stream.
_RECORD = re.compile(
    r"\S+ \S+ (?P<process>engine\[\d+\]) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<message>.*)"
)


def readable(fd: int | None, timeout: float) -> bool:
    """Whether ``fd`` turns readable within ``timeout`` seconds (a pidfd: the process has exited)."""
    if fd is None:
        return False
    return bool(select.select([fd], [], [], timeout)[0])
