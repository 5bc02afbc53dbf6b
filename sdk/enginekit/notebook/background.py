"""GenerationHandle: a generation running in the background on this thread's asyncio loop.

``engine.generate_background(...)`` (``"async"`` mode) returns one at once. In a notebook the kernel's loop
keeps running the generation between and during other cells.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

from enginekit.notebook.loop import run_sync

if TYPE_CHECKING:
    from enginekit.notebook.viewer import Viewer
    from enginekit.output_processor import RequestState
    from enginekit.outputs import RequestOutput

__all__ = ["GenerationHandle"]

# NOTE: the loop keeps only weak references to tasks; a handle the user drops must not stop its generation.
_running: set[asyncio.Task[Any]] = set()


class GenerationHandle:
    """A background generation started by ``engine.generate_background``.

    Await it (``outputs = await handle``) or call ``handle.result()`` for the outputs: one finished
    ``RequestOutput`` per prompt, in order. Awaiting does not tie the generation to the awaiting cell:
    interrupting that cell stops the wait, not the generation; ``cancel()`` stops the generation.

    Attributes
    ----------
    request_ids
        The ids of its requests, in prompt order (for ``engine.abort``).
    viewer
        The ``Viewer`` watching the requests, or ``None``.
    """

    def __init__(
        self,
        coro: Coroutine[Any, Any, list[RequestOutput]],
        *,
        states: list[RequestState],
        viewer: Viewer | None,
        on_done: Callable[[], None],
    ) -> None:
        self._states = states
        self.request_ids = [state.output.request_id for state in states]
        self.viewer = viewer
        self._task: asyncio.Task[list[RequestOutput]] = asyncio.get_running_loop().create_task(
            coro, name="enginekit-generate-background"
        )
        _running.add(self._task)
        self._task.add_done_callback(_forget)
        self._task.add_done_callback(lambda _task: on_done())

    @property
    def outputs(self) -> list[RequestOutput]:
        """The requests' outputs as they are now: cumulative, and changing while the generation runs."""
        return [state.output for state in self._states]

    def done(self) -> bool:
        """Whether the generation has ended (finished, failed or cancelled)."""
        return self._task.done()

    def cancelled(self) -> bool:
        """Whether the generation was cancelled."""
        return self._task.cancelled()

    def cancel(self) -> bool:
        """Stop the generation and abort its unfinished requests; False if it had already ended.

        ``result()`` and ``await handle`` then raise ``asyncio.CancelledError``.
        """
        return self._task.cancel()

    def result(self) -> list[RequestOutput]:
        """The outputs; blocks until the generation ends, running the loop meanwhile.

        Raises what the generation raised (``EngineDeadError``, ...), or ``asyncio.CancelledError`` after
        ``cancel()``. Blocking on the loop from inside it uses nest-asyncio, as every sync call in
        ``"async"`` mode does.
        """
        if self._task.done():
            return self._task.result()
        loop = self._task.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop and (running is not None or loop.is_running()):
            raise RuntimeError(
                "result() must be called on the thread whose asyncio loop runs the generation; "
                "await the handle there, or wait until handle.done() is True"
            )
        if loop.is_closed():
            raise RuntimeError("the asyncio loop that ran this generation is closed; its result is lost")
        if running is None:
            return loop.run_until_complete(self._task)
        return run_sync(self._wait())

    async def _wait(self) -> list[RequestOutput]:
        return await asyncio.shield(self._task)

    def __await__(self) -> Generator[Any, None, list[RequestOutput]]:
        return asyncio.shield(self._task).__await__()

    def __repr__(self) -> str:
        if not self._task.done():
            state = "running"
        elif self._task.cancelled():
            state = "cancelled"
        elif self._task.exception() is not None:
            state = f"failed: {type(self._task.exception()).__name__}"
        else:
            state = "done"
        return f"<GenerationHandle {state}, {len(self._states)} requests>"


def _forget(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failure is reported through the handle, not as "never retrieved"
