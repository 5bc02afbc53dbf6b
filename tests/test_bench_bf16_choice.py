"""The bf16 choice benchmark's competitors compute what docs/architecture.md says they do: oneDNN's bf16 linear on
the dequantized weight (in place and reordered) gives the stored weight's product within bf16 rounding of input,
weight and output, as ours does within that of input and weight; and the script reads which implementation
oneDNN picked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_bf16_choice import _products, onednn_implementation

from enginekit.model.kernels.quant_gemm import bf16_error_bound, native_quant_gemm, random_blocks

NATIVE = native_quant_gemm()
pytestmark = pytest.mark.skipif(
    NATIVE is None or NATIVE.best_isa != "avx512_bf16" or not torch.backends.mkldnn.is_available(),
    reason="needs the native bf16 path (AVX-512 BF16) and oneDNN",
)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0])
def test_every_competitor_gives_the_stored_weights_product_within_bf16_rounding(qtype: QType) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(qtype, 96, 256, gen)
    weight = NATIVE.dequantize(blocks, qtype, 96, 256)
    x = torch.randn(16, 256, generator=gen)
    exact = x.double() @ weight.double().T
    bound = bf16_error_bound(x, weight).double()
    for kernel, products in _products([blocks], qtype, 96, 256, 16).items():
        result = products[0](x)
        assert result.dtype == torch.float32 and result.shape == (16, 96), kernel
        slack = bound if kernel == "ours" else bound + exact.abs() * 2.0**-8  # oneDNN's output is bf16
        assert ((result.double() - exact).abs() <= slack + 1e-6).all(), kernel


def test_the_implementation_oneDNN_picked_is_read_from_its_log() -> None:
    assert "matmul" in onednn_implementation() or "gemm" in onednn_implementation()
