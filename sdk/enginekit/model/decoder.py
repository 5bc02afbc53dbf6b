"""The decoder of every architecture (``model/architectures.py``) in plain torch, over a paged KV cache, built from
``layers/``; the config's options (biases, q/k norms, rope type) choose its pieces."""

from __future__ import annotations

import torch
from torch import nn

from enginekit.model.config import ModelConfig
from enginekit.model.kernels.native import LayerOps, native_layer_ops
from enginekit.model.layers.attention import Attention
from enginekit.model.layers.embedding import Embedding
from enginekit.model.layers.linear import Linear, LinearKernel
from enginekit.model.layers.mlp import MLP
from enginekit.model.layers.norm import RMSNorm
from enginekit.model.layers.paged_attention import AttentionMetadata
from enginekit.model.layers.rotary import RotaryEmbedding


def layer_ops(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LayerOps | None:
    """The native layer operations (RMS norm, rotary embedding with the cache write, attention over the
    paged cache in place; ``enginekit.model.kernels.native``) for this model on this device, or ``None``: the model's
    torch code, on other devices and dtypes, where the library is not usable, or for attention shapes past its
    limits."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    ops = native_layer_ops()
    if ops is None or not ops.supports(config.num_heads, config.num_kv_heads, config.head_dim):
        return None
    return ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.window_of(layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # sandwich norms (Gemma): post_attention_layernorm norms the attention's output, these the MLP's input
        # and output
        self.sandwich = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, rotary, kv_cache, meta):
        if self.sandwich:
            attended = self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
        return hidden.add_(self.mlp(self.post_attention_layernorm(hidden)))

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"


class Decoder(nn.Module):
    """Decoder over a flat batch of new tokens; returns logits only for the rows asked for."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
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
        if self.config.scale_embeddings:  # by sqrt(hidden) rounded to the model's dtype, as transformers does
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        rotary = self.rotary(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, rotary, kv_cache, meta)
        hidden = self.norm(hidden[logits_indices])
        logits = self.lm_head(hidden).float()
        if cap := self.config.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits
