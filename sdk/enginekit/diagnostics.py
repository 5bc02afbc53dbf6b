"""Measure what this process holds, to prove an engine leaks nothing across restarts.

Take a :func:`snapshot` before starting an engine, another after shutting it down, and compare
them with :meth:`ProcessSnapshot.diff`. The resulting :class:`SnapshotDiff` lists everything
that grew (threads, file descriptors, child processes, frozen objects, signal handlers, tensors,
CUDA memory, resident memory beyond a tolerance). Because teardown of threads and child
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

from __future__ import annotations

import gc
import inspect
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ProcessSnapshot",
    "SnapshotDiff",
    "format_table",
    "snapshot",
    "wait_until_clean",
]

_MIB = 2**20
_DEFAULT_RSS_TOLERANCE = 64 * _MIB


@dataclass(frozen=True)
class ProcessSnapshot:
    """What this process held at one moment.

    Create one with :func:`snapshot`; compare two with :meth:`diff`.

    Attributes
    ----------
    num_threads : int
        Number of live Python threads (``threading.active_count()``).
    thread_names : tuple of str
        Sorted names of the live Python threads (duplicates kept).
    num_fds : int
        Open file descriptors, or ``-1`` when they cannot be counted on this platform.
    child_pids : tuple of int
        Sorted ids of live (non-zombie) descendant processes, children of children included.
    rss_bytes : int
        Resident set size in bytes. Without ``/proc`` and without psutil this falls back to the
        peak resident size reported by :mod:`resource`.
    gc_freeze_count : int
        Objects in the garbage collector's permanent generation (``gc.get_freeze_count()``).
    sigint_handler : str
        Stable description of the Python-level ``SIGINT`` handler.
    sigterm_handler : str
        Stable description of the Python-level ``SIGTERM`` handler.
    num_tensors : int
        Live ``torch.Tensor`` objects the garbage collector can see; ``0`` when torch has not
        been imported. Tensors held only inside C++ (for example saved for backward) and tensors
        frozen by ``gc.freeze()`` are not visible.
    tensor_bytes : int
        Total bytes of the storages behind those tensors, each storage counted once.
    cuda_allocated_bytes : int
        Bytes the CUDA caching allocator has handed out on all devices; ``0`` when torch has not
        been imported or CUDA has not been initialized.
    """

    num_threads: int
    thread_names: tuple[str, ...]
    num_fds: int
    child_pids: tuple[int, ...]
    rss_bytes: int
    gc_freeze_count: int
    sigint_handler: str
    sigterm_handler: str
    num_tensors: int
    tensor_bytes: int
    cuda_allocated_bytes: int

    def diff(self, later: ProcessSnapshot) -> SnapshotDiff:
        """Compare this snapshot with a later one.

        Parameters
        ----------
        later : ProcessSnapshot
            A snapshot taken after this one.

        Returns
        -------
        SnapshotDiff
            The change from ``self`` to ``later``; positive numbers mean ``later`` holds more.
        """
        new_names = Counter(later.thread_names) - Counter(self.thread_names)
        return SnapshotDiff(
            before=self,
            after=later,
            threads=later.num_threads - self.num_threads,
            fds=later.num_fds - self.num_fds,
            children=len(later.child_pids) - len(self.child_pids),
            rss_bytes=later.rss_bytes - self.rss_bytes,
            gc_freeze_count=later.gc_freeze_count - self.gc_freeze_count,
            tensors=later.num_tensors - self.num_tensors,
            tensor_bytes=later.tensor_bytes - self.tensor_bytes,
            cuda_allocated_bytes=later.cuda_allocated_bytes - self.cuda_allocated_bytes,
            new_thread_names=tuple(sorted(new_names.elements())),
            new_child_pids=tuple(sorted(set(later.child_pids) - set(self.child_pids))),
            handlers_changed=(
                later.sigint_handler != self.sigint_handler or later.sigterm_handler != self.sigterm_handler
            ),
        )


@dataclass(frozen=True)
class SnapshotDiff:
    """The change between two :class:`ProcessSnapshot` objects.

    Every numeric field is ``after - before``.

    Attributes
    ----------
    before, after : ProcessSnapshot
        The two snapshots compared.
    threads, fds, children : int
        Change in live threads, open file descriptors and live descendant processes.
    rss_bytes : int
        Change in resident set size.
    gc_freeze_count : int
        Change in the number of objects frozen by ``gc.freeze()``.
    tensors, tensor_bytes : int
        Change in live tensors and in the bytes of their storages.
    cuda_allocated_bytes : int
        Change in CUDA memory handed out by torch's allocator.
    new_thread_names : tuple of str
        Names of threads alive in ``after`` but not in ``before`` (as a multiset).
    new_child_pids : tuple of int
        Descendant processes alive in ``after`` but not in ``before``.
    handlers_changed : bool
        Whether the ``SIGINT`` or ``SIGTERM`` handler differs.
    """

    before: ProcessSnapshot
    after: ProcessSnapshot
    threads: int
    fds: int
    children: int
    rss_bytes: int
    gc_freeze_count: int
    tensors: int
    tensor_bytes: int
    cuda_allocated_bytes: int
    new_thread_names: tuple[str, ...]
    new_child_pids: tuple[int, ...]
    handlers_changed: bool

    def leaks(self, *, rss_tolerance_bytes: int = _DEFAULT_RSS_TOLERANCE) -> list[str]:
        """List everything that grew.

        Parameters
        ----------
        rss_tolerance_bytes : int, optional
            Growth of resident memory that is not reported (allocators keep freed memory).
            Defaults to 64 MiB.

        Returns
        -------
        list of str
            One human-readable line per leak; empty when the process is back to ``before``.
            A thread or child process that did not exist before counts as a leak even when
            another one ended meanwhile, so the totals did not grow.
        """
        found: list[str] = []
        if self.threads > 0 or self.new_thread_names:
            names = ", ".join(repr(name) for name in self.new_thread_names)
            found.append(f"threads: {self.threads:+d} (new: {names or 'none'})")
        if self.fds > 0:
            found.append(f"file descriptors: {self.fds:+d}")
        if self.children > 0 or self.new_child_pids:
            pids = ", ".join(str(pid) for pid in self.new_child_pids)
            found.append(f"child processes: {self.children:+d} (new pids: {pids or 'none'})")
        if self.gc_freeze_count > 0:
            found.append(f"gc frozen objects: {self.gc_freeze_count:+d}")
        if self.handlers_changed:
            changes = []
            for name, old, new in (
                ("SIGINT", self.before.sigint_handler, self.after.sigint_handler),
                ("SIGTERM", self.before.sigterm_handler, self.after.sigterm_handler),
            ):
                if old != new:
                    changes.append(f"{name} {old} -> {new}")
            found.append("signal handlers changed: " + "; ".join(changes))
        if self.tensors > 0 or self.tensor_bytes > 0:
            found.append(f"tensors: {self.tensors:+d} ({_format_mib(self.tensor_bytes)} of storage)")
        if self.cuda_allocated_bytes > 0:
            found.append(f"CUDA allocated: {_format_mib(self.cuda_allocated_bytes)}")
        if self.rss_bytes > rss_tolerance_bytes:
            found.append(
                f"resident memory: {_format_mib(self.rss_bytes)} "
                f"(tolerance {rss_tolerance_bytes / _MIB:.1f} MiB)"
            )
        return found

    def as_row(self) -> dict[str, object]:
        """Flatten the diff into one table row.

        Returns
        -------
        dict of str to object
            Keys ``threads``, ``fds``, ``children``, ``gc_freeze``, ``tensors`` (ints),
            ``rss_mib``, ``tensor_mib``, ``cuda_mib`` (floats rounded to 0.01 MiB),
            ``handlers_changed`` and ``clean`` (bools, ``clean`` with the default tolerance).
            Suitable for :func:`format_table`.
        """
        return {
            "threads": self.threads,
            "fds": self.fds,
            "children": self.children,
            "rss_mib": round(self.rss_bytes / _MIB, 2),
            "gc_freeze": self.gc_freeze_count,
            "tensors": self.tensors,
            "tensor_mib": round(self.tensor_bytes / _MIB, 2),
            "cuda_mib": round(self.cuda_allocated_bytes / _MIB, 2),
            "handlers_changed": self.handlers_changed,
            "clean": not self.leaks(),
        }

    def __str__(self) -> str:
        """Describe the diff on one line, ending with ``clean`` or the number of leaks."""
        leaks = self.leaks()
        verdict = "clean" if not leaks else f"{len(leaks)} leak(s): " + "; ".join(leaks)
        return (
            f"threads {self.threads:+d}, fds {self.fds:+d}, children {self.children:+d}, "
            f"rss {_format_mib(self.rss_bytes)}, gc freeze {self.gc_freeze_count:+d}, "
            f"tensors {self.tensors:+d} ({_format_mib(self.tensor_bytes)}), "
            f"cuda {_format_mib(self.cuda_allocated_bytes)}, "
            f"handlers {'changed' if self.handlers_changed else 'unchanged'} -- {verdict}"
        )


def snapshot(*, collect: bool = True) -> ProcessSnapshot:
    """Measure what this process holds right now.

    A pure measurement: it does not wait for anything to finish.

    Parameters
    ----------
    collect : bool, optional
        Run ``gc.collect()`` first so that unreachable objects (and the files, tensors and
        threads' bookkeeping they hold) are not counted. Defaults to ``True``.

    Returns
    -------
    ProcessSnapshot
        The measurements.
    """
    if collect:
        gc.collect()
    threads = threading.enumerate()
    thread_names = tuple(sorted(thread.name for thread in threads))
    del threads
    num_tensors, tensor_bytes = _count_tensors()
    return ProcessSnapshot(
        num_threads=len(thread_names),
        thread_names=thread_names,
        num_fds=_count_fds(),
        child_pids=_child_pids(),
        rss_bytes=_rss_bytes(),
        gc_freeze_count=gc.get_freeze_count(),
        sigint_handler=_describe_handler(signal.getsignal(signal.SIGINT)),
        sigterm_handler=_describe_handler(signal.getsignal(signal.SIGTERM)),
        num_tensors=num_tensors,
        tensor_bytes=tensor_bytes,
        cuda_allocated_bytes=_cuda_allocated_bytes(),
    )


def wait_until_clean(
    baseline: ProcessSnapshot,
    *,
    timeout: float = 10.0,
    rss_tolerance_bytes: int = _DEFAULT_RSS_TOLERANCE,
) -> SnapshotDiff:
    """Poll until the process is back to ``baseline`` or ``timeout`` passes.

    Threads and child processes take a moment to go away after a shutdown; this takes
    snapshots (with ``gc.collect()``) until ``baseline.diff(now).leaks()`` is empty.

    Parameters
    ----------
    baseline : ProcessSnapshot
        The snapshot to return to, usually taken before the engine started.
    timeout : float, optional
        Seconds to keep polling. At least one snapshot is always taken. Defaults to 10.
    rss_tolerance_bytes : int, optional
        Passed to :meth:`SnapshotDiff.leaks`. Defaults to 64 MiB.

    Returns
    -------
    SnapshotDiff
        The last diff taken: clean unless the timeout passed first.

    Raises
    ------
    ValueError
        If ``timeout`` is negative.
    """
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    deadline = time.monotonic() + timeout
    interval = 0.02
    while True:
        diff = baseline.diff(snapshot())
        if not diff.leaks(rss_tolerance_bytes=rss_tolerance_bytes):
            return diff
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return diff
        time.sleep(min(interval, remaining))
        interval = min(interval * 2, 0.25)


def format_table(rows: list[dict[str, object]]) -> str:
    """Render rows (such as :meth:`SnapshotDiff.as_row` dicts) as a Markdown table.

    Columns appear in the order their keys first appear, so extra keys placed first in a row
    (``{"mode": "restart", **diff.as_row()}``) come first. Missing values are left blank,
    floats are shown with two decimals and numeric columns are right-aligned.

    Parameters
    ----------
    rows : list of dict of str to object
        The rows; at least one.

    Returns
    -------
    str
        The table, one line per row after the header and separator, without a trailing newline.

    Raises
    ------
    ValueError
        If ``rows`` is empty.
    """
    if not rows:
        raise ValueError("format_table needs at least one row")
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    numeric = {
        column: all(_is_number(row[column]) for row in rows if row.get(column) is not None)
        for column in columns
    }
    cells = [[_format_cell(row.get(column)) for column in columns] for row in rows]
    header = [_escape(column) for column in columns]
    widths = [max(3, len(header[i]), *(len(line[i]) for line in cells)) for i in range(len(columns))]

    def render(values: list[str]) -> str:
        padded = [
            value.rjust(width) if numeric[column] else value.ljust(width)
            for value, width, column in zip(values, widths, columns)
        ]
        return "| " + " | ".join(padded) + " |"

    separator = (
        "|"
        + "|".join(
            ("-" * (width + 1) + ":") if numeric[column] else ("-" * (width + 2))
            for width, column in zip(widths, columns)
        )
        + "|"
    )
    return "\n".join([render(header), separator, *(render(line) for line in cells)])


# -- measurements -------------------------------------------------------------------------------


def _count_fds() -> int:
    # The listing itself holds one descriptor open; it is counted every time, so diffs are exact.
    fd_dirs = ["/proc/self/fd"] + (["/dev/fd"] if sys.platform == "darwin" else [])
    for fd_dir in fd_dirs:
        try:
            return len(os.listdir(fd_dir))
        except OSError:
            continue
    try:
        import psutil
    except ImportError:
        return -1
    try:
        process = psutil.Process()
        if hasattr(process, "num_fds"):
            return int(process.num_fds())
        return int(process.num_handles())
    except Exception:
        return -1


def _child_pids() -> tuple[int, ...]:
    try:
        import psutil
    except ImportError:
        return _child_pids_from_proc()
    pids: list[int] = []
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return _child_pids_from_proc()
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            pass  # Alive but unreadable: still a child.
        pids.append(child.pid)
    return tuple(sorted(pids))


def _child_pids_from_proc() -> tuple[int, ...]:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return ()
    children_of: dict[int, list[int]] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                stat = stat_file.read().decode("ascii", "replace")
        except OSError:
            continue
        # The command name is in parentheses and may itself contain spaces or parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 2 or fields[0] in ("Z", "X", "x"):
            continue
        children_of.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    pending = [os.getpid()]
    while pending:
        kids = children_of.get(pending.pop(), [])
        found.extend(kids)
        pending.extend(kids)
    return tuple(sorted(found))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        pass
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _describe_handler(handler: Any) -> str:
    if handler is None:
        return "None"
    if handler is signal.default_int_handler:
        return "default_int_handler"
    if isinstance(handler, int):
        for name in ("SIG_DFL", "SIG_IGN"):
            if handler == getattr(signal, name):
                return name
        return f"int:{int(handler)}"
    if inspect.ismethod(handler):
        func = handler.__func__
        owner = handler.__self__
        return f"{_qualified_name(func)} bound to {type(owner).__qualname__}@{id(owner):#x}"
    if inspect.isfunction(handler) or inspect.isbuiltin(handler):
        return f"{_qualified_name(handler)}@{id(handler):#x}"
    kind = type(handler)
    return f"{kind.__module__}.{kind.__qualname__} instance@{id(handler):#x}"


def _qualified_name(obj: Callable[..., object]) -> str:
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or "?"
    return f"{module}.{qualname}"


def _count_tensors() -> tuple[int, int]:
    torch = sys.modules.get("torch")
    if torch is None:
        return 0, 0
    c_module = getattr(torch, "_C", None)
    tensor_type = getattr(c_module, "TensorBase", None) or getattr(torch, "Tensor", None)
    if not isinstance(tensor_type, type):
        return 0, 0
    count = 0
    storages: dict[tuple[str, int], int] = {}
    objects = gc.get_objects()
    try:
        for obj in objects:
            # issubclass on the type never calls into the object (no __class__ lookup).
            if not issubclass(type(obj), tensor_type):
                continue
            count += 1
            try:
                storage = obj.untyped_storage()
                device = str(storage.device)
                if device == "meta":
                    continue
                key = (device, int(storage.data_ptr()))
                if key[1] == 0:
                    continue
                storages[key] = max(storages.get(key, 0), int(storage.nbytes()))
            except Exception:
                continue  # Sparse, fake or otherwise storage-less tensors.
    finally:
        del objects
    return count, sum(storages.values())


def _cuda_allocated_bytes() -> int:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None:
        return 0
    try:
        if not cuda.is_initialized():
            return 0
        return sum(int(cuda.memory_allocated(index)) for index in range(cuda.device_count()))
    except Exception:
        return 0


# -- formatting ---------------------------------------------------------------------------------


def _format_mib(num_bytes: int) -> str:
    return f"{num_bytes / _MIB:+.1f} MiB"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return _escape(str(value))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
