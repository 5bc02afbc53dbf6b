"""The viewer's ipywidgets view: an engine panel with a Stop-all button, then one row per request.

Everything shown is HTML built here from the viewer's rows and summary; the panel is laid out as items that
wrap between each other, never inside one ("prefix-cache hits 50%" stays on one line).
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginekit.notebook.jupyter import in_jupyter

if TYPE_CHECKING:
    from enginekit.notebook.rows import RequestRow
    from enginekit.notebook.viewer import Viewer

STATE_COLORS = {
    "waiting": "#8c959f",
    "running": "#1f6feb",
    "preempted": "#9a6700",
    "stop": "#1a7f37",
    "length": "#57606a",
    "abort": "#bc4c00",
}
_FONT = "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.45"
_GREY = "color:#6e7781"
_ids = itertools.count()


class WidgetView:
    def __init__(self, viewer: Viewer, *, on_abort: Callable[[list[RequestRow]], None]) -> None:
        try:
            import ipywidgets as widgets
        except ImportError as error:
            raise ImportError(
                "the widget viewer needs ipywidgets: pip install ipywidgets (or use Viewer(kind='text'))"
            ) from error

        self._widgets = widgets
        self._viewer = viewer
        self._on_abort = on_abort
        self.panel = widgets.HTML(layout=widgets.Layout(height="auto", flex="1 1 auto", width="auto"))
        self.stop_all = widgets.Button(
            description="Stop all",
            icon="stop",
            button_style="danger",
            tooltip="Abort every running request of this viewer",
            disabled=True,
            layout=widgets.Layout(width="auto", flex="0 0 auto"),
        )
        self.stop_all.on_click(lambda _button: viewer.abort_all())
        # The rows scroll past ``rows_height``; dragging the corner resizes the area (then the user's height
        # holds: the rule only caps an area the user has not resized, which has no inline height).
        rows_class = f"enginekit-rows-{next(_ids)}"
        self._style = (
            f"<style>.{rows_class}{{resize:vertical;overflow:auto}}"
            f'.{rows_class}:not([style*="height"]){{max-height:{html.escape(viewer.rows_height)}}}</style>'
        )
        self.rows_box = widgets.VBox(layout=widgets.Layout(overflow="auto"))
        self.rows_box.add_class(rows_class)
        header = widgets.HBox(
            [self.panel, self.stop_all],
            layout=widgets.Layout(justify_content="space-between", align_items="flex-start"),
        )
        self.root = widgets.VBox([header, self.rows_box], layout=widgets.Layout(width="100%"))
        self.root.add_class("enginekit-viewer")
        self._row_widgets: dict[int, tuple[Any, Any, Any]] = {}  # id(row) -> (row box, button, html)
        self._row_layouts: tuple[Any, Any, Any] | None = None

    def show(self) -> None:
        if in_jupyter():
            self.show_again()

    def show_again(self) -> None:
        from IPython.display import display

        display(self.root)

    def add_rows(self, rows: list[RequestRow]) -> None:
        widgets = self._widgets
        if self._row_layouts is None:  # shared by every row: fewer widgets to create and sync
            self._row_layouts = (
                widgets.Layout(width="64px", flex="0 0 auto"),
                widgets.Layout(flex="1 1 auto", width="auto", height="auto"),
                # "0 0 auto": a row keeps its height; the rows box scrolls instead of squeezing them
                widgets.Layout(align_items="flex-start", flex="0 0 auto", width="100%"),
            )
        button_layout, text_layout, box_layout = self._row_layouts
        boxes = []
        for row in rows:
            button = widgets.Button(
                description="Abort", tooltip=f"Abort request {row.request_id}", layout=button_layout
            )
            button.on_click(lambda _button, row=row: self._on_abort([row]))
            text = widgets.HTML(layout=text_layout)
            box = widgets.HBox([button, text], layout=box_layout)
            self._row_widgets[id(row)] = (box, button, text)
            boxes.append(box)
        # One change of the container for the whole batch of new rows.
        self.rows_box.children = (*self.rows_box.children, *boxes)

    def set_rows(self, rows: list[RequestRow]) -> None:
        keep = {id(row) for row in rows}
        for key in [key for key in self._row_widgets if key not in keep]:
            box, button, text = self._row_widgets.pop(key)
            for widget in (text, button, box):
                widget.close()
        self.rows_box.children = tuple(self._row_widgets[id(row)][0] for row in rows)

    def render(self, changed: list[RequestRow], now: float, *, final: bool) -> None:
        viewer = self._viewer
        for row in changed:
            _box, button, text = self._row_widgets[id(row)]
            text.value = row_html(row, now, viewer.max_chars)
            if row.finished:
                button.disabled = True
        summary = viewer.summary()
        self.panel.value = self._style + panel_html(summary)
        self.stop_all.disabled = summary["num_finished"] == summary["num_requests"]


# ---- rows ---------------------------------------------------------------------------------------------------
def row_html(row: RequestRow, now: float, max_chars: int) -> str:
    state = row.state
    color = STATE_COLORS.get(state, "#8250df")
    limit = row.max_tokens
    tokens = f"{row.num_tokens}/{limit} tokens" if limit is not None else f"{row.num_tokens} tokens"
    facts = [
        f"<span style='color:{color};font-weight:bold'>{html.escape(state)}</span>",
        tokens,
        f"{row.tokens_per_s(now):.1f} tok/s",
    ]
    metrics = row.output.metrics
    if metrics is not None:
        if metrics.time_to_first_token is not None:
            facts.append(f"first token {metrics.time_to_first_token:.2f} s")
        if row.finished and metrics.latency is not None:
            facts.append(f"latency {metrics.latency:.2f} s")
        if metrics.num_preemptions:
            facts.append(f"preemptions {metrics.num_preemptions}")
    settings = row.settings()
    header = (
        f"<span style='{_GREY}'>{html.escape(row.request_id)}</span> "
        + _items(facts)
        + (f" <span style='{_GREY}'>· {html.escape(settings)}</span>" if settings else "")
    )
    fill = min(1.0, row.num_tokens / limit) if limit else (1.0 if row.finished else 0.0)
    bar = (
        "<div style='height:2px;background:#eaeef2;margin:1px 0 2px'>"
        f"<div style='height:2px;width:{fill:.1%};background:{color}'></div></div>"
    )
    return (
        f"<div style='{_FONT};padding:1px 0 3px 8px;border-left:3px solid {color}'>{header}{bar}"
        f"<div style='white-space:pre-wrap;word-break:break-word'>{_body(row, max_chars)}</div></div>"
    )


def _body(row: RequestRow, max_chars: int) -> str:
    """The prompt (a chat as its turns) in grey, then the generated text (each sample's, for ``n > 1``)."""
    messages = row.output.messages
    if messages:
        turns = [
            f"<div><b style='{_GREY}'>{html.escape(str(m.get('role', '?')))}:</b> "
            f"<span style='{_GREY}'>{html.escape(_tail(str(m.get('content', '')), max_chars))}</span></div>"
            for m in messages
        ]
        prompt = "".join(turns) + "<b style='color:#1f6feb'>assistant:</b> "
    else:
        text = row.prompt if row.prompt is not None else f"<{row.num_prompt_tokens} tokens>"
        prompt = f"<span style='{_GREY}'>{html.escape(_tail(text, 60))}</span>"
    completions = row.output.outputs
    if len(completions) == 1:
        return (
            prompt
            + f"<span class='enginekit-text'>{html.escape(_tail(completions[0].text, max_chars))}</span>"
        )
    samples = "".join(
        f"<div><span style='{_GREY}'>[{c.index}]</span> "
        f"<span class='enginekit-text'>{html.escape(_tail(c.text, max_chars // len(completions) + 20))}</span></div>"
        for c in completions
    )
    return prompt + samples


def _tail(text: str, max_chars: int) -> str:
    return "…" + text[-max_chars:] if len(text) > max_chars else text


# ---- the panel ----------------------------------------------------------------------------------------------
def panel_html(summary: dict[str, Any]) -> str:
    engine = [
        "<b>enginekit</b>",
        f"mode <b>{html.escape(str(summary['mode']))}</b>",
        f"engine pid {summary['engine_pid']}",
    ]
    stats = summary["stats"]
    if stats is not None:
        engine += [
            f"running {stats['num_running_requests']}",
            f"waiting {stats['num_waiting_requests']}",
            f"KV cache {stats['kv_cache_usage']:.0%}",
            f"prefix-cache hits {stats['prefix_cache_hit_rate']:.0%}",
        ]
        if "num_preemptions" in stats:
            engine.append(f"preemptions {stats['num_preemptions']}")
        for index, rank in enumerate(stats.get("ranks") or []):  # data parallel: each rank's load
            load = rank["num_running_requests"] + rank["num_waiting_requests"]
            engine.append(f"rank {index}: {load} requests, KV {rank['kv_cache_usage']:.0%}")
    if summary["stats_error"]:
        engine.append(f"<span style='color:#bc4c00'>{html.escape(summary['stats_error'])}</span>")
    requests = [_token_bar(summary), f"{summary['num_tokens']}/{summary['num_max_tokens']} tokens"]
    for state in ("running", "waiting", "preempted"):
        count = summary[f"num_{state}"]
        if count:
            requests.append(f"<span style='color:{STATE_COLORS[state]}'>{count} {state}</span>")
    done, total = summary["num_finished"], summary["num_requests"]
    requests.append(f"{done}/{total} finished")
    for reason, count in sorted(summary["finish_reasons"].items()):
        requests.append(f"<span style='color:{STATE_COLORS.get(reason, '#8250df')}'>{count} {reason}</span>")
    requests += [
        f"{summary['tokens_per_s']:.1f} tok/s",
        f"{summary['elapsed_s']:.1f} s",
        f"<b>{summary['state']}</b>",
    ]
    return f"<div style='{_FONT}'><div>{_items(engine)}</div><div>{_items(requests)}</div></div>"


def _token_bar(summary: dict[str, Any]) -> str:
    """Tokens generated out of the most that may come, coloured by how their requests are doing."""
    total = max(summary["num_max_tokens"], 1)
    parts = summary.get("tokens_by_state", {})
    segments = "".join(
        f"<span style='display:inline-block;height:100%;width:{count / total:.2%};background:{STATE_COLORS.get(state, '#8250df')}'></span>"
        for state, count in parts.items()
        if count
    )
    return (
        "<span style='display:inline-block;width:160px;height:9px;background:#eaeef2;vertical-align:middle;"
        f"white-space:nowrap;overflow:hidden;line-height:0'>{segments}</span>"
    )


def _items(items: list[str]) -> str:
    """Items separated by " · ", each kept on one line: lines break between items only."""
    return " · ".join(f"<span style='white-space:nowrap'>{item}</span>" for item in items)
