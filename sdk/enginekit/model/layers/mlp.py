"""The gated MLP: fused gate and up projection, SiLU (or GeLU-tanh) and multiply, down projection. Under tensor
parallelism (``comm``) each rank holds its share of the intermediate features: gate/up column-parallel (each split),
down row-parallel."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.config import ModelConfig
from enginekit.model.kernels.native import LayerOps
from enginekit.model.layers.linear import Linear
from enginekit.model.layers.parallel_linear import Collectives, ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    ops: LayerOps | None = None  # see Decoder.use_layer_ops
    gelu_ops: LayerOps | None = None  # the native GeLU-tanh, under batch invariance (Decoder.use_layer_ops)

    def __init__(self, config: ModelConfig, comm: Collectives | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.intermediate_size = inter // (comm.size if comm is not None else 1)  # this rank's
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"
        if comm is None:
            self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
            self.down_proj = Linear(inter, config.hidden_size, bias=False)
        else:
            self.gate_up_proj = ColumnParallelLinear(
                config.hidden_size, [inter, inter], bias=False, comm=comm
            )
            self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, comm=comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh:
            if self.gelu_ops is not None:
                return self.down_proj(self.gelu_ops.gelu_tanh_mul(self.gate_up_proj(x)))
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # in place: no new [T, inter] tensors

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"
