"""Products with GGUF weights as stored (``quant_gemm``): every type's dequantization bit-exact with gguf-py's, every
type's product within float32 rounding of the dequantized weight's (within the int8 path's bound where the input is
quantized, within the bf16 path's bound where input and weight are rounded to bf16), on every instruction set this
CPU has and every path, and the portable form where the library is off.

The block types gguf-py can quantize are made by it; the K-quants are built field by field (scales, minimums,
quantized values packed as the format lays them out), and checked against the values they were built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels.quant_gemm import (
    NATIVE_TYPES,
    QuantGemm,
    bf16_error_bound,
    bf16_min_rows,
    int8_error_bound,
    native_quant_gemm,
    quant_gemm,
    row_bytes,
)

NATIVE = native_quant_gemm()
needs_native = pytest.mark.skipif(NATIVE is None, reason="the native library cannot be built or loaded here")
GGUF_QUANTIZES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.F16, QType.BF16)
K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
ALL_TYPES = sorted(NATIVE_TYPES)


def _halves(rng: np.random.Generator, count: int, scale: float) -> np.ndarray:
    """``count`` float16 values of about ``scale``, as their two bytes each."""
    return (rng.standard_normal(count) * scale).astype(np.float16).view(np.uint8).reshape(count, 2)


def _q4k_q5k(rng: np.random.Generator, blocks: int, five_bits: bool) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks from random six-bit scales and minimums and four- or five-bit values, with the values
    they stand for (computed from the fields, not by gguf-py)."""
    d, dmin = _halves(rng, blocks, 0.01), _halves(rng, blocks, 0.01)
    scale, minimum = rng.integers(0, 64, (blocks, 8)), rng.integers(0, 64, (blocks, 8))
    q = rng.integers(0, 32 if five_bits else 16, (blocks, 8, 32))
    packed = np.zeros((blocks, 12), dtype=np.uint8)
    packed[:, 0:4] = scale[:, :4] | (scale[:, 4:] >> 4) << 6
    packed[:, 4:8] = minimum[:, :4] | (minimum[:, 4:] >> 4) << 6
    packed[:, 8:12] = (scale[:, 4:] & 15) | (minimum[:, 4:] & 15) << 4
    low = q & 15  # sub-blocks 2c and 2c + 1 share 32 bytes: low nibbles, then high
    qs = (low[:, 0::2] | low[:, 1::2] << 4).reshape(blocks, 128).astype(np.uint8)
    parts = [d, dmin, packed]
    if five_bits:
        qh = sum((q[:, s] >> 4) << s for s in range(8)).astype(
            np.uint8
        )  # bit s of qh[i]: sub-block s, value i
        parts.append(qh)
    parts.append(qs)
    ds = d.view(np.float16).astype(np.float32) * scale.astype(np.float32)
    dm = dmin.view(np.float16).astype(np.float32) * minimum.astype(np.float32)
    values = ds[..., None] * q.astype(np.float32) - dm[..., None]
    return np.concatenate(parts, axis=1), values.reshape(blocks, 256)


def _q6k(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks from random signed eight-bit scales (one per 16 values) and six-bit values."""
    d = _halves(rng, blocks, 0.001)
    scales = rng.integers(-128, 128, (blocks, 16)).astype(np.int8)
    q = rng.integers(0, 64, (blocks, 256))
    ql, qh = np.zeros((blocks, 128), dtype=np.uint8), np.zeros((blocks, 64), dtype=np.uint8)
    for i in range(
        256
    ):  # value i: half i // 128; its low nibble and its two high bits, where the format puts them
        half, within = divmod(i, 128)
        ql[:, 64 * half + within % 64] |= ((q[:, i] & 15) << (4 * (within // 64))).astype(np.uint8)
        qh[:, 32 * half + within % 32] |= ((q[:, i] >> 4) << (2 * (within // 32))).astype(np.uint8)
    ds = d.view(np.float16).astype(np.float32) * scales.astype(np.float32)  # [blocks, 16]
    values = np.repeat(ds, 16, axis=1) * (q - 32).astype(np.float32)
    return np.concatenate([ql, qh, scales.view(np.uint8), d], axis=1), values


def stored(qtype: QType, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight of ``qtype`` as a file stores it: ``[out_features, row_bytes]`` uint8."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES:
        values = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
        data = gguf.quants.quantize(values, qtype)
    else:
        blocks = out_features * in_features // 256
        data, _ = _q6k(rng, blocks) if qtype == QType.Q6_K else _q4k_q5k(rng, blocks, qtype == QType.Q5_K)
    data = np.ascontiguousarray(data).view(np.uint8).reshape(out_features, -1)
    assert data.shape[1] == row_bytes(qtype, in_features)
    return torch.from_numpy(data.copy())


def dequantized(blocks: torch.Tensor, qtype: QType, out_features: int, in_features: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).astype(np.float32)).view(
        out_features, in_features
    )


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quant_blocks_built_by_hand_read_back_as_built(qtype: QType) -> None:
    rng = np.random.default_rng(1)
    data, values = _q6k(rng, 6) if qtype == QType.Q6_K else _q4k_q5k(rng, 6, qtype == QType.Q5_K)
    assert data.shape == (6, gguf.GGML_QUANT_SIZES[qtype][1])
    np.testing.assert_array_equal(gguf.quants.dequantize(data, qtype).reshape(6, 256), values)


@needs_native
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantization_is_bit_exact_with_gguf_py(qtype: QType) -> None:
    blocks = stored(qtype, 37, 512, seed=int(qtype))
    native = NATIVE.dequantize(blocks, qtype, 37, 512)
    assert torch.equal(native.view(torch.int32), dequantized(blocks, qtype, 37, 512).view(torch.int32))


def test_dequantization_of_subnormal_infinite_and_nan_halves_is_bit_exact() -> None:
    if NATIVE is None:
        pytest.skip("the native library cannot be built or loaded here")
    special = np.array(
        [0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E01, 0x8000, 0], dtype=np.uint16
    )
    blocks = torch.from_numpy(np.tile(special, 4).view(np.uint8).reshape(2, 40).copy())
    native = NATIVE.dequantize(blocks, QType.F16, 2, 20)
    assert torch.equal(native.view(torch.int32), dequantized(blocks, QType.F16, 2, 20).view(torch.int32))


def _check_product(
    result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, int8: bool, bf16: bool = False
) -> None:
    """Within float32 rounding of the float64 product of the dequantized weight, plus the int8 (or bf16) path's
    bound."""
    reference = x.double() @ weight.double().T
    slack = 1e-5 * (x.abs() @ weight.abs().T).double() + 1e-6
    if int8:
        slack += int8_error_bound(x, weight).double() * 1.001
    if bf16:
        slack += bf16_error_bound(x, weight).double() * 1.001
    excess = (result.double() - reference).abs() - slack
    assert excess.max() <= 0, f"off by {excess.max():.3g} past the tolerance"


def _paths(qtype: QType, isa: str) -> list[str]:
    paths = ["auto", "float"] + (["int8"] if qtype not in (QType.F16, QType.BF16) else [])
    return paths + (["panels"] if isa != "scalar" else []) + (["bf16"] if isa == "avx512_bf16" else [])


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 200])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_product_matches_the_dequantized_weight_on_every_isa_and_path(qtype: QType, rows: int) -> None:
    out_features, in_features = 37, 512  # an odd number of outputs: partial tasks, tiles and panels
    blocks = stored(qtype, out_features, in_features, seed=rows)
    weight = dequantized(blocks, qtype, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    for isa in NATIVE.isas():
        for path in _paths(qtype, isa):
            result = NATIVE(x, blocks, qtype, out_features, in_features, isa=isa, path=path)
            blocky = qtype not in (QType.F16, QType.BF16)  # auto: int8 up to 16 rows, and always without AVX2
            # auto with AVX-512 BF16: bf16 from bf16_min_rows on (a prefill's rows included)
            bf16 = path == "bf16" or (
                path == "auto" and blocky and isa == "avx512_bf16" and bf16_min_rows(qtype) <= rows
            )
            int8 = not bf16 and (
                path == "int8" or (path == "auto" and blocky and (rows <= 16 or isa == "scalar"))
            )
            _check_product(result, x, weight, int8, bf16)


@needs_native
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q5_K, QType.Q6_K], ids=lambda t: t.name)
def test_int8_path_at_every_row_count_up_to_sixteen(qtype: QType) -> None:
    """The int8 path multiplies each decoded group of weight rows into the input rows four or eight at a time, then
    the rest together: every count of rows a decode step can have, and a number of outputs that leaves a partial
    group of weight rows."""
    assert NATIVE is not None
    out_features, in_features = 38, 256
    blocks = stored(qtype, out_features, in_features, seed=5)
    weight = dequantized(blocks, qtype, out_features, in_features)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(6))
    for isa in NATIVE.isas():
        for rows in range(1, 17):
            result = NATIVE(x[:rows], blocks, qtype, out_features, in_features, isa=isa, path="int8")
            _check_product(result, x[:rows], weight, int8=True)


@needs_native
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bf16_path_at_every_row_count_up_to_sixteen(qtype: QType) -> None:
    """The bf16 path (CPUs with AVX-512 BF16) multiplies four decoded weight rows into the input rows six at a
    time (split evenly): every count of rows a decode step can have, a number of outputs that leaves a partial
    group of weight rows, and a width that is not whole vectors of 32 (F16, BF16)."""
    assert NATIVE is not None
    if "avx512_bf16" not in NATIVE.isas():
        pytest.skip("this CPU lacks AVX-512 BF16")
    in_features = 256 + (8 if qtype in (QType.F16, QType.BF16) else 0)
    out_features = 38
    blocks = stored(qtype, out_features, in_features, seed=7)
    weight = dequantized(blocks, qtype, out_features, in_features)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(8))
    for rows in range(1, 17):
        result = NATIVE(x[:rows], blocks, qtype, out_features, in_features, path="bf16")
        _check_product(result, x[:rows], weight, int8=False, bf16=True)
    for threads in (1, 2):  # tasks split over threads change nothing
        assert torch.equal(
            NATIVE(x, blocks, qtype, out_features, in_features, path="bf16", threads=threads),
            NATIVE(x, blocks, qtype, out_features, in_features, path="bf16", threads=1),
        )


@needs_native
def test_bf16_path_is_refused_without_avx512_bf16() -> None:
    assert NATIVE is not None
    blocks, x = stored(QType.Q4_1, 8, 64), torch.randn(6, 64)
    for isa in NATIVE.isas():
        if isa != "avx512_bf16":
            with pytest.raises(ValueError, match="no such path"):
                NATIVE(x, blocks, QType.Q4_1, 8, 64, isa=isa, path="bf16")


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_an_odd_width_of_blocks_change_nothing(threads: int) -> None:
    """Tasks split over threads, and a row of an odd number of blocks (the AVX-512 path's half-vector tail)."""
    blocks = stored(QType.Q4_1, 301, 32 * 7)
    x = torch.randn(5, 32 * 7, generator=torch.Generator().manual_seed(3))
    single = NATIVE(x, blocks, QType.Q4_1, 301, 32 * 7, threads=1)
    assert torch.equal(NATIVE(x, blocks, QType.Q4_1, 301, 32 * 7, threads=threads), single)
    _check_product(single, x, dequantized(blocks, QType.Q4_1, 301, 32 * 7), int8=True)


@needs_native
def test_every_isa_gives_the_same_int8_sums() -> None:
    """The integer sums are exact on every instruction set; only the float accumulation order differs."""
    blocks = stored(QType.Q8_0, 9, 1024)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4))
    results = [NATIVE(x, blocks, QType.Q8_0, 9, 1024, isa=isa, path="int8") for isa in NATIVE.isas()]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_portable_form_dequantizes_and_multiplies_in_float32(qtype: QType) -> None:
    blocks = stored(qtype, 7, 256)
    weight = dequantized(blocks, qtype, 7, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    portable = QuantGemm()
    assert portable.supports(qtype)
    assert torch.equal(portable.dequantize(blocks, qtype, 7, 256), weight)
    _check_product(portable(x, blocks, qtype, 7, 256), x, weight, int8=False)


def test_without_the_library_quant_gemm_is_the_portable_form() -> None:
    script = (
        "import json, torch; from enginekit.model.kernels.quant_gemm import quant_gemm, native_quant_gemm;"
        "g = quant_gemm(); print(json.dumps([native_quant_gemm() is None, g.name]))"
    )
    env = {**os.environ, "ENGINEKIT_NATIVE_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    is_none, name = json.loads(done.stdout.strip().splitlines()[-1])
    assert is_none and name.startswith("portable")


@needs_native
def test_native_and_portable_agree_on_a_type_without_a_native_kernel() -> None:
    """Q2_K has no native kernel: the native object says so and computes it the portable way."""
    rng = np.random.default_rng(6)
    data = rng.integers(0, 256, (4, 84), dtype=np.uint8)
    data[:, 80:84] = _halves(rng, 8, 0.01).reshape(4, 4)  # d and dmin
    blocks = torch.from_numpy(data)
    assert not NATIVE.supports(QType.Q2_K)
    x = torch.randn(2, 256)
    assert torch.equal(NATIVE(x, blocks, QType.Q2_K, 4, 256), QuantGemm()(x, blocks, QType.Q2_K, 4, 256))


@pytest.mark.parametrize("gemm", ["native", "portable"])
def test_bad_arguments_raise_instead_of_reading_past_the_weight(gemm: str) -> None:
    if gemm == "native" and NATIVE is None:
        pytest.skip("the native library cannot be built or loaded here")
    kernel = NATIVE if gemm == "native" else QuantGemm()
    blocks, x = stored(QType.Q4_0, 8, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="whole number"):
        kernel(torch.randn(2, 48), blocks, QType.Q4_0, 8, 48)
    with pytest.raises(ValueError):
        kernel(x, blocks[:, :30], QType.Q4_0, 8, 64)  # rows too short for 64 features
    with pytest.raises(ValueError):
        kernel(x, blocks, QType.Q4_0, 9, 64)  # more outputs than rows
    with pytest.raises(TypeError):
        kernel(x.double(), blocks, QType.Q4_0, 8, 64)
    with pytest.raises(TypeError):
        kernel(x, blocks.view(torch.int8), QType.Q4_0, 8, 64)
    with pytest.raises(ValueError):
        kernel(torch.randn(64, 2).T, blocks, QType.Q4_0, 8, 64) if gemm == "native" else kernel(
            torch.randn(2, 65), blocks, QType.Q4_0, 8, 64
        )
    with pytest.raises(ValueError, match="unknown GGUF tensor type"):
        kernel(x, blocks, 99, 8, 64)


def test_quant_gemm_is_native_where_the_library_loads() -> None:
    assert (quant_gemm() is NATIVE) if NATIVE is not None else quant_gemm().name.startswith("portable")


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_an_lm_head_computes_its_largest_outputs_from_the_unquantized_input(rows):
    from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight

    blocks = stored(QType.Q8_0, 512, 256, seed=3)
    weight = dequantized(blocks, QType.Q8_0, 512, 256)
    part = StoredWeight(blocks, QType.Q8_0, 512, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    plain = QuantizedWeight([part], NATIVE)(x)
    head = QuantizedWeight([part], NATIVE, exact_top=8)(x)
    exact = (x.double() @ weight.double().T).float()
    top = plain.topk(8, dim=1).indices  # the outputs computed again
    torch.testing.assert_close(head.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(head.argmax(dim=1), exact.argmax(dim=1))
    if rows <= 16 or "avx512_bf16" in NATIVE.isas():
        # the int8 or bf16 path: the other outputs keep its values, which differ from the exact ones
        rest = torch.ones_like(head, dtype=torch.bool).scatter_(1, top, False)
        assert torch.equal(head[rest], plain[rest]) and not torch.equal(plain[rest], exact[rest])


@needs_native
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_the_invariant_path_gives_a_row_the_same_outputs_whatever_the_other_rows(qtype: QType) -> None:
    # path "auto" picks by the row count (int8 up to 5 rows, then bf16 with AVX-512 BF16; int8 up to 16, then
    # panels without): a row's outputs then depend on how many rows share its call
    blocks = stored(qtype, 40, 256, seed=5)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(6))
    for isa in NATIVE.isas():
        alone = torch.cat(
            [NATIVE(x[i : i + 1], blocks, qtype, 40, 256, isa=isa, path="invariant") for i in range(20)]
        )
        for rows in (*range(1, 21), 64, 300):
            together = NATIVE(x[:rows], blocks, qtype, 40, 256, isa=isa, path="invariant", threads=2)
            first = min(rows, 20)
            assert torch.equal(together[:first], alone[:first]), (isa, rows)
        taken = (
            "bf16" if isa == "avx512_bf16" else "int8" if qtype not in (QType.F16, QType.BF16) else "float"
        )
        assert torch.equal(alone, NATIVE(x[:20], blocks, qtype, 40, 256, isa=isa, path=taken)), isa


@needs_native
def test_an_invariant_lm_head_gives_a_row_the_same_logits_whatever_the_other_rows() -> None:
    from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight

    part = StoredWeight(stored(QType.Q8_0, 512, 256, seed=7), QType.Q8_0, 512, 256)
    head = QuantizedWeight([part], NATIVE, exact_top=8, batch_invariant=True)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([head(x[i : i + 1]) for i in range(40)])
    for rows in (2, 3, 16, 17, 40):
        assert torch.equal(head(x[:rows]), alone[:rows]), rows
    exact = (x.double() @ dequantized(part.blocks, QType.Q8_0, 512, 256).double().T).float()
    assert torch.equal(alone.argmax(dim=1), exact.argmax(dim=1))
