"""The viewer's ipywidgets view: an engine panel with a Stop-all button, then one row per request."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginekit.notebook.jupyter import in_jupyter

if TYPE_CHECKING:
    from enginekit.notebook.viewer import RequestRow, Viewer

_REASON_COLORS = {None: "#1f6feb", "length": "#57606a", "stop": "#1a7f37", "abort": "#bc4c00"}
_FONT = "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.45"


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
        self.panel = widgets.HTML(layout=widgets.Layout(height="auto"))  # not one fixed-height line
        self.stop_all = widgets.Button(
            description="Stop all",
            icon="stop",
            button_style="danger",
            tooltip="Abort every running request of this viewer",
            disabled=True,
            layout=widgets.Layout(width="auto", flex="0 0 auto"),
        )
        self.stop_all.on_click(lambda _button: viewer.abort_all())
        self.rows_box = widgets.VBox(layout=widgets.Layout(max_height="520px", overflow="auto"))
        header = widgets.HBox(
            [self.panel, self.stop_all],
            layout=widgets.Layout(justify_content="space-between", align_items="center"),
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
        self.panel.value = panel_html(summary)
        self.stop_all.disabled = summary["num_finished"] == summary["num_requests"]


def row_html(row: RequestRow, now: float, max_chars: int) -> str:
    reason = row.finish_reason
    color = _REASON_COLORS.get(reason, "#8250df")
    label = html.escape(reason or "running")
    text = row.text
    if len(text) > max_chars:
        text = "…" + text[-max_chars:]
    prompt = row.prompt if row.prompt is not None else f"<{row.num_prompt_tokens} tokens>"
    if len(prompt) > 60:
        prompt = "…" + prompt[-60:]
    return (
        f"<div style='{_FONT};padding:1px 0 3px 8px;border-left:3px solid {color}'>"
        f"<span style='color:#888'>{html.escape(row.request_id)}</span> "
        f"<span style='color:{color};font-weight:bold'>{label}</span> · "
        f"{row.num_tokens} tokens · {row.tokens_per_s(now):.1f} tok/s"
        "<div style='white-space:pre-wrap;word-break:break-all'>"
        f"<span style='color:#888'>{html.escape(prompt)}</span>"
        f"<span class='enginekit-text'>{html.escape(text)}</span></div></div>"
    )


def panel_html(summary: dict[str, Any]) -> str:
    engine = (
        f"<b>enginekit</b> · mode <b>{html.escape(str(summary['mode']))}</b>"
        f" · engine pid {summary['engine_pid']}"
    )
    stats = summary["stats"]
    if stats is not None and summary["active"]:  # engine load now; once done, the moment has passed
        engine += (
            f" · running {stats['num_running_requests']} · waiting {stats['num_waiting_requests']}"
            f" · KV cache {stats['kv_cache_usage']:.0%}"
        )
        if "ranks" in stats:  # data parallel: each rank's load
            engine += " · " + " ".join(
                f"rank {i}: {rank['num_running_requests'] + rank['num_waiting_requests']}"
                for i, rank in enumerate(stats["ranks"])
            )
    if stats is not None:
        engine += f" · prefix-cache hits {stats['prefix_cache_hit_rate']:.0%}"
    if summary["stats_error"]:
        engine += f" · <span style='color:#bc4c00'>{html.escape(summary['stats_error'])}</span>"
    done, total = summary["num_finished"], summary["num_requests"]
    state = "running" if summary["active"] else "done"
    progress = (
        f"<progress value='{done}' max='{max(total, 1)}' style='width:140px;vertical-align:middle'>"
        "</progress>"
    )
    requests = (
        f"{progress} {done}/{total} finished · {summary['num_tokens']} tokens"
        f" · {summary['tokens_per_s']:.1f} tok/s · {summary['elapsed_s']:.1f} s · {state}"
    )
    return f"<div style='{_FONT}'>{engine}<br>{requests}</div>"
