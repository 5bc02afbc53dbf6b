"""Ctrl-C at a safe point: while a critical section runs on the main thread, an interrupt is noted and raised
when it ends.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be can cut a batch of outputs in half (the
rest, meant for requests of other threads, is lost), leave an in-process step half applied, land inside a loop
callback, or land in a destructor, where Python prints it and drops it (pyzmq checks signals while freeing a
frame). Inside ``deferred_interrupts()`` the interrupt waits for the end of the section instead; a second Ctrl-C
raises at once, as an escape hatch. It takes over only Python's default handler, only on the main thread, and
restores it exactly. A section inside another shares the outer one (and its ``on_interrupt``) at almost no cost.

An ``await`` on the main thread's loop is interrupted by whoever handles SIGINT there (a Jupyter kernel cancels
the cell's task). ``awaiting_with_signal_checks()`` keeps that prompt while the awaited outputs are far apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

_active: list[bool] | None = None  # the outermost section's notes, while its handler is in place


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or ``None``."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@contextlib.contextmanager
def deferred_interrupts(on_interrupt: Callable[[], None] | None = None) -> Iterator[list[bool]]:
    """Yield a list that gets an item when Ctrl-C arrives (a loop may stop early on it), after calling
    ``on_interrupt`` (a blocking call cancels its task there); raise ``KeyboardInterrupt`` on the way out if it
    did. An exception leaving the section goes on as it is."""
    global _active
    if _active is not None and threading.current_thread() is threading.main_thread():
        yield _active
        return
    interrupted: list[bool] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupted
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(True)
        if on_interrupt is not None:
            on_interrupt()

    previous = signal.signal(signal.SIGINT, on_sigint)
    _active = interrupted
    try:
        yield interrupted
    finally:
        _active = None
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


SIGNAL_CHECK_S = 0.1
_tickers: dict[asyncio.AbstractEventLoop, list[Any]] = {}  # per loop: [number of awaiting calls, timer]


@contextlib.contextmanager
def awaiting_with_signal_checks() -> Iterator[None]:
    """While the calling task awaits on the main thread's loop, wake that loop every ``SIGNAL_CHECK_S``.

    A SIGINT sent to the process may be delivered to any of its threads (a Jupyter kernel has several). The
    Python handler always runs on the main thread, but only once that thread runs Python code again: a loop
    sleeping in ``select`` until the next output (a ``generate`` hears only each request's end) would run the
    kernel's handler, which cancels the awaiting cell, only when the whole generation is done. The periodic
    wake-up bounds that delay. One timer per loop, however many calls await.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    ticker = _tickers.get(loop)
    if ticker is None:
        ticker = _tickers[loop] = [0, None]
        _tick(loop, ticker)
    ticker[0] += 1
    try:
        yield
    finally:
        ticker[0] -= 1
        if ticker[0] == 0:
            ticker[1].cancel()
            del _tickers[loop]


def _tick(loop: asyncio.AbstractEventLoop, ticker: list[Any]) -> None:
    # NOTE: does nothing: returning from select is what lets the main thread run a pending signal handler.
    ticker[1] = loop.call_later(SIGNAL_CHECK_S, _tick, loop, ticker)
