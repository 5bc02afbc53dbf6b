"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, over a paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.attention import AttentionMetadata, paged_attention
from enginekit.model.config import ModelConfig
from enginekit.model.native import (
    MAX_ROWS,
    LayerOps,
    native_layer_ops,
    native_packed_gemm,
    native_skinny_gemm,
)

logger = logging.getLogger("enginekit.model")
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Linear(nn.Linear):
    """A linear layer that skips random initialisation (its weights always come from a loader) and runs the
    model's chosen kernel (see ``linear_kernel``)."""

    kernel: LinearKernel = F.linear

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


# Measured with torch 2.13 on 2 cores, 1-128 rows: in the whole 135M model oneDNN made the projections 1.35-1.5x
# faster; on the tiny test models' weights (under 400k elements) it was 0.15-0.7x of F.linear, its fixed cost
# per call (40-50 us) dominating. With many rows that cost is amortised: at 129-2048 rows oneDNN was 1.1-1.3x
# F.linear on 16k-330k-element weights (the default model's 576x576 output projection among them), 0.6-1.0x
# below 2**25 multiply-adds per call.
ONEDNN_MIN_WEIGHT_NUMEL = 1 << 19
ONEDNN_MIN_WORK = 1 << 25  # rows x weight elements
# From this many rows the native packed GEMM runs a call: on the default model's weights (2 threads, an AVX2 CPU)
# it overtakes the skinny GEMM's tiles at 81-95 rows (150 against 140 GFLOP/s at 96, 153 against 146 at 128).
# With inputs under 256 wide (the tiny test models' 128) its short inner loop loses to oneDNN at 512-2,048 rows.
PACKED_MIN_ROWS = 96
PACKED_MIN_DEPTH = 256  # input features


def linear_kernel(
    device: torch.device, dtype: torch.dtype, *, native: bool = True
) -> tuple[str, LinearKernel]:
    """The fastest correct kernel for the model's projections on this device, with its name (``native=False``:
    without the native GEMMs, to measure what they give).

    On CPU in float32 it picks per call, by the input's rows and the weight's size:

    - **``PACKED_MIN_ROWS`` (96) rows or more, inputs ``PACKED_MIN_DEPTH`` (256) wide or more** (a prefill step,
      the largest decode steps): the native packed GEMM of ``packed_gemm.c``, 1.2-1.3x oneDNN's linear at
      256-2,048 rows on the default model's weights;
    - **otherwise 1 to ``MAX_ROWS`` (128) rows** (a decode step): the native skinny GEMM of ``skinny_gemm.c``.
      Up to 8 rows it reads each weight once for all the rows, at 75-90% of the CPU's read bandwidth, where
      torch's kernels reach 50-70% at one row and slow down with every row added; past that its
      register-blocked tiles run 1.1-1.5x oneDNN's linear on an AVX2 CPU;
    - past those, and where the native library cannot be built or loaded (``enginekit.model.native`` then
      returns ``None``), **weights of ``ONEDNN_MIN_WEIGHT_NUMEL`` elements or more, or calls of
      ``ONEDNN_MIN_WORK`` multiply-adds or more**: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel
      torch's own compiler emits for a CPU linear). It reads the same ``[out, in]`` weights in place and is
      1.35-1.5x faster than ``F.linear`` (MKL's GEMM, which repacks the weights on every call) for the model's
      shapes at 1 to 128 rows (see docs/benchmarks.md), used when this torch build has it and it agrees with
      ``F.linear`` on a probe. Its fixed cost per call (about 40-50 us here) loses to ``F.linear`` on smaller
      weights;
    - otherwise ``F.linear``, which is also the kernel on other devices and dtypes.
    """
    if device.type != "cpu" or dtype != torch.float32:
        return "F.linear", F.linear
    onednn = _onednn_linear()
    skinny = native_skinny_gemm() if native else None
    packed = native_packed_gemm() if native else None
    if onednn is None and skinny is None and packed is None:
        return "F.linear", F.linear

    def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous():
            rows = x.shape[0]
            if packed is not None and rows >= PACKED_MIN_ROWS and weight.shape[1] >= PACKED_MIN_DEPTH:
                return packed(x, weight, bias)
            if skinny is not None and 0 < rows <= MAX_ROWS and x.is_contiguous():
                return skinny(x, weight, bias)
        if onednn is not None and (
            weight.numel() >= ONEDNN_MIN_WEIGHT_NUMEL or x.numel() * weight.shape[0] >= ONEDNN_MIN_WORK
        ):
            return onednn(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    parts = [f"native packed GEMM from {PACKED_MIN_ROWS} rows {PACKED_MIN_DEPTH} wide"] if packed else []
    if skinny is not None:
        parts.append(f"native skinny GEMM at 1-{MAX_ROWS} rows")
    if onednn is not None:
        parts.append(
            f"oneDNN from {ONEDNN_MIN_WEIGHT_NUMEL} weight elements or {ONEDNN_MIN_WORK} multiply-adds"
        )
    return ", ".join([*parts, "else F.linear"]), cpu_linear


def layer_ops(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LayerOps | None:
    """The native layer operations (RMS norm, rotary embedding with the cache write, attention over the
    paged cache in place; ``enginekit.model.native``) for this model on this device, or ``None``: the model's
    torch code, on other devices and dtypes, where the library is not usable, or for attention shapes past its
    limits."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    ops = native_layer_ops()
    if ops is None or not ops.supports(config.num_heads, config.num_kv_heads, config.head_dim):
        return None
    return ops


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's linear, if this torch build has it and it agrees with ``F.linear`` on a probe."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        if not torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5):
            raise RuntimeError("oneDNN's linear disagrees with F.linear on a probe")
    except (AttributeError, RuntimeError) as error:
        logger.info("CPU linear: no oneDNN (it is not usable here: %s)", error)
        return None
    return op


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    ops: LayerOps | None = None  # see LlamaForCausalLM.use_layer_ops

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


class RotaryEmbedding(nn.Module):
    """cos and sin tables for every position, computed once the way the reference implementation does; the sin
    table's first half is stored negated (see ``rotate``)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        with torch.device("cpu"):  # NOTE: real tables even when the model is built on the meta device
            cos, sin = _rotary_tables(head_dim, max_positions, theta)
            signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of these positions, ``[T, 1, D]``; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[T, heads, D]``: the reference's ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x2, x1)``, written as ``roll(x) * signed_sin`` with ``roll(x) = cat(x2, x1)`` and
    the sign in the table. Bitwise the same values in two fewer ops (2x faster at one row, measured with torch
    2.13 on 2 cores)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rotary_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    ops: LayerOps | None = None  # see LlamaForCausalLM.use_layer_ops

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, hidden, rotary, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        if self.ops is not None:  # rotates q and k, and writes k and v to the cache, in one call
            qk = self.ops.rope_write_cache(
                qkv, *rotary, meta.slot_mapping, kv_cache, self.num_heads, self.num_kv_heads
            )
        else:
            # q and k are adjacent in each row: rotate them as one [T, heads + kv_heads, D] view (half the ops).
            qk = rotate(
                qkv[:, : self.q_size + self.kv_size].view(
                    -1, self.num_heads + self.num_kv_heads, self.head_dim
                ),
                *rotary,
            )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.ops)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    ops: LayerOps | None = None  # see LlamaForCausalLM.use_layer_ops

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # in place: no new [T, inter] tensors


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, rotary, kv_cache, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))


class LlamaForCausalLM(nn.Module):
    """Decoder over a flat batch of new tokens; returns logits only for the rows asked for."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layer_ops: LayerOps | None = None  # see use_layer_ops

    def use_linear_kernel(self, kernel: LinearKernel) -> int:
        """Run every projection (and the LM head) with ``kernel(x, weight, bias)``; returns how many."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        for module in linears:
            module.kernel = kernel
        return len(linears)

    def use_layer_ops(self, ops: LayerOps | None) -> int:
        """Run the norms, attention and MLP activations with the native ``ops`` (``None``: the torch code); returns how many
        modules use them."""
        modules = [module for module in self.modules() if isinstance(module, (RMSNorm, Attention, MLP))]
        for module in modules:
            module.ops = ops
        self.layer_ops = ops
        return len(modules) if ops is not None else 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        input_embeds: list[tuple[int, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for row, embeds in input_embeds or ():
            hidden[row : row + embeds.shape[0]] = embeds.to(hidden.dtype)
        rotary = self.rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, rotary, kv_cache, meta)
        hidden = self.norm(hidden[logits_indices])
        return self.lm_head(hidden).float()
