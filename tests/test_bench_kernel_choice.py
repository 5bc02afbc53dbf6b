"""The kernel-choice benchmark's competitors compute what docs/architecture.md says they do: torch's int4 kernel
on a Q4_1 / Q4_0 weight repacked at load gives the stored weight's product to float32 rounding, and ggml's
``mul_mat`` (called through ctypes from llama-cpp-python's libraries) gives it within its int8 input's rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_kernel_choice import Ggml, torch_int4, torch_int8

from enginekit.model.kernels.quant_gemm import QuantGemm, random_blocks


def _relative(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float((result.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q4_0])
def test_torch_int4_maps_the_stored_weight_exactly(qtype: QType) -> None:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no _weight_int4pack_mm_for_cpu")
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(qtype, 64, 256, gen)
    dense = QuantGemm().dequantize(blocks, qtype, 64, 256)
    x = torch.randn(5, 256, generator=gen)
    exact = x.double() @ dense.double().T
    assert _relative(torch_int4(blocks, qtype, 64, 256)(x), exact) < 1e-5
    bf16 = _relative(torch_int4(blocks, qtype, 64, 256, torch.bfloat16)(x), exact)
    assert 1e-4 < bf16 < 2e-2  # bfloat16 input and scales: no longer the stored weight


def test_torch_int8_requantizes_q8_0_per_row() -> None:
    gen = torch.Generator().manual_seed(1)
    dense = QuantGemm().dequantize(random_blocks(QType.Q8_0, 64, 256, gen), QType.Q8_0, 64, 256)
    x = torch.randn(5, 256, generator=gen)
    error = _relative(torch_int8(dense)(x), x.double() @ dense.double().T)
    assert 1e-4 < error < 5e-2


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0])
def test_ggml_mul_mat_gives_the_stored_weights_product(qtype: QType) -> None:
    ggml, why = Ggml.load()
    if ggml is None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(2)
    weights = [random_blocks(qtype, 48, 256, gen) for _ in range(2)]
    x = torch.randn(3, 256, generator=gen)
    run, free = ggml.product(weights, qtype, 48, 256, x, 1)
    try:
        result = run().clone()
    finally:
        free()
    exact = x.double() @ QuantGemm().dequantize(weights[0], qtype, 48, 256).double().T
    assert _relative(result, exact) < 2e-2  # int8 input blocks of 32: about 5e-3
