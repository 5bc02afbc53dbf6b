"""Shut every live engine down at interpreter exit, holding them only weakly."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False


def register(engine: Any) -> None:
    global _registered
    if not _registered:
        atexit.register(_shutdown_all)
        _registered = True
    _engines.add(engine)


def unregister(engine: Any) -> None:
    _engines.discard(engine)


def _shutdown_all() -> None:
    for engine in list(_engines):
        try:
            engine.shutdown(timeout=0)
        except Exception:  # NOTE: at exit, one broken engine must not keep the others alive
            pass
