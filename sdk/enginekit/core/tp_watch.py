"""Rank 0's watch over its tensor-parallel workers: their processes, never the collective they may hang in.

A thread (``enginekit-tp-watch``) polls every worker's pidfd, and while a step runs it also looks at each worker
four times a second. A worker fails the engine when:

- it exits, at any time (its pidfd turns readable);
- during a step, it has made no progress for ``tensor_parallel_stall_timeout`` seconds while holding the others
  up: it has not reached the collective another rank waits in (the ``ProgressBoard`` counts), or it is stopped
  (SIGSTOP, a debugger), and in that time neither its count nor its CPU time moved, and it is not running or in
  disk IO. The watch then kills it (SIGKILL), so that gloo's collective raises in rank 0 and names it.

Either way ``on_failure`` hears the reason once (the executor fails the engine, and during a step aborts the group:
NCCL's collectives never raise on a dead peer). Should the step still not end within ``ABORT_GRACE_S``,
``on_stuck`` hears it: the engine process reports its death and exits, as a step that raised would have made it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from enginekit.model.parallel import ProgressBoard

logger = logging.getLogger("enginekit.engine_process")

LOOK_S = 0.25  # how often a running step's workers are looked at
ABORT_GRACE_S = 5.0  # how long a step may take to fail by itself once a worker is dead (gloo: at once)
BUSY_STATES = frozenset("RD")  # running, or waiting for disk IO: busy, not stalled
GONE_STATES = frozenset("ZXx")  # exited: a death, which the pidfd reports
STATE_WORDS = {
    "T": "it is stopped (SIGSTOP or a job-control stop)",
    "t": "it is stopped by a debugger or tracer",
    "S": "it sleeps outside the collective the other ranks wait in",
}


class WorkerWatch:
    """Watch ``workers`` (rank 1 is the first) from a thread until ``close``; see the module's docstring."""

    def __init__(
        self,
        workers: Sequence[subprocess.Popen[bytes]],
        board: ProgressBoard,
        stall_timeout_s: float,
        *,
        on_failure: Callable[[str], None],
        on_stuck: Callable[[str], None],
    ) -> None:
        self.workers = list(workers)
        self.board = board
        self.stall_timeout_s = stall_timeout_s
        self.on_failure = on_failure
        self.on_stuck = on_stuck
        self.step_started: float | None = None  # the executor sets it around a step's collectives
        self.failure: str | None = None  # the first failure found, as a sentence
        self._pidfds = [os.pidfd_open(worker.pid) for worker in self.workers]
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="enginekit-tp-watch", daemon=True)
        self._thread.start()

    # ---- what the executor asks -------------------------------------------------------------------------
    def death_reason(self) -> str | None:
        """The failure found so far, else the first worker found dead, as a sentence; ``None`` while all live."""
        if self.failure is not None:
            return self.failure
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel worker rank {rank} (pid {worker.pid}) exited with {how}"
        return None

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for fd in (*self._pidfds, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds = []

    # ---- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self._pidfds:
            poller.register(fd, select.POLLIN)
        stalls = _StallClock()
        failed_at: float | None = None
        while not self._stopping:
            events = poller.poll(LOOK_S * 1000)
            if self._stopping:
                return
            for fd, _ in events:
                if fd != self._wake_r:
                    poller.unregister(fd)  # dead: readable for good
            now = time.monotonic()
            if failed_at is None:
                reason = self.death_reason() if events else None
                if reason is None and self.step_started is not None:
                    reason = self._stalled(stalls, now)
                if reason is not None:
                    failed_at = now
                    self._fail(reason)
            if failed_at is not None:
                if self.step_started is None:
                    return  # the step failed by itself (gloo), or none ran: the engine fails from its loop
                if now - failed_at >= ABORT_GRACE_S:
                    logger.error("the step did not end %.0f s after: %s", ABORT_GRACE_S, self.failure)
                    self.on_stuck(self.failure or "")
                    return

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        logger.error("%s", self.failure)
        self.on_failure(self.failure)

    def _stalled(self, stalls: _StallClock, now: float) -> str | None:
        """The workers holding the running step up without progress for the stall timeout, killed, as a sentence."""
        step_started = self.step_started
        if step_started is None:
            return None
        counts = self.board.snapshot()
        reached = max(counts)  # the collective the furthest rank entered
        stalled = []
        for rank, worker in enumerate(self.workers, start=1):
            state, cpu = _process_state(worker.pid)
            if state in GONE_STATES:
                continue  # its pidfd tells
            idle_s = stalls.idle_for(rank, (counts[rank], cpu), now, step_started)
            behind = counts[rank] < reached or state in ("T", "t")
            if behind and state not in BUSY_STATES and idle_s >= self.stall_timeout_s:
                stalled.append((rank, worker, state))
        if not stalled:
            return None
        for _, worker, _ in stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
        timeout = f"{self.stall_timeout_s:g} s"
        if len(stalled) == 1:
            rank, worker, state = stalled[0]
            who = f"worker rank {rank} (pid {worker.pid})"
            why = STATE_WORDS.get(state, f"its state is {state}")
            killed = "it"
        else:
            who = "workers " + ", ".join(f"rank {rank} (pid {worker.pid})" for rank, worker, _ in stalled)
            why = "; ".join(
                f"rank {rank}: {STATE_WORDS.get(state, f'its state is {state}')}"
                for rank, _, state in stalled
            )
            killed = "them"
        return (
            f"tensor-parallel {who} made no progress for {timeout} in a step, holding the other ranks up "
            f"(tensor_parallel_stall_timeout={self.stall_timeout_s:g}): {why}; the engine killed {killed}"
        )


class _StallClock:
    """Since when each worker has shown the same (progress count, CPU time), counted from the step's start."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}
        self._since: dict[int, float] = {}
        self._step: float | None = None

    def idle_for(self, rank: int, sample: tuple[int, int], now: float, step_started: float) -> float:
        if step_started != self._step:  # a new step: what happened between steps does not count
            self._step = step_started
            self._seen.clear()
        if self._seen.get(rank) != sample:
            self._seen[rank] = sample
            self._since[rank] = now
        return now - max(self._since[rank], step_started)


def _process_state(pid: int) -> tuple[str, int]:
    """A process's state letter (``/proc/<pid>/stat``) and its CPU time in clock ticks; ``("X", 0)`` once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read().decode("ascii", "replace")
    except OSError:
        return "X", 0
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime
