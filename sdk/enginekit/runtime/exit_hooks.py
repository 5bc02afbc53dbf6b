"""At interpreter exit: shut every live engine down, then the launcher — in that order, in one hook.

Engines are held only weakly. One hook for both keeps the order fixed whatever else registered exit hooks
(the engines' run folders are removed before the launcher goes).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol


class _Engine(Protocol):
    """What the hook needs of an engine (the front end's ``Engine``, which this layer does not import)."""

    def shutdown(self, timeout: float | None = None) -> None: ...


_engines: weakref.WeakSet[_Engine] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def register(engine: _Engine) -> None:
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
        _engines.add(engine)


def unregister(engine: _Engine) -> None:
    _engines.discard(engine)


def _at_exit() -> None:
    for engine in list(_engines):
        try:
            engine.shutdown(timeout=0)
        except Exception:  # NOTE: at exit, one broken engine must not keep the others alive
            pass
    from enginekit.runtime.launcher import Launcher

    Launcher.close_shared()
