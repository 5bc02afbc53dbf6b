"""What ``generate`` watches its requests with: a viewer, a progress bar, or nothing."""

from __future__ import annotations

from typing import Any

from enginekit.notebook.viewer import Viewer, check_viewer_argument
from enginekit.outputs import RequestOutput


class NoWatcher:
    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_watcher(engine: Any, outputs: list[RequestOutput], progress: bool | None, viewer: Any) -> Any:
    """A viewer's hold on these live outputs (``viewer=True`` builds a new ``Viewer``), else a progress bar
    (``progress=True``, or 16 prompts and more when ``progress`` is ``None``), else nothing."""
    check_viewer_argument(viewer)
    if viewer is not None and viewer is not False:
        return (Viewer() if viewer is True else viewer).attach(engine, outputs)
    if progress or (progress is None and len(outputs) >= 16):
        from enginekit.notebook.progress import ProgressWatcher

        return ProgressWatcher(outputs)
    return NoWatcher()
