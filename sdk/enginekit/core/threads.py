"""ThreadGovernor: an engine on CPU runs up to ``num_threads`` torch threads, fewer while other processes keep
its cores busy.

An OpenMP parallel region ends at a barrier that waits for every worker. On an idle machine the workers spin
there for some milliseconds (the launcher's ``GOMP_SPINCOUNT``, libgomp's own default in any other process) and
two threads run an op fastest. Beside a busy process, the worker that the barrier waits for is often the
descheduled one, and every op of a step waits for it: one thread is then fastest (docs/benchmarks.md, the thread
section). So the engine reads, four times a second from its step loop, how much CPU other processes took on its
cores (``/proc/stat``, less this process's own time) and runs as many threads as they leave cores free. The
engine process sets its count when it changes; an in-process engine applies it around each of its steps only
(``client/inproc.py``), so the user's own torch code keeps the user's setting.

Fewer threads take effect at the first reading that asks for them: a step stalled on every core beside a busy
process can take seconds (the real model's took 1.7 s against 0.1 s on one thread), and a second reading to
confirm it costs one more such step. More threads need two readings in a row that agree, so one burst costs at
most half a second on one thread and the count does not flap. Only working time counts: the engine marks each
wait for requests (``pause``), and the first step after it takes the wait out of the window, the other
processes' CPU during it included. A step that runs no request (it only answers a utility call, such as a
ping or ``get_stats``, or hands outputs over) is no work and ends no wait: the governor is not called for it
(two readings of ``/proc/stat`` a call, ~50 µs each, were a fifth of a utility round trip). What other
processes do with the cores while the engine has nothing to do says nothing about how they share them with its work (a benchmark that alternates engines kept an engine of
short runs on one thread that way: each reading then held the other engines' runs). An engine opens its first
window before it loads the model (a first ``poll``, then ``pause`` once it is built): loading is work too, and
its first step then runs on the count that window measured.

The thread count changes the last bits of some ops (decode attention splits its work by thread), so with
``adaptive_threads=False`` an engine keeps exactly ``num_threads`` and repeats its logprobs bit for bit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection

import torch

logger = logging.getLogger("enginekit.engine")

INTERVAL_S = 0.25
# A core counts as free when other processes use less than this much of it (0.35: a front end that reads
# outputs at full speed takes 0.1-0.15 of a core and leaves both threads running).
_FREE_SLACK = 0.35
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (idle, iowait and steal are not busy)


def busy_seconds(cpus: Collection[int]) -> float | None:
    """Seconds the cores ``cpus`` have been busy since boot, from ``/proc/stat``; ``None`` where unreadable."""
    try:
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(b" ")
        if name.startswith(b"cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        cpus: Collection[int],
        *,
        read_busy: Callable[[Collection[int]], float | None] = busy_seconds,
        read_own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = frozenset(cpus)
        self._read_busy, self._read_own, self._clock = read_busy, read_own, clock
        self._set_threads = set_threads
        self._interval_s = interval_s
        self._next_s = 0.0
        self._last: tuple[float, float, float] | None = None  # clock, machine busy s, own CPU s
        self._proposed: int | None = None
        self._paused: tuple[float, float | None, float] | None = None  # the reading when a wait began
        self.changes = 0

    @classmethod
    def for_this_process(
        cls, max_threads: int, *, set_threads: Callable[[int], None] = torch.set_num_threads
    ) -> ThreadGovernor | None:
        """A governor over this process's cores, or ``None`` when there is nothing to choose (one thread, or
        no ``/proc/stat`` to read)."""
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if max_threads < 2 or not cpus or busy_seconds(cpus) is None:
            return None
        return cls(max_threads, cpus, set_threads=set_threads)

    def pause(self) -> None:
        """The engine is about to wait for work: the wait, up to the next ``poll``, is left out of the window."""
        if self._last is not None and self._paused is None:
            self._paused = self._reading()

    def poll(self) -> None:
        """Called every step; reads the machine only once per interval of working time (a clock read
        otherwise)."""
        if self._paused is not None:
            self._leave_out_the_wait()
        now = self._clock()
        if now < self._next_s:
            return
        self._next_s = now + self._interval_s
        _, busy, own = self._reading(now)
        if busy is None:
            return
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
        target = max(1, min(self.max_threads, int(len(self._cpus) - others + _FREE_SLACK)))
        if target == self.threads:
            self._proposed = None
        elif target > self.threads and target != self._proposed:
            self._proposed = target  # more threads: the next reading must agree
        else:
            logger.info(
                "torch threads %d -> %d (other processes used %.2f cores)", self.threads, target, others
            )
            self._set_threads(target)
            self.threads, self._proposed = target, None
            self.changes += 1

    def _reading(self, now: float | None = None) -> tuple[float, float | None, float]:
        return (self._clock() if now is None else now), self._read_busy(self._cpus), self._read_own()

    def _leave_out_the_wait(self) -> None:
        """Move the window's start and the next reading forward by the wait that just ended."""
        start, self._paused = self._paused, None
        end = self._reading()
        if self._last is None or start is None or start[1] is None or end[1] is None:
            return
        waited = end[0] - start[0]
        t, busy, own = self._last
        self._last = (t + waited, busy + (end[1] - start[1]), own + (end[2] - start[2]))
        self._next_s += waited
