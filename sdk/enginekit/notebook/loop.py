"""Run a coroutine to completion from sync code, with or without an asyncio loop already running.

A notebook cell runs inside the kernel's running loop, where ``asyncio.run`` is refused. Only there, on
the first sync call made on a running loop, that loop is made re-entrant with nest-asyncio, once. enginekit
patches no other loop; note that nest-asyncio itself also replaces the asyncio Task and Future classes and
patches the loop's class process-wide when it is applied (see docs/notebook_guide.md). Its ``asyncio.run``,
which never closes the loop it runs on, is put back to the stdlib's. Outside a running loop,
a sync call simply runs on a fresh loop with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
from collections.abc import Coroutine
from typing import Any, TypeVar

from enginekit.interrupts import deferred_interrupts

T = TypeVar("T")

_patched_loops: set[int] = set()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    make_reentrant(loop)
    task = asyncio.ensure_future(coro, loop=loop)
    # NOTE: a KeyboardInterrupt raised wherever the main thread happens to be would land in whichever
    # callback the loop is running (the kernel's, or a zmq socket's, which then loses an edge-triggered event
    # and never reads that socket again). Ctrl-C cancels the task instead, as ``asyncio.run`` does, and the call
    # raises ``KeyboardInterrupt`` once the task has cleaned up (also when it had already finished).
    on_interrupt = functools.partial(_cancel, task, loop)
    with deferred_interrupts(on_interrupt) as interrupted, _releasing_deferred(loop):
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        except BaseException:
            # NOTE: an exception from elsewhere leaves the task pending on the kernel's loop, where it
            # would keep its requests running: cancel it and let its cleanup (the abort) run.
            if not task.done():
                task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    loop.run_until_complete(task)
            raise


def _cancel(task: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
    if not task.done():
        task.cancel()
        loop.call_soon_threadsafe(_wake_up)  # a loop blocked in select then sees the cancellation


def _wake_up() -> None:
    """Scheduled from the signal handler so that a loop blocked in select sees the cancellation."""


def make_reentrant(loop: asyncio.AbstractEventLoop) -> None:
    """Apply nest-asyncio to this one loop (once); needed to block on it from inside one of its callbacks."""
    if id(loop) not in _patched_loops and not getattr(loop, "_nest_patched", False):
        import nest_asyncio

        run, applied_before = asyncio.run, hasattr(asyncio, "_nest_patched")
        nest_asyncio.apply(loop)
        if not applied_before:
            # NOTE: nest-asyncio's asyncio.run runs on the thread's policy loop and never closes it (each
            # later asyncio.run in a script or test would leave a loop open). Only the loop needs patching
            # here: put the stdlib's back, and let a user's own nest_asyncio.apply() patch it again.
            asyncio.run = run
            del asyncio._nest_patched  # pyright: ignore[reportAttributeAccessIssue]  # nest-asyncio's marker
        _patched_loops.add(id(loop))
    if not getattr(loop, "_enginekit_defers_entered_contexts", False):
        _defer_entered_contexts(loop)


def _defer_entered_contexts(loop: Any) -> None:
    """Hold back, during a nested run, every callback whose context is already entered.

    NOTE: a nested run steps other tasks from inside the task that blocks (the notebook cell). A task in the
    same ``contextvars.Context`` as that one cannot be stepped ("cannot enter context"): asyncio logs the
    error and the task is lost. ipykernel runs every shell message (the next queued cell, a widget message)
    in one persistent context, so "Run All" would drop the cells queued behind a sync call. Such callbacks
    wait until their context is free again, as they would have without nest-asyncio. Uses the loop's private
    ``_ready`` queue and ``_run_once``, as nest-asyncio does.
    """
    run_once = loop._run_once
    deferred: collections.deque[asyncio.Handle] = collections.deque()
    loop._enginekit_deferred = deferred

    def run_once_deferring() -> None:
        ready = loop._ready
        if deferred:
            free = [handle for handle in deferred if not _is_entered(handle._context)]
            for handle in free:
                deferred.remove(handle)
            ready.extendleft(reversed(free))
        for _ in range(len(ready)):
            handle = ready.popleft()
            (deferred if _is_entered(handle._context) else ready).append(handle)
        run_once()

    loop._run_once = run_once_deferring
    loop._enginekit_defers_entered_contexts = True


@contextlib.contextmanager
def _releasing_deferred(loop: Any):
    """When a nested run ends, the callbacks it held back go first again, in their order.

    NOTE: not later: the loop pass that ran the blocking callback goes on with what the nested run left in
    the ready queue, and a cell queued after the held-back ones would otherwise take the kernel's lock first.
    """
    try:
        yield
    finally:
        deferred = getattr(loop, "_enginekit_deferred", None)
        if deferred:
            loop._ready.extendleft(reversed(deferred))
            deferred.clear()


def _is_entered(context: contextvars.Context) -> bool:
    try:
        context.run(int)
    except RuntimeError:
        return True
    return False
