"""A disk cache of prepared weights (e.g. a GGUF dequantized to bf16), mapped rather than read on later loads.

Each entry is a folder ``<cache dir>/<source name>-<key hash>/`` holding ``weights.safetensors`` and
``manifest.json``. The key hashes the source file's identity (resolved path, size, mtime_ns, inode) with the
caller's key parts (dtype, layout version), so a changed source or layout gets a new entry.

Writing: an entry is built in a temporary folder inside the cache folder, fsynced, then renamed into place in
one step, so readers never see half an entry. Of two concurrent builders one rename wins; the other discards
its folder and maps the winner's entry (or keeps its own tensors if that fails).

Reading maps the file (``torch.UntypedStorage.from_file``, private mapping) and slices tensors at the header's
offsets: no copy, the pages are the page cache's, shared by every process that maps the entry.

Integrity: a full CRC-32 of the data on every load is too slow for a 0.75 s restart budget. Measured on the
513 MiB of the fp32 SmolLM2-135M entry (2 CPU cores): 0.23-0.29 s with the file in the page cache, 0.35-0.6 s
from disk. A load checks instead, in about 10 ms warm (about 0.1-0.17 s cold):

* the manifest (present, valid JSON, this format) and the exact file size: catches partial and truncated writes;
* a CRC-32 of the safetensors header, and that its tensor names, dtypes, shapes and offsets match the manifest:
  catches header damage and a wrong tensor set;
* the file's mtime_ns and inode against those recorded at write time: any ordinary write to the file changes
  them, and then every 1 MiB chunk is checked against its CRC-32 in the manifest (and the stamp renewed when
  all match, e.g. after a copy);
* otherwise the first, the last and ``NUM_SAMPLED_CHUNKS`` random chunks: silent damage (bit rot, a writer that
  restores the mtime) to a fraction f of the chunks is caught with probability about 1 - (1 - f)^10 per load,
  and by a later load if not this one.

A damaged entry is logged at warning level, removed and rebuilt; it is never used.

Bounds: every load that maps an entry marks it used (the entry folder's mtime). After a new entry is written,
entries unused for ``ENGINEKIT_CACHE_MAX_AGE_DAYS`` (default 30) are removed, then the least recently used ones
until the cache holds at most ``ENGINEKIT_CACHE_MAX_BYTES`` (default 4 GiB; suffixes K, M, G; ``0`` for no
bound), never the entry just written. Removing an entry another process maps is safe: its mapping stays valid.
``list_entries``, ``prune_cache`` and ``clear_cache`` (and ``enginekit cache list|prune|clear``) do it by hand.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from enginekit.cache import cache_dir
from enginekit.errors import EngineStartupError

CACHE_FORMAT = 1
CHUNK_BYTES = 1 << 20
NUM_SAMPLED_CHUNKS = 8
WEIGHTS_FILE, MANIFEST_FILE = "weights.safetensors", "manifest.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
MAX_BYTES_ENV, MAX_AGE_ENV = "ENGINEKIT_CACHE_MAX_BYTES", "ENGINEKIT_CACHE_MAX_AGE_DAYS"
DEFAULT_MAX_BYTES, DEFAULT_MAX_AGE_DAYS = 4 << 30, 30.0
_LEFTOVER_AGE_S = 24 * 3600  # a builder's temporary folder this old belongs to a process that is gone
_MAX_HEADER_BYTES = 100 << 20
_MANIFEST_KEYS = {"file_bytes", "stamp", "header_crc32", "tensors", "chunk_bytes", "chunk_crc32"}

logger = logging.getLogger("enginekit.weight_cache")


class _DamagedEntry(Exception):
    """An entry that must not be used; the message says what is wrong with it."""


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
        _publish(entry, tensors, key_parts)
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
        tensors = _map_entry(entry)
    except (_DamagedEntry, OSError, KeyError, TypeError, ValueError) as problem:
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


def _publish(entry: Path, tensors: dict[str, torch.Tensor], key_parts: Mapping[str, str]) -> None:
    """Write the entry into a temporary folder, fsync it, and rename it into place; a lost race is not an error."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        weights = staging / WEIGHTS_FILE
        save_file(tensors, str(weights))
        _fsync(weights)
        _write_manifest(staging, _manifest(weights, key_parts))
        _fsync(staging)
        try:
            os.rename(staging, entry)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            logger.debug("weight cache entry %s was written by another builder first", entry)
        _fsync(entry.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _manifest(weights: Path, key_parts: Mapping[str, str]) -> dict[str, Any]:
    header_bytes, header = _read_header(weights)
    checksums = []
    with open(weights, "rb") as file:
        file.seek(len(header_bytes))
        while chunk := file.read(CHUNK_BYTES):
            checksums.append(zlib.crc32(chunk))
    stat = weights.stat()
    return {
        "format": CACHE_FORMAT,
        "key_parts": dict(key_parts),
        "file_bytes": stat.st_size,
        "stamp": [stat.st_mtime_ns, stat.st_ino],
        "header_crc32": zlib.crc32(header_bytes),
        "tensors": {name: [spec["dtype"], spec["shape"]] for name, spec in header.items()},
        "chunk_bytes": CHUNK_BYTES,
        "chunk_crc32": checksums,
    }


def _map_entry(entry: Path) -> dict[str, torch.Tensor]:
    manifest = _read_manifest(entry)
    weights = entry / WEIGHTS_FILE
    try:
        stat = weights.stat()
    except OSError as error:
        raise _DamagedEntry(f"no weights file ({error.strerror})") from None
    if stat.st_size != manifest["file_bytes"]:
        raise _DamagedEntry(
            f"weights file has {stat.st_size} bytes, the manifest says {manifest['file_bytes']}"
        )
    header_bytes, header = _read_header(weights)
    if zlib.crc32(header_bytes) != manifest["header_crc32"]:
        raise _DamagedEntry("safetensors header checksum mismatch")
    if {name: [spec["dtype"], spec["shape"]] for name, spec in header.items()} != manifest["tensors"]:
        raise _DamagedEntry("its tensors differ from the manifest's")
    # NOTE: a private mapping: the model never writes its weights, and a write would only copy that page. The
    # file must not change while mapped (truncating it would SIGBUS a reader); this cache never changes a
    # published file, it only renames and unlinks whole entries, which leaves existing mappings intact.
    # torch's stub declares from_file on the storage base class, with the base's return type.
    storage: torch.UntypedStorage = torch.UntypedStorage.from_file(  # pyright: ignore[reportAssignmentType]
        str(weights), shared=False, nbytes=stat.st_size
    )
    data = torch.empty(0, dtype=torch.uint8).set_(storage)[len(header_bytes) :].numpy()
    num_chunks = len(manifest["chunk_crc32"])
    if [stat.st_mtime_ns, stat.st_ino] == manifest["stamp"]:
        sampled = random.sample(range(num_chunks), min(num_chunks, NUM_SAMPLED_CHUNKS))
        _check_chunks(data, manifest, {0, num_chunks - 1, *sampled} if num_chunks else set())
    else:
        _check_chunks(data, manifest, range(num_chunks))
        try:
            _write_manifest(entry, manifest | {"stamp": [stat.st_mtime_ns, stat.st_ino]})
        except OSError as error:  # a read-only cache still works, it only checks every chunk each time
            logger.debug("cannot renew the manifest of %s: %s", entry, error)
    return {name: _tensor_view(storage, len(header_bytes), name, spec) for name, spec in header.items()}


def _read_manifest(entry: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((entry / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise _DamagedEntry("no manifest") from None
    except (OSError, ValueError) as error:
        raise _DamagedEntry(f"unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        raise _DamagedEntry("manifest of another cache format")
    missing = _MANIFEST_KEYS - manifest.keys()
    if missing:
        raise _DamagedEntry(f"manifest lacks {', '.join(sorted(missing))}")
    return manifest


def _read_header(weights: Path) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """The raw header bytes (length prefix included) and its tensor entries."""
    with open(weights, "rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise _DamagedEntry(f"bad safetensors header length {length}")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise _DamagedEntry(f"bad safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise _DamagedEntry("bad safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    return prefix + raw, header


def _check_chunks(data: Any, manifest: dict[str, Any], chunks: Any) -> None:
    expected, size = manifest["chunk_crc32"], manifest["chunk_bytes"]
    if len(expected) != -(-len(data) // size):
        raise _DamagedEntry("checksum table does not cover the data")
    for index in sorted(chunks):
        if zlib.crc32(data[index * size : (index + 1) * size]) != expected[index]:
            raise _DamagedEntry(
                f"data checksum mismatch in bytes {index * size}-{(index + 1) * size} of the data"
            )


def _tensor_view(
    storage: torch.UntypedStorage, data_start: int, name: str, spec: dict[str, Any]
) -> torch.Tensor:
    dtype, shape = _DTYPES.get(spec.get("dtype", "")), spec.get("shape")
    begin, end = spec.get("data_offsets", (0, -1))
    if dtype is None or not isinstance(shape, list):
        raise _DamagedEntry(f"tensor {name} has an unknown dtype or shape")
    num_bytes = dtype.itemsize * torch.Size(shape).numel()
    start = data_start + begin
    if end - begin != num_bytes or end + data_start > storage.nbytes() or start % dtype.itemsize:
        raise _DamagedEntry(f"tensor {name} has bad or misaligned data offsets")
    # torch's stub wants a stride whenever a size is given; torch itself makes it contiguous.
    return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape)  # pyright: ignore[reportCallIssue]


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write (or atomically replace) the manifest, durably."""
    staging = folder / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(manifest))
    _fsync(staging)
    os.replace(staging, folder / MANIFEST_FILE)


def _discard(folder: Path) -> None:
    """Rename a folder out of the way (one atomic step), then delete it; gone already is fine."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{random.getrandbits(32):08x}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
