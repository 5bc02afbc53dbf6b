"""The native kernels' boundary: every entry point of the library is declared in one table, and each refuses wrong
dtypes, shapes, layouts and out-of-range table entries with a Python exception instead of touching memory."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels import entry_points
from enginekit.model.kernels.boundary import MAX_THREADS
from enginekit.model.kernels.library import FLAGS, SOURCES
from enginekit.model.kernels.native import (
    native_layer_ops,
    native_library,
    native_quant_gemm,
    native_skinny_gemm,
)

pytestmark = pytest.mark.skipif(
    native_library() is None, reason="the native library cannot be built or loaded here"
)
# Queries of the library's constants and of the CPU, with no tensor arguments.
QUERIES = {
    "enginekit_skinny_max_rows",
    "enginekit_skinny_supported",
    "enginekit_layer_ops_limits",
    "enginekit_panel_gemm_scratch",
    "enginekit_quant_isa",
    "enginekit_quant_format",
    "enginekit_panel_gemm",  # called from C only (quant_gemm.c)
}


def test_every_exported_function_is_declared_in_the_table() -> None:
    exported = set()
    for source in SOURCES:
        exported |= set(
            re.findall(r"^(?:\w+ )*?(?:int|void|long) (enginekit_\w+)\(", source.read_text(), re.M)
        )
    declared = {entry.symbol for entry in entry_points.ENTRY_POINTS}
    assert exported - QUERIES == declared


def test_signatures_come_from_the_table() -> None:
    lib = native_library()
    for entry in entry_points.ENTRY_POINTS:
        kernel = entry.bind(lib)
        function = getattr(lib, entry.symbol)
        assert function.argtypes == entry.argtypes() and len(function.argtypes) == len(entry.arguments)
        assert kernel.entry is entry


def _refuses(call, error: type[Exception] = ValueError, match: str | None = None) -> None:
    with pytest.raises(error, match=match):
        call()


def test_the_gemm_refuses_wrong_dtypes_shapes_and_layouts() -> None:
    gemm = native_skinny_gemm()
    x, w, b = torch.randn(3, 16), torch.randn(5, 16), torch.randn(5)
    assert torch.allclose(gemm(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
    _refuses(lambda: gemm(x.double(), w, b), TypeError, "float32")
    _refuses(lambda: gemm(x, w.half(), b), TypeError)
    _refuses(lambda: gemm(x, w, b.to(torch.int64)), TypeError)
    _refuses(lambda: gemm(torch.randn(3, 15), w, b), match="K")
    _refuses(lambda: gemm(x, w, torch.randn(4)), match="N")
    _refuses(lambda: gemm(x, torch.randn(16, 5).T, b), match="contiguous")
    _refuses(lambda: gemm(x[0], w, b), match="dimensions")
    _refuses(lambda: gemm(x, w, b[:, None]), match="dimensions")
    _refuses(lambda: gemm(x, "weights", b), TypeError)


def test_the_gemm_refuses_its_own_limits() -> None:
    _refuses(lambda: native_skinny_gemm()(torch.randn(16, 3).T, torch.randn(5, 16), None), match="contiguous")
    _refuses(lambda: native_skinny_gemm()(torch.randn(129, 16), torch.randn(5, 16), None), match="128 rows")


def test_rms_norm_and_silu_mul_refuse_mismatched_sizes() -> None:
    ops = native_layer_ops()
    x = torch.randn(4, 32)
    ops.rms_norm(x, torch.ones(32), 1e-5)
    _refuses(lambda: ops.rms_norm(x, torch.ones(31), 1e-5), match="size")
    _refuses(lambda: ops.rms_norm(x.to(torch.bfloat16), torch.ones(32), 1e-5), TypeError)
    _refuses(lambda: ops.rms_norm(torch.randn(32, 4).T, torch.ones(32), 1e-5), match="row")
    _refuses(lambda: ops.rms_norm(x[None], torch.ones(32), 1e-5), match="dimensions")
    ops.silu_mul(torch.randn(4, 32))
    _refuses(lambda: ops.silu_mul(torch.randn(4, 33)), match="2 \\* inter")
    _refuses(lambda: ops.silu_mul(torch.randn(32, 4).T), match="row")


def _attention_inputs(block_size: int = 4, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 9])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    kv_cache = torch.randn(2, 6 * block_size, kv_heads, dim, generator=gen)
    q = torch.randn(2, heads, dim, generator=gen)
    return q, kv_cache, tables, lens, block_size


def test_paged_attention_refuses_tables_that_point_outside_the_cache() -> None:
    ops = native_layer_ops()
    q, kv_cache, tables, lens, block_size = _attention_inputs()
    ops.paged_attention(q, kv_cache, tables, lens, block_size, 0.3)
    bad_block = tables.clone()
    bad_block[1, 2] = 6  # the cache holds blocks 0-5
    _refuses(lambda: ops.paged_attention(q, kv_cache, bad_block, lens, block_size, 0.3), match="block id")
    bad_block[1, 2] = -1
    _refuses(lambda: ops.paged_attention(q, kv_cache, bad_block, lens, block_size, 0.3), match="block id")
    unused = tables.clone()
    unused[0, 2] = 10**9  # past the context of row 0 (3 tokens = one block): never read, so accepted
    ops.paged_attention(q, kv_cache, unused, lens, block_size, 0.3)
    _refuses(
        lambda: ops.paged_attention(q, kv_cache, tables, torch.tensor([3, 13]), block_size, 0.3),
        match="longer",
    )
    _refuses(
        lambda: ops.paged_attention(q, kv_cache, tables, torch.tensor([-1, 3]), block_size, 0.3),
        match="negative",
    )
    _refuses(
        lambda: ops.paged_attention(q, kv_cache, tables, lens, block_size, 0.3, torch.tensor([0, 2])),
        match="table row",
    )
    ops.paged_attention(q, kv_cache, tables, lens, block_size, 0.3, torch.tensor([1, 1]))


def test_paged_attention_refuses_wrong_shapes_dtypes_and_sizes() -> None:
    ops = native_layer_ops()
    q, kv_cache, tables, lens, block_size = _attention_inputs()
    _refuses(
        lambda: ops.paged_attention(q, kv_cache, tables.int(), lens, block_size, 0.3), TypeError, "int64"
    )
    _refuses(lambda: ops.paged_attention(q, kv_cache, tables, lens.int(), block_size, 0.3), TypeError)
    _refuses(lambda: ops.paged_attention(q, kv_cache, tables, lens[:1], block_size, 0.3), match="N")
    _refuses(
        lambda: ops.paged_attention(torch.randn(2, 4, 4), kv_cache, tables, lens, block_size, 0.3), match="D"
    )
    _refuses(lambda: ops.paged_attention(q[:, :3], kv_cache, tables, lens, block_size, 0.3), match="multiple")
    _refuses(lambda: ops.paged_attention(q, kv_cache, tables, lens, 3, 0.3), match="power of two")
    _refuses(
        lambda: ops.paged_attention(q, torch.randn(2, 22, 2, 8), tables, lens, 8, 0.3), match="whole blocks"
    )
    _refuses(lambda: ops.paged_attention(q, kv_cache.transpose(2, 3), tables, lens, block_size, 0.3))
    _refuses(
        lambda: ops.paged_attention(q.transpose(1, 2), kv_cache, tables, lens, block_size, 0.3), match="row"
    )
    _refuses(
        lambda: ops.paged_attention(q, kv_cache[:1], tables, lens, block_size, 0.3),
        match="dimension 0, not 2",
    )
    _refuses(lambda: ops.paged_attention(q, kv_cache, tables.T, lens, block_size, 0.3), match="N|row")
    wide = torch.randn(2, 4 * 65, 8)  # 65 query heads per KV head: past the kernel's stack arrays
    cache = torch.randn(2, 24, 4, 8)
    _refuses(lambda: ops.paged_attention(wide, cache, tables, lens, block_size, 0.3), match="limits")


def test_rope_write_cache_refuses_slots_outside_the_cache() -> None:
    ops = native_layer_ops()
    heads, kv_heads, dim = 4, 2, 8
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(3, 1, dim), torch.randn(3, 1, dim)
    kv_cache = torch.zeros(2, 16, kv_heads, dim)
    ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, 5, 15]), kv_cache, heads, kv_heads)
    before = kv_cache.clone()
    _refuses(
        lambda: ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, 16, 1]), kv_cache, heads, kv_heads),
        match="slot",
    )
    _refuses(
        lambda: ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, -1, 1]), kv_cache, heads, kv_heads),
        match="slot",
    )
    assert torch.equal(kv_cache, before)  # nothing written by a refused call
    _refuses(
        lambda: ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, 1]), kv_cache, heads, kv_heads),
        match="T",
    )
    _refuses(
        lambda: ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, 1, 2]).int(), kv_cache, heads, kv_heads),
        TypeError,
    )
    _refuses(
        lambda: ops.rope_write_cache(qkv, cos, sin, torch.tensor([0, 1, 2]), kv_cache, heads + 1, kv_heads)
    )
    _refuses(
        lambda: ops.rope_write_cache(
            qkv, cos[:, :, :4], sin, torch.tensor([0, 1, 2]), kv_cache, heads, kv_heads
        )
    )
    _refuses(
        lambda: ops.rope_write_cache(
            qkv, cos.transpose(0, 1), sin, torch.tensor([0, 1, 2]), kv_cache, heads, kv_heads
        )
    )


def test_quant_gemm_and_dequantize_refuse_rows_that_do_not_fit_their_type() -> None:
    gemm = native_quant_gemm()
    blocks = torch.zeros(4, 2 * 18, dtype=torch.uint8)  # Q4_0: 64 features a row
    x = torch.randn(2, 64)
    gemm(x, blocks, QType.Q4_0, 4, 64)
    _refuses(lambda: gemm(x, blocks, QType.Q4_1, 4, 64), match="bytes")
    _refuses(lambda: gemm(x, blocks, QType.Q4_K, 4, 64), match="whole number")
    _refuses(lambda: gemm.dequantize(blocks, QType.Q8_0, 4, 64), match="bytes")
    _refuses(lambda: gemm.dequantize(blocks[:, :20], QType.Q4_0, 4, 64))
    _refuses(lambda: gemm(x, blocks, QType.Q4_0, 4, 64, isa="scalar", path="panels"), match="no such path")
    _refuses(lambda: gemm(x, blocks.view(4, 4, 9), QType.Q4_0, 4, 64), match="dimensions")


@pytest.mark.parametrize("threads", [0, -1, 2**32 + 1, MAX_THREADS + 1])
def test_a_thread_count_out_of_range_is_refused_before_c_sees_it(threads: int) -> None:
    # -1 reached quant_gemm.c's per-thread scratch (a negative size) and corrupted the heap; 2**32 + 1 reached C
    # as 1 (ctypes wraps silently)
    blocks, x = torch.zeros(4, 2 * 18, dtype=torch.uint8), torch.randn(2, 64)
    _refuses(lambda: native_quant_gemm()(x, blocks, QType.Q4_0, 4, 64, threads=threads), match="threads")
    _refuses(lambda: native_skinny_gemm()(x, torch.randn(3, 64), None, threads), match="threads")


def test_scalars_and_sizes_of_the_wrong_type_are_refused() -> None:
    x, w = torch.randn(2, 16), torch.randn(3, 16)
    _refuses(lambda: native_skinny_gemm()(x, w, None, 1.5), TypeError, "threads must be an int")
    _refuses(lambda: native_skinny_gemm()(x, w, None, True), TypeError, "threads must be an int")
    ops = native_layer_ops()
    _refuses(lambda: ops.rms_norm(x, torch.ones(16), "1e-5"), TypeError, "eps must be a float")
    q, kv_cache, tables, lens, block_size = _attention_inputs()
    _refuses(lambda: ops.paged_attention(q, kv_cache, tables, lens, 4.0, 0.3), TypeError, "block_size")
    _refuses(
        lambda: ops.paged_attention(q, kv_cache, tables, lens, block_size, 0.3, window=2**63), match="window"
    )


def test_the_attention_limits_are_the_librarys_own(tmp_path) -> None:
    # layer_ops.c keeps a task's query heads on the stack: a limit Python wrote apart let a call past the C
    # arrays through. Built with smaller limits, the checker and LayerOps follow them.
    small = tmp_path / "layer_ops_small.so"
    source = next(source for source in SOURCES if source.name == "layer_ops.c")
    subprocess.run(
        ["cc", *FLAGS, "-DMAX_GROUP=4", "-DMAX_GROUP_FLOATS=64", str(source), "-o", str(small)], check=True
    )
    lib = ctypes.CDLL(str(small))
    assert entry_points.attention_limits(lib) == {"MAX_GROUP": 4, "MAX_GROUP_FLOATS": 64}
    attention = entry_points.PAGED_ATTENTION.bind(lib)
    q, kv_cache, tables, lens, block_size = _attention_inputs(
        heads=8, kv_heads=2, dim=8
    )  # 4 per KV head: fits
    arguments = {"kv_cache": kv_cache, "block_tables": tables, "table_rows": None, "context_lens": lens}
    arguments |= {"block_size": block_size, "scale": 0.3, "window": 0, "softcap": 0.0, "threads": 1}
    attention(q=q, **arguments)
    wide = torch.randn(2, 10, 8)  # 5 query heads per KV head
    _refuses(lambda: attention(q=wide, **arguments), match=r"limits \(4 query heads per KV head, 64 of")
    cache = torch.randn(2, 24, 1, 32)  # heads of 32 values: 2 per KV head are 64 values, 4 are 128
    attention(q=torch.randn(2, 2, 32), **(arguments | {"kv_cache": cache}))
    _refuses(lambda: attention(q=torch.randn(2, 4, 32), **(arguments | {"kv_cache": cache})), match="limits")
