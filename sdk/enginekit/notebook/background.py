"""Background generation: ``engine.generate_background(...)`` returns a ``GenerationHandle`` at once.

The requests are submitted in the calling cell (bad prompts raise there), and a task on the caller's running
loop collects them, so in a notebook the kernel's loop keeps running the generation between and during other
cells. Uses only the engine's public API: ``mode``, ``agenerate`` and ``abort``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any

from enginekit.interrupts import awaiting_with_signal_checks
from enginekit.notebook.loop import run_sync
from enginekit.notebook.viewer import Viewer, check_viewer_argument
from enginekit.notebook.watch import watcher_for
from enginekit.outputs import RequestOutput

if TYPE_CHECKING:  # notebook/ uses the engine it is handed through its public API
    from enginekit.frontend.engine import Engine

__all__ = ["GenerationHandle", "start_background"]

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
        engine: Engine,
        recorder: _Recorder,
        viewer: Viewer | None,
    ) -> None:
        self._outputs = recorder.outputs
        self.request_ids = [output.request_id for output in self._outputs]
        self.viewer = viewer
        self._task: asyncio.Task[list[RequestOutput]] = asyncio.get_running_loop().create_task(
            coro, name="enginekit-generate-background"
        )
        _running.add(self._task)
        self._task.add_done_callback(_forget)
        # NOTE: also when the task is cancelled before it ever ran (its own cleanup then never runs).
        self._task.add_done_callback(lambda _task: _clean_up(engine, recorder))

    @property
    def outputs(self) -> list[RequestOutput]:
        """The requests' outputs as they are now: cumulative, and changing while the generation runs."""
        return list(self._outputs)

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
        with awaiting_with_signal_checks():
            return await asyncio.shield(self._task)

    def __await__(self) -> Generator[Any, None, list[RequestOutput]]:
        return self._wait().__await__()

    def __repr__(self) -> str:
        if not self._task.done():
            state = "running"
        elif self._task.cancelled():
            state = "cancelled"
        elif self._task.exception() is not None:
            state = f"failed: {type(self._task.exception()).__name__}"
        else:
            state = "done"
        return f"<GenerationHandle {state}, {len(self._outputs)} requests>"


def _forget(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failure is reported through the handle, not as "never retrieved"


class _Recorder:
    """Passed to ``agenerate`` as its viewer: keeps the live outputs, and watches them as asked."""

    def __init__(self, progress: bool | None, viewer: Viewer | None) -> None:
        self._progress = progress
        self._viewer = viewer
        self.outputs: list[RequestOutput] = []
        self.watch: Any = None

    def attach(self, engine: Engine, outputs: list[RequestOutput], params: list[Any] | None = None) -> Any:
        self.outputs = outputs
        self.watch = watcher_for(self._progress, self._viewer)(engine, outputs, params)
        return self.watch


def start_background(
    engine: Engine,
    prompts: Any,
    params: Any = None,
    *,
    use_tqdm: bool | None = None,
    viewer: Any = None,
    request_id: Any = None,
    lora_request: Any = None,
) -> GenerationHandle:
    """What ``engine.generate_background`` does: submit now, collect in a task on the running loop."""
    if engine.mode != "async":
        raise RuntimeError(
            f"generate_background needs mode='async', this engine runs in mode={engine.mode!r}: "
            "call engine.restart(mode='async') first, or use engine.generate"
        )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "generate_background needs a running asyncio loop in this thread: call it from a notebook "
            "cell or a coroutine (in a script, inside asyncio.run(...)), or use engine.generate"
        ) from None
    check_viewer_argument(viewer)
    shown = Viewer() if viewer is True else viewer if isinstance(viewer, Viewer) else None
    if shown is not None:
        shown.show()  # in the calling cell, before it returns
    recorder = _Recorder(use_tqdm, shown)
    coro = engine.agenerate(
        prompts, params, viewer=recorder, request_id=request_id, lora_request=lora_request
    )
    return GenerationHandle(coro, engine=engine, recorder=recorder, viewer=shown)


def _clean_up(engine: Engine, recorder: _Recorder) -> None:
    unfinished = [output.request_id for output in recorder.outputs if not output.finished]
    if unfinished and engine.is_running:
        try:
            engine.abort(unfinished)
        except Exception:  # NOTE: a done callback must not raise into the loop
            pass
    if recorder.watch is not None:
        recorder.watch.close()
