"""One entry of the weight cache on disk: writing it so that no reader sees half of it, and mapping it back
after checking it has not been damaged (``weight_cache.py`` names, finds and evicts entries).

An entry is a folder holding ``weights.safetensors`` and ``manifest.json``. Writing: the entry is built in a
temporary folder beside it, fsynced, then renamed into place in one step. Of two concurrent builders one rename
wins; the other's is not an error (the caller maps the winner's entry).

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

What fails a check raises ``DamagedEntry``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

CACHE_FORMAT = 1
CHUNK_BYTES = 1 << 20
NUM_SAMPLED_CHUNKS = 8
WEIGHTS_FILE, MANIFEST_FILE = "weights.safetensors", "manifest.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER_BYTES = 100 << 20
_MANIFEST_KEYS = {"file_bytes", "stamp", "header_crc32", "tensors", "chunk_bytes", "chunk_crc32"}

logger = logging.getLogger("enginekit.weight_cache")


class DamagedEntry(Exception):
    """An entry that must not be used; the message says what is wrong with it."""


def write_entry(entry: Path, tensors: dict[str, torch.Tensor], key_parts: Mapping[str, str]) -> None:
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


def map_entry(entry: Path) -> dict[str, torch.Tensor]:
    manifest = _read_manifest(entry)
    weights = entry / WEIGHTS_FILE
    try:
        stat = weights.stat()
    except OSError as error:
        raise DamagedEntry(f"no weights file ({error.strerror})") from None
    if stat.st_size != manifest["file_bytes"]:
        raise DamagedEntry(
            f"weights file has {stat.st_size} bytes, the manifest says {manifest['file_bytes']}"
        )
    header_bytes, header = _read_header(weights)
    if zlib.crc32(header_bytes) != manifest["header_crc32"]:
        raise DamagedEntry("safetensors header checksum mismatch")
    if {name: [spec["dtype"], spec["shape"]] for name, spec in header.items()} != manifest["tensors"]:
        raise DamagedEntry("its tensors differ from the manifest's")
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
        raise DamagedEntry("no manifest") from None
    except (OSError, ValueError) as error:
        raise DamagedEntry(f"unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        raise DamagedEntry("manifest of another cache format")
    missing = _MANIFEST_KEYS - manifest.keys()
    if missing:
        raise DamagedEntry(f"manifest lacks {', '.join(sorted(missing))}")
    return manifest


def _read_header(weights: Path) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """The raw header bytes (length prefix included) and its tensor entries."""
    with open(weights, "rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise DamagedEntry(f"bad safetensors header length {length}")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise DamagedEntry(f"bad safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise DamagedEntry("bad safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    return prefix + raw, header


def _check_chunks(data: Any, manifest: dict[str, Any], chunks: Any) -> None:
    expected, size = manifest["chunk_crc32"], manifest["chunk_bytes"]
    if len(expected) != -(-len(data) // size):
        raise DamagedEntry("checksum table does not cover the data")
    for index in sorted(chunks):
        if zlib.crc32(data[index * size : (index + 1) * size]) != expected[index]:
            raise DamagedEntry(
                f"data checksum mismatch in bytes {index * size}-{(index + 1) * size} of the data"
            )


def _tensor_view(
    storage: torch.UntypedStorage, data_start: int, name: str, spec: dict[str, Any]
) -> torch.Tensor:
    dtype, shape = _DTYPES.get(spec.get("dtype", "")), spec.get("shape")
    begin, end = spec.get("data_offsets", (0, -1))
    if dtype is None or not isinstance(shape, list):
        raise DamagedEntry(f"tensor {name} has an unknown dtype or shape")
    num_bytes = dtype.itemsize * torch.Size(shape).numel()
    start = data_start + begin
    if end - begin != num_bytes or end + data_start > storage.nbytes() or start % dtype.itemsize:
        raise DamagedEntry(f"tensor {name} has bad or misaligned data offsets")
    # torch's stub wants a stride whenever a size is given; torch itself makes it contiguous.
    return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, shape)  # pyright: ignore[reportCallIssue]


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write (or atomically replace) the manifest, durably."""
    staging = folder / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(manifest))
    _fsync(staging)
    os.replace(staging, folder / MANIFEST_FILE)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
