"""What ``generate`` watches its requests with: a viewer, a progress bar, or nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginekit.notebook.viewer import Viewer, check_viewer_argument
from enginekit.outputs import RequestOutput
from enginekit.sampling_params import SamplingParams

if TYPE_CHECKING:  # notebook/ uses the engine it is handed through its public API
    from enginekit.frontend.engine import Engine


class NoWatcher:
    def update(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def watches_live(viewer: Any) -> bool:
    """Whether a call with this ``viewer`` argument shows its requests token by token. If not, the caller needs
    only their ends, and the engine sends nothing else (``EngineCoreRequest.final_only``)."""
    return viewer is not None and viewer is not False


def watcher_for(progress: bool | None, viewer: Any, *, blocking: bool = False) -> Callable[..., Any]:
    """Check the arguments now (before anything is submitted); the result attaches to the live outputs.

    A viewer (``viewer=True`` builds a new ``Viewer``) holds the outputs' rows; else a progress bar watches
    them (``progress=True``, or 16 prompts and more when ``progress`` is ``None``); else nothing does.
    ``blocking``: for a call that blocks its thread (a plain ``generate``), not one awaited on a loop.
    """
    check_viewer_argument(viewer)

    def attach(
        engine: Engine, outputs: list[RequestOutput], params: list[SamplingParams] | None = None
    ) -> Any:
        if watches_live(viewer):
            watch = (Viewer() if viewer is True else viewer).attach(engine, outputs, params)
            watch.blocking = blocking
            return watch
        if progress or (progress is None and len(outputs) >= 16):
            from enginekit.notebook.progress import ProgressWatcher

            return ProgressWatcher(outputs)
        return NoWatcher()

    return attach
