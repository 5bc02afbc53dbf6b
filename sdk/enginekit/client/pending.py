"""PendingCalls: the utility calls a client has sent and not yet had answered, each behind a future.

A blocking call waits on a ``concurrent.futures.Future``, an async one on an ``asyncio.Future`` of its loop
(``answers``). Answers arrive on whichever thread reads the output socket; resolving is thread-safe either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import Any

from enginekit.errors import UtilityCallError
from enginekit.wire.messages import UtilityOutput

AnyFuture = concurrent.futures.Future[Any] | asyncio.Future[Any]


class PendingCalls:
    def __init__(self) -> None:
        self._calls: dict[int, AnyFuture] = {}
        self._lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._error: BaseException | None = None

    def add(self, future: AnyFuture) -> int:
        """Track ``future`` under a new call id; fails it at once if the engine is already gone."""
        with self._lock:
            call_id = next(self._call_ids)
            if self._error is None:
                self._calls[call_id] = future
        if self._error is not None:
            _settle(future, None, self._error)
        return call_id

    def discard(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def resolve(self, output: UtilityOutput) -> None:
        with self._lock:
            future = self._calls.pop(output.call_id, None)
        if future is None:
            return  # timed out or cancelled meanwhile
        error = UtilityCallError(output.failure_message) if output.failure_message else None
        _settle(future, output.result, error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending call, and every later one, with ``error``."""
        with self._lock:
            self._error = error
            calls, self._calls = self._calls, {}
        for future in calls.values():
            _settle(future, None, error)

    def __len__(self) -> int:
        return len(self._calls)


def _settle(future: AnyFuture, result: Any, error: BaseException | None) -> None:
    if isinstance(future, asyncio.Future):
        loop = future.get_loop()
        if asyncio._get_running_loop() is loop:  # on the loop's own thread (the async reader)
            _complete(future, result, error)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(_complete, future, result, error)
        return
    _complete(future, result, error)


def _complete(future: AnyFuture, result: Any, error: BaseException | None) -> None:
    """Settle ``future`` (on its loop's thread for an asyncio one) unless it already is."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def answers(futures: list[asyncio.Future[Any]], timeout: float | None) -> list[Any]:
    """The futures' results in order (one per rank called), or ``TimeoutError`` once ``timeout`` has passed.

    Each future is awaited itself, and a timer fails the ones left at the deadline: an answer wakes its caller in
    the loop's next pass, where ``wait_for`` over ``gather`` took two passes more (each relays a done callback), a
    tenth of a round trip to an idle engine.
    """
    loop = asyncio.get_running_loop()
    timer = None if timeout is None else loop.call_later(timeout, _time_out, futures)
    try:
        return [await future for future in futures]
    finally:
        if timer is not None:
            timer.cancel()
        for (
            future
        ) in futures:  # answered or failed but never awaited (an earlier one raised): not "never retrieved"
            if future.done() and not future.cancelled():
                future.exception()


def _time_out(futures: list[asyncio.Future[Any]]) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(asyncio.TimeoutError())
