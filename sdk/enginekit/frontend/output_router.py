"""OutputRouter: takes batches from the client and routes them to the requests that wait for them.

Whoever waits, pulls: a blocking caller waits for a batch and takes it itself; on each asyncio loop one pump
task does it for every coroutine awaiting a request there. Taking a batch and applying it happen in one short
critical section, so deltas are applied in the order they arrived whichever thread or task took them, and
every waiter sees every batch meant for it (another waiter may have routed it). A request that ends badly —
the engine died, was shut down, or refused the request — wakes its waiter with the error to raise.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from enginekit.client.base import EngineCoreClient
from enginekit.errors import EngineError
from enginekit.frontend.output_processor import Decode, OutputProcessor, RequestState
from enginekit.interrupts import awaiting_with_signal_checks, deferred_interrupts
from enginekit.outputs import RequestOutput
from enginekit.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from enginekit.frontend.prompts import PreparedRequest

logger = logging.getLogger("enginekit")

_POLL_S = 0.05  # a blocking wait's longest sleep (a guard: batches and routed updates wake it sooner)


class Watcher(Protocol):
    """What ``generate`` updates while it waits: a progress bar or a viewer's hold on its rows."""

    def update(self) -> None: ...

    def close(self) -> None: ...

    async def aclose(self) -> None:
        """``close`` on a loop: may await what the watcher shows last (a viewer's final engine numbers)."""


class OutputRouter:
    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        self.processor = OutputProcessor()
        self._lock = threading.Lock()
        self._pumps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )

    def track(self, state: RequestState) -> None:
        with self._lock:
            self.processor.add(state)

    def forget(self, states: Iterable[RequestState]) -> list[str]:
        """Stop routing to these requests; returns the ids still unfinished, for the caller to abort."""
        with self._lock:
            return self.processor.forget(list(states))

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            self.processor.fail_all(error)
        self.client.wake_waiters()

    def take(self) -> bool:
        """Take one batch, if there is one, and route it; False if there was none.

        A Ctrl-C meanwhile is raised once the batch is routed: part of it may be another thread's outputs.
        """
        with deferred_interrupts(), self._lock:
            try:
                batch = self.client.get_output(0)
            except EngineError as error:
                self.processor.fail_all(error)
                raise
            if batch is None:
                return False
            self.processor.process(batch)
        self.client.wake_waiters()  # threads whose requests this batch updated stop waiting for a batch
        return True

    def abort_unfinished(self, states: list[RequestState]) -> None:
        """Forget and abort a call's unfinished requests (it was interrupted, cancelled or left early)."""
        ids = self.forget(states)
        if ids and self.client.is_alive:
            try:
                self.client.abort_requests(ids)
            except Exception:
                logger.debug("abort after interrupt failed", exc_info=True)

    # ---- what the facade's calls wait with ----------------------------------------------------------
    def collect(self, states: list[RequestState], watcher: Watcher) -> list[RequestOutput]:
        """Until every request has ended; their final outputs. Interrupted, it aborts them."""
        try:
            self.wait(states, watcher)
        except BaseException:
            self.abort_unfinished(states)
            raise
        finally:
            watcher.close()
        return [state.output for state in states]

    async def collect_async(self, states: list[RequestState], watcher: Watcher) -> list[RequestOutput]:
        try:
            await self.wait_async(states, watcher)
        except BaseException:
            self.abort_unfinished(states)
            watcher.close()
            raise
        await watcher.aclose()
        return [state.output for state in states]

    def stream(self, state: RequestState) -> Iterator[RequestOutput]:
        """A snapshot of the output at each update; the last one is finished. Left early, it aborts."""
        seen, final_only = 0, state.output_kind is RequestOutputKind.FINAL_ONLY
        try:
            while True:
                self.wait_update(state, seen)
                seen = state.version
                if final_only and not state.finished:
                    continue
                snapshot = state.snapshot()
                yield snapshot
                if snapshot.finished:  # NOTE: not state.finished, which may have changed while we yielded
                    return
        finally:
            if not state.finished:
                self.abort_unfinished([state])

    async def stream_async(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        seen, final_only = 0, state.output_kind is RequestOutputKind.FINAL_ONLY
        try:
            while True:
                await self.wait_update_async(state, seen)
                seen = state.version
                if final_only and not state.finished:
                    continue
                snapshot = state.snapshot()
                yield snapshot
                if snapshot.finished:
                    return
        finally:
            if not state.finished:
                self.abort_unfinished([state])

    # ---- blocking waits -----------------------------------------------------------------------------
    def wait(self, states: list[RequestState], watcher: Watcher | None = None) -> None:
        """Until every request in ``states`` has ended; raises the first one's error."""
        for state in states:
            while not state.finished:
                self._pump(state, state.version)
                if watcher is not None:
                    watcher.update()
            if state.error is not None:
                raise state.error

    def wait_update(self, state: RequestState, seen: int) -> None:
        """Until ``state`` has changed since version ``seen``; raises its error if it failed."""
        while state.version == seen:
            self._pump(state, seen)
        if state.error is not None:
            raise state.error

    def _pump(self, state: RequestState, seen: int) -> None:
        """Route a batch, or wait for one until ``state`` changes from version ``seen`` (another thread may route
        its update: ``take`` wakes the waiters)."""
        if not self.take() and state.version == seen:
            self.client.wait_for_output(_POLL_S, lambda: state.version != seen)

    # ---- async waits --------------------------------------------------------------------------------
    async def wait_async(self, states: list[RequestState], watcher: Watcher | None = None) -> None:
        for state in states:
            while not state.finished:
                await self.wait_update_async(state, state.version)
                if watcher is not None:
                    watcher.update()

    async def wait_update_async(self, state: RequestState, seen: int) -> None:
        """Await a change of ``state`` since version ``seen``; raises its error if it failed."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        state.listener = functools.partial(_notify, loop, event)
        try:
            with awaiting_with_signal_checks():
                while state.version == seen:
                    self._ensure_pump(loop)
                    await event.wait()
                    event.clear()
        finally:
            state.listener = None
        if state.error is not None:
            raise state.error

    def _ensure_pump(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        """One task per loop takes batches while any request of this router is tracked."""
        pump = self._pumps.get(loop)
        if pump is None or pump.done():
            pump = loop.create_task(_pump(weakref.ref(self), self.client), name="enginekit-output-pump")
            pump.add_done_callback(_retrieve_exception)
            self._pumps[loop] = pump
        return pump


async def _pump(router_ref: weakref.ref[OutputRouter], client: EngineCoreClient) -> None:
    # NOTE: holds the router only weakly, so a dropped engine is collected and its pump ends.
    try:
        while True:
            router = router_ref()
            if router is None or not router.processor.states:
                return  # nothing left to route; the next waiter starts a new pump
            took = router.take()
            del router
            if took:
                # NOTE: in-process, every take runs a step: yield between steps, or a stream on this loop
                # sees nothing until the pump runs out of work, and cannot stop it by leaving.
                await asyncio.sleep(0)
            else:
                await client.wait_for_output_async()
    except Exception as error:
        router = router_ref()
        if router is not None:
            router.fail_all(error)  # wakes every waiter with the error (take() did so already for its own)
        raise


def _notify(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    """Wake an async waiter from whichever thread routed its request."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop or not loop.is_running():
        event.set()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(event.set)


def submit(prepared: list[PreparedRequest], router: OutputRouter, decode: Decode) -> list[RequestState]:
    """Track and send the requests of one call, all checked already; if sending one fails, none is left
    running."""
    router.processor.check_new_ids([r.request_id for p in prepared for r in p.engine_requests])
    states: list[RequestState] = []
    try:
        for p in prepared:
            state = RequestState.of(p, decode)
            states.append(state)
            router.track(state)
            for request in p.engine_requests:
                router.client.add_request(request)
    except BaseException:
        router.abort_unfinished(states)
        raise
    return states


def _retrieve_exception(task: asyncio.Task[Any]) -> None:
    # A pump's failure reaches every waiter through its request; it must not also be logged as never retrieved.
    if not task.cancelled():
        task.exception()
