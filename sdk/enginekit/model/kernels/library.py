"""Building and loading the native library: the C files of this folder compiled once per machine into one shared
library, loaded once per process (see ``native.py`` for what it holds and when it is used).

The library is compiled with the C compiler found at run time (``$CC``, else ``cc`` or ``gcc``, a few seconds) into
``<cache>/native/`` (``$ENGINEKIT_CACHE``, else ``~/.cache/enginekit``), named by a hash of the sources and the
flags, and published with an atomic rename, so concurrent engine processes can build it at once. A cache hit runs
no compiler: an engine process's start pays a few milliseconds to load and probe it. A cached file that cannot be
loaded (truncated, overwritten, missing a symbol) is built again, once; if the new one fails too, the kernels are
off in this process. The library checks the CPU itself at load (AVX2 and FMA), so a cache shared by several
machines stays safe. It links the OpenMP runtime torch has already loaded (same soname), so its parallel loops run
on torch's thread pool. Two pools would spin against each other, so before the library is loaded the process's
mapped OpenMP runtimes are counted and the library's own (its ELF ``DT_NEEDED`` entries) compared with torch's
(its ``DT_SONAME``): a second runtime already there, or one the library would bring, leaves the kernels off and
the library unloaded.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import struct
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
_COMPILE_TIMEOUT_S = 600.0  # a hang guard: on a busy machine the compile (about 20 s of CPU) can take minutes
_OPENMP_RUNTIME = re.compile(r"/lib[gi]?omp[^/]*\.so")


class NativeUnavailable(Exception):
    """Why the native kernels are not used here; the message is logged."""


class CorruptLibrary(NativeUnavailable):
    """A library file that cannot be loaded or lacks what this source builds: built again, once."""


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


def library_file() -> Path:
    """Where this source's library is cached: ``<cache>/native/``, named by a hash of the sources and flags."""
    sources = b"\0".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + b"\0" + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"enginekit-native-{digest}.so"


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"it is built for x86-64 Linux, not {sys.platform} on {platform.machine()}")
    if not torch.backends.openmp.is_available():
        raise NativeUnavailable("this torch build has no OpenMP thread pool to share")
    runtime = _torch_openmp_runtime()
    path = library_file()
    if path.is_file():
        try:
            return _open(path, runtime)
        except CorruptLibrary as reason:
            logger.warning("the cached native library is unusable, building it again: %s", reason)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _build(compiler, folder, path)
    except OSError as error:  # a cache we cannot write: build privately, load, then delete the file
        logger.warning(
            "cannot write %s (%s); building the native kernels in a temporary folder", folder, error
        )
        with tempfile.TemporaryDirectory(prefix="enginekit-native-") as private:
            path = Path(private) / path.name
            _build(compiler, Path(private), path)
            return _open(path, runtime)
    return _open(path, runtime)  # a second failure is final: CorruptLibrary is a NativeUnavailable


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


def _open(path: Path, runtime: str) -> ctypes.CDLL:
    """The library at ``path``, loaded only once it is known to share ``runtime`` (torch's OpenMP runtime)."""
    try:
        needed, _ = elf_dynamic(path)
    except (OSError, ValueError) as error:
        raise CorruptLibrary(f"{path} is not a readable shared library ({error})") from None
    soname = _soname(runtime)
    others = [name for name in needed if _OPENMP_RUNTIME.search("/" + name) and name != soname]
    if others:
        raise NativeUnavailable(
            f"{path.name} needs the OpenMP runtime {', '.join(others)}, and torch runs {runtime} ({soname}): "
            "loading it would start a second thread pool"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise CorruptLibrary(f"cannot load {path}: {error}") from None
    try:
        supported, max_rows = lib.enginekit_skinny_supported(), lib.enginekit_skinny_max_rows()
    except AttributeError as error:  # NOTE: unloaded, so that a rebuilt file at this path loads anew
        _ctypes.dlclose(lib._handle)
        raise CorruptLibrary(f"{path} lacks a symbol ({error})") from None
    if max_rows != MAX_ROWS:
        _ctypes.dlclose(lib._handle)
        raise CorruptLibrary(f"{path} takes up to {max_rows} rows, not {MAX_ROWS}")
    if not supported:
        raise NativeUnavailable("this CPU lacks AVX2 or FMA")
    return lib


def _torch_openmp_runtime() -> str:
    """The path of the one OpenMP runtime mapped into this process (torch's), checked before the library loads."""
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:
        raise NativeUnavailable(
            f"this process has more than one OpenMP runtime ({', '.join(sorted(runtimes))})"
        )
    if not runtimes:
        raise NativeUnavailable("torch's OpenMP runtime is not mapped into this process")
    return next(iter(runtimes))


def _soname(path: str) -> str:
    """The name a library is known by to the dynamic loader: its ``DT_SONAME``, else its file name."""
    try:
        return elf_dynamic(Path(path))[1] or Path(path).name
    except (OSError, ValueError):
        return Path(path).name


def elf_dynamic(path: Path) -> tuple[list[str], str | None]:
    """The ``DT_NEEDED`` names and the ``DT_SONAME`` of a 64-bit little-endian ELF shared library, read from its
    dynamic segment (``ValueError`` if it is not one, or is cut short)."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a 64-bit little-endian ELF file")
    try:
        return _dynamic_names(data)
    except (struct.error, IndexError) as error:
        raise ValueError(f"cut short ({error})") from None


def _dynamic_names(data: bytes) -> tuple[list[str], str | None]:
    phoff, (phentsize, phnum) = struct.unpack_from("<Q", data, 0x20)[0], struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for index in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + index * phentsize)
        if kind == 1:  # PT_LOAD
            loads.append((vaddr, filesz, offset))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    if dynamic is None:
        raise ValueError("no dynamic segment")
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + at) for at in range(0, dynamic[1], 16)]
    strtab = next((value for tag, value in entries if tag == 5), None)  # DT_STRTAB: a virtual address
    if strtab is None:
        raise ValueError("no string table")
    base = next(
        (offset + strtab - vaddr for vaddr, size, offset in loads if vaddr <= strtab < vaddr + size), None
    )
    if base is None:
        raise ValueError("its string table is outside its segments")

    def string(at: int) -> str:
        end = data.index(b"\0", base + at)  # ValueError if unterminated
        return data[base + at : end].decode(errors="replace")

    needed = [string(value) for tag, value in entries if tag == 1]  # DT_NEEDED
    soname = next((string(value) for tag, value in entries if tag == 14), None)  # DT_SONAME
    return needed, soname


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
