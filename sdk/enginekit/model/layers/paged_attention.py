"""Paged attention in plain torch: write new K/V into cache slots, read each sequence's context back.

The cache of one layer is ``[2, num_blocks * block_size, kv_heads, head_dim]``. Contexts are read a whole
block at a time (one index per block, not per token, with ``index_select`` over rows of one block); the tail of a
sequence's last block and the padding of shorter sequences are masked out. Every block is zeroed before its first
use, so masked slots never hold NaN (0 * NaN would poison the output).

With the native layer operations (``LayerOps``) the keys and values are already in the cache, and the decodes
and every prefill chunk that ends within ``NATIVE_PREFILL_TOKENS`` tokens attend in place, each query over its
own context, in one call for the whole step. Chunks that end further on keep SDPA, which reuses each key across
many queries.

The gathered contexts go into the step's ``gather_buffer`` when it has one: one buffer, reused by every layer
and every chunk, instead of two fresh multi-megabyte tensors per layer. A fresh tensor that large comes from
``mmap`` and is touched page by page, which cost more than the gather itself at 128 decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from enginekit.model.kernels.native import LayerOps
from enginekit.model.kernels.triton_path import PagedAttentionInputs

# Prefill chunks that end within this many tokens of their sequence's start attend through the native call (each
# query over its own context), the others through SDPA (which reuses each key across many queries): past about
# this many tokens SDPA per chunk was faster (docs/benchmarks.md).
NATIVE_PREFILL_TOKENS = 512
# So does any chunk of at most this many rows (a decode's proposals, speculative decoding), wherever it starts: a
# few queries gain nothing from SDPA's reuse of each key, and would pay its gather and mask.
NATIVE_QUERY_ROWS = 32


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens that is not a single-token decode."""

    token_start: int  # first row of this chunk in the flat token batch
    num_tokens: int
    context_start: int  # tokens of this request already in the cache before this chunk
    block_table: torch.Tensor | None = None  # blocks holding the context, when context_start > 0
    mask: torch.Tensor | None = None  # [num_tokens, context_start + num_tokens] causal mask with offset
    native: bool = False  # attended by the step's native call (query_lens), not by SDPA


@dataclass
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and cache slots.

    The first ``num_decode`` rows are single-token decodes (one per sequence), batched in one call; each
    prefill chunk after them is attended separately, or, with the native layer operations, in the same call as
    the decodes (``query_*``: every row of the step, a chunk's rows each over the context up to its token).
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_size: int
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks], padded with block 0
    decode_len: int = 0  # longest decode context
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, decode_len], None when all equal
    # Native attention: the block tables, [tables, blocks] (the runner's persistent tables, a row per live
    # sequence); each row's table, [num_tokens] (None: row i, table i); each row's context length, 0 for the rows
    # SDPA attends, [num_tokens].
    query_tables: torch.Tensor | None = None
    query_table_rows: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    gather_buffer: torch.Tensor | None = None  # [2, rows, block row] scratch for the gathered K and V blocks
    # The Triton path (CUDA; model/kernels/triton_path.py): the step's layout on the device. When set, the layers
    # given Triton kernels (Decoder.use_triton) run them instead of the torch code; None on CPU.
    kernel_inputs: PagedAttentionInputs | None = None


def _gather(blocks: torch.Tensor, table: torch.Tensor, buffer: torch.Tensor | None, kv: int) -> torch.Tensor:
    """The rows ``table`` of ``blocks``, into ``buffer[kv]`` when there is one (see the module docstring)."""
    if buffer is None:
        return blocks.index_select(0, table)
    return torch.index_select(blocks, 0, table, out=buffer[kv, : table.shape[0]])


def _attend(query, keys, values, mask, scale: float, gqa: bool, softcap: float) -> torch.Tensor:
    """SDPA with a boolean ``mask`` (or none), or (``softcap`` above 0) the same attention with the scaled scores
    capped at ``softcap * tanh(s / softcap)``."""
    if not softcap:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    if gqa:
        group = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.tanh((query @ keys.transpose(-1, -2)) * (scale / softcap)) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def _window_mask(context_start: int, num_tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """``[num_tokens, context_start + num_tokens]``: the chunk's token at position ``p`` attends to positions
    ``p - window + 1 .. p``."""
    query = torch.arange(context_start, context_start + num_tokens, device=device).unsqueeze(1)
    key = torch.arange(context_start + num_tokens, device=device).unsqueeze(0)
    return (key <= query) & (key > query - window)


def _decode_window_mask(meta: AttentionMetadata, window: int, device: torch.device) -> torch.Tensor:
    """The decodes' mask (``decode_mask``) narrowed to the last ``window`` tokens of each context."""
    key = torch.arange(meta.decode_len, device=device).unsqueeze(0)
    if meta.decode_mask is None:  # every context is decode_len long
        valid, lens = None, torch.full((meta.num_decode, 1), meta.decode_len, device=device)
    else:
        valid = meta.decode_mask[:, 0, 0, :]
        lens = valid.sum(-1, keepdim=True)
    mask = key >= lens - window
    return (mask if valid is None else mask & valid)[:, None, None, :]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    ops: LayerOps | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of the step's new tokens; writes their keys and values to the cache first, unless ``ops`` (the
    native layer operations) is given: then they are already there (``LayerOps.rope_write_cache``), and the
    decodes and short prefill chunks attend in place, in one call (``LayerOps.paged_attention``). With a sliding
    ``window`` (0: none) each token attends only to the last ``window`` tokens up to its own; a ``softcap``
    above 0 caps the scaled scores at ``softcap * tanh(s / softcap)`` (the torch path then runs its own
    attention: SDPA has no soft-capping)."""
    if ops is not None:  # the decodes and the short prefill chunks, in one call
        assert meta.query_tables is not None and meta.query_lens is not None  # built whenever ops is
        out = ops.paged_attention(
            q,
            kv_cache,
            meta.query_tables,
            meta.query_lens,
            meta.block_size,
            scale,
            meta.query_table_rows,
            window,
            softcap,
        )
        chunks = [chunk for chunk in meta.prefills if not chunk.native]
        if not chunks:  # most steps
            return out
    else:
        kv_cache[0].index_copy_(0, meta.slot_mapping, k)
        kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out, chunks = torch.empty_like(q) if meta.prefills else None, meta.prefills
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # One row per block (block_size * KVH * D values): a context is gathered with one index_select per K and
    # V, a plain copy of whole rows (faster than advanced indexing of [2, blocks, ...]).
    k_blocks, v_blocks = (kv_cache[kv].view(-1, meta.block_size * num_kv_heads * head_dim) for kv in (0, 1))
    gqa = q.shape[1] != num_kv_heads
    if ops is None and meta.num_decode:
        num_decode, length = meta.num_decode, meta.decode_len
        assert meta.decode_block_tables is not None  # built whenever there are decodes
        table = meta.decode_block_tables.flatten()
        keys, values = (
            _gather(blocks, table, meta.gather_buffer, kv)
            .view(num_decode, -1, num_kv_heads, head_dim)[:, :length]
            .transpose(1, 2)
            for kv, blocks in enumerate((k_blocks, v_blocks))
        )  # [B, KVH, length, D]
        mask = meta.decode_mask if not window else _decode_window_mask(meta, window, q.device)
        attended = _attend(q[:num_decode].unsqueeze(2), keys, values, mask, scale, gqa, softcap)
        if out is None:  # a pure decode step: its output is the whole result
            return attended.squeeze(2)
        out[:num_decode] = attended.squeeze(2)
    assert out is not None  # None only in a step of decodes alone, returned above
    # Prefill inputs get a batch dimension of one: torch's CPU flash kernel takes only 4-D inputs, and 3-D ones
    # fall back to the slower math path.
    for chunk in chunks:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.context_start == 0 and not window and not softcap:
            attended = F.scaled_dot_product_attention(
                query,
                k[rows].transpose(0, 1).unsqueeze(0),
                v[rows].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
        elif chunk.context_start == 0:  # a fresh chunk, windowed or capped: its own keys and values
            attended = _attend(
                query,
                k[rows].transpose(0, 1).unsqueeze(0),
                v[rows].transpose(0, 1).unsqueeze(0),
                _window_mask(0, chunk.num_tokens, window or chunk.num_tokens, q.device),
                scale,
                gqa,
                softcap,
            )
        else:
            length = chunk.context_start + chunk.num_tokens
            assert chunk.block_table is not None  # set whenever context_start > 0
            keys, values = (
                _gather(blocks, chunk.block_table, meta.gather_buffer, kv)
                .view(-1, num_kv_heads, head_dim)[:length]
                .transpose(0, 1)
                .unsqueeze(0)
                for kv, blocks in enumerate((k_blocks, v_blocks))
            )  # [1, KVH, length, D]
            mask = (
                chunk.mask
                if not window
                else _window_mask(chunk.context_start, chunk.num_tokens, window, q.device)
            )
            attended = _attend(query, keys, values, mask, scale, gqa, softcap)
        out[rows] = attended[0].transpose(0, 1)
    return out
