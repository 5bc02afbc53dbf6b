"""The native CPU kernels (``skinny_gemm.c``, ``packed_gemm.c`` and ``layer_ops.c``): built once per machine
into one library, loaded once per process.

- :func:`native_skinny_gemm`: the float32 product of 1 to ``MAX_ROWS`` (128) rows with a weight. A decode step
  of a few sequences multiplies every weight by that many vectors: it is bound by how fast the weights stream
  from memory. torch's kernels at these shapes (oneDNN's inner product, MKL's GEMM) read them at 50-70% of the
  CPU's read bandwidth at one row, and take longer with every row they add; ``skinny_gemm.c`` reads each weight
  once for all the rows (up to ``SKINNY_ROWS``, 8). Past that a step is bound by arithmetic, and its
  register-blocked tiles beat oneDNN up to 128 rows on an AVX2 CPU (see docs/benchmarks.md).
- :func:`native_packed_gemm`: the float32 product of any number of rows with a weight, for prefill steps and
  the largest decode steps: the weight packed on every call into panels of 16 columns, and a 6x16 micro-kernel
  that keeps the multiply-add units busy (1.2-1.3x oneDNN's linear at 256-2,048 rows on an AVX2 CPU; see
  ``packed_gemm.c``).
- :func:`native_layer_ops`: a decoder layer's small float32 operations: RMS norm, rotary embedding fused with
  the KV-cache write, and attention of single queries (decodes, prefill tokens) that reads the paged cache in
  place (``LayerOps``).

They are accelerators, never requirements: both return ``None``, and the model keeps its torch code, whenever
they cannot be used here (not x86-64 Linux, no AVX2/FMA, no C compiler, torch without OpenMP, a failed probe,
or ``ENGINEKIT_NATIVE_KERNELS=0``), and the ``enginekit.model`` log says why.

The library is compiled with the C compiler found at run time (``$CC``, else ``cc`` or ``gcc``, about two
seconds) into ``<cache>/native/`` (``$ENGINEKIT_CACHE``, else ``~/.cache/enginekit``), named by a hash of the
sources and the flags, and published with an atomic rename, so concurrent engine processes can build it at
once. A cache hit runs no compiler: an engine process's start pays a few milliseconds to load and probe it. The
library checks the CPU itself at load (AVX2 and FMA), so a cache shared by several machines stays safe. It
links the OpenMP runtime torch has already loaded (same soname), so its parallel loops run on torch's thread
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

from enginekit.cache import cache_dir

logger = logging.getLogger("enginekit.model")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("skinny_gemm.c", "packed_gemm.c", "layer_ops.c"))
MAX_ROWS = 128  # ENGINEKIT_MAX_ROWS in skinny_gemm.c; checked at load
SKINNY_ROWS = 8  # ENGINEKIT_SKINNY_ROWS: up to this many rows each weight row is read once for all of them
DISABLE_ENV = "ENGINEKIT_NATIVE_KERNELS"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_COMPILE_TIMEOUT_S = 120.0
_OPENMP_RUNTIME = re.compile(r"/lib[gi]?omp[^/]*\.so")

SkinnyGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_ptr = ctypes.c_void_p


class NativeUnavailable(Exception):
    """Why the native kernels are not used here; the message is logged."""


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The native library, built on the first call in a process (later calls return the same one), or ``None``
    with the reason logged."""
    try:
        lib = _load()
    except NativeUnavailable as reason:
        logger.info("native kernels not used: %s", reason)
        return None
    logger.info("native kernels loaded from %s", lib._name)
    return lib


@functools.cache
def native_skinny_gemm() -> SkinnyGemm | None:
    """``gemm(x, weight, bias)`` for a contiguous float32 ``x`` of 1 to ``MAX_ROWS`` rows and a contiguous
    ``weight`` on CPU, or ``None`` (logged why).

    Built and probed on the first call in a process; later calls return the same function.
    """
    lib = native_library()
    if lib is None:
        return None
    kernel = lib.enginekit_skinny_gemm
    kernel.restype = ctypes.c_int
    kernel.argtypes = [_ptr] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
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
        _probe_gemm(gemm)
    except NativeUnavailable as reason:
        logger.warning("native skinny-GEMM kernel not used: %s", reason)
        return None
    return gemm


@functools.cache
def native_packed_gemm() -> SkinnyGemm | None:
    """``gemm(x, weight, bias)`` for a float32 ``x`` of any number of rows (each row contiguous) and a contiguous
    ``weight`` on CPU, or ``None`` (logged why).

    Built and probed on the first call in a process; later calls return the same function. Each call packs the
    weight into a scratch of a few megabytes at most (``enginekit_packed_gemm_scratch``), allocated per call:
    after the first, the allocator hands back the same memory, at no measurable cost.
    """
    lib = native_library()
    if lib is None:
        return None
    kernel = _function(lib.enginekit_packed_gemm, [_ptr, ctypes.c_long, _ptr, _ptr, _ptr], 3, [_ptr])
    scratch_floats = lib.enginekit_packed_gemm_scratch
    scratch_floats.restype, scratch_floats.argtypes = ctypes.c_long, [ctypes.c_long, ctypes.c_int]
    get_threads = torch.get_num_threads

    def gemm(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
    ) -> torch.Tensor:
        m, (n, k), threads = x.shape[0], weight.shape, threads or get_threads()
        out = torch.empty((m, n), dtype=torch.float32)
        scratch = torch.empty(scratch_floats(k, threads), dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        kernel(
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            bias_ptr,
            out.data_ptr(),
            m,
            n,
            k,
            scratch.data_ptr(),
            threads,
        )
        return out

    try:
        _probe_packed_gemm(gemm)
    except NativeUnavailable as reason:
        logger.warning("native packed-GEMM kernel not used: %s", reason)
        return None
    return gemm


class LayerOps:
    """A decoder layer's small float32 operations on CPU tensors, in the native library (``layer_ops.c``).

    Each replaces several torch ops: ``rms_norm`` five, ``silu_mul`` the split of the MLP's ``[gate | up]`` and
    two ops, ``rope_write_cache`` the rotary embedding of q and k
    and the two cache writes, ``paged_attention`` the gather of every context out of the paged cache and
    SDPA over it (for a step's decodes, and its prefill chunks over short contexts). Use
    :func:`native_layer_ops` to get one.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = _function(
            lib.enginekit_rms_norm, [_ptr, ctypes.c_long, _ptr, _ptr], 2, [ctypes.c_float]
        )
        self._silu_mul = _function(lib.enginekit_silu_mul, [_ptr, ctypes.c_long, _ptr], 2)
        self._rope = _function(lib.enginekit_rope_write_cache, [_ptr, ctypes.c_long] + [_ptr] * 6, 4)
        self._attention = _function(
            lib.enginekit_paged_attention,
            [_ptr, ctypes.c_long, _ptr, _ptr, _ptr, ctypes.c_long, _ptr, _ptr, _ptr],
            5,
            [ctypes.c_float],
        )
        limits = [ctypes.c_long() for _ in range(2)]
        lib.enginekit_layer_ops_limits(*(ctypes.byref(limit) for limit in limits))
        self.max_group, self.max_group_floats = (limit.value for limit in limits)
        self._threads = torch.get_num_threads

    def supports(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether a model of these attention shapes fits the library's limits (query heads per KV head)."""
        group = heads // kv_heads
        return heads % kv_heads == 0 and group <= self.max_group and group * head_dim <= self.max_group_floats

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm of the rows of a 2-D ``x`` whose rows are contiguous, into a new tensor."""
        rows, size = x.shape
        out = torch.empty((rows, size), dtype=torch.float32)
        self._rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, size, eps, self._threads()
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a 2-D ``[gate | up]`` whose rows are contiguous, into a new tensor."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, self._threads())
        return out

    def rope_write_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        slots: torch.Tensor,
        kv_cache: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """The rotated q and k heads of ``qkv`` ``[T, (heads + 2 kv_heads) * D]`` (rows contiguous) as a new
        ``[T, heads + kv_heads, D]``; writes the rotated k and the v heads into the contiguous ``kv_cache``
        ``[2, slots, KVH, D]`` at ``slots`` (int64). ``cos`` and ``signed_sin`` are contiguous ``[T, ..., D]``
        (see ``llama.rotate``)."""
        tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
        qk = torch.empty((tokens, heads + kv_heads, head_dim), dtype=torch.float32)
        self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            slots.data_ptr(),
            qk.data_ptr(),
            *_keys_and_values(kv_cache),
            tokens,
            heads,
            kv_heads,
            head_dim,
            self._threads(),
        )
        return qk

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        table_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of single query tokens (``q`` ``[N, H, D]``, heads and values contiguous), each over its own
        context in the contiguous paged ``kv_cache`` ``[2, slots, KVH, D]``, read in place: ``[N, H, D]``.
        Query ``i`` attends to the first ``context_lens[i]`` tokens of the blocks in row ``table_rows[i]`` of
        ``block_tables`` (row ``i`` when ``table_rows`` is ``None``): a decode to its whole context, a prefill
        token to the tokens up to its own. ``block_tables`` ``[rows, blocks]`` (rows contiguous),
        ``context_lens`` and ``table_rows`` are int64, and every key and value attended to is already in the
        cache."""
        rows, heads, head_dim = q.shape
        out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
        self._attention(
            q.data_ptr(),
            q.stride(0),
            *_keys_and_values(kv_cache),
            block_tables.data_ptr(),
            block_tables.stride(0),
            None if table_rows is None else table_rows.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_cache.shape[2],
            head_dim,
            block_size,
            scale,
            self._threads(),
        )
        return out


def _keys_and_values(kv_cache: torch.Tensor) -> tuple[int, int]:
    """The addresses of ``kv_cache[0]`` and ``kv_cache[1]`` (float32), without making the two views."""
    address = kv_cache.data_ptr()
    return address, address + kv_cache.stride(0) * 4


def _function(function, pointers: list, longs: int, tail: list | None = None):
    """A library function with its argument types: ``pointers``, ``longs`` longs, ``tail``, the thread count."""
    function.restype = None
    function.argtypes = [*pointers, *[ctypes.c_long] * longs, *(tail or []), ctypes.c_int]
    return function


@functools.cache
def native_layer_ops() -> LayerOps | None:
    """The native layer operations, probed against torch on the first call in a process, or ``None`` (logged
    why). Later calls return the same object."""
    lib = native_library()
    if lib is None:
        return None
    ops = LayerOps(lib)
    try:
        _probe_layer_ops(ops)
    except NativeUnavailable as reason:
        logger.warning("native layer operations not used: %s", reason)
        return None
    return ops


def _load() -> ctypes.CDLL:
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"it is built for x86-64 Linux, not {sys.platform} on {platform.machine()}")
    if not torch.backends.openmp.is_available():
        raise NativeUnavailable("this torch build has no OpenMP thread pool to share")
    sources = b"\0".join(source.read_bytes() for source in SOURCES)
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


def _probe_gemm(gemm: Callable[..., torch.Tensor]) -> None:
    """The kernel against ``F.linear`` on shapes that take every path: one row (full and partial blocks of
    weight rows), every other row count of the skinny path, every tile shape past it, a column tail, a bias, on
    one and two threads."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 64, 96, False), (1, 13, 19, True)] + [(m, 5, 19, True) for m in range(2, SKINNY_ROWS + 1)]
    shapes += [(m, 13, 19, True) for m in (9, 10, 11, 12, MAX_ROWS)]  # every tile: 1-4 rows by 1-3 weights
    for m, n, k, with_bias in shapes:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if with_bias else None
        for threads in (1, 2):
            if not torch.allclose(gemm(x, w, b, threads), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                raise NativeUnavailable(
                    f"it disagrees with F.linear on a probe ({m}x{k} by {n}x{k}, {threads} threads)"
                )


def _probe_packed_gemm(gemm: Callable[..., torch.Tensor]) -> None:
    """The kernel against ``F.linear`` on shapes that take every path: full and partial micro-panels of rows and
    panels of columns, one and several panels a task, rows a stride apart, a bias, on one and two threads."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k, with_bias in [(1, 5, 7, True), (6, 16, 8, False), (29, 40, 19, True), (100, 530, 45, True)]:
        rows = torch.randn(m, k + 3, generator=gen)
        x, w = rows[:, :k], torch.randn(n, k, generator=gen)  # rows k + 3 floats apart
        b = torch.randn(n, generator=gen) if with_bias else None
        for threads in (1, 2):
            if not torch.allclose(gemm(x, w, b, threads), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                raise NativeUnavailable(
                    f"it disagrees with F.linear on a probe ({m}x{k} by {n}x{k}, {threads} threads)"
                )


def _probe_layer_ops(ops: LayerOps) -> None:
    """Each layer operation against the torch formula the model uses otherwise, on shapes that take every path:
    head sizes with and without a vector tail, grouped and plain heads, contexts of one token, of part of a block
    and of several blocks."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    if not torch.allclose(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5), rtol=1e-4, atol=1e-5):
        raise NativeUnavailable("its RMS norm disagrees with F.rms_norm on a probe")
    gate_up = torch.randn(3, 42, generator=gen) * 30  # large values both ways: the sigmoid must not overflow
    if not torch.allclose(
        ops.silu_mul(gate_up), F.silu(gate_up[:, :21]) * gate_up[:, 21:], rtol=1e-5, atol=1e-5
    ):
        raise NativeUnavailable("its SiLU-and-multiply disagrees with torch's on a probe")
    for heads, kv_heads, dim, block_size in [(6, 2, 24, 4), (4, 4, 32, 16), (2, 1, 16, 512)]:
        lens = torch.tensor([1, 3, 17, 40, 300])
        blocks = -(-int(lens.max()) // block_size)
        tables = torch.randperm(len(lens) * blocks, generator=gen).view(len(lens), blocks)
        kv_cache = torch.randn(2, tables.numel() * block_size, kv_heads, dim, generator=gen)
        tokens = len(lens)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
        cos, sin = torch.randn(tokens, 1, dim, generator=gen), torch.randn(tokens, 1, dim, generator=gen)
        slots = tables[torch.arange(tokens), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
        expected_cache = kv_cache.clone()
        rotated = qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim)
        rotated = rotated * cos + rotated.roll(dim // 2, -1) * sin
        expected_cache[0, slots] = rotated[:, heads:]
        expected_cache[1, slots] = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        qk = ops.rope_write_cache(qkv, cos, sin, slots, kv_cache, heads, kv_heads)
        if not (
            torch.allclose(qk, rotated, atol=1e-6) and torch.allclose(kv_cache, expected_cache, atol=1e-6)
        ):
            raise NativeUnavailable("its rotary embedding and cache write disagree with torch's on a probe")
        out = ops.paged_attention(qk[:, :heads], kv_cache, tables, lens, block_size, dim**-0.5)
        for seq, length in enumerate(lens.tolist()):
            context = tables[seq].repeat_interleave(block_size) * block_size + torch.arange(
                block_size
            ).repeat(blocks)
            keys, values = (kv_cache[kv, context[:length]].transpose(0, 1) for kv in (0, 1))
            reference = F.scaled_dot_product_attention(
                qk[seq, :heads, None], keys, values, scale=dim**-0.5, enable_gqa=heads != kv_heads
            )[:, 0]
            if not torch.allclose(out[seq], reference, rtol=1e-4, atol=1e-5):
                raise NativeUnavailable(
                    f"its decode attention disagrees with SDPA on a probe ({heads} heads, {kv_heads} KV heads, "
                    f"head size {dim}, context {length})"
                )
