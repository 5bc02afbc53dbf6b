"""Measure what this process holds, to prove an engine leaks nothing across restarts.

Take a :func:`snapshot` before starting an engine, another after shutting it down, and compare
them with :meth:`ProcessSnapshot.diff`. The resulting :class:`SnapshotDiff` lists everything
that grew (threads, file descriptors, child processes, zombie processes (exited, never reaped),
frozen objects, signal handlers, tensors, CUDA memory, resident memory beyond a tolerance). Because teardown of threads and child
processes takes a moment, :func:`wait_until_clean` polls until the process is back to its
baseline or a timeout passes.

Examples
--------
>>> from enginekit.diagnostics import snapshot, wait_until_clean
>>> baseline = snapshot()
>>> # ... start, use and shut down an engine ...
>>> diff = wait_until_clean(baseline, timeout=10.0)
>>> assert not diff.leaks(), diff.leaks()

This module only measures: it never waits on its own (except in :func:`wait_until_clean`),
never imports torch (tensors are only counted when torch is already imported) and never
initializes CUDA.
"""

from .snapshot import ProcessSnapshot, SnapshotDiff, snapshot, wait_until_clean
from .table import format_table

__all__ = [
    "ProcessSnapshot",
    "SnapshotDiff",
    "format_table",
    "snapshot",
    "wait_until_clean",
]
