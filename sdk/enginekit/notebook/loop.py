"""Run a coroutine to completion from sync code, with or without an asyncio loop already running.

A notebook cell runs inside the kernel's running loop, where ``asyncio.run`` is refused. Only there, the
running loop is made re-entrant with nest-asyncio — applied lazily, once, to that loop alone; no other
loop is ever patched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_patched_loops: set[int] = set()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    make_reentrant(loop)
    return loop.run_until_complete(coro)


def make_reentrant(loop: asyncio.AbstractEventLoop) -> None:
    """Apply nest-asyncio to this one loop (once); needed to block on it from inside one of its callbacks."""
    if id(loop) in _patched_loops or getattr(loop, "_nest_patched", False):
        return
    import nest_asyncio

    nest_asyncio.apply(loop)
    _patched_loops.add(id(loop))
