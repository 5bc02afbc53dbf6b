"""Paged attention in Triton: every query of a step, decodes and prefill chunks alike, in one launch per layer,
each over its own context read where it lies in the paged KV cache.

The grid is (query blocks, KV heads[, splits]). A program takes ``BLOCK_Q`` consecutive new tokens of one
sequence and the ``GROUP`` query heads that share one KV head: ``BLOCK_M = BLOCK_Q x GROUP`` rows (padded to a
power of two) that attend together, so each key and value is loaded once for the whole group (GQA without
repeating K/V). It walks the keys its rows may see (causal: up to its last token; with a sliding window, from
``window - 1`` before its first) a tile of ``TILE`` tokens at a time, each token's slot looked up in the block
table (``block_tables[s, p // block_size] * block_size + p % block_size``), with an online softmax in float32
(exp2, the scale folded in). Nothing is gathered and no row is padded to the longest: a program's work is its
own context. Soft-capping (``softcap * tanh(s / softcap)``) applies to the scaled scores before the mask.

The query blocks of all sequences are numbered without a host sync: sequence ``s``'s blocks start at
``query_start[s] // BLOCK_Q + s``, so ``num_tokens // BLOCK_Q + num_seqs`` programs cover every sequence, and each
program finds its sequence by a binary search of ``query_start``; the spare ones exit at once. A padded step (the
CUDA graphs of mixed steps, ``mixed_graph.py``) ends with sequences of no new token, whose programs exit at once
too, and tokens of no sequence, whose output rows stay zeros (``PagedAttentionInputs.padded``).

Long contexts with few programs (a small decode batch) split each program's keys into ``SPLITS`` parts run as
separate programs (split-K); a second launch merges their partial results (max, sum and unnormalised output
of each part) into the output. ``paged_attention`` picks the split from the device's multiprocessor count.
"""

# pyright: reportArgumentType=false, reportCallIssue=false
# (triton types a kernel's tl.constexpr parameters as tl.constexpr and its launch options, num_warps, not at all:
# a launch passes plain numbers for both, as Triton's own examples do)
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from enginekit.model.kernels.triton_layer_ops import LOG2E, tanh

if TYPE_CHECKING:  # triton_path binds these kernels (TritonOps): its types only, no import cycle
    from enginekit.model.kernels.triton_path import PagedAttentionInputs

MAX_SPLITS = 16
SPLIT_MIN_KEYS = 256  # keys per split at least: a shorter part costs more to merge than it saves
SPLIT_MAX_ROWS = (
    4096  # tokens x splits at most: the partial results' scratch is [rows, heads, head_dim] float32
)


@triton.jit
def _sequence_of(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold ``q_block``: the last ``s`` with ``query_start[s] // BLOCK_Q + s <=
    q_block`` (those starts increase with ``s``)."""
    low, high = 0, num_seqs
    while low < high:
        middle = (low + high) // 2
        if tl.load(query_start_ptr + middle) // BLOCK_Q + middle <= q_block:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_seqs,
    scale,
    softcap,
    window,
    q_stride_token,
    q_stride_head,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    first_token = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - first_token
    local = q_block - (first_token // BLOCK_Q + seq)  # this program's block among its sequence's
    if local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len  # tokens before this step's

    rows = tl.arange(0, BLOCK_M)
    token = local * BLOCK_Q + rows // GROUP  # each row's token among the sequence's new ones
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < query_len)
    position = context + token
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_rows = (first_token + token).to(tl.int64) * q_stride_token + head * q_stride_head
    q = tl.load(
        q_ptr + q_rows[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )

    # the keys any row may see: [start, end); the split's share of them, whole tiles
    end = tl.minimum(context + (local + 1) * BLOCK_Q, seq_len)
    start = 0
    if WINDOW:
        start = tl.maximum(context + local * BLOCK_Q - window + 1, 0)
    num_tiles = tl.cdiv(end - start, TILE)
    per_split = tl.cdiv(num_tiles, SPLITS)
    tile_end = tl.minimum((split + 1) * per_split, num_tiles)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    offsets = tl.arange(0, TILE)
    table = block_tables_ptr + tl.cast(seq, tl.int64) * table_stride
    for tile in range(split * per_split, tile_end):
        keys = start + tile * TILE + offsets
        key_valid = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + keys % BLOCK_SIZE
        where = slots[:, None] * cache_stride_slot + kv_head * cache_stride_head + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + where, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + where, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = softcap * tanh(scores * scale / softcap) * LOG2E if SOFTCAP else scores * (scale * LOG2E)
        seen = row_valid[:, None] & (keys[None, :] <= position[:, None])
        if WINDOW:
            seen = seen & (keys[None, :] > position[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a row that has seen no key yet keeps -inf: subtract 0 instead, so that exp2 gives 0, never NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    out_rows = (first_token + token).to(tl.int64) * NUM_HEADS + head
    if SPLITS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:  # every split stores its part, an empty one too (max -inf, sum 0)
        part = out_rows * SPLITS + split
        tl.store(part_max_ptr + part, running_max, mask=row_valid)
        tl.store(part_sum_ptr + part, running_sum, mask=row_valid)
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    num_seqs,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (token, head)'s output from its splits' parts: each rescaled to the largest max. A padding token's
    (past the sequences' tokens: a padded step) has no parts, and keeps its output."""
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(query_start_ptr + num_seqs) * NUM_HEADS:
        return
    parts = row * SPLITS + tl.arange(0, SPLITS)
    dims = tl.arange(0, DIM_PAD)
    maxima = tl.load(part_max_ptr + parts)
    scales = tl.exp2(maxima - tl.max(maxima, axis=0))  # a part that saw no key: exp2(-inf) = 0
    total = tl.sum(tl.load(part_sum_ptr + parts) * scales, axis=0)
    acc = tl.sum(tl.load(part_out_ptr + parts[:, None] * DIM_PAD + dims[None, :]) * scales[:, None], axis=0)
    out = acc / total  # pyright: ignore[reportOperatorIssue]  # tl.sum is typed as maybe a tuple (with indices)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    inputs: PagedAttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the step's queries ``q`` ``[T, H, D]`` (heads and values contiguous) over their sequences'
    contexts in ``kv_cache`` ``[2, slots, KVH, D]`` (slot = block * block_size + offset; the step's keys and
    values already written), as a new ``[T, H, D]``. ``window`` (0: none): each query sees only the last
    ``window`` tokens up to its own; ``softcap`` above 0 caps each scaled score ``s`` at
    ``softcap * tanh(s / softcap)``. ``num_splits`` (a power of two; ``None``: chosen here) splits each
    program's keys (split-K)."""
    tokens, heads, head_dim = q.shape
    _check(q, kv_cache, inputs)
    num_seqs, kv_heads = inputs.seq_lens.shape[0], kv_cache.shape[2]
    group = heads // kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    # rows per program: 16 for decodes (bound by the bytes of K and V), 64 for prefill chunks (by arithmetic)
    block_m = max(16 if inputs.max_query_len <= 4 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    tile = 64 if dim_pad <= 128 else 32
    q_blocks = tokens // block_q + num_seqs
    splits = num_splits or _splits(q.device, q_blocks * kv_heads, tokens, inputs.max_seq_len)
    if splits & (splits - 1) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be a power of two from 1 to {MAX_SPLITS}, got {splits}")
    # a padded step's padding tokens attend to nothing: their rows stay as allocated, zeros
    out = (torch.zeros if inputs.padded else torch.empty)(
        (tokens, heads, head_dim), dtype=q.dtype, device=q.device
    )
    if not tokens:
        return out
    if splits > 1:
        part_out = torch.empty((tokens * heads * splits, dim_pad), dtype=torch.float32, device=q.device)
        part_max = torch.empty((tokens * heads * splits,), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # never touched with one split
    _attention_kernel[(q_blocks, kv_heads, splits)](
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        inputs.block_tables,
        inputs.query_start,
        inputs.seq_lens,
        part_out,
        part_max,
        part_sum,
        num_seqs,
        scale,
        softcap,
        window,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        inputs.block_tables.stride(0),
        NUM_HEADS=heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=inputs.block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE=tile,
        SPLITS=splits,
        SOFTCAP=softcap > 0,
        WINDOW=window > 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 exactly; halves ignore it
        num_warps=4 if block_m * dim_pad <= 64 * 64 else 8,
    )
    if splits > 1:
        _merge_kernel[(tokens * heads,)](
            out,
            part_out,
            part_max,
            part_sum,
            inputs.query_start,
            num_seqs,
            NUM_HEADS=heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS=splits,
        )
    return out


def _splits(device: torch.device, programs: int, tokens: int, max_seq_len: int) -> int:
    """Parts to split each program's keys into: enough to give every multiprocessor about two programs when the
    grid alone has fewer, each part at least ``SPLIT_MIN_KEYS`` keys of the longest context, the scratch at most
    ``SPLIT_MAX_ROWS`` rows; 1 off CUDA (nothing there to fill)."""
    if device.type != "cuda":
        return 1
    splits = 1
    target = 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    while (
        splits < MAX_SPLITS
        and programs * splits < target
        and max_seq_len >= 2 * splits * SPLIT_MIN_KEYS
        and tokens * splits * 2 <= SPLIT_MAX_ROWS
    ):
        splits *= 2
    return splits


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check(q: torch.Tensor, kv_cache: torch.Tensor, inputs: PagedAttentionInputs) -> None:
    """Shapes, dtypes and devices the kernel relies on (its indices are trusted: checking them on the device
    would cost a sync per layer)."""
    problems = []
    if q.dim() != 3 or q.stride(2) != 1:
        problems.append(f"q must be [tokens, heads, head_dim] with contiguous heads, got {tuple(q.shape)}")
    elif kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != q.shape[2]:
        problems.append(f"kv_cache must be [2, slots, kv_heads, {q.shape[2]}], got {tuple(kv_cache.shape)}")
    elif kv_cache.stride(3) != 1 or q.shape[1] % kv_cache.shape[2]:
        problems.append(
            f"{q.shape[1]} query heads over {kv_cache.shape[2]} KV heads (a whole group each), contiguous"
        )
    elif kv_cache.dtype != q.dtype:
        problems.append(f"q is {q.dtype} and kv_cache {kv_cache.dtype}: one dtype")
    num_seqs = inputs.seq_lens.shape[0]
    tables = inputs.block_tables
    if inputs.query_start.shape != (num_seqs + 1,) or tables.dim() != 2 or tables.shape[0] != num_seqs:
        problems.append(
            f"{num_seqs} sequence lengths need [{num_seqs + 1}] query starts and [{num_seqs}, blocks] tables, "
            f"got {tuple(inputs.query_start.shape)} and {tuple(tables.shape)}"
        )
    index_tensors = (tables, inputs.query_start, inputs.seq_lens)
    if any(t.dtype not in (torch.int32, torch.int64) for t in index_tensors) or tables.stride(-1) != 1:
        problems.append(
            "block_tables, query_start and seq_lens must be int32 or int64 (tables with contiguous rows)"
        )
    if any(t.device != q.device for t in (kv_cache, *index_tensors)):
        problems.append(f"every tensor on q's device ({q.device})")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems))
