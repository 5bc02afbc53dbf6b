"""The thread governor: an engine on CPU (in its own process or in this one) runs fewer torch threads while other
processes keep its cores busy, and all of them again once they are free.

The rule is tested on scripted readings; real engines are then watched beside real busy processes, one per core,
so that the cores are busy whatever else the machine runs. Whether a core comes free again depends on the
machine: that test measures it first, as the governor does.
"""

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

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


def test_a_busy_core_takes_a_thread_away_at_once_and_two_free_readings_give_it_back():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, others=0.05, readings=4)  # a front end reading outputs: both threads stay
    assert governor.threads == 2 and machine.set_to == []
    run(machine, governor, others=1.0, readings=1)  # a step on both cores would stall: one reading is enough
    assert governor.threads == 1 and machine.set_to == [1]
    run(machine, governor, others=0.0, readings=1)  # the first free reading only proposes
    assert governor.threads == 1
    run(machine, governor, others=0.0, readings=1)
    assert governor.threads == 2 and machine.set_to == [1, 2]


def test_bursts_do_not_flap_the_thread_count():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, others=0.0, readings=2)
    for _ in range(5):
        run(machine, governor, others=1.5, readings=1)
        run(machine, governor, others=0.0, readings=1)
    assert machine.set_to == [1] and governor.threads == 1  # one change, kept while the bursts recur
    run(machine, governor, others=0.0, readings=2)
    assert machine.set_to == [1, 2] and governor.threads == 2


def test_a_window_opened_before_the_model_loads_sets_the_first_steps_threads():
    """An engine opens its first window before it loads the model: beside a busy process its very first step
    runs on one thread, not stalled on both cores (a wait between the load and that step is left out)."""
    machine = Machine()
    governor = machine.governor()
    governor.poll()  # before the load
    machine.advance(0.5, others=1.0)  # loading, beside a busy process
    governor.pause()  # built; no request yet
    machine.advance(3.0, others=0.0, own=0.0)  # the user types: nothing runs meanwhile
    governor.poll()  # the first step
    assert governor.threads == 1 and machine.set_to == [1]


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


HANG_GUARD_S = 120.0  # a bound against hanging: every wait below ends at the event it waits for
FREE_CORE_SEARCH_S = 30.0  # how long to look for a free core before skipping (not a hang guard)
TWO_CORES = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2 or busy_seconds({0}) is None,
    reason="sized for two cores, read from /proc/stat",
)
BATCH = [[5] * 16] * 8
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that spin, one per core: whatever else runs, the engine's cores are not free."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def generate_until(engine: Engine, condition) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        engine.generate(BATCH, PARAMS, progress=False)


def free_cores_for_a_second(engine_pid: int, cpus: frozenset[int]) -> bool:
    """Whether, over four windows of 0.25 s in a row, other processes than the engine's left a core free by a
    wide margin: each window under 0.1 cores, so that every reading of the governor within them (0.25 s, a tick
    of 10 ms either way) is under its 0.35."""
    engine = psutil.Process(engine_pid)
    for _ in range(4):
        busy, own, started = busy_seconds(cpus), sum(engine.cpu_times()[:2]), time.monotonic()
        time.sleep(0.25)  # a window of measurement, not a wait for an event
        others = busy_seconds(cpus) - busy - (sum(engine.cpu_times()[:2]) - own)
        if others / (time.monotonic() - started) > 0.1:
            return False
    return True


@TWO_CORES
def test_a_background_engine_gives_a_thread_up_beside_busy_processes():
    with Engine("builtin", mode="mp") as engine:
        assert engine.call_utility("debug_process")["max_torch_threads"] == 2
        with busy_processes(2):
            generate_until(engine, lambda: engine.call_utility("debug_process")["torch_threads"] == 1)
        assert engine.call_utility("debug_process")["thread_changes"] >= 1


@TWO_CORES
def test_a_background_engine_takes_its_thread_back_once_a_core_is_free():
    """Whether a core comes free depends on the machine: the test measures it itself, as the governor does, and
    skips when no core was free for a second within the guard (a machine shared with other work)."""
    with Engine("builtin", mode="mp") as engine:
        with busy_processes(2):
            generate_until(engine, lambda: engine.call_utility("debug_process")["torch_threads"] == 1)
        lowered = engine.call_utility("debug_process")["thread_changes"]
        stop = threading.Event()

        def keep_generating() -> None:
            while not stop.is_set():
                engine.generate(BATCH, PARAMS, progress=False)

        generating = threading.Thread(target=keep_generating, daemon=True)
        generating.start()
        try:
            cpus = frozenset(os.sched_getaffinity(engine.engine_pid))
            deadline = time.monotonic() + FREE_CORE_SEARCH_S
            while not free_cores_for_a_second(engine.engine_pid, cpus):
                if time.monotonic() > deadline:
                    pytest.skip("no core of this machine was free for a second: other work kept both busy")
            changes = engine.call_utility("debug_process")["thread_changes"]
        finally:
            stop.set()
            generating.join(HANG_GUARD_S)
        assert changes > lowered  # on one thread until then: the first change after it gave the thread back


@TWO_CORES
def test_fixed_threads_stay_fixed_where_adaptive_ones_change():
    """Both engines run the same batches beside the same busy processes, in turns, until the adaptive one has
    changed its count: the fixed one has then run as long, and has kept its threads."""
    with (
        Engine("builtin", mode="mp") as adaptive,
        Engine("builtin", mode="mp", num_threads=2, adaptive_threads=False) as fixed,
        busy_processes(2),
    ):

        def adaptive_changed() -> bool:
            fixed.generate(BATCH, PARAMS, progress=False)
            return adaptive.call_utility("debug_process")["thread_changes"] > 0

        generate_until(adaptive, adaptive_changed)
        inside = fixed.call_utility("debug_process")
    assert inside["torch_threads"] == 2 and inside["thread_changes"] == 0


@TWO_CORES
def test_an_inproc_engine_steps_on_fewer_threads_beside_busy_processes_and_leaves_the_users_count():
    """In-process the OpenMP workers are this process's and spin: beside busy processes a step on both cores
    stalls at every op. The governor's count applies inside each step; between steps and after shutdown torch
    runs on the user's count."""
    users = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with busy_processes(2), Engine("builtin", mode="inproc", num_kv_blocks=64) as engine:
            assert engine.client.thread_governor.max_threads == 2
            inside: list[int] = []
            engine.client.core.runner.model.register_forward_pre_hook(
                lambda module, args: inside.append(torch.get_num_threads())
            )
            generate_until(engine, lambda: 1 in inside)
            assert torch.get_num_threads() == 2  # between steps: the user's count
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(users)


@pytest.mark.parametrize("adaptive_threads", [True, False])
def test_an_inproc_engine_restores_the_users_thread_count_at_shutdown(adaptive_threads):
    users = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(
            "builtin", mode="inproc", num_kv_blocks=64, num_threads=2, adaptive_threads=adaptive_threads
        )
        assert torch.get_num_threads() == 2  # an explicit count applies while the engine runs
        engine.generate(BATCH, PARAMS, progress=False)
        engine.shutdown()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(users)


def test_an_inproc_engine_with_fixed_threads_has_no_governor():
    with Engine("builtin", mode="inproc", num_kv_blocks=64, num_threads=2, adaptive_threads=False) as engine:
        assert engine.client.thread_governor is None


def test_utility_calls_between_runs_neither_read_the_machine_nor_end_the_wait():
    """A step that only answers a utility call (a ping, ``get_stats``) is no model work: the governor reads
    nothing for it (two ``/proc/stat`` readings a call were a fifth of a round trip) and the wait it falls in goes
    on; the next run's first step ends the wait."""
    users = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with Engine("builtin", mode="inproc", num_kv_blocks=64, num_threads=2) as engine:
            governor = engine.client.thread_governor
            assert governor is not None
            engine.generate(BATCH, PARAMS, progress=False)
            assert governor._paused is not None  # the run ended: a wait began
            reads = []
            read = governor._read_busy
            governor._read_busy = lambda cpus: reads.append(1) or read(cpus)
            for _ in range(20):
                engine.call_utility("ping")
                engine.get_stats()
            assert reads == [] and governor._paused is not None
            engine.generate(BATCH, PARAMS, progress=False)
            assert reads  # the run's first step took the wait out of the window
    finally:
        torch.set_num_threads(users)
