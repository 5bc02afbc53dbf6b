"""The thread governor: a background engine runs fewer torch threads while other processes keep its cores busy,
and all of them again once they are free.

The rule is tested on scripted readings; a real engine is then watched beside a real busy process.
"""

import os
import subprocess
import sys
import time

import pytest

from enginekit import Engine, SamplingParams
from enginekit.core.threads import ThreadGovernor, busy_seconds


class Machine:
    """Scripted readings: each step of the clock, other processes use ``others`` cores and we use ``own``."""

    def __init__(self) -> None:
        self.now = self.busy = self.own_s = 0.0
        self.set_to: list[int] = []

    def advance(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own_s += own * seconds

    def governor(self, max_threads: int = 2, cpus=(0, 1)) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            cpus,
            read_busy=lambda _: self.busy,
            read_own=lambda: self.own_s,
            clock=lambda: self.now,
            set_threads=self.set_to.append,
        )


def run(machine: Machine, governor: ThreadGovernor, others: float, readings: int) -> None:
    for _ in range(readings):
        machine.advance(0.25, others)
        governor.poll()


def test_a_busy_core_takes_a_thread_away_after_two_readings_that_agree():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, others=0.05, readings=4)  # a front end reading outputs: both threads stay
    assert governor.threads == 2 and machine.set_to == []
    run(machine, governor, others=1.0, readings=1)  # the first reading under load only proposes
    assert governor.threads == 2
    run(machine, governor, others=1.0, readings=1)
    assert governor.threads == 1 and machine.set_to == [1]
    run(machine, governor, others=0.0, readings=2)
    assert governor.threads == 2 and machine.set_to == [1, 2]


def test_one_burst_does_not_flap_the_thread_count():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, others=0.0, readings=2)
    for _ in range(5):
        run(machine, governor, others=1.5, readings=1)
        run(machine, governor, others=0.0, readings=1)
    assert machine.set_to == [] and governor.threads == 2


def test_time_spent_waiting_for_work_does_not_count():
    """Other processes that use the cores while the engine waits (other engines' runs between the short runs of
    this one, as a benchmark alternates them) neither propose nor confirm a change: the waits are taken out of
    the window. A busy process that keeps a core while the engine works still takes a thread away."""
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, others=0.0, readings=1)

    def short_run(wait_s: float, others_while_waiting: float, others: float) -> None:
        """A wait, then a run shorter than the interval: a step right after the wait, one at its end."""
        governor.pause()
        machine.advance(wait_s, others=others_while_waiting, own=0.0)
        governor.poll()
        machine.advance(0.15, others=others)
        governor.poll()

    for _ in range(8):  # each after a wait shorter than the interval, others taking both cores meanwhile
        short_run(0.1, others_while_waiting=2.0, others=0.05)
    assert governor.threads == 2 and machine.set_to == []
    for _ in range(4):  # the same runs beside a busy process
        short_run(0.1, others_while_waiting=1.0, others=1.0)
    assert governor.threads == 1 and machine.set_to == [1]


def test_the_count_stays_between_one_and_the_maximum():
    machine = Machine()
    governor = machine.governor(max_threads=4, cpus=range(8))
    run(machine, governor, others=0.0, readings=3)
    assert governor.threads == 4  # eight free cores, but never more than num_threads
    run(machine, governor, others=5.2, readings=3)
    assert governor.threads == 3  # 2.8 cores left free: three threads
    run(machine, governor, others=8.0, readings=3)
    assert governor.threads == 1
    assert machine.set_to == [3, 1]


def test_readings_come_only_once_per_interval():
    machine = Machine()
    reads = []
    governor = machine.governor()
    governor._read_busy = lambda cpus: reads.append(cpus) or machine.busy
    for _ in range(100):  # a hundred steps within one interval
        machine.advance(0.001, others=0.0)
        governor.poll()
    assert len(reads) == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_busy_seconds_grow_with_this_process_work():
    cpus = os.sched_getaffinity(0)
    before, started = busy_seconds(cpus), time.process_time()
    while time.process_time() - started < 0.3:
        pass
    assert busy_seconds(cpus) - before >= 0.2
    assert busy_seconds(set()) == 0


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2, reason="sized for two cores"
)
def test_a_background_engine_gives_a_thread_up_beside_a_busy_process_and_takes_it_back():
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with Engine("builtin", mode="mp") as engine:

        def threads_while_generating(seconds: float) -> set[int]:
            seen, deadline = set(), time.monotonic() + seconds
            while time.monotonic() < deadline:
                engine.generate([[5] * 16] * 8, params, progress=False)
                seen.add(engine.call_utility("debug_process")["torch_threads"])
            return seen

        assert engine.call_utility("debug_process")["max_torch_threads"] == 2
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            assert 1 in threads_while_generating(3.0)
        finally:
            busy.kill()
            busy.wait()
        assert 2 in threads_while_generating(3.0)
        assert engine.call_utility("debug_process")["thread_changes"] >= 2


def test_fixed_threads_stay_fixed_beside_a_busy_process():
    with Engine("builtin", mode="mp", num_threads=2, adaptive_threads=False) as engine:
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                engine.generate([[5] * 16] * 4, SamplingParams(max_tokens=32, temperature=0), progress=False)
            inside = engine.call_utility("debug_process")
        finally:
            busy.kill()
            busy.wait()
        assert inside["torch_threads"] == 2 and inside["thread_changes"] == 0
