"""RMS norm: the native layer operation on CPU float32, else torch."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.kernels.native import LayerOps


class RMSNorm(nn.Module):
    ops: LayerOps | None = None  # see Decoder.use_layer_ops

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one kernel, bitwise equal to the reference formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"
