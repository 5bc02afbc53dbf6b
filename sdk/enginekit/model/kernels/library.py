"""Building and loading the native library: the C files of this folder compiled once per machine into one shared
library, loaded once per process (see ``native.py`` for what it holds and when it is used).

The library is compiled with the C compiler found at run time (``$CC``, else ``cc`` or ``gcc``, a few seconds) into
``<cache>/native/`` (``$ENGINEKIT_CACHE``, else ``~/.cache/enginekit``), named by a hash of the sources and the
flags, and published with an atomic rename, so concurrent engine processes can build it at once. A cache hit runs
no compiler: an engine process's start pays a few milliseconds to load and probe it. The library checks the CPU
itself at load (AVX2 and FMA), so a cache shared by several machines stays safe. It links the OpenMP runtime torch
has already loaded (same soname), so its parallel loops run on torch's thread pool; a second OpenMP runtime in the
process disables it, since two pools would spin against each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from enginekit.cache import cache_dir

logger = logging.getLogger("enginekit.model")

FOLDER = Path(__file__).parent
SOURCES = tuple(
    FOLDER / name
    for name in ("skinny_gemm.c", "panel_gemm.c", "layer_ops.c", "quant_gemm.c", "stored_layer.c")
)
HEADERS = (FOLDER / "common.h", FOLDER / "quant_dot.h")
MAX_ROWS = 128  # ENGINEKIT_MAX_ROWS in skinny_gemm.c; checked at load
SKINNY_ROWS = 8  # ENGINEKIT_SKINNY_ROWS: up to this many rows each weight row is read once for all of them
DISABLE_ENV = "ENGINEKIT_NATIVE_KERNELS"
# No fused multiply-adds where the C code does not ask for them: dequantization matches gguf-py's float32
# arithmetic bit for bit only if a * b + c stays two roundings.
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120.0
_OPENMP_RUNTIME = re.compile(r"/lib[gi]?omp[^/]*\.so")


class NativeUnavailable(Exception):
    """Why the native kernels are not used here; the message is logged."""


_status: list[str] = []  # what native_library() found in this process: "on" or "off: <why>"


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The native library, built on the first call in a process (later calls return the same one), or ``None``
    with the reason logged and kept for ``native_kernels_status``."""
    try:
        lib = _load()
    except NativeUnavailable as reason:
        logger.info("native kernels not used: %s", reason)
        _status.append(f"off: {reason}")
        return None
    logger.info("native kernels loaded from %s", lib._name)
    _status.append("on")
    return lib


def native_kernels_status() -> str:
    """Whether this process computes with the native kernels: ``"on"``, ``"off: <why>"``, or ``"not loaded"``
    (nothing asked for them: a model on CUDA, or none loaded yet). ``get_stats()`` reports it, since the log
    line saying why is at INFO."""
    return _status[0] if _status else "not loaded"


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"it is built for x86-64 Linux, not {sys.platform} on {platform.machine()}")
    if not torch.backends.openmp.is_available():
        raise NativeUnavailable("this torch build has no OpenMP thread pool to share")
    sources = b"\0".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + b"\0" + " ".join(FLAGS).encode()).hexdigest()[:16]
    name = f"enginekit-native-{digest}.so"
    folder = cache_dir() / "native"
    path = folder / name
    if path.is_file():
        return _open(path)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _build(compiler, folder, path)
    except OSError as error:  # a cache we cannot write: build privately, load, then delete the file
        logger.warning(
            "cannot write %s (%s); building the native kernels in a temporary folder", folder, error
        )
        with tempfile.TemporaryDirectory(prefix="enginekit-native-") as private:
            path = Path(private) / name
            _build(compiler, Path(private), path)
            return _open(path)
    return _open(path)


def _build(compiler: str, folder: Path, path: Path) -> None:
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        _run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", partial],
            f"compiling {', '.join(source.name for source in SOURCES)}",
        )
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _open(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeUnavailable(f"cannot load {path}: {error}") from None
    if len(runtimes := _openmp_runtimes()) > 1:
        raise NativeUnavailable(
            f"this process has more than one OpenMP runtime ({', '.join(sorted(runtimes))})"
        )
    if not lib.enginekit_skinny_supported():
        raise NativeUnavailable("this CPU lacks AVX2 or FMA")
    if lib.enginekit_skinny_max_rows() != MAX_ROWS:
        raise NativeUnavailable(f"{path} takes up to {lib.enginekit_skinny_max_rows()} rows, not {MAX_ROWS}")
    return lib


def _openmp_runtimes() -> set[str]:
    """The paths of the OpenMP runtime libraries mapped into this process (Linux)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if line.count(" ") >= 5}
    return {path for path in paths if _OPENMP_RUNTIME.search(path)}


def _run(command: list[str], what: str) -> str:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeUnavailable(f"{what} failed: {error}") from None
    if done.returncode != 0:
        raise NativeUnavailable(f"{what} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout
