"""At interpreter exit: shut every live engine down, then the launcher — in that order, in one hook.

Engines are held only weakly. One hook for both keeps the order fixed whatever else registered exit hooks
(the engines' run folders are removed before the launcher goes).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def register(engine: Any) -> None:
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
        _engines.add(engine)


def unregister(engine: Any) -> None:
    _engines.discard(engine)


def _at_exit() -> None:
    for engine in list(_engines):
        try:
            engine.shutdown(timeout=0)
        except Exception:  # NOTE: at exit, one broken engine must not keep the others alive
            pass
    from enginekit.runtime.launcher import Launcher

    Launcher.close_shared()
