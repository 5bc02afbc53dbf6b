"""The probes each native kernel passes once per process before it is used: its results against torch's on shapes
that take every path of its C code (``native.py`` logs why a kernel that fails one is not used)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from enginekit.model.kernels.library import MAX_ROWS, SKINNY_ROWS, NativeUnavailable

if TYPE_CHECKING:
    from enginekit.model.kernels.native import LayerOps


def probe_gemm(gemm: Callable[..., torch.Tensor]) -> None:
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


def probe_layer_ops(ops: LayerOps) -> None:
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
    expected = F.gelu(gate_up[:, :21], approximate="tanh") * gate_up[:, 21:]
    if not torch.allclose(ops.gelu_tanh_mul(gate_up), expected, rtol=1e-5, atol=1e-5):
        raise NativeUnavailable("its GeLU-tanh-and-multiply disagrees with torch's on a probe")
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
