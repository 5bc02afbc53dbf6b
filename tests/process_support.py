"""Test support: waiting for processes to be gone; a call on a thread; an engine that has started generating;
the engine's log lines as events.

Tests wait for the event they need; a deadline is only a guard against hanging (``HANG_GUARD_S``), generous
enough for a machine shared with other work. None of them measures how fast something happened.
"""

from __future__ import annotations

import logging
import threading
import time

import psutil

HANG_GUARD_S = 60.0


def wait_gone(pids: list[int], timeout: float = HANG_GUARD_S) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); returns the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if is_running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_thread(function):
    """Run ``function`` on a daemon thread; the list gets its result, or the exception it raised."""
    outcome = []

    def run():
        try:
            outcome.append(function())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def wait_for(condition, timeout: float = HANG_GUARD_S, what: str = "the condition") -> None:
    """Wait until ``condition()`` holds; fails the test if it still does not after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.005)


def wait_until_generating(engine, timeout: float = HANG_GUARD_S) -> None:
    """Wait until the engine has reported some request of ``engine`` running (or sent it a token)."""
    deadline = time.monotonic() + timeout
    while not any(state.version for state in list(engine._router.processor.states.values())):
        assert time.monotonic() < deadline, "no request started running"
        time.sleep(0.005)


def generate_with_deltas(engine, prompts, params):
    """``engine.generate``, with every request sent a delta per step as a stream or a viewer gets them (a plain
    ``generate`` gets one output per request, when it ends): for the tests of the per-step output path."""
    from enginekit.notebook.watch import NoWatcher

    return engine._router.collect(engine._submit(prompts, params, final_only=False), NoWatcher())


class LogWatch(logging.Handler):
    """The records of one logger (an engine process's lines reach ``enginekit.engine_process``), as events a test
    can wait for. Use as a context manager; the logger's level is lowered to DEBUG meanwhile."""

    def __init__(self, logger_name: str = "enginekit.engine_process") -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(logger_name)
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def __enter__(self) -> LogWatch:
        self._level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def count(self, needle: str) -> int:
        with self.changed:
            return sum(needle in line for line in self.lines)

    def wait_for(self, needle: str, count: int = 1, timeout: float = HANG_GUARD_S) -> None:
        """Wait until ``count`` lines hold ``needle``."""
        with self.changed:
            seen = self.changed.wait_for(lambda: sum(needle in line for line in self.lines) >= count, timeout)
        assert seen, f"no {count} log lines with {needle!r} within {timeout}s; the last: {self.lines[-5:]}"
