"""At interpreter exit: release what every live engine and client holds, then the launcher — in that order.

Engines and clients put their resources in an object of their own and register a ``weakref.finalize`` over
it here, in place of a ``__del__``: it runs once, when its owner is collected, when its owner shuts down
(which calls it), or at exit, whichever comes first. Those registered here run from this module's one exit hook
rather than ``weakref``'s, so the order is fixed whatever else registered exit hooks: newest first (an engine
before the client it made), then the launcher (the engines' run folders are removed before it goes).
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections.abc import Callable

# NOTE: keyed so that a finalizer leaves as it runs (at shutdown or collection), not at the next registration: a
# dead one kept until then would be freed inside a later engine's start (a user's gc.freeze() count would drop).
_finalizers: dict[int, weakref.finalize] = {}
_keys = itertools.count()
_lock = threading.RLock()  # NOTE: reentrant: a collection inside a locked section may run a finalizer
_registered = False


def register(owner: object, release: Callable[..., object], *args: object) -> weakref.finalize:
    """``weakref.finalize(owner, release, *args)``, run (if it has not run yet) at exit from this module's hook;
    returns it. ``release`` must not refer to ``owner``."""
    global _registered
    key = next(_keys)
    finalizer = weakref.finalize(owner, _run, key, release, args)
    finalizer.atexit = False
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
        _finalizers[key] = finalizer
    return finalizer


def _run(key: int, release: Callable[..., object], args: tuple[object, ...]) -> None:
    with _lock:
        _finalizers.pop(key, None)
    release(*args)


def _at_exit() -> None:
    with _lock:
        finalizers = list(_finalizers.values())[::-1]
    for finalizer in finalizers:
        try:
            finalizer()
        except Exception:  # NOTE: at exit, one broken engine must not keep the others alive
            pass
    from enginekit.runtime.launcher import Launcher

    Launcher.close_shared()
