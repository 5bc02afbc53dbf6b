"""A disk cache of prepared weights (e.g. a GGUF dequantized to bf16), mapped rather than read on later loads.

Each entry is a folder ``<cache dir>/<source name>-<key hash>/`` holding ``weights.safetensors`` and
``manifest.json``. The key hashes the source file's identity (resolved path, size, mtime_ns, inode) with the
caller's key parts (dtype, layout version), so a changed source or layout gets a new entry. How an entry is
written (never half of it seen) and checked when mapped is ``weight_cache_entry.py``'s business; this module
finds, builds and evicts entries. Of two concurrent builders one rename wins; the other discards its folder and
maps the winner's entry (or keeps its own tensors if that fails).

A damaged entry is logged at warning level, removed and rebuilt; it is never used.

Bounds: every load that maps an entry marks it used (the entry folder's mtime). After a new entry is written,
entries unused for ``ENGINEKIT_CACHE_MAX_AGE_DAYS`` (default 30) are removed, then the least recently used ones
until the cache holds at most ``ENGINEKIT_CACHE_MAX_BYTES`` (default 4 GiB; suffixes K, M, G; ``0`` for no
bound), never the entry just written. Removing an entry another process maps is safe: its mapping stays valid.
``list_entries``, ``prune_cache`` and ``clear_cache`` (and ``enginekit cache list|prune|clear``) do it by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from enginekit.cache import cache_dir
from enginekit.errors import EngineStartupError
from enginekit.model.formats.weight_cache_entry import (
    CACHE_FORMAT,
    MANIFEST_FILE,
    DamagedEntry,
    map_entry,
    write_entry,
)

MAX_BYTES_ENV, MAX_AGE_ENV = "ENGINEKIT_CACHE_MAX_BYTES", "ENGINEKIT_CACHE_MAX_AGE_DAYS"
DEFAULT_MAX_BYTES, DEFAULT_MAX_AGE_DAYS = 4 << 30, 30.0
_LEFTOVER_AGE_S = 24 * 3600  # a builder's temporary folder this old belongs to a process that is gone

logger = logging.getLogger("enginekit.weight_cache")


@dataclass(frozen=True)
class CacheEntry:
    """One weight cache entry: its folder, its size on disk, when a load last used it, what it was built for."""

    path: Path
    num_bytes: int
    last_used: float  # seconds since the epoch
    key_parts: dict[str, str]


def list_entries() -> list[CacheEntry]:
    """Every entry in the cache, most recently used first."""
    root = cache_dir()
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        try:
            if folder.name.startswith(".") or not (folder / MANIFEST_FILE).is_file():
                continue
            size = sum(item.stat().st_size for item in folder.iterdir())
            last_used = folder.stat().st_mtime
            key_parts = json.loads((folder / MANIFEST_FILE).read_text()).get("key_parts", {})
        except (OSError, ValueError, AttributeError):
            continue  # removed meanwhile, or not ours: never a reason to fail
        entries.append(CacheEntry(folder, size, last_used, key_parts if isinstance(key_parts, dict) else {}))
    return sorted(entries, key=lambda entry: entry.last_used, reverse=True)


def cache_limits() -> tuple[int, float]:
    """The cache's bounds: most bytes (``0``: none) and most days unused (``0``: none), from the environment."""
    return (
        _parse_bytes(os.environ.get(MAX_BYTES_ENV, ""), DEFAULT_MAX_BYTES),
        _parse_days(os.environ.get(MAX_AGE_ENV, ""), DEFAULT_MAX_AGE_DAYS),
    )


def prune_cache(
    *, max_bytes: int | None = None, max_age_days: float | None = None, keep: Collection[Path] = ()
) -> list[CacheEntry]:
    """Remove entries unused for more than ``max_age_days``, then the least recently used ones until the rest
    hold at most ``max_bytes`` (``None``: the environment's bounds, see ``cache_limits``; ``0``: no bound).
    Entries in ``keep`` stay. Returns the removed entries."""
    default_bytes, default_days = cache_limits()
    max_bytes = default_bytes if max_bytes is None else max_bytes
    max_age_days = default_days if max_age_days is None else max_age_days
    _remove_leftovers()
    now, total, removed = time.time(), 0, []
    for entry in list_entries():  # most recently used first: the last ones go first
        too_old = max_age_days > 0 and now - entry.last_used > max_age_days * 86400
        too_big = max_bytes > 0 and total + entry.num_bytes > max_bytes
        if entry.path not in keep and (too_old or too_big):
            _discard(entry.path)
            removed.append(entry)
        else:
            total += entry.num_bytes
    for entry in removed:
        logger.info("removed weight cache entry %s (%d bytes, last used %s)", entry.path, entry.num_bytes,
                    time.ctime(entry.last_used))  # fmt: skip
    return removed


def _remove_leftovers() -> None:
    """Temporary folders of builders that are gone, and trash a removal left behind."""
    root, now = cache_dir(), time.time()
    for folder in root.iterdir() if root.is_dir() else ():
        try:
            stale = folder.name.startswith(".tmp-") and now - folder.stat().st_mtime > _LEFTOVER_AGE_S
        except OSError:
            continue
        if stale or folder.name.startswith(".trash-"):
            shutil.rmtree(folder, ignore_errors=True)


def _parse_bytes(text: str, default: int) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if not text:
        return default
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{MAX_BYTES_ENV} must be a size in bytes (e.g. 4000000000 or 4G), got {text!r}")
    return int(value)


def _parse_days(text: str, default: float) -> float:
    if not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{MAX_AGE_ENV} must be a number of days (0: no bound), got {text!r}")
    return value


def clear_cache() -> int:
    """Remove every cache entry (and leftover temporary folders); returns how many folders were removed."""
    root = cache_dir()
    if not root.is_dir():
        return 0
    ours = [
        p for p in root.iterdir() if (p / MANIFEST_FILE).is_file() or p.name.startswith((".tmp-", ".trash-"))
    ]
    for folder in ours:
        _discard(folder)
    return len(ours)


def load_or_build(
    source: Path, *, key_parts: Mapping[str, str], build: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The cached tensors for ``source`` and ``key_parts``, building and storing them on a miss.

    Parameters
    ----------
    source
        The file the tensors are made from; its identity is part of the key.
    key_parts
        Everything else the tensors depend on, e.g. ``{"dtype": "bfloat16", "layout": "hf-1"}``.
    build
        Makes the tensors (contiguous, no two sharing memory); called only on a miss or a damaged entry.

    Returns
    -------
    dict[str, torch.Tensor]
        Tensors backed by a private, read-mostly mapping of the cache file.

    Raises
    ------
    EngineStartupError
        ``source`` cannot be read. A cache that cannot be written only logs a warning.
    """
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in key_parts.items()):
        raise TypeError(f"key_parts maps strings to strings, got {dict(key_parts)!r}")
    entry = cache_dir() / _entry_name(source, key_parts)
    if entry.is_dir() and (tensors := _map_or_discard(entry)) is not None:
        return tensors
    tensors = build()
    try:
        write_entry(entry, tensors, key_parts)
    except OSError as error:
        logger.warning("cannot write weight cache entry %s (%s); using the tensors in memory", entry, error)
        return tensors
    mapped = _map_or_discard(entry)
    try:
        prune_cache(keep={entry})
    except (OSError, ValueError) as error:  # a bad bound in the environment must not stop the engine
        logger.warning("cannot prune the weight cache: %s", error)
    return tensors if mapped is None else mapped


def _map_or_discard(entry: Path) -> dict[str, torch.Tensor] | None:
    try:
        tensors = map_entry(entry)
    except (DamagedEntry, OSError, KeyError, TypeError, ValueError) as problem:
        # Anything unexpected in an entry (a missing key, a wrong type) means it was not written by us intact.
        logger.warning("weight cache entry %s is damaged (%s); removing it", entry, problem)
        _discard(entry)
        return None
    with contextlib.suppress(OSError):  # a read-only cache works, it only forgets what was used last
        now = time.time()  # NOTE: not the file system's clock, which may tick every few milliseconds only
        os.utime(entry, (now, now))  # used now: the least recently used entries are evicted first
    return tensors


def _entry_name(source: Path, key_parts: Mapping[str, str]) -> str:
    try:
        resolved = Path(source).resolve(strict=True)
        stat = resolved.stat()
    except OSError as error:
        raise EngineStartupError(f"cannot read {source}: {error}", phase="model load") from error
    identity = {
        "format": CACHE_FORMAT,
        "source": [str(resolved), stat.st_size, stat.st_mtime_ns, stat.st_ino],
        "key": dict(key_parts),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', resolved.stem)[:48]}-{digest}"


def _discard(folder: Path) -> None:
    """Rename a folder out of the way (one atomic step), then delete it; gone already is fine."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
