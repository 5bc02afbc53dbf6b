"""Test support: waiting for processes to be gone."""

from __future__ import annotations

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
