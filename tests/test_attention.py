"""Paged attention against plain causal attention over each sequence's contiguous keys and values, and the
runner's gather scratch: one buffer for every layer and step, grown only when a step needs more rows."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from enginekit import Engine, SamplingParams
from enginekit.model.kernels.native import native_layer_ops
from enginekit.model.layers import attention as llama
from enginekit.model.layers.paged_attention import AttentionMetadata, PrefillChunk, paged_attention

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_attention(q, k, v, context_start, window=0, softcap=0.0):
    """Causal attention of new queries ``q`` [n, H, D] over a whole context ``k``/``v`` [length, KVH, D]; with a
    ``window``, each query over the last ``window`` tokens up to its own; with a ``softcap``, the scaled scores
    capped at ``softcap * tanh(s / softcap)``."""
    n, length = q.shape[0], k.shape[0]
    query = torch.arange(context_start, context_start + n)[:, None]
    mask = torch.arange(length)[None, :] <= query
    if window:
        mask &= torch.arange(length)[None, :] > query - window
    if softcap:
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)
        scores = (
            torch.tanh(q.transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5 / softcap) * softcap
        )
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return (weights @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)).transpose(
            0, 1
        )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


def layout(lengths, new_tokens, generator):
    """Random, scattered block tables for sequences of ``lengths`` tokens (context plus new tokens)."""
    blocks = list(range(1, 64))
    random.Random(0).shuffle(blocks)
    tables = []
    for length in lengths:
        count = -(-length // BLOCK)
        tables.append([blocks.pop() for _ in range(count)])
    cache = torch.zeros(2, 64 * BLOCK, KV_HEADS, DIM)
    contexts = [torch.randn(2, length, KV_HEADS, DIM, generator=generator) for length in lengths]
    for table, context, length, new in zip(tables, contexts, lengths, new_tokens):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length - new)]
        cache[:, slots] = context[:, : length - new]
    return cache, tables, contexts


@pytest.mark.parametrize(
    ("window", "softcap"), [(0, 0.0), (5, 0.0), (5, 2.0)], ids=["full", "window5", "capped"]
)
@pytest.mark.parametrize(
    ("with_buffer", "native"), [(False, None), (True, None), (True, "every row"), (True, "decodes")]
)
def test_paged_attention_equals_dense_attention_per_sequence(with_buffer, native, window, softcap):
    """Through torch (the KV cache written by paged_attention) and through the native layer operations (written
    beforehand, as ``LayerOps.rope_write_cache`` does): every row attending in place in one call, or the decodes
    in place and the prefill chunks through SDPA (as chunks that end past ``NATIVE_PREFILL_TOKENS`` do)."""
    ops = native_layer_ops() if native else None
    if native and ops is None:
        pytest.skip("the native layer operations are not available here")
    generator = torch.Generator().manual_seed(1)
    # Three decodes of unequal contexts, a prefill chunk after cached context, and a fresh prompt.
    lengths, new_tokens = [9, 3, 16, 11, 6], [1, 1, 1, 5, 6]
    cache, tables, contexts = layout(lengths, new_tokens, generator)
    q = torch.randn(sum(new_tokens), HEADS, DIM, generator=generator)
    k = torch.cat([c[0, length - new :] for c, length, new in zip(contexts, lengths, new_tokens)])
    v = torch.cat([c[1, length - new :] for c, length, new in zip(contexts, lengths, new_tokens)])
    slots = [
        table[p // BLOCK] * BLOCK + p % BLOCK
        for table, length, new in zip(tables, lengths, new_tokens)
        for p in range(length - new, length)
    ]
    max_blocks = max(len(t) for t in tables[:3])
    meta = AttentionMetadata(
        torch.tensor(slots),
        BLOCK,
        num_decode=3,
        decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:3]]),
        decode_len=max(lengths[:3]),
        decode_mask=(torch.arange(16)[None, :] < torch.tensor(lengths[:3])[:, None])[:, None, None, :],
    )
    meta.prefills = [
        PrefillChunk(
            3, 5, 6, torch.tensor(tables[3]), torch.arange(11)[None, :] <= torch.arange(6, 11)[:, None]
        ),
        PrefillChunk(8, 6, 0),
    ]
    if native:
        for chunk in meta.prefills:
            chunk.native = native == "every row"
        width = max(len(t) for t in tables)
        meta.query_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        meta.query_table_rows = torch.tensor([0, 1, 2] + [3] * 5 + [4] * 6)
        chunk_lens = [*range(7, 12), *range(1, 7)] if native == "every row" else [0] * 11
        meta.query_lens = torch.tensor(lengths[:3] + chunk_lens)
    if with_buffer:
        meta.gather_buffer = torch.full(
            (2, 32, BLOCK * KV_HEADS * DIM), float("nan")
        )  # stale rows are never read
    if ops is not None:
        cache[0, slots], cache[1, slots] = k, v
        if native == "every row":  # nothing is gathered: stale rows would poison the output were they read
            meta.gather_buffer = None
    out = paged_attention(q, k, v, cache, meta, DIM**-0.5, ops, window, softcap)

    row = 0
    for context, length, new in zip(contexts, lengths, new_tokens):
        expected = dense_attention(q[row : row + new], context[0], context[1], length - new, window, softcap)
        torch.testing.assert_close(out[row : row + new], expected)
        row += new


def test_the_runner_gathers_into_one_buffer_grown_only_when_a_step_needs_more(monkeypatch):
    buffers = []

    def attention(q, k, v, kv_cache, meta, scale, ops, window=0, softcap=0.0):
        assert ops is None
        if meta.num_decode:
            buffers.append(meta.gather_buffer)
        return paged_attention(q, k, v, kv_cache, meta, scale, window=window, softcap=softcap)

    monkeypatch.setattr(llama, "paged_attention", attention)
    with Engine("builtin", mode="inproc", block_size=BLOCK, num_kv_blocks=512, max_model_len=256) as engine:
        runner = engine.client.core.runner
        runner.model.use_layer_ops(None)  # the torch path: native decode attention gathers nothing
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        sizes = set()
        execute = runner.execute

        def recording(batch):
            result = execute(batch)
            sizes.add((runner._gather_buffer.data_ptr(), runner._gather_buffer.shape[1]))
            return result

        runner.execute = recording
        engine.generate([[5] * 20] * 8, params, progress=False)
        # 8 sequences growing from 6 to 15 blocks: a few sizes (each half again the last), not one per step.
        # (The first step gathers nothing: a fresh prompt attends over its own keys.)
        rows = sorted(size for _, size in sizes if size)
        assert 1 <= len(rows) <= 4, sizes
        assert rows[-1] >= 8 * 15
        assert all(b >= a * 3 // 2 for a, b in itertools.pairwise(rows))
        # Every layer of every decode step gathered into the runner's buffer.
        assert len(buffers) == 39 * 4 and all(b is not None for b in buffers)
        assert buffers[-1] is runner._gather_buffer


def test_with_native_attention_the_runner_gathers_for_prefill_context_only():
    if native_layer_ops() is None:
        pytest.skip("the native layer operations are not available here")
    with Engine("builtin", mode="inproc", block_size=BLOCK, num_kv_blocks=512, max_model_len=256) as engine:
        runner = engine.client.core.runner
        assert runner.model.layer_ops is not None
        engine.generate(
            [[5] * 20] * 8, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), progress=False
        )
        assert runner._gather_buffer.shape[1] == 0, "decode steps read the cache in place"
