"""Process snapshots and their diffs: what this process holds, and what grew between two moments."""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

from .probes import (
    count_fds,
    count_tensors,
    cuda_allocated_bytes,
    descendant_pids,
    describe_handler,
    rss_bytes,
)
from .table import format_mib

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
    zombie_pids : tuple of int
        Sorted ids of descendant processes that have exited but were never reaped (waited for) by their parent:
        each holds a process-table slot and its exit status until it is. A child of this process stays one until
        this process waits for it (``Popen.wait``, ``os.waitpid``).
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
    zombie_pids: tuple[int, ...]
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
            zombies=len(later.zombie_pids) - len(self.zombie_pids),
            rss_bytes=later.rss_bytes - self.rss_bytes,
            gc_freeze_count=later.gc_freeze_count - self.gc_freeze_count,
            tensors=later.num_tensors - self.num_tensors,
            tensor_bytes=later.tensor_bytes - self.tensor_bytes,
            cuda_allocated_bytes=later.cuda_allocated_bytes - self.cuda_allocated_bytes,
            new_thread_names=tuple(sorted(new_names.elements())),
            new_child_pids=tuple(sorted(set(later.child_pids) - set(self.child_pids))),
            new_zombie_pids=tuple(sorted(set(later.zombie_pids) - set(self.zombie_pids))),
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
    zombies : int
        Change in descendant processes that exited and were never reaped.
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
    new_zombie_pids : tuple of int
        Unreaped descendant processes in ``after`` that were not unreaped in ``before``.
    handlers_changed : bool
        Whether the ``SIGINT`` or ``SIGTERM`` handler differs.
    """

    before: ProcessSnapshot
    after: ProcessSnapshot
    threads: int
    fds: int
    children: int
    zombies: int
    rss_bytes: int
    gc_freeze_count: int
    tensors: int
    tensor_bytes: int
    cuda_allocated_bytes: int
    new_thread_names: tuple[str, ...]
    new_child_pids: tuple[int, ...]
    new_zombie_pids: tuple[int, ...]
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
        if self.zombies > 0 or self.new_zombie_pids:
            pids = ", ".join(str(pid) for pid in self.new_zombie_pids)
            found.append(
                f"zombie processes (exited, never reaped): {self.zombies:+d} (new pids: {pids or 'none'})"
            )
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
            found.append(f"tensors: {self.tensors:+d} ({format_mib(self.tensor_bytes)} of storage)")
        if self.cuda_allocated_bytes > 0:
            found.append(f"CUDA allocated: {format_mib(self.cuda_allocated_bytes)}")
        if self.rss_bytes > rss_tolerance_bytes:
            found.append(
                f"resident memory: {format_mib(self.rss_bytes)} "
                f"(tolerance {rss_tolerance_bytes / _MIB:.1f} MiB)"
            )
        return found

    def as_row(self) -> dict[str, object]:
        """Flatten the diff into one table row.

        Returns
        -------
        dict of str to object
            Keys ``threads``, ``fds``, ``children``, ``zombies``, ``gc_freeze``, ``tensors`` (ints),
            ``rss_mib``, ``tensor_mib``, ``cuda_mib`` (floats rounded to 0.01 MiB),
            ``handlers_changed`` and ``clean`` (bools, ``clean`` with the default tolerance).
            Suitable for :func:`format_table`.
        """
        return {
            "threads": self.threads,
            "fds": self.fds,
            "children": self.children,
            "zombies": self.zombies,
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
            f"zombies {self.zombies:+d}, "
            f"rss {format_mib(self.rss_bytes)}, gc freeze {self.gc_freeze_count:+d}, "
            f"tensors {self.tensors:+d} ({format_mib(self.tensor_bytes)}), "
            f"cuda {format_mib(self.cuda_allocated_bytes)}, "
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
    num_tensors, tensor_bytes = count_tensors()
    live, zombies = descendant_pids()
    return ProcessSnapshot(
        num_threads=len(thread_names),
        thread_names=thread_names,
        num_fds=count_fds(),
        child_pids=live,
        zombie_pids=zombies,
        rss_bytes=rss_bytes(),
        gc_freeze_count=gc.get_freeze_count(),
        sigint_handler=describe_handler(signal.getsignal(signal.SIGINT)),
        sigterm_handler=describe_handler(signal.getsignal(signal.SIGTERM)),
        num_tensors=num_tensors,
        tensor_bytes=tensor_bytes,
        cuda_allocated_bytes=cuda_allocated_bytes(),
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
