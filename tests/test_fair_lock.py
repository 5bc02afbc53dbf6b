"""The in-process client's lock is taken in the order threads ask: a call from another thread waits a step or two
beside a thread that steps back to back, never hundreds (CPython's own locks let the releasing thread win)."""

import ctypes
import itertools
import signal
import statistics
import threading

import pytest

from enginekit import Engine, SamplingParams
from enginekit.client.fair_lock import FairLock
from process_support import HANG_GUARD_S, in_thread, wait_for

LONG = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)


def test_threads_get_the_lock_in_the_order_they_asked():
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    waiters = []
    for index in range(5):
        thread, _ = in_thread(lambda index=index: _append_under(lock, order, index))
        waiters.append(thread)
        wait_for(lambda index=index: lock._next_ticket == index + 2, what=f"waiter {index} taking a ticket")
    lock.release()
    for thread in waiters:
        thread.join(HANG_GUARD_S)
    assert order == [0, 1, 2, 3, 4]


def _append_under(lock: FairLock, order: list[int], index: int) -> None:
    with lock:
        order.append(index)


def test_a_thread_that_takes_it_in_a_loop_lets_a_waiter_in_after_one_turn():
    lock = FairLock()
    turns = [0]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                turns[0] += 1

    looper, _ = in_thread(loop)
    wait_for(lambda: turns[0] > 100, what="the looping thread running")
    waited = []
    for _ in range(200):
        before = turns[0]  # the looper holds or waits for at most one ticket older than ours
        with lock:
            waited.append(turns[0] - before)
    stop.set()
    looper.join(HANG_GUARD_S)
    # Between reading the count and asking, the looper may run while this thread waits for the GIL: the median.
    assert statistics.median(waited) <= 1, waited


def test_it_is_reentrant_and_only_its_holder_releases_it():
    lock = FairLock()
    with lock, lock:
        _, outcome = in_thread(lock.release)
        assert isinstance(outcome[0], RuntimeError)
    acquired, _ = in_thread(lambda: _append_under(lock, [], 0))
    acquired.join(HANG_GUARD_S)
    assert not acquired.is_alive(), "the lock stayed held after its holder left both levels"


def test_an_interrupted_waiter_does_not_block_the_threads_behind_it():
    lock = FairLock()
    lock.acquire()
    interrupted, outcome = in_thread(lambda: _append_under(lock, [], 0))
    wait_for(lambda: lock._next_ticket == 2, what="the first waiter taking a ticket")
    behind, _ = in_thread(lambda: _append_under(lock, [], 1))
    wait_for(lambda: lock._next_ticket == 3, what="the second waiter taking a ticket")
    # As a Ctrl-C would: an exception raised in the first waiter while it waits for its turn.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(interrupted.ident), ctypes.py_object(KeyboardInterrupt)
    )
    lock.release()  # wakes the waiters; the first one raises on its way out of the wait
    interrupted.join(HANG_GUARD_S)
    behind.join(HANG_GUARD_S)
    assert isinstance(outcome[0], KeyboardInterrupt), outcome
    assert not behind.is_alive(), "the thread behind an interrupted waiter never got the lock"
    with lock:  # and the lock is free again
        pass


def test_in_process_a_call_from_another_thread_waits_steps_not_hundreds():
    with Engine("builtin", mode="inproc", num_kv_blocks=64) as engine:
        worker, _ = in_thread(lambda: engine.generate(["a", "b"], LONG))
        wait_for(lambda: engine.get_stats()["num_running_requests"] == 2, what="both requests running")
        steps = [engine.get_stats()["num_steps"] for _ in range(30)]
        engine.abort(engine.call_utility("get_request_ids"))
        worker.join(HANG_GUARD_S)
    # A call takes the lock three times (hand over, step until answered, take the answer), each after at most
    # one step of the generating thread, and runs one step itself; more only while this thread waited for the
    # GIL or a core, hence the median. Before: a median of 14, up to 300.
    between = [after - before for before, after in itertools.pairwise(steps)]
    assert statistics.median(between) <= 4, between


class _InterruptedOnceHeld:
    """The client's lock, with a Ctrl-C (a real SIGINT, to this thread) landing the instant it has been granted:
    the worst moment for a lock whose acquire is Python code."""

    def __init__(self, lock: FairLock) -> None:
        self.lock = lock

    def __enter__(self) -> None:
        self.lock.acquire()
        signal.raise_signal(signal.SIGINT)  # to this thread, at once
        _python_call()  # Python runs a pending signal's handler at a call like this one

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _python_call() -> None:
    pass


def test_a_ctrl_c_as_the_in_process_lock_is_granted_is_raised_after_it_is_released():
    with Engine("builtin", mode="inproc", num_kv_blocks=64) as engine:
        client = engine.client
        lock = client._lock
        client._lock = _InterruptedOnceHeld(lock)
        try:
            with pytest.raises(KeyboardInterrupt):
                engine.abort(["no-such-request"])  # this thread takes the lock (a utility call hands it on)
        finally:
            client._lock = lock
        assert lock._owner is None, "the interrupt left the lock held: every later call would wait for good"
        waiter, stats = in_thread(engine.get_stats)
        waiter.join(HANG_GUARD_S)
        assert not waiter.is_alive() and stats[0]["num_running_requests"] == 0
