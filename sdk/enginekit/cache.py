"""Where enginekit keeps its files: prepared weights and the native kernels it builds."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The cache folder: ``$ENGINEKIT_CACHE``, else ``~/.cache/enginekit``."""
    return Path(os.environ.get("ENGINEKIT_CACHE") or Path.home() / ".cache" / "enginekit")
