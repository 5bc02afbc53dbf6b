"""The native float32 product of a few rows with a weight (``skinny_gemm.c``): built once per machine, loaded
once per process.

A decode step of 1 to ``MAX_ROWS`` sequences multiplies every weight by that many vectors: it is bound by how
fast the weights stream from memory. torch's kernels at these shapes (oneDNN's inner product, MKL's GEMM) read
them at 50-70% of the CPU's read bandwidth at one row, and take longer with every row they add;
``skinny_gemm.c`` reads each weight once for all the rows (see docs/benchmarks.md). It is an accelerator, never
a requirement: :func:`native_skinny_gemm` returns ``None``, and the model keeps torch's kernels, whenever it
cannot be used here (not x86-64 Linux, no AVX2/FMA, no C compiler, torch without OpenMP, a failed probe, or
``ENGINEKIT_NATIVE_KERNELS=0``), and logs why.

The library is compiled with the C compiler found at run time (``$CC``, else ``cc`` or ``gcc``, about a
second) into ``<cache>/native/`` (``$ENGINEKIT_CACHE``, else ``~/.cache/enginekit``), named by a hash of the
source and the flags, and published with an atomic rename, so concurrent engine processes can build it at once.
A cache hit runs no compiler: an engine process's start pays a few milliseconds to load and probe it. The
library checks the CPU itself at load (AVX2 and FMA), so a cache shared by several machines stays safe. It
links the OpenMP runtime torch has already loaded (same soname), so its parallel loop runs on torch's thread
pool; a second OpenMP runtime in the process disables it, since two pools would spin against each other. Its
thread count is the calling thread's ``torch.get_num_threads()``.
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
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from enginekit.model.weight_cache import cache_dir

logger = logging.getLogger("enginekit.model")

SOURCE = Path(__file__).with_name("skinny_gemm.c")
MAX_ROWS = 8  # ENGINEKIT_MAX_ROWS in the C file; checked at load
DISABLE_ENV = "ENGINEKIT_NATIVE_KERNELS"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120.0
_OPENMP_RUNTIME = re.compile(r"/lib[gi]?omp[^/]*\.so")

SkinnyGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class NativeUnavailable(Exception):
    """Why the native kernel is not used here; the message is logged."""


@functools.cache
def native_skinny_gemm() -> SkinnyGemm | None:
    """``gemm(x, weight, bias)`` for a contiguous float32 ``x`` of 1 to ``MAX_ROWS`` rows and a contiguous
    ``weight`` on CPU, or ``None`` (logged why).

    Built and probed on the first call in a process; later calls return the same function.
    """
    try:
        lib = _load()
    except NativeUnavailable as reason:
        logger.info("native skinny-GEMM kernel not used: %s", reason)
        return None
    kernel = lib.enginekit_skinny_gemm
    kernel.restype = ctypes.c_int
    kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    get_threads = torch.get_num_threads

    def gemm(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
    ) -> torch.Tensor:
        m, (n, k) = x.shape[0], weight.shape
        out = torch.empty((m, n), dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        if kernel(
            weight.data_ptr(), x.data_ptr(), bias_ptr, out.data_ptr(), m, n, k, threads or get_threads()
        ):
            raise ValueError(f"the native skinny GEMM takes 1 to {MAX_ROWS} rows, not {m}")
        return out

    try:
        _probe(gemm)
    except NativeUnavailable as reason:
        logger.warning("native skinny-GEMM kernel not used: %s", reason)
        return None
    logger.info("native skinny-GEMM kernel loaded from %s", lib._name)
    return gemm


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"it is built for x86-64 Linux, not {sys.platform} on {platform.machine()}")
    if not torch.backends.openmp.is_available():
        raise NativeUnavailable("this torch build has no OpenMP thread pool to share")
    digest = hashlib.sha256(SOURCE.read_bytes() + b"\0" + " ".join(FLAGS).encode()).hexdigest()[:16]
    name = f"skinny_gemm-{digest}.so"
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
            "cannot write %s (%s); building the native kernel in a temporary folder", folder, error
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
        _run([compiler, *FLAGS, str(SOURCE), "-o", partial], f"compiling {SOURCE.name}")
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


def _probe(gemm: Callable[..., torch.Tensor]) -> None:
    """The kernel against ``F.linear`` on shapes that take every path: one row (full and partial blocks of
    weight rows) and every other row count, a column tail, a bias, on one and two threads."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 64, 96, False), (1, 13, 19, True)] + [(m, 5, 19, True) for m in range(2, MAX_ROWS + 1)]
    for m, n, k, with_bias in shapes:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if with_bias else None
        for threads in (1, 2):
            if not torch.allclose(gemm(x, w, b, threads), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                raise NativeUnavailable(
                    f"it disagrees with F.linear on a probe ({m}x{k} by {n}x{k}, {threads} threads)"
                )
