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

from enginekit.notebook.engine_stats import EngineStats
from enginekit.notebook.jupyter import in_jupyter
from enginekit.notebook.rows import RequestRow
from enginekit.notebook.text_view import TextView
from enginekit.notebook.widget_view import WidgetView

if TYPE_CHECKING:
    from enginekit.frontend.engine import Engine
    from enginekit.outputs import RequestOutput
    from enginekit.sampling_params import SamplingParams

__all__ = ["Viewer", "ViewerKind", "check_viewer_argument", "in_jupyter"]

ViewerKind = Literal["auto", "widget", "text"]
_FINAL_STATS_TIMEOUT_S = 5.0  # an awaited generate returns without the final numbers after this long


def _why_no_widgets() -> str | None:
    """``None`` when the widget view can be shown here, else the reason it cannot."""
    if not in_jupyter():
        return "not running in a Jupyter kernel"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed (pip install ipywidgets)"
    return None


class Viewer:
    """Live view of generation: one row per request and an engine panel.

    In a Jupyter kernel with ipywidgets each row shows the request's state (waiting, running, preempted, or how
    it finished), its tokens out of ``max_tokens``, tokens/s, time to first token, latency and sampling
    settings, the text as it streams in (a chat as its turns), and an *Abort* button. The panel above shows the
    engine (mode, process id, running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions,
    each data-parallel rank's load), the requests by state, and a bar of the tokens generated out of the most
    that may come; *Stop all* aborts every running request of the viewer, and the panel then says how many
    ended each way. The engine's numbers are fetched again when the last request is done, so the final panel
    matches the engine. Elsewhere (a script, a terminal, no ipywidgets) it prints a one-time note saying why,
    then a plain-text progress line every ``text_interval_s`` seconds and a summary at the end.

    Parameters
    ----------
    kind
        ``"auto"`` (widgets in Jupyter when ipywidgets is installed, else text), ``"widget"`` (build the
        widgets anyway; they are displayed only in a Jupyter kernel) or ``"text"``.
    max_chars
        Each row shows the last ``max_chars`` characters of its text.
    rows_height
        The most height the rows take before they scroll (any CSS length, e.g. ``"900px"``); the area can also
        be resized by dragging its bottom-right corner.
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
        rows_height: str = "70vh",
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
        if not isinstance(rows_height, str) or not rows_height.strip():
            raise ValueError(
                f"rows_height must be a CSS length such as '600px' or '70vh', got {rows_height!r}"
            )
        self.max_chars = max_chars
        self.rows_height = rows_height
        self.min_interval_s = min_interval_s
        self.rows: list[RequestRow] = []
        self._clock: Callable[[], float] = time.monotonic
        self._next_render_at = -math.inf
        self._started_at = 0.0  # when the viewer last began watching
        self._watched_s = 0.0  # time spent watching before that
        self._engine_ref: weakref.ref[Engine] | None = None
        self._engine_stats = EngineStats(stats_interval_s, on_late_answer=self._stats_arrived)
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

    def refresh(self, *, force: bool = False, blocking: bool = False) -> None:
        """Render what changed since the last render; throttled to one render per ``min_interval_s`` or more.

        ``blocking``: called from a blocking generate, which holds this thread's loop (if any): the engine's
        numbers are fetched with a blocking call, as no task could run meanwhile.
        """
        now = self._clock()
        if not force and now < self._next_render_at:
            return
        if self._num_attached:
            self._engine_stats.maybe_refresh(self._engine(), now, blocking=blocking)
        # NOTE: a blocking stats call waits for the engine's current step (a prefill can take a second): that
        # is not rendering, and counting it below would leave the viewer still for several seconds after it.
        now = self._clock()
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
        """The numbers the panel shows: requests by state, tokens, throughput and the latest engine statistics.

        ``num_max_tokens`` is the most tokens the requests may still make in all: a request that finished by
        stop or length counts its own tokens, the others their ``max_tokens`` (an aborted one never got there).
        ``state`` is ``"running"``, ``"done"`` or, when a request was aborted, ``"stopped"``.
        """
        engine = self._engine()
        num_tokens = sum(row.num_tokens for row in self.rows)
        elapsed = self._watched_s + (self._clock() - self._started_at if self._num_attached else 0.0)
        states = {"waiting": 0, "running": 0, "preempted": 0}
        reasons: dict[str, int] = {}
        num_max_tokens = 0
        tokens_by_state: dict[str, int] = {}
        for row in self.rows:
            reason = row.finish_reason if row.finished else None
            if reason is not None:
                reasons[reason] = reasons.get(reason, 0) + 1
            else:
                states[row.output.status] = states.get(row.output.status, 0) + 1
            state = row.state
            tokens_by_state[state] = tokens_by_state.get(state, 0) + row.num_tokens
            limit = row.max_tokens
            done = reason is not None and reason != "abort"
            num_max_tokens += row.num_tokens if done or limit is None else max(limit, row.num_tokens)
        active = self._num_attached > 0
        return {
            "mode": engine.mode if engine is not None else None,
            "engine_pid": engine.engine_pid if engine is not None else None,
            "num_requests": len(self.rows),
            "num_finished": sum(reasons.values()),
            "num_waiting": states["waiting"],
            "num_running": states["running"],
            "num_preempted": states["preempted"],
            "finish_reasons": reasons,
            "num_tokens": num_tokens,
            "num_max_tokens": num_max_tokens,
            "tokens_by_state": tokens_by_state,
            "num_preemptions": sum(
                row.output.metrics.num_preemptions for row in self.rows if row.output.metrics
            ),
            "elapsed_s": elapsed,
            "tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
            "active": active,
            "state": "running" if active else "stopped" if "abort" in reasons else "done",
            "stats": self._engine_stats.latest,
            "stats_error": self._engine_stats.error,
        }

    def _ipython_display_(self) -> None:
        # Shown as a cell's value: another view of the same widgets (they stay in sync), or a text line.
        self._shown = True
        self._view.show_again()

    def __repr__(self) -> str:
        done = sum(1 for row in self.rows if row.finished)
        return f"Viewer(kind={self.kind!r}, {done}/{len(self.rows)} requests finished)"

    # ---- the generate loop's side -------------------------------------------------------------------
    def attach(
        self, engine: Engine, outputs: list[RequestOutput], params: list[SamplingParams] | None = None
    ) -> ViewerWatch:
        """Add rows for these live outputs (made with these ``params``, one per output, when known) and start
        watching them; ``close()`` the returned watch when done.

        ``engine`` is used through its public API only: ``mode``, ``engine_pid``, ``is_running``, ``abort``,
        ``get_stats`` and ``aget_stats``.
        """
        now = self._clock()
        all_params = params if params is not None else [None] * len(outputs)
        new_rows = [RequestRow(output, engine, now, p) for output, p in zip(outputs, all_params)]
        self.rows.extend(new_rows)
        self._engine_ref = weakref.ref(engine)
        if self._num_attached == 0:
            self._started_at = now
            self._engine_stats.restart()
        self._num_attached += 1
        self.show()  # before the rows: displaying builds a text form of every widget in the tree
        self._view.add_rows(new_rows)
        self.refresh(force=True)
        self._start_ticker()
        return ViewerWatch(self)

    def _detach(self, blocking: bool) -> None:
        self._num_attached -= 1
        if self._num_attached > 0:
            return
        self._watched_s += self._clock() - self._started_at
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        # The engine's numbers once more, so that the final panel matches them.
        self._engine_stats.refresh_final(self._engine(), blocking=blocking)
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
    @property
    def stats_interval_s(self) -> float:
        """Least time between two engine-statistics requests for the panel."""
        return self._engine_stats.interval_s

    def _engine(self) -> Engine | None:
        return self._engine_ref() if self._engine_ref is not None else None

    def _stats_arrived(self) -> None:
        if self._num_attached == 0:
            self.refresh(force=True)  # the final numbers: no ticker renders them any more

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
                self._engine_stats.error = f"abort failed: {type(error).__name__}: {error}"
        self.refresh(force=True)


class ViewerWatch:
    """One ``generate`` call's hold on a viewer: ``update()`` after each batch, ``close()`` at the end.

    ``blocking``: the call blocks this thread (a plain ``generate``), so no task of its loop runs meanwhile.
    """

    __slots__ = ("_closed", "blocking", "viewer")

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self.blocking = False
        self._closed = False

    def update(self) -> None:
        self.viewer.refresh(blocking=self.blocking)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.viewer._detach(self.blocking)

    async def aclose(self) -> None:
        """``close``, then wait (briefly) for the engine's final numbers, so the panel shows them on return."""
        self.close()
        await self.viewer._engine_stats.wait(_FINAL_STATS_TIMEOUT_S)


def check_viewer_argument(viewer: Any) -> None:
    """Raise ``TypeError`` unless ``viewer`` is ``None``, a bool or a ``Viewer``."""
    if viewer is None or isinstance(viewer, bool) or callable(getattr(viewer, "attach", None)):
        return
    raise TypeError(
        f"viewer must be True, False, None or an enginekit Viewer, got {type(viewer).__name__}; "
        "build one with enginekit.notebook.Viewer(...)"
    )
