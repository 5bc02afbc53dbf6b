"""The token embedding: a float table, or rows kept as a GGUF file stores them (dequantized as they are looked up)."""

from __future__ import annotations

import torch
from torch import nn

from enginekit.model.kernels.native import quant_gemm
from enginekit.model.layers.quant_linear import StoredWeight


class Embedding(nn.Embedding):
    stored: StoredWeight | None = None

    def reset_parameters(self) -> None:
        pass

    def use_stored(self, weight: StoredWeight) -> None:
        """Look rows up in ``weight`` as stored (each step dequantizes only its tokens' rows); the float
        ``weight`` parameter is dropped."""
        if (weight.out_features, weight.in_features) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"a stored table of [{weight.out_features}, {weight.in_features}] for an embedding of "
                f"[{self.num_embeddings}, {self.embedding_dim}]"
            )
        self.weight = None  # pyright: ignore[reportAttributeAccessIssue]  # the stored table replaces it
        self.stored = weight
        self._gemm = quant_gemm()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # named as nn.Embedding names it
        if self.stored is None:
            return super().forward(input)
        rows = self.stored.rows(input, self._gemm)
        return rows.view(*input.shape, self.embedding_dim)
