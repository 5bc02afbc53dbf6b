"""Decode steps replayed from captured CUDA graphs, one graph per padded shape.

On a GPU a decode step of a small model is mostly kernel launches: about a dozen small kernels per layer, each
costing more to launch from Python than to run. A CUDA graph records a step's kernels once and replays them
with one call, but it replays fixed shapes on fixed addresses. So a pure-decode step is padded to a shape that
was (or now gets) captured, and its inputs are copied into static buffers:

- the batch to the next of ``batch_sizes(max_num_seqs)``: padding rows write their keys and values into a
  scratch slot past the cache's blocks (``pad_slot``), attend to one slot, and their logits are dropped;
- the context to the next power of two of blocks (capped at ``max_blocks``); the attention mask, computed
  inside the graph from the static context lengths, hides the tail and the padding.

LoRA adapters run in the graphs as a dense product masked per row (``lora/slots.py``). Steps with prefill chunks,
prompt embeddings or prompt logprobs, and batches larger than the largest size, run eagerly, or, on the Triton
path, as padded mixed steps (``mixed_graph.py``). As the engine starts, shapes are captured for up to ``cuda_graph_capture_s`` seconds (``capture_at_start``: the shortest contexts first, each at
every batch size from the largest, so that the pool is sized by the largest step first); the rest are captured on
first use. Graphs share one memory pool and one static logits buffer (``graph_pool.py``).

With Triton kernels (``Decoder.triton``) the graphs record them: the static buffers are their inputs too (one new
token per row, each row's blocks, its context length), and the padded context only picks their launch shape.

Without CUDA (``GraphPool(capture=False)``) the same padded, static-buffer path runs eagerly: that is how its shape
handling is tested on CPU, and how ``EngineConfig(cuda_graphs=True)`` behaves there.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

from enginekit.model.batch import SequenceChunk
from enginekit.model.decoder import Decoder
from enginekit.model.graph_pool import GraphPool
from enginekit.model.input_batch import StepInputs
from enginekit.model.kernels.triton_path import PagedAttentionInputs
from enginekit.model.layers.paged_attention import AttentionMetadata


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes: 1, 2, 4, 8, then every multiple of 8 up to 64, then of 32, up to the limit.

    Coarse enough that few graphs are captured, fine enough that padding wastes at most about a third.
    """
    sizes = (1, 2, 4, *range(8, 65, 8), *range(96, max_num_seqs, 32))
    return (*tuple(size for size in sizes if size < max_num_seqs), max_num_seqs)


def block_buckets(max_blocks: int) -> tuple[int, ...]:
    """Padded context lengths in blocks: powers of two below ``max_blocks``, then ``max_blocks``."""
    buckets, size = [], 1
    while size < max_blocks:
        buckets.append(size)
        size *= 2
    return (*buckets, max_blocks)


def _bucket(value: int, sizes: tuple[int, ...]) -> int:
    return sizes[bisect.bisect_left(sizes, value)]


class DecodeGraphs:
    """Pads pure-decode steps to captured shapes and replays them (or runs the padded path eagerly)."""

    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        pad_slot: int,
        pool: GraphPool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.batch_sizes = batch_sizes(max_num_seqs)
        self.block_buckets = block_buckets(max_blocks)
        self.pad_slot = pad_slot
        self.pool = pool
        device = pool.device
        largest = self.batch_sizes[-1]

        # NOTE: the graphs read these addresses: fill them in place, never rebind them. The four per-row
        # inputs are the rows of one tensor, filled from the step's prepared inputs (already on the device) in
        # one copy.
        self.inputs = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.token_ids, self.positions, self.slot_mapping, self.context_lens = self.inputs
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, device=device)
        self.query_start = torch.arange(largest + 1, device=device)  # the Triton kernels': one token per row
        self.padding = torch.tensor([[0], [0], [pad_slot], [1]], device=device)  # attending to one slot
        self.offsets = torch.arange(max_blocks * block_size, device=device)
        self.steps: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}  # (batch, blocks) -> step

    def accepts(self, chunks: list[SequenceChunk]) -> bool:
        """Whether this step is a pure decode step (every chunk samples) that fits the largest padded shape."""
        return 0 < len(chunks) <= self.batch_sizes[-1] and all(
            chunk.is_decode and chunk.samples and chunk.prompt_embeds is None and not chunk.prompt_targets
            for chunk in chunks
        )

    def __call__(self, inputs: StepInputs, tables: torch.Tensor) -> torch.Tensor:
        """Logits of the step, one row per chunk (a view of a static tensor: use it before the next step).
        ``inputs``: the step's prepared inputs (``InputBatch``), ``tables``: the block tables they index."""
        count = len(inputs.counts)
        batch = _bucket(count, self.batch_sizes)
        blocks = _bucket(-(-(int(inputs.starts.max()) + 1) // self.block_size), self.block_buckets)
        # token ids, rotary rows, cache slots and context lengths: the first four of the step's rows, in one copy
        self.inputs[:, :count].copy_(inputs.per_token[:4])
        self.inputs[:, count:batch] = (
            self.padding
        )  # padding rows: token 0 at position 0, into the scratch slot
        self.block_tables[:count, :blocks] = tables[:, :blocks].index_select(0, inputs.chunk_rows)
        self.block_tables[count:batch, :blocks] = 0
        step = self.steps.get((batch, blocks))
        if step is None:
            step = self.steps[batch, blocks] = self._prepare(batch, blocks)
        return step()[:count]

    def capture_at_start(self, budget_s: float, clock: Callable[[], float] = time.perf_counter) -> int:
        """Prepare shapes before the first step until ``budget_s`` seconds have passed: every context bucket from
        the shortest, each at every batch size from the largest. Every row is a padding row (its keys and values go
        to the scratch slot, it attends to one slot), so no block of the cache is written. Returns how many."""
        shapes = [(batch, blocks) for blocks in self.block_buckets for batch in reversed(self.batch_sizes)]
        self.inputs.copy_(self.padding.expand_as(self.inputs))
        self.block_tables.zero_()
        return self.pool.prepare_ahead(
            "decode graphs", self.steps, shapes, lambda shape: self._prepare(*shape), budget_s, clock
        )

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The padded step on the static buffers: everything a graph of this shape records."""
        length = blocks * self.block_size
        if self.model.triton is not None:
            inputs = PagedAttentionInputs(
                slot_mapping=self.slot_mapping[:batch],
                block_tables=self.block_tables[:batch, :blocks],
                query_start=self.query_start[: batch + 1],
                seq_lens=self.context_lens[:batch],
                block_size=self.block_size,
                max_query_len=1,
                max_seq_len=length,
            )
            meta = AttentionMetadata(self.slot_mapping[:batch], self.block_size, kernel_inputs=inputs)
            return self.model(
                self.token_ids[:batch], self.positions[:batch], self.kv_caches, meta, self.rows[:batch]
            )
        mask = self.offsets[:length].unsqueeze(0) < self.context_lens[:batch].unsqueeze(1)
        meta = AttentionMetadata(
            self.slot_mapping[:batch],
            self.block_size,
            num_decode=batch,
            decode_block_tables=self.block_tables[:batch, :blocks],
            decode_len=length,
            decode_mask=mask[:, None, None, :],
            query_tables=self.block_tables[:batch, :blocks],
            query_lens=self.context_lens[:batch],
        )
        return self.model(
            self.token_ids[:batch], self.positions[:batch], self.kv_caches, meta, self.rows[:batch]
        )

    def _prepare(self, batch: int, blocks: int) -> Callable[[], torch.Tensor]:
        return self.pool.prepare(lambda: self._forward(batch, blocks), batch)

    def release(self) -> None:
        """Drop the graphs (the runner drops their pool, the model and the cache)."""
        self.steps.clear()
