"""Steps with prefill chunks replayed from captured CUDA graphs, on the Triton path: one graph per padded token
count.

A step that mixes prefill chunks with decodes (staggered arrivals, chunked prompts, proposals to verify) has any
number of tokens in any split between its sequences. The Triton kernels read that split from device tensors
(``PagedAttentionInputs``: query starts, sequence lengths, block tables) and walk each sequence's own context
inside the kernel, so a graph recorded for one token count replays every split of it. The step is padded:

- its tokens to the next of ``token_buckets(max_num_batched_tokens)``: a padding token is token 0 at position 0,
  with no cache slot (its keys and values are written nowhere) and no sequence: its attention output is zeros
  (``PagedAttentionInputs.padded``), and no logits row reads it;
- its sequences to ``max_num_seqs``: a padding sequence has no new token (its query start repeats the step's
  token count), so the attention kernel's programs for it return at once; the block tables are full width, each
  sequence's row filled up to its longest context;
- its logits rows to ``min(tokens, max_num_seqs)``, the padding ones reading row 0 (dropped after).

So the shapes are one per token bucket, few enough to capture all of them at start. The launch shape of
attention is fixed per bucket: the rows per program of a prefill chunk, and the split of long contexts chosen for
the longest a sequence may have. LoRA adapters run in the graphs as a dense product masked per row
(``lora/slots.py``). Steps with prompt embeddings or prompt logprobs, more tokens than the largest bucket or more
logits rows than ``max_num_seqs`` (long proposals) run eagerly, and so does every step of
a model without Triton kernels (the torch path's prefill attention follows each chunk's length on the host).
Pure decode steps keep their own graphs (``decode_graph.py``: fewer rows per attention program).

Without CUDA (``GraphPool(capture=False)``) the same padded path runs eagerly, through Triton's interpreter in
the tests.
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

MIN_TOKENS = 16  # the smallest bucket: a mixed step holds a chunk of a few tokens and some decodes


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The padded token counts: from 16, each power of two and one and a half times it (at most a third of a
    step is padding), below ``max_tokens``, then ``max_tokens``."""
    buckets, size = [], MIN_TOKENS
    while size < max_tokens:
        buckets.append(size)
        if size * 3 // 2 < max_tokens:
            buckets.append(size * 3 // 2)
        size *= 2
    return (*buckets, max_tokens)


class MixedGraphs:
    """Pads steps with prefill chunks to captured token counts and replays them (or runs the padded path
    eagerly)."""

    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks: int,
        pool: GraphPool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_buckets = token_buckets(max_num_tokens)
        self.max_blocks = max_blocks
        self.pool = pool
        device = pool.device
        largest = self.token_buckets[-1]
        # NOTE: the graphs read these addresses: fill them in place, never rebind them.
        self.inputs = torch.zeros(3, largest, dtype=torch.long, device=device)  # token id, rotary row, slot
        self.token_ids, self.positions, self.slot_mapping = self.inputs
        self.padding = torch.tensor([[0], [0], [-1]], device=device)  # token 0 at position 0, written nowhere
        self.logits_rows = torch.zeros(min(largest, max_num_seqs), dtype=torch.long, device=device)
        self.query_start = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.long, device=device)
        self.steps: dict[int, Callable[[], torch.Tensor]] = {}  # padded token count -> step

    def accepts(self, chunks: list[SequenceChunk]) -> bool:
        """Whether this step can run padded: a model on the Triton path, no prompt embeddings or prompt logprobs,
        its tokens within the largest bucket and its logits rows within ``max_num_seqs``."""
        if self.model.triton is None or not 0 < len(chunks) <= self.max_num_seqs:
            return False
        tokens = rows = 0
        for chunk in chunks:
            if chunk.prompt_embeds is not None or chunk.prompt_targets:
                return False
            tokens += chunk.num_tokens
            rows += chunk.num_sample_rows if chunk.samples else 0
        return tokens <= self.token_buckets[-1] and rows <= self.max_num_seqs

    def __call__(self, inputs: StepInputs, tables: torch.Tensor) -> torch.Tensor:
        """Logits of the step's sampling rows (a view of a static tensor: use it before the next step).
        ``inputs``: the step's prepared inputs, staged with the kernels' layout (``InputBatch``); ``tables``: the
        block tables they index."""
        assert inputs.query_start is not None and inputs.seq_lens is not None  # staged with kernel_layout
        tokens, count, rows = inputs.per_token.shape[1], len(inputs.counts), inputs.logits_indices.shape[0]
        padded = self.token_buckets[bisect.bisect_left(self.token_buckets, tokens)]
        self.inputs[:, :tokens].copy_(inputs.per_token[:3])
        self.inputs[:, tokens:padded] = self.padding
        self.logits_rows[:rows].copy_(inputs.logits_indices)
        self.logits_rows[rows:] = 0
        self.query_start[: count + 1].copy_(inputs.query_start)
        self.query_start[count + 1 :] = tokens  # padding sequences: no new token
        self.seq_lens[:count].copy_(inputs.seq_lens)  # (a padding sequence's length is never read)
        width = -(-int((inputs.starts + inputs.counts).max()) // self.block_size)
        self.block_tables[:count, :width] = tables[:, :width].index_select(0, inputs.chunk_rows)
        step = self.steps.get(padded)
        if step is None:
            step = self.steps[padded] = self._prepare(padded)
        return step()[:rows]

    def capture_at_start(self, budget_s: float, clock: Callable[[], float] = time.perf_counter) -> int:
        """Prepare token counts before the first step, the largest first, until ``budget_s`` seconds have passed.
        Every token is a padding token and every sequence a padding one: nothing is written to the cache.
        Returns how many."""
        self.inputs.copy_(self.padding.expand_as(self.inputs))
        self.query_start.zero_()
        self.seq_lens.zero_()
        self.logits_rows.zero_()
        return self.pool.prepare_ahead(
            "mixed-step graphs", self.steps, self.token_buckets[::-1], self._prepare, budget_s, clock
        )

    def _logits_rows(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    def _forward(self, tokens: int) -> torch.Tensor:
        """The padded step of ``tokens`` tokens on the static buffers: everything its graph records."""
        inputs = PagedAttentionInputs(
            slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables,
            query_start=self.query_start,
            seq_lens=self.seq_lens,
            block_size=self.block_size,
            max_query_len=tokens,  # a prefill chunk's rows per attention program
            max_seq_len=self.max_blocks * self.block_size,  # the split for the longest context there may be
            padded=True,
        )
        meta = AttentionMetadata(self.slot_mapping[:tokens], self.block_size, kernel_inputs=inputs)
        rows = self.logits_rows[: self._logits_rows(tokens)]
        return self.model(self.token_ids[:tokens], self.positions[:tokens], self.kv_caches, meta, rows)

    def _prepare(self, tokens: int) -> Callable[[], torch.Tensor]:
        return self.pool.prepare(lambda: self._forward(tokens), self._logits_rows(tokens))

    def release(self) -> None:
        """Drop the graphs (the runner drops their pool, the model and the cache)."""
        self.steps.clear()
