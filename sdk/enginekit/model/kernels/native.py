"""The native CPU kernels (the C files of this folder): built once per machine into one library, loaded once per
process (``library.py``), each entry point called through one checked boundary (``boundary.py``,
``entry_points.py``).

- :func:`native_skinny_gemm`: the float32 product of 1 to ``MAX_ROWS`` (128) rows with a weight. A decode step
  of a few sequences multiplies every weight by that many vectors: it is bound by how fast the weights stream
  from memory. torch's kernels at these shapes (oneDNN's inner product, MKL's GEMM) read them well under the CPU's
  read bandwidth at one row, and take longer with every row they add; ``skinny_gemm.c`` reads each weight
  once for all the rows (up to ``SKINNY_ROWS``, 8). Past that a step is bound by arithmetic, and its
  register-blocked tiles keep the multiply-add units busier (see docs/benchmarks.md).
- :func:`native_layer_ops`: a decoder layer's small float32 operations: RMS norm, rotary embedding fused with
  the KV-cache write, and attention of single queries (decodes, prefill tokens) that reads the paged cache in
  place (``LayerOps``).
- :func:`native_quant_gemm`: the product of float32 rows with a weight kept as a GGUF file stores it
  (``quant_gemm.py``, ``quant_gemm.c``); :func:`quant_gemm` gives it, or a portable equivalent where the library
  cannot be used.

They are accelerators, never requirements: each returns ``None``, and the model keeps its torch code, whenever
they cannot be used here (not x86-64 Linux, no AVX2/FMA, no C compiler, torch without OpenMP, a failed probe,
or ``ENGINEKIT_NATIVE_KERNELS=0``), and the ``enginekit.model`` log says why. Their thread count is the calling
thread's ``torch.get_num_threads()`` (at most ``MAX_THREADS``, 1024).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from enginekit.model.kernels import entry_points as entries
from enginekit.model.kernels.library import (
    MAX_ROWS,
    SKINNY_ROWS,
    SOURCES,
    NativeUnavailable,
    _openmp_runtimes,
    native_library,
)
from enginekit.model.kernels.probes import probe_gemm, probe_layer_ops
from enginekit.model.kernels.quant_gemm import PATHS, QuantGemm, native_quant_gemm, quant_gemm

__all__ = [
    "MAX_ROWS",
    "SKINNY_ROWS",
    "SOURCES",
    "LayerOps",
    "NativeUnavailable",
    "QuantGemm",
    "SkinnyGemm",
    "_openmp_runtimes",
    "native_layer_ops",
    "native_library",
    "native_quant_gemm",
    "native_skinny_gemm",
    "quant_gemm",
]

logger = logging.getLogger("enginekit.model")
SkinnyGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@functools.cache
def native_skinny_gemm() -> SkinnyGemm | None:
    """``gemm(x, weight, bias)`` for a contiguous float32 ``x`` of 1 to ``MAX_ROWS`` rows and a contiguous
    ``weight`` on CPU, or ``None`` (logged why).

    Built and probed on the first call in a process; later calls return the same function.
    """
    lib = native_library()
    if lib is None:
        return None
    kernel = entries.SKINNY_GEMM.bind(lib)
    get_threads = entries.threads

    def gemm(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
    ) -> torch.Tensor:
        return kernel(weight=weight, x=x, bias=bias, threads=get_threads() if threads is None else threads)

    try:
        probe_gemm(gemm)
    except NativeUnavailable as reason:
        logger.warning("native skinny-GEMM kernel not used: %s", reason)
        return None
    return gemm


class LayerOps:
    """A decoder layer's small float32 operations on CPU tensors, in the native library (``layer_ops.c``).

    Each replaces several torch ops: ``rms_norm`` five, ``silu_mul`` the split of the MLP's ``[gate | up]`` and
    two ops, ``rope_write_cache`` the rotary embedding of q and k and the two cache writes, ``paged_attention``
    the gather of every context out of the paged cache and SDPA over it (for a step's decodes, and its prefill
    chunks over short contexts). Every argument is checked first (``entry_points.py``): a wrong shape, dtype or
    layout, or a slot, block id, table row or context length out of range raises ``TypeError`` or
    ``ValueError``. Use :func:`native_layer_ops` to get one.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = entries.RMS_NORM.bind(lib)
        self._silu_mul = entries.SILU_MUL.bind(lib)
        self._gelu_tanh_mul = entries.GELU_TANH_MUL.bind(lib)
        self._rope = entries.ROPE_WRITE_CACHE.bind(lib)
        self._attention = entries.PAGED_ATTENTION.bind(lib)
        self._stored_layer = entries.STORED_LAYER.bind(lib)
        self._quant_isa = lib.enginekit_quant_isa()
        limits = entries.attention_limits(lib)
        self.max_group, self.max_group_floats = limits["MAX_GROUP"], limits["MAX_GROUP_FLOATS"]
        self._threads = entries.threads

    def supports(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether a model of these attention shapes fits the library's limits (query heads per KV head)."""
        group = heads // kv_heads
        return heads % kv_heads == 0 and group <= self.max_group and group * head_dim <= self.max_group_floats

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm of the rows of a 2-D ``x`` whose rows are contiguous, into a new tensor."""
        return self._rms_norm(x=x, weight=weight, eps=eps, threads=self._threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a 2-D ``[gate | up]`` whose rows are contiguous, into a new tensor."""
        inter = gate_up.shape[-1] // 2 if isinstance(gate_up, torch.Tensor) else 0
        return self._silu_mul(gate_up=gate_up, inter=inter, threads=self._threads())

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` of a 2-D ``[gate | up]`` whose rows are contiguous, into a new
        tensor; each row's values computed from that row alone (torch's are not: see ``layer_ops.c``)."""
        inter = gate_up.shape[-1] // 2 if isinstance(gate_up, torch.Tensor) else 0
        return self._gelu_tanh_mul(gate_up=gate_up, inter=inter, threads=self._threads())

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
        ``[2, slots, KVH, D]`` at ``slots`` (int64). ``cos`` and ``signed_sin`` are contiguous ``[T, 1, D]``
        (see ``rotary.rotate``)."""
        return self._rope(
            qkv=qkv,
            cos=cos,
            signed_sin=signed_sin,
            slots=slots,
            kv_cache=kv_cache,
            heads=heads,
            kv_heads=kv_heads,
            threads=self._threads(),
        )

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        table_rows: torch.Tensor | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of single query tokens (``q`` ``[N, H, D]``, heads and values contiguous), each over its own
        context in the contiguous paged ``kv_cache`` ``[2, slots, KVH, D]``, read in place: ``[N, H, D]``.
        Query ``i`` attends to the first ``context_lens[i]`` tokens of the blocks in row ``table_rows[i]`` of
        ``block_tables`` (row ``i`` when ``table_rows`` is ``None``): a decode to its whole context, a prefill
        token to the tokens up to its own. ``block_tables`` ``[rows, blocks]`` (rows contiguous),
        ``context_lens`` and ``table_rows`` are int64, and every key and value attended to is already in the
        cache. With a sliding ``window`` (0: none) query ``i`` attends only to the last ``window`` of those
        tokens; a ``softcap`` above 0 caps each scaled score ``s`` at ``softcap * tanh(s / softcap)``."""
        return self._attention(
            q=q,
            kv_cache=kv_cache,
            block_tables=block_tables,
            table_rows=table_rows,
            context_lens=context_lens,
            block_size=block_size,
            scale=scale,
            window=window,
            softcap=softcap,
            threads=self._threads(),
        )

    def stored_layer(self, hidden: torch.Tensor, path: int = PATHS["auto"], **arguments) -> None:
        """A whole plain decoder layer with its four projections' weights kept as stored (``stored_layer.c``),
        ``hidden`` ``[T, H]`` (contiguous) updated in place to the layer's output; ``path``: the products'
        (``quant_gemm.PATHS``). ``arguments``: the entry point's (``entry_points.STORED_LAYER``) but ``threads``
        and ``isa``; every one checked as the other calls'."""
        self._stored_layer(
            hidden=hidden, threads=self._threads(), isa=self._quant_isa, path=path, **arguments
        )


@functools.cache
def native_layer_ops() -> LayerOps | None:
    """The native layer operations, probed against torch on the first call in a process, or ``None`` (logged
    why). Later calls return the same object."""
    lib = native_library()
    if lib is None:
        return None
    ops = LayerOps(lib)
    try:
        probe_layer_ops(ops)
    except NativeUnavailable as reason:
        logger.warning("native layer operations not used: %s", reason)
        return None
    return ops
