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

from enginekit.model.kernels.native import QuantGemm, quant_gemm


class StoredWeight(NamedTuple):
    """One weight of ``out_features`` rows by ``in_features`` as stored: uint8 ``blocks`` ``[out_features,
    row_bytes]`` of GGUF type ``quant_type``."""

    blocks: torch.Tensor
    quant_type: GGMLQuantizationType
    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor, gemm: QuantGemm, exact_input: bool = False) -> torch.Tensor:
        """``x @ weight.T`` for float32 ``x`` ``[M, in_features]``: float32 ``[M, out_features]``;
        ``exact_input``: ``x`` is never quantized to int8."""
        return gemm(
            x, self.blocks, self.quant_type, self.out_features, self.in_features, exact_input=exact_input
        )

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

    ``exact_input`` keeps the input in float32 at every row count, for the LM head: a decode step's input
    quantized to int8 (as the other projections take it, and as llama.cpp does) moves its logits by about 1%,
    enough to flip a greedy choice of a small model (SmolLM2-135M answers "What is the capital of France?" with
    "L'Étoile, la Cité, ..." that way, in llama.cpp too), while it shifts the hidden states of the others
    within what the following norms absorb."""

    def __init__(
        self, parts: Sequence[StoredWeight], gemm: QuantGemm | None = None, *, exact_input: bool = False
    ) -> None:
        if not parts or len({part.in_features for part in parts}) != 1:
            raise ValueError("a quantized weight needs one or more parts of the same input width")
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.gemm = gemm or quant_gemm()
        self.exact_input = exact_input

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        outs = [part.matmul(x, self.gemm, self.exact_input) for part in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if bias is not None:
            out += bias
        return out.view(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """The bytes one product streams."""
        return sum(part.nbytes for part in self.parts)

    def describe(self) -> str:
        return "+".join(f"{part.quant_type.name}[{part.out_features}]" for part in self.parts)
