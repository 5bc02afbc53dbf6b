"""EngineStats: the engine's numbers for a viewer's panel, fetched at most every ``interval_s`` while its
requests run, and once more when they are done so that the final panel matches the engine.

On a running loop (an awaited generate, a background one) the numbers come from a task, and the loop is never
blocked. A blocking generate holds its thread's loop, so no task could run: there they come from a blocking
call, which waits for the engine's current step.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginekit.interrupts import running_loop

if TYPE_CHECKING:
    from enginekit.frontend.engine import Engine


class EngineStats:
    def __init__(self, interval_s: float, *, on_late_answer: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None
        self.error: str | None = None
        self._asked_at = -math.inf
        self._task: asyncio.Task[Any] | None = None
        self._on_late_answer = on_late_answer  # an answer from a task arrived: the viewer decides to render

    def restart(self) -> None:
        """A new watch begins: the next ``maybe_refresh`` asks at once."""
        self._asked_at = -math.inf

    def maybe_refresh(self, engine: Engine | None, now: float, *, blocking: bool) -> None:
        """Ask for the numbers if ``interval_s`` has passed since the last time."""
        if now - self._asked_at < self.interval_s or engine is None or not engine.is_running:
            return
        self._asked_at = now
        self._ask(engine, blocking)

    def refresh_final(self, engine: Engine | None, *, blocking: bool) -> None:
        """Ask once more now that every request is done."""
        if engine is None or not engine.is_running:
            return
        if self._task is not None and not self._task.done():
            self._task.cancel()  # asked while requests ran: its answer would be older than the final one
        self._task = None
        self._ask(engine, blocking)

    async def wait(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for an answer asked for in a task."""
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task], timeout=timeout)

    def _ask(self, engine: Engine, blocking: bool) -> None:
        if not blocking and running_loop() is not None:
            self._ask_in_task(engine)
            return
        try:
            self.latest, self.error = engine.get_stats(), None
        except Exception as error:
            self.error = f"{type(error).__name__}: {error}"

    def _ask_in_task(self, engine: Engine) -> None:
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(
            engine.aget_stats(), name="enginekit-viewer-stats"
        )
        self._task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"
        else:
            self.latest, self.error = task.result(), None
        self._on_late_answer()
