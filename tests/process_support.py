"""Test support: waiting for processes to be gone; a call on a thread; an engine that has started generating."""

from __future__ import annotations

import threading
import time

import psutil


def wait_gone(pids: list[int], timeout: float) -> list[int]:
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


def wait_until_generating(engine, timeout: float = 60.0) -> None:
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
