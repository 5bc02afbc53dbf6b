"""Tensor-parallel projections: each rank holds a slice of a weight and computes its part of the product.

- ``ColumnParallelLinear``: the output features are split. A fused projection (q/k/v, gate/up) is split part by
  part, so each rank holds its heads of q, of k and of v (its share of gate and of up) back to back, and the
  layer after it sees the same layout as on one rank, only narrower. No communication.
- ``RowParallelLinear``: the input features are split (the o and down projections, fed by a column-parallel
  layer's local output); each rank's partial product is summed over the ranks (``all_reduce``) and the bias added
  once, after the sum.

``shard`` turns the checkpoint's full tensor into this rank's slice, a copy, so the full tensor is freed once the
loader drops it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from enginekit.model.layers.linear import Linear


class Collectives(Protocol):
    """What the parallel layers need of the ranks' process group (``enginekit.model.parallel``)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        ...

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape everywhere), on rank 0; ``None`` on the others."""
        ...


class ColumnParallelLinear(Linear):
    """``sum(parts)`` output features, each part split evenly over the ranks; this rank's slices side by side."""

    def __init__(self, in_features: int, parts: list[int], *, bias: bool, comm: Collectives) -> None:
        if any(part % comm.size for part in parts):
            raise ValueError(f"output parts {parts} do not split evenly over {comm.size} ranks")
        super().__init__(in_features, sum(parts) // comm.size, bias=bias)
        self.parts = parts
        self.comm = comm

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full weight (or bias): its slice of each part, in order."""
        pieces, offset, rank = [], 0, self.comm.rank
        for part in self.parts:
            width = part // self.comm.size
            pieces.append(full[offset + rank * width : offset + (rank + 1) * width])
            offset += part
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


class RowParallelLinear(Linear):
    """``in_features`` split evenly over the ranks; the partial products summed over them, then the bias."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, comm: Collectives) -> None:
        if in_features % comm.size:
            raise ValueError(f"{in_features} input features do not split evenly over {comm.size} ranks")
        super().__init__(in_features // comm.size, out_features, bias=bias)
        self.comm = comm

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the full weight; the bias is whole on every rank (added once, after the sum)."""
        if name.endswith("bias"):
            return full
        width = self.in_features
        return full[:, self.comm.rank * width : (self.comm.rank + 1) * width].clone(
            memory_format=torch.contiguous_format
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # named as nn.Linear names it
        out = self.kernel(input, self.weight, None)
        if (
            self.lora is not None
        ):  # this rank's share of the adapters' product too: A is split by input as well
            self.lora(input, out)
        self.comm.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out

    __call__ = forward
