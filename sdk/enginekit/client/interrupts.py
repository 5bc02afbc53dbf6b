"""Ctrl-C at a safe point: while a critical section runs on the main thread, an interrupt is noted and raised
when it ends.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be can cut a batch of outputs in half (the
rest, meant for requests of other threads, is lost), leave an in-process step half applied, or land in a
destructor, where Python prints it and drops it (pyzmq checks signals while freeing a frame). Inside
``deferred_interrupts()`` the interrupt waits for the end of the section instead; a second Ctrl-C raises at
once, as an escape hatch. It takes over only Python's default handler, only on the main thread, and restores
it exactly; nested sections share the outermost one.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[bool]]:
    """Yield a list that gets an item when Ctrl-C arrives (a loop may stop early on it); raise
    ``KeyboardInterrupt`` on the way out if it did."""
    interrupted: list[bool] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupted
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt
