"""The measurements behind a snapshot: descriptors, descendant processes, resident memory, signal handlers,
tensors and CUDA memory. Each works without psutil and without importing torch (tensors are only counted when
torch is already imported)."""

from __future__ import annotations

import gc
import inspect
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def count_fds() -> int:
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
        if sys.platform == "win32":
            return int(process.num_handles())
        return int(process.num_fds())
    except Exception:
        return -1


def descendant_pids() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The live descendant processes, children of children included, and the zombies among them."""
    try:
        import psutil
    except ImportError:
        return _descendants_from_proc()
    live: list[int] = []
    zombies: list[int] = []
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return _descendants_from_proc()
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
                continue
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            pass  # Alive but unreadable: still a child.
        live.append(child.pid)
    return tuple(sorted(live)), tuple(sorted(zombies))


def _descendants_from_proc() -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return (), ()
    children_of: dict[int, list[int]] = {}
    zombie = set()
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
        if len(fields) < 2 or fields[0] in ("X", "x"):
            continue
        if fields[0] == "Z":
            zombie.add(int(entry))
        children_of.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    pending = [os.getpid()]
    while pending:
        kids = children_of.get(pending.pop(), [])
        found.extend(kids)
        pending.extend(kid for kid in kids if kid not in zombie)
    live = tuple(sorted(pid for pid in found if pid not in zombie))
    return live, tuple(sorted(pid for pid in found if pid in zombie))


def rss_bytes() -> int:
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


def describe_handler(handler: Callable[[int, FrameType | None], Any] | int | None) -> str:
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


def count_tensors() -> tuple[int, int]:
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


def cuda_allocated_bytes() -> int:
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
