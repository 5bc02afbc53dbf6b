"""Weights kept as a GGUF file stores them (``StoredWeight``): the products of the projections that use them
(``QuantizedWeight``), and the rows of a stored token embedding (``StoredWeight.rows``).

The bytes are those of the file, mapped read-only by the loader; every product goes through
``enginekit.model.kernels.native.quant_gemm`` (the native kernels, or their portable equivalent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from enginekit.model.kernels.native import QuantGemm, native_skinny_gemm, quant_gemm
from enginekit.model.kernels.quant_gemm import INT8_MAX_ROWS, NativeQuantGemm


class StoredWeight(NamedTuple):
    """One weight of ``out_features`` rows by ``in_features`` as stored: uint8 ``blocks`` ``[out_features,
    row_bytes]`` of GGUF type ``quant_type``."""

    blocks: torch.Tensor
    quant_type: GGMLQuantizationType
    out_features: int
    in_features: int

    def rows(self, ids: torch.Tensor, gemm: QuantGemm) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized to float32 ``[len(ids), in_features]`` (an embedding lookup:
        only those rows are read)."""
        picked = self.blocks.index_select(0, ids.reshape(-1))
        return gemm.dequantize(picked, self.quant_type, picked.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class QuantizedWeight:
    """A projection's weight as stored, in one or more ``parts`` whose outputs follow each other (a fused q/k/v or
    gate/up whose pieces are of different types stays several products); its product is theirs side by side.

    ``exact_top`` (the LM head): the ``exact_top`` largest outputs of each row computed again from the input
    unquantized. At a decode step (up to ``INT8_MAX_ROWS`` rows) the kernels quantize the input to int8, as
    llama.cpp does (or, on CPUs with AVX-512 BF16 from ``BF16_MIN_ROWS`` rows on, round input and weight to bf16),
    which moves each output by up to about 1% of its size: the hidden states of the next layer absorb
    that, but a logit is a choice, and it flips greedy choices of a small model (SmolLM2-135M answers "What is
    the capital of France?" with "L'Étoile, la Cité, ..." that way, in llama.cpp too). The candidates' rows cost
    ``M x exact_top`` dot products; computing the whole head without int8 would cost three times the step's
    largest product. The other logits keep the int8 product's values (sampling at a temperature sees them).

    ``batch_invariant``: a row's outputs do not depend on the other rows of the call. The native kernels' path is
    then the same at every row count (``"invariant"`` in ``quant_gemm.c``), and the candidates' dot products are
    the native skinny GEMM's, one row at a time (its sums do not depend on the rows either; a batched einsum's may).
    It needs the native kernels (``ValueError`` without them)."""

    def __init__(
        self,
        parts: Sequence[StoredWeight],
        gemm: QuantGemm | None = None,
        *,
        exact_top: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        if not parts or len({part.in_features for part in parts}) != 1:
            raise ValueError("a quantized weight needs one or more parts of the same input width")
        if exact_top and len(parts) != 1:
            raise ValueError("exact_top needs a weight of one part")
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.gemm = gemm or quant_gemm()
        self.exact_top = min(exact_top, self.out_features)
        self.batch_invariant = batch_invariant
        self._dot = native_skinny_gemm() if batch_invariant else None
        native = isinstance(self.gemm, NativeQuantGemm) and all(
            self.gemm.supports(p.quant_type) for p in parts
        )
        if batch_invariant and (self._dot is None or not native):
            raise ValueError(
                "a batch-invariant product needs the native kernels and a type they compute with "
                f"({self.gemm.name}; {self.describe()})"
            )
        # each part's product, bound once (the layer calls it at every step)
        path = "invariant" if batch_invariant else "auto"
        self._products = tuple(
            self.gemm.bind(part.blocks, part.quant_type, part.out_features, part.in_features, path=path)
            for part in self.parts
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        if len(shape) != 2:
            x = x.reshape(-1, self.in_features)
        if x.dtype is not torch.float32:
            x = x.to(torch.float32)
        if not x.is_contiguous():
            x = x.contiguous()
        products = self._products
        out = products[0](x) if len(products) == 1 else torch.cat([p(x) for p in products], dim=1)
        # every row: the bf16 path (CPUs with AVX-512 BF16) rounds past 16 rows too; in chunks, to bound the
        # dequantized candidate rows' memory
        for first in range(0, x.shape[0] if self.exact_top else 0, INT8_MAX_ROWS):
            self._recompute_top(x[first : first + INT8_MAX_ROWS], out[first : first + INT8_MAX_ROWS])
        if bias is not None:
            out += bias
        return out if len(shape) == 2 else out.view(*shape[:-1], self.out_features)

    def _recompute_top(self, x: torch.Tensor, out: torch.Tensor) -> None:
        top = out.topk(self.exact_top, dim=1).indices  # [M, exact_top]
        rows = self.parts[0].rows(top, self.gemm).view(*top.shape, self.in_features)
        if self._dot is None:
            out.scatter_(1, top, torch.einsum("mtk,mk->mt", rows, x))
        else:  # each row's candidates on their own: see batch_invariant
            dot = self._dot
            out.scatter_(1, top, torch.cat([dot(x[i : i + 1], rows[i], None) for i in range(x.shape[0])]))

    @property
    def nbytes(self) -> int:
        """The bytes one product streams."""
        return sum(part.nbytes for part in self.parts)

    def describe(self) -> str:
        return "+".join(f"{part.quant_type.name}[{part.out_features}]" for part in self.parts)
