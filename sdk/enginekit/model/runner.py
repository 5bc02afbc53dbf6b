"""ModelRunner: owns the model and the KV-cache tensors; turns a scheduled batch into one forward pass.

``execute`` is the whole story of a step: prepare the flat inputs, describe the attention layout, run the
model, sample. Decodes come first in the flat batch so that they attend in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.config import ModelConfig
from enginekit.model.decode_graph import DecodeGraphs
from enginekit.model.decoder import Decoder
from enginekit.model.layers.paged_attention import NATIVE_PREFILL_TOKENS, AttentionMetadata, PrefillChunk
from enginekit.model.lora.model import LoRAModel, LoRASpec
from enginekit.model.lora.weights import LoRAWeights
from enginekit.model.sampler import Sampler, SamplerOutput, top_logprobs


class ExecutorError(RuntimeError):
    """The model runner failed; the engine cannot go on."""


@dataclass
class ModelInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor  # the sampling rows first, then every prompt row whose logprobs are wanted
    embeds: list[tuple[int, torch.Tensor]]
    prompt_rows: dict[int, slice]  # chunk index -> its prompt rows among the logits


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        fail_at_step: int | None = None,
        decode_graphs: bool = False,
        max_num_seqs: int = 1,
        max_blocks_per_seq: int = 1,
        lora: LoRASpec | None = None,
    ) -> None:
        self.model: Decoder = model  # None only once released
        self.lora = LoRAModel(model, lora, device, dtype) if lora is not None else None
        self.block_size = block_size
        self.device = device
        # With decode graphs, one more block past the pool's: the scratch slot of padding rows (never handed out).
        slots = (num_blocks + decode_graphs) * block_size
        # under tensor parallelism each rank caches its own KV heads (the block tables are the same everywhere)
        shape = (2, slots, config.num_kv_heads // model.tensor_parallel_size, config.head_dim)
        # Uninitialised, so memory is touched only as the cache fills; blocks are zeroed on first use.
        self.kv_caches = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self._num_zeroed_blocks = 0
        self._gather_buffer = torch.empty(
            (2, 0, block_size * shape[2] * config.head_dim), device=device, dtype=dtype
        )
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs:
            for kv_cache in self.kv_caches:
                kv_cache[:, num_blocks * block_size :].zero_()
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_blocks=max_blocks_per_seq,
                pad_slot=num_blocks * block_size,
                device=device,
                capture=device.type == "cuda",
            )
        self.sampler = Sampler(seed=seed)
        self.fail_at_step = fail_at_step
        self.num_steps = 0

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run one forward pass; returns a token for each chunk that samples, in batch order.

        The batch lists its single-token decodes first: they attend in one batched call. A pure decode step
        replays a captured CUDA graph when decode graphs are on (``DecodeGraphs``).
        """
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise ExecutorError(f"injected executor failure at step {self.num_steps} (fail_at_step)")
        chunks = batch.chunks
        if self.decode_graphs is not None and batch.lora_slots is None and self.decode_graphs.accepts(chunks):
            if self.lora is not None:
                self.lora.begin_step(None)  # a graph captured now runs no adapter
            self._zero_new_blocks(batch.num_used_blocks)
            with torch.inference_mode():
                return self._sample(batch, self.decode_graphs(chunks), {})
        with torch.inference_mode():
            logits, prompt_rows = self.forward(batch)
            return self._sample(batch, logits, prompt_rows)

    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, dict[int, slice]]:
        """The forward pass of ``batch`` (in inference mode): the logits of its sampled rows, then of its scored
        prompt rows (under tensor parallelism: on rank 0, empty on the others, which call this alone)."""
        chunks = batch.chunks
        inputs = self._prepare_inputs(chunks)
        meta = self._attention_metadata(chunks, inputs.slot_mapping)
        self._zero_new_blocks(batch.num_used_blocks)
        if self.lora is not None:
            self.lora.begin_step(batch.lora_slots)
        logits = self.model(
            inputs.token_ids, inputs.positions, self.kv_caches, meta, inputs.logits_indices, inputs.embeds
        )
        return logits, inputs.prompt_rows

    def _sample(
        self, batch: ScheduledBatch, logits: torch.Tensor, prompt_rows: dict[int, slice]
    ) -> SamplerOutput:
        """Sample the chunks that end their known tokens; score the prompt rows whose logprobs were asked for."""
        chunks = batch.chunks
        sampling = [chunk for chunk in chunks if chunk.samples]
        histories = [chunk.history for chunk in sampling] if any(c.history for c in sampling) else None
        bad_words = [chunk.bad_words for chunk in sampling] if any(c.bad_words for c in sampling) else None
        output = self.sampler(
            logits[: len(sampling)],
            [c.sampling_params for c in sampling if c.sampling_params is not None],  # all of them
            [c.generator for c in sampling],
            histories,
            bad_words=bad_words,
            bitmask=batch.token_bitmask,
        )
        if prompt_rows:
            output.prompt_logprobs = {}
            for index, rows in prompt_rows.items():
                chunk = chunks[index]
                assert chunk.prompt_logprobs is not None  # prompt_rows holds the chunks that want them
                targets = torch.tensor(chunk.prompt_targets)
                output.prompt_logprobs[index] = top_logprobs(logits[rows], targets, chunk.prompt_logprobs)
        return output

    def _prepare_inputs(self, chunks: list[SequenceChunk]) -> ModelInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        embeds: list[tuple[int, torch.Tensor]] = []
        prompt_rows: list[tuple[int, int, int]] = []  # chunk index, first row, number of rows
        size = self.block_size
        rotary = self.model.rotary
        for index, chunk in enumerate(chunks):
            row, start, end = len(token_ids), chunk.start, chunk.start + chunk.num_tokens
            table = chunk.block_table
            token_ids.extend(chunk.token_ids)
            positions.extend(rotary.rows(start, end, chunk.rope_long))
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            if chunk.prompt_embeds is not None:
                embeds.append((row, chunk.prompt_embeds.to(self.device)))
            if chunk.samples:
                logits_rows.append(row + chunk.num_tokens - 1)
            if chunk.prompt_targets:
                prompt_rows.append((index, row, len(chunk.prompt_targets)))
        rows_by_chunk = {}
        for index, row, count in prompt_rows:
            rows_by_chunk[index] = slice(len(logits_rows), len(logits_rows) + count)
            logits_rows.extend(range(row, row + count))
        return ModelInputs(
            self._tensor(token_ids),
            self._tensor(positions),
            self._tensor(slots),
            self._tensor(logits_rows),
            embeds,
            rows_by_chunk,
        )

    def _attention_metadata(
        self, chunks: list[SequenceChunk], slot_mapping: torch.Tensor
    ) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping, self.block_size)
        native = self.model.layer_ops is not None
        decodes = [chunk for chunk in chunks if chunk.is_decode]
        row = meta.num_decode = len(decodes)
        for chunk in chunks[row:]:
            meta.prefills.append(self._prefill_chunk(chunk, row, native))
            row += chunk.num_tokens
        if native:  # one native call attends the decodes and the short chunks
            self._query_metadata(meta, chunks)
        elif decodes:
            self._decode_metadata(meta, decodes)
        # The contexts gathered for SDPA: prefill chunks after a context, and the decodes without native attention.
        tables = [chunk.block_table for chunk in meta.prefills if not chunk.native]
        if not native:
            tables.append(meta.decode_block_tables)
        rows = [t.numel() for t in tables if t is not None]
        if rows:
            meta.gather_buffer = self._gather_rows(max(rows))
        return meta

    def _gather_rows(self, rows: int) -> torch.Tensor:
        """The scratch that every layer gathers its contexts into, grown by half again when too small (so a
        growing batch reallocates it a few times, not every step); its size is one layer's padded block tables."""
        if self._gather_buffer.shape[1] < rows:
            size = max(rows, self._gather_buffer.shape[1] * 3 // 2)
            self._gather_buffer = self._gather_buffer.new_empty((2, size, self._gather_buffer.shape[2]))
        return self._gather_buffer

    def _decode_metadata(self, meta: AttentionMetadata, decodes: list[SequenceChunk]) -> None:
        context_lens = [chunk.start + 1 for chunk in decodes]
        max_len = max(context_lens)
        max_blocks = -(-max_len // self.block_size)
        tables = [chunk.block_table[:max_blocks] for chunk in decodes]
        meta.decode_len = max_len
        meta.decode_block_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        if min(context_lens) != max_len:
            lens = torch.tensor(context_lens).unsqueeze(1)
            mask = torch.arange(max_len).unsqueeze(0) < lens
            meta.decode_mask = mask[:, None, None, :].to(self.device)

    def _query_metadata(self, meta: AttentionMetadata, chunks: list[SequenceChunk]) -> None:
        """Every row of the step, for the native attention call: a table per chunk (decodes included), each row's
        table (when the step has prefill chunks) and context length (a prefill token's: up to its own; 0 where SDPA
        attends)."""
        size, tables, table_rows, lens = self.block_size, [], [], []
        for index, chunk in enumerate(chunks):
            start, end = chunk.start, chunk.start + chunk.num_tokens
            native = index < meta.num_decode or meta.prefills[index - meta.num_decode].native
            tables.append(chunk.block_table[: -(-end // size)] if native else [])  # SDPA reads its own
            table_rows.extend([index] * chunk.num_tokens)
            lens.extend(range(start + 1, end + 1) if native else [0] * chunk.num_tokens)
        width = max(map(len, tables))
        meta.query_tables = self._tensor([t + [0] * (width - len(t)) for t in tables])
        meta.query_table_rows = self._tensor(table_rows) if meta.prefills else None
        meta.query_lens = self._tensor(lens)

    def _prefill_chunk(self, chunk: SequenceChunk, row: int, native: bool) -> PrefillChunk:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        prefill = PrefillChunk(token_start=row, num_tokens=chunk.num_tokens, context_start=start)
        if native and end <= NATIVE_PREFILL_TOKENS:  # attends in place, in the step's native call
            prefill.native = True
        elif start:
            prefill.block_table = self._tensor(chunk.block_table[: -(-end // self.block_size)])
            query_pos = torch.arange(start, end).unsqueeze(1)
            prefill.mask = (torch.arange(end).unsqueeze(0) <= query_pos).to(self.device)
        return prefill

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _zero_new_blocks(self, num_used_blocks: int) -> None:
        """Zero blocks on their first use (the cache is allocated uninitialised, so startup is instant)."""
        if num_used_blocks > self._num_zeroed_blocks:
            start, end = self._num_zeroed_blocks * self.block_size, num_used_blocks * self.block_size
            for kv_cache in self.kv_caches:
                kv_cache[:, start:end].zero_()
            self._num_zeroed_blocks = num_used_blocks

    def load_lora(self, slot: int, weights: LoRAWeights) -> None:
        """Write a LoRA adapter's weights into ``slot`` of the adapter pool (``enable_lora``)."""
        assert self.lora is not None
        self.lora.load(slot, weights)

    def release(self) -> None:
        """Drop the model and the KV cache so their memory can be returned."""
        if self.lora is not None:
            self.lora.release()
            self.lora = None
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        self.kv_caches = []
        self._gather_buffer = self._gather_buffer.new_empty((2, 0, 0))
        self.model = None  # pyright: ignore[reportAttributeAccessIssue]  # released: never used again
