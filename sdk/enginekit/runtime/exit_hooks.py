"""At interpreter exit: release what every live engine and client holds, then the launcher — in that order.

Engines and clients put their resources in an object of their own and register a ``weakref.finalize`` over
it here, in place of a ``__del__``: it runs once, when its owner is collected, when its owner shuts down
(which calls it), or at exit, whichever comes first. Those registered here run from this module's one exit hook
rather than ``weakref``'s, so the order is fixed whatever else registered exit hooks: newest first (an engine
before the client it made), then the launcher (the engines' run folders are removed before it goes).
"""

from __future__ import annotations

import atexit
import threading
import weakref

_finalizers: list[weakref.finalize] = []
_lock = threading.Lock()
_registered = False


def register(finalizer: weakref.finalize) -> weakref.finalize:
    """Run ``finalizer`` (if it has not run yet) at exit, from this module's hook; returns it."""
    global _registered
    finalizer.atexit = False
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
        _finalizers[:] = [f for f in _finalizers if f.alive]
        _finalizers.append(finalizer)
    return finalizer


def _at_exit() -> None:
    with _lock:
        finalizers = _finalizers[::-1]
        _finalizers.clear()
    for finalizer in finalizers:
        try:
            finalizer()
        except Exception:  # NOTE: at exit, one broken engine must not keep the others alive
            pass
    from enginekit.runtime.launcher import Launcher

    Launcher.close_shared()
