"""Notebook helpers: the live viewer, background generation, progress bars.

Nothing here imports the facade: the viewer and background generation use an engine only through its public
API, so the facade can hand them its requests' live outputs.
"""

from enginekit.notebook.background import GenerationHandle, start_background
from enginekit.notebook.jupyter import in_jupyter
from enginekit.notebook.viewer import Viewer
from enginekit.notebook.watch import watcher_for, watches_live

__all__ = ["GenerationHandle", "Viewer", "in_jupyter", "start_background", "watcher_for", "watches_live"]
