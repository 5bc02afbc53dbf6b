"""Viewer: watch requests live — an ipywidgets panel in Jupyter, throttled plain text elsewhere.

``engine.generate(..., viewer=True)`` (or ``viewer=Viewer(...)``) attaches the requests of that call to a
viewer. The generate loop calls ``update()`` after every routed batch; the viewer renders at most once per
``min_interval_s`` whatever the token rate, and only the rows whose request changed since the last render.
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TextIO

from enginekit.notebook.jupyter import in_jupyter
from enginekit.notebook.text_view import TextView
from enginekit.notebook.widget_view import WidgetView

if TYPE_CHECKING:
    from enginekit.engine import Engine
    from enginekit.outputs import RequestOutput

__all__ = ["Viewer", "ViewerKind", "check_viewer_argument", "in_jupyter"]

ViewerKind = Literal["auto", "widget", "text"]


def _why_no_widgets() -> str | None:
    """``None`` when the widget view can be shown here, else the reason it cannot."""
    if not in_jupyter():
        return "not running in a Jupyter kernel"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed (pip install ipywidgets)"
    return None


class RequestRow:
    """What the viewer knows about one request (a live ``RequestOutput``); read by the views."""

    __slots__ = ("engine_ref", "finished_at", "output", "rendered_key", "started_at")

    def __init__(self, output: RequestOutput, engine: Any, now: float) -> None:
        self.output = output
        self.engine_ref = weakref.ref(engine)
        self.started_at = now
        self.finished_at: float | None = None
        self.rendered_key: tuple[int, str | None] | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def prompt(self) -> str | None:
        return self.output.prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def text(self) -> str:
        return self.output.outputs[0].text

    @property
    def num_tokens(self) -> int:
        return len(self.output.outputs[0].token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.output.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        return self.output.finished

    def tokens_per_s(self, now: float) -> float:
        elapsed = (self.finished_at if self.finished_at is not None else now) - self.started_at
        return self.num_tokens / elapsed if elapsed > 0 else 0.0

    def observe(self, now: float) -> bool:
        """Note the request's progress; True when it changed since the last render."""
        if self.finished and self.finished_at is None:
            self.finished_at = now
        key = (self.num_tokens, self.finish_reason)
        if key == self.rendered_key:
            return False
        self.rendered_key = key
        return True


class Viewer:
    """Live view of generation: one row per request and an engine panel.

    In a Jupyter kernel with ipywidgets each row shows the text as it streams in, the token count, tokens/s,
    the finish reason and an *Abort* button; a *Stop all* button aborts every running request of the viewer,
    and the panel shows the engine's mode, process id, running and waiting requests, KV-cache usage and
    prefix-cache hit rate. Elsewhere (a script, a terminal, no ipywidgets) it prints a one-time note saying
    why, then a plain-text progress line every ``text_interval_s`` seconds and a summary at the end.

    Parameters
    ----------
    kind
        ``"auto"`` (widgets in Jupyter when ipywidgets is installed, else text), ``"widget"`` (build the
        widgets anyway; they are displayed only in a Jupyter kernel) or ``"text"``.
    max_chars
        Each row shows the last ``max_chars`` characters of its text.
    min_interval_s
        Least time between two renders: no widget is updated more often than ``1 / min_interval_s`` times a
        second, however fast tokens arrive. Renders that take long (many rows) are spaced further apart, so
        the viewer spends at most about a fifth of the time rendering.
    stats_interval_s
        Least time between two engine-statistics requests for the panel.
    text_interval_s
        Least time between two plain-text progress lines.
    stream
        Where the plain-text view writes (default: ``sys.stderr`` at the time of writing).

    Examples
    --------
    >>> viewer = Viewer()
    >>> outputs = engine.generate(prompts, params, viewer=viewer)  # or simply viewer=True

    Notes
    -----
    The buttons act while the kernel's loop is free to read widget messages: during
    ``await engine.agenerate(...)`` and while an ``engine.generate_background(...)`` generation runs. A
    blocking call (``engine.generate`` in any mode) holds the kernel until it returns; interrupt the kernel
    to stop it.
    """

    def __init__(
        self,
        *,
        kind: ViewerKind = "auto",
        max_chars: int = 400,
        min_interval_s: float = 0.1,
        stats_interval_s: float = 0.5,
        text_interval_s: float = 2.0,
        stream: TextIO | None = None,
    ) -> None:
        if kind not in ("auto", "widget", "text"):
            raise ValueError(f"kind must be 'auto', 'widget' or 'text', got {kind!r}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars}")
        for name, value in (
            ("min_interval_s", min_interval_s),
            ("stats_interval_s", stats_interval_s),
            ("text_interval_s", text_interval_s),
        ):
            if not value >= 0:
                raise ValueError(f"{name} must be zero or positive, got {value}")
        self.max_chars = max_chars
        self.min_interval_s = min_interval_s
        self.stats_interval_s = stats_interval_s
        self.rows: list[RequestRow] = []
        self._clock: Callable[[], float] = time.monotonic
        self._next_render_at = -math.inf
        self._started_at = 0.0  # when the viewer last began watching
        self._watched_s = 0.0  # time spent watching before that
        self._engine_ref: weakref.ref[Engine] | None = None
        self._stats: dict[str, Any] | None = None
        self._stats_error: str | None = None
        self._stats_at = -math.inf
        self._stats_task: asyncio.Task[Any] | None = None
        self._num_attached = 0
        self._ticker: asyncio.TimerHandle | None = None
        self._shown = False
        reason = _why_no_widgets() if kind == "auto" else ("" if kind == "text" else None)
        self._view: WidgetView | TextView
        if reason is None:
            self._view = WidgetView(self, on_abort=self._abort_rows)
        else:
            self._view = TextView(self, reason=reason, interval_s=text_interval_s, stream=stream)
        self.kind: Literal["widget", "text"] = "widget" if isinstance(self._view, WidgetView) else "text"

    # ---- public -------------------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """The root ipywidgets container (``None`` for the text view)."""
        return self._view.root if isinstance(self._view, WidgetView) else None

    def show(self) -> None:
        """Display the viewer in the current cell (once; later calls do nothing)."""
        if self._shown:
            return
        self._shown = True
        self._view.show()

    def refresh(self, *, force: bool = False) -> None:
        """Render what changed since the last render; throttled to one render per ``min_interval_s`` or more."""
        now = self._clock()
        if not force and now < self._next_render_at:
            return
        self._maybe_refresh_stats(now)
        changed = [row for row in self.rows if row.observe(now)]
        self._view.render(changed, now, final=self._num_attached == 0)
        # A render that takes long (many rows) spaces the next ones out: at most a fifth of the time.
        spent = self._clock() - now
        self._next_render_at = now + max(self.min_interval_s, 4 * spent)

    def abort_all(self) -> None:
        """Abort every request of this viewer that is still running."""
        self._abort_rows([row for row in self.rows if not row.finished])

    def clear(self) -> None:
        """Forget the finished rows (running ones stay)."""
        self.rows = [row for row in self.rows if not row.finished]
        self._view.set_rows(self.rows)

    def summary(self) -> dict[str, Any]:
        """The numbers the panel shows: requests, tokens, throughput and the latest engine statistics."""
        engine = self._engine_ref() if self._engine_ref is not None else None
        num_tokens = sum(row.num_tokens for row in self.rows)
        elapsed = self._watched_s + (self._clock() - self._started_at if self._num_attached else 0.0)
        reasons: dict[str, int] = {}
        for row in self.rows:
            if row.finish_reason is not None:
                reasons[row.finish_reason] = reasons.get(row.finish_reason, 0) + 1
        return {
            "mode": engine.mode if engine is not None else None,
            "engine_pid": engine.engine_pid if engine is not None else None,
            "num_requests": len(self.rows),
            "num_finished": sum(1 for row in self.rows if row.finished),
            "finish_reasons": reasons,
            "num_tokens": num_tokens,
            "elapsed_s": elapsed,
            "tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
            "active": self._num_attached > 0,
            "stats": self._stats,
            "stats_error": self._stats_error,
        }

    def _ipython_display_(self) -> None:
        # Shown as a cell's value: another view of the same widgets (they stay in sync), or a text line.
        self._shown = True
        self._view.show_again()

    def __repr__(self) -> str:
        done = sum(1 for row in self.rows if row.finished)
        return f"Viewer(kind={self.kind!r}, {done}/{len(self.rows)} requests finished)"

    # ---- the generate loop's side -------------------------------------------------------------------
    def attach(self, engine: Engine, outputs: list[RequestOutput]) -> ViewerWatch:
        """Add rows for these live outputs and start watching them; ``close()`` the returned watch when done.

        ``engine`` is used through its public API only: ``mode``, ``engine_pid``, ``is_running``, ``abort``,
        ``get_stats`` and ``aget_stats``.
        """
        now = self._clock()
        new_rows = [RequestRow(output, engine, now) for output in outputs]
        self.rows.extend(new_rows)
        self._engine_ref = weakref.ref(engine)
        if self._num_attached == 0:
            self._started_at = now
            self._stats_at = -math.inf
        self._num_attached += 1
        self.show()  # before the rows: displaying builds a text form of every widget in the tree
        self._view.add_rows(new_rows)
        self.refresh(force=True)
        self._start_ticker()
        return ViewerWatch(self)

    def _detach(self) -> None:
        self._num_attached -= 1
        if self._num_attached > 0:
            return
        self._watched_s += self._clock() - self._started_at
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._stats_task is not None and not self._stats_task.done():
            self._stats_task.cancel()  # the final panel shows no engine load: nothing to wait for
            self._stats_task = None
        self.refresh(force=True)

    def _start_ticker(self) -> None:
        # Renders while the loop runs even when no batch concerns the request the generate loop awaits. A
        # blocking generate never lets the loop run, and cancels the timer in close() before it fires.
        if self._ticker is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ticker = loop.call_later(max(self.min_interval_s, 0.02), self._tick)

    def _tick(self) -> None:
        self._ticker = None
        if self._num_attached > 0:
            self.refresh()
            self._start_ticker()

    # ---- engine statistics --------------------------------------------------------------------------
    def _maybe_refresh_stats(self, now: float) -> None:
        if self._num_attached == 0 or now - self._stats_at < self.stats_interval_s:
            return
        engine = self._engine_ref() if self._engine_ref is not None else None
        if engine is None or not engine.is_running:
            return
        self._stats_at = now
        if _running_loop() is not None:
            # On a running loop (an awaited generate, a background one): ask without blocking the loop.
            self._refresh_stats_in_task(engine)
            return
        try:
            self._stats = engine.get_stats()
            self._stats_error = None
        except Exception as error:
            self._stats_error = f"{type(error).__name__}: {error}"

    def _refresh_stats_in_task(self, engine: Engine) -> None:
        if self._stats_task is not None and not self._stats_task.done():
            return
        loop = asyncio.get_running_loop()
        self._stats_task = loop.create_task(engine.aget_stats(), name="enginekit-viewer-stats")
        self._stats_task.add_done_callback(self._on_stats)

    def _on_stats(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self._stats_error = f"{type(error).__name__}: {error}"
        else:
            self._stats, self._stats_error = task.result(), None

    # ---- buttons ------------------------------------------------------------------------------------
    def _abort_rows(self, rows: list[RequestRow]) -> None:
        by_engine: dict[int, tuple[Engine, list[str]]] = {}
        for row in rows:
            engine = row.engine_ref()
            if engine is not None and not row.finished:
                by_engine.setdefault(id(engine), (engine, []))[1].append(row.request_id)
        for engine, request_ids in by_engine.values():
            try:
                engine.abort(request_ids)
            except Exception as error:  # a button callback must not raise into the kernel log
                self._stats_error = f"abort failed: {type(error).__name__}: {error}"
        self.refresh(force=True)


class ViewerWatch:
    """One ``generate`` call's hold on a viewer: ``update()`` after each batch, ``close()`` at the end."""

    __slots__ = ("_closed", "viewer")

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self._closed = False

    def update(self) -> None:
        self.viewer.refresh()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.viewer._detach()


def check_viewer_argument(viewer: Any) -> None:
    """Raise ``TypeError`` unless ``viewer`` is ``None``, a bool or a ``Viewer``."""
    if viewer is None or isinstance(viewer, bool) or callable(getattr(viewer, "attach", None)):
        return
    raise TypeError(
        f"viewer must be True, False, None or an enginekit Viewer, got {type(viewer).__name__}; "
        "build one with enginekit.notebook.Viewer(...)"
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
