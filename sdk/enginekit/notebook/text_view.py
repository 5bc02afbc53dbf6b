"""The viewer's plain-text view (outside Jupyter, or without ipywidgets): throttled progress lines."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from enginekit.notebook.rows import RequestRow
    from enginekit.notebook.viewer import Viewer

_explained: set[str] = set()  # reasons already told in this process: the note is shown once


class TextView:
    """``reason`` says why there are no widgets (told once per process); empty when text was asked for."""

    def __init__(self, viewer: Viewer, *, reason: str, interval_s: float, stream: TextIO | None) -> None:
        self._viewer = viewer
        self._reason = reason
        self._interval_s = interval_s
        self._stream = stream
        self._last_line = -math.inf
        self._printed_final = False

    def _write(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        print(line, file=stream, flush=True)

    def show(self) -> None:
        if self._reason and self._reason not in _explained:
            _explained.add(self._reason)
            self._write(f"enginekit viewer: {self._reason}; showing plain-text progress instead.")

    def show_again(self) -> None:
        summary = self._viewer.summary()
        self._write(summary_line(summary, final=not summary["active"]))

    def add_rows(self, rows: list[RequestRow]) -> None:
        self._printed_final = False

    def set_rows(self, rows: list[RequestRow]) -> None:
        pass

    def render(self, changed: list[RequestRow], now: float, *, final: bool) -> None:
        if final:
            if not self._printed_final:
                self._printed_final = True
                self._write(summary_line(self._viewer.summary(), final=True))
            return
        if now - self._last_line >= self._interval_s:
            self._last_line = now
            self._write(summary_line(self._viewer.summary(), final=False))


def summary_line(summary: dict[str, Any], *, final: bool) -> str:
    done, total = summary["num_finished"], summary["num_requests"]
    states = ", ".join(
        f"{summary[f'num_{state}']} {state}"
        for state in ("running", "waiting", "preempted")
        if summary[f"num_{state}"]
    )
    line = (
        f"enginekit: {done}/{total} finished{', ' + states if states else ''}, "
        f"{summary['num_tokens']}/{summary['num_max_tokens']} tokens, "
        f"{summary['tokens_per_s']:.1f} tok/s, {summary['elapsed_s']:.1f} s"
    )
    stats = summary["stats"]
    if final:
        reasons = ", ".join(
            f"{reason} {count}" for reason, count in sorted(summary["finish_reasons"].items())
        )
        line = f"{line} ({summary['state']}{': ' + reasons if reasons else ''})"
        if stats is not None and stats.get("num_preemptions"):
            line += f" | preemptions {stats['num_preemptions']}"
        return line
    if stats is not None:
        line += (
            f" | engine: running {stats['num_running_requests']}, waiting {stats['num_waiting_requests']},"
            f" KV cache {stats['kv_cache_usage']:.0%}, prefix-cache hits {stats['prefix_cache_hit_rate']:.0%}"
        )
        if stats.get("num_preemptions"):
            line += f", preemptions {stats['num_preemptions']}"
    return line
