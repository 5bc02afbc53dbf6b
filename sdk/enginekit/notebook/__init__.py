"""Notebook helpers: the live viewer, background generation, progress bars.

Nothing here imports the facade: the viewer and background generation use an engine only through its public
API, so the facade can hand them its requests' live outputs.
"""

from enginekit.notebook.background import GenerationHandle, start_background
from enginekit.notebook.jupyter import in_jupyter
from enginekit.notebook.viewer import Viewer
from enginekit.notebook.watch import make_watcher

__all__ = ["GenerationHandle", "Viewer", "in_jupyter", "make_watcher", "start_background"]
