"""The gated MLP: fused gate and up projection, SiLU (or GeLU-tanh) and multiply, down projection."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.config import ModelConfig
from enginekit.model.kernels.native import LayerOps
from enginekit.model.layers.linear import Linear


class MLP(nn.Module):
    ops: LayerOps | None = None  # see Decoder.use_layer_ops

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # in place: no new [T, inter] tensors

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"
