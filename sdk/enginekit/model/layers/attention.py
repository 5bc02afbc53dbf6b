"""The attention block: fused q/k/v projection, optional per-head q/k norms, rotary embedding, paged attention
(over all the context, or a sliding window of it), output projection. Under tensor parallelism (``comm``) each
rank holds its share of the heads (and KV heads): q/k/v column-parallel, o row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from enginekit.model.config import ModelConfig
from enginekit.model.kernels.native import LayerOps
from enginekit.model.kernels.triton_path import PagedAttentionInputs, TritonOps
from enginekit.model.layers.linear import Linear
from enginekit.model.layers.norm import RMSNorm
from enginekit.model.layers.paged_attention import AttentionMetadata, paged_attention
from enginekit.model.layers.parallel_linear import Collectives, ColumnParallelLinear, RowParallelLinear
from enginekit.model.layers.rotary import rotate


class Attention(nn.Module):
    ops: LayerOps | None = None  # see Decoder.use_layer_ops
    triton: TritonOps | None = None  # see Decoder.use_triton

    def __init__(self, config: ModelConfig, window: int = 0, comm: Collectives | None = None) -> None:
        super().__init__()
        ranks = comm.size if comm is not None else 1
        self.window = window  # sliding window: attend to the last this many tokens (0: to all)
        self.num_heads = config.num_heads // ranks  # this rank's
        self.num_kv_heads = config.num_kv_heads // ranks
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.softcap = config.attn_logit_softcap
        if comm is None:
            self.qkv_proj = Linear(
                config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
            )
            self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        else:
            full_q, full_kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            self.qkv_proj = ColumnParallelLinear(
                config.hidden_size, [full_q, full_kv, full_kv], bias=config.attention_bias, comm=comm
            )
            self.o_proj = RowParallelLinear(full_q, config.hidden_size, bias=False, comm=comm)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if (
            self.q_norm is not None and self.k_norm is not None
        ):  # normed in place in qkv, so the native rotary call below reads them
            tokens = qkv.shape[0]
            q = qkv[:, : self.q_size].reshape(tokens * self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(
                tokens * self.num_kv_heads, self.head_dim
            )
            qkv[:, : self.q_size] = self.q_norm(q).view(tokens, self.q_size)
            qkv[:, self.q_size : self.q_size + self.kv_size] = self.k_norm(k).view(tokens, self.kv_size)
        if self.triton is not None and meta.kernel_inputs is not None:  # CUDA: the Triton path
            return self.o_proj(self._triton_attention(self.triton, qkv, rotary, kv_cache, meta.kernel_inputs))
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
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.ops, self.window, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _triton_attention(
        self,
        ops: TritonOps,
        qkv: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        inputs: PagedAttentionInputs,
    ) -> torch.Tensor:
        """q rotated and the new keys and values written (one launch), then every query attends over the cache in
        place (one, or two for a split of long contexts): ``[T, q_size]``."""
        q = ops.rope_write_cache(
            qkv, *rotary, inputs.slot_mapping, kv_cache, self.num_heads, self.num_kv_heads
        )
        out = ops.paged_attention(q, kv_cache, inputs, self.scale, self.window, self.softcap)
        return out.view(-1, self.q_size)

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"
