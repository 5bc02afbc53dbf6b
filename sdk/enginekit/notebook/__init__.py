"""Notebook helpers: running sync calls on a live asyncio loop, progress bars and the live viewer."""

from enginekit.notebook.background import GenerationHandle
from enginekit.notebook.viewer import Viewer, in_jupyter

__all__ = ["GenerationHandle", "Viewer", "in_jupyter"]
