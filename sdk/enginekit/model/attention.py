"""Paged attention in plain torch: write new K/V into cache slots, read each sequence's context back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens that is not a single-token decode."""

    token_start: int  # first row of this chunk in the flat token batch
    num_tokens: int
    context_start: int  # tokens of this request already in the cache before this chunk
    context_slots: torch.Tensor | None = (
        None  # [context_start + num_tokens] cache slots, when context_start > 0
    )
    mask: torch.Tensor | None = None  # [num_tokens, context_start + num_tokens] causal mask with offset


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and cache slots.

    The first ``num_decode`` rows are single-token decodes (one per sequence), batched in one call; each
    prefill chunk after them is attended separately.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decode, max_context] context slots, padded
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context], None when unpadded
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(q)
    if meta.num_decode:
        num_decode = meta.num_decode
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        query = q[:num_decode].unsqueeze(2)  # [B, H, 1, D]
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:num_decode] = attended.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        query = q[rows].transpose(0, 1)  # [H, n, D]
        if chunk.context_start == 0:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            keys = k_cache[chunk.context_slots].transpose(0, 1)  # [KVH, ctx, D]
            values = v_cache[chunk.context_slots].transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa
            )
        out[rows] = attended.transpose(0, 1)
    return out
