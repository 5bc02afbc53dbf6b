"""ModelRunner: owns the model and the KV-cache tensors; turns a scheduled batch into one forward pass.

``execute`` is the whole story of a step: prepare the flat inputs (``InputBatch``: persistent host buffers, copied
to the device without blocking), describe the attention layout, run the model, sample on the device, copy back the
sampled ids. Decodes come first in the flat batch so that they attend in one batched call.

A model with Triton kernels (``Decoder.triton``: on CUDA, ``kernels/triton_path.py``) gets the step's layout as
``PagedAttentionInputs`` (views of the step's staged inputs and its rows of the block tables, no host sync) instead
of the torch path's metadata: its layers then attend over the cache in place.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from enginekit.model import transfer
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.config import ModelConfig
from enginekit.model.decode_graph import DecodeGraphs
from enginekit.model.decoder import Decoder
from enginekit.model.graph_pool import GraphPool
from enginekit.model.input_batch import InputBatch, StepInputs
from enginekit.model.kernels.triton_path import PagedAttentionInputs
from enginekit.model.layers.paged_attention import (
    NATIVE_PREFILL_TOKENS,
    NATIVE_QUERY_ROWS,
    AttentionMetadata,
    PrefillChunk,
)
from enginekit.model.lora.model import LoRAModel, LoRASpec
from enginekit.model.lora.weights import LoRAWeights
from enginekit.model.mixed_graph import MixedGraphs
from enginekit.model.sampler import (
    DeviceSample,
    PendingSample,
    Sampler,
    SamplerOutput,
    sample_rows,
    top_logprobs,
)


class ExecutorError(RuntimeError):
    """The model runner failed; the engine cannot go on."""


@dataclass
class StepForward:
    """A step's forward pass, queued on the device: the logits of its sampled rows, then of its scored prompt rows
    (chunk index -> their slice)."""

    logits: torch.Tensor
    prompt_rows: dict[int, slice]


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
        graph_capture_s: float = 0.0,
        max_num_seqs: int = 1,
        max_num_batched_tokens: int = 1,
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
        self.mixed_graphs: MixedGraphs | None = None
        self.graph_pool: GraphPool | None = None
        if decode_graphs:
            for kv_cache in self.kv_caches:
                kv_cache[:, num_blocks * block_size :].zero_()
            self.graph_pool = GraphPool(device, max_num_seqs, capture=device.type == "cuda")
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_blocks=max_blocks_per_seq,
                pad_slot=num_blocks * block_size,
                pool=self.graph_pool,
            )
            # steps with prefill chunks: on the Triton path only (``MixedGraphs.accepts``)
            self.mixed_graphs = MixedGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_tokens=max_num_batched_tokens,
                max_blocks=max_blocks_per_seq,
                pool=self.graph_pool,
            )
            if self.lora is not None:  # a graph's step runs every slot's product, masked per row
                self.lora.allow_static(max(max_num_seqs, self.mixed_graphs.token_buckets[-1]))
            if device.type == "cuda" and graph_capture_s > 0:
                self._capture_at_start(graph_capture_s)
        rotary = model.rotary
        self.inputs = InputBatch(
            block_size=block_size,
            device=device,
            rope_offset=rotary.max_positions if rotary.long_from is not None else 0,
            min_table_width=max_blocks_per_seq if decode_graphs else 1,
        )
        self.sampler = Sampler(seed=seed)
        self.copy_stream = transfer.CopyStream(device)
        self.fail_at_step = fail_at_step
        self.num_steps = 0

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run one forward pass; returns a token for each chunk that samples, in batch order.

        The batch lists its single-token decodes first: they attend in one batched call. With ``cuda_graphs`` a
        pure decode step replays a captured CUDA graph (``DecodeGraphs``), and on the Triton path so does a step
        with prefill chunks (``MixedGraphs``).
        """
        return self.sample_step(batch, self.forward_step(batch)).result()

    def forward_step(self, batch: ScheduledBatch) -> StepForward:
        """Prepare the step's inputs and queue its forward pass on the device (on CPU: run it)."""
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise ExecutorError(f"injected executor failure at step {self.num_steps} (fail_at_step)")
        with torch.inference_mode():
            return StepForward(*self.forward(batch))

    def sample_step(self, batch: ScheduledBatch, forward: StepForward) -> PendingSample:
        """Sample the step on the device and start copying its ids (and the logprobs asked for) back. The batch's
        sampling side (parameters, bitmask, banned stop tokens) may have been filled in after ``forward_step``."""
        with torch.inference_mode():
            sample = self.sample_on_device(batch, forward.logits, forward.prompt_rows)
            return sample.to_host(self.copy_stream)

    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, dict[int, slice]]:
        """The forward pass of ``batch`` (in inference mode): the logits of its sampled rows, then of its scored
        prompt rows (under tensor parallelism: on rank 0, empty on the others, which call this alone)."""
        chunks = batch.chunks
        self.inputs.release(batch.freed_seq_ids)
        native = self.model.layer_ops is not None
        lora = self.lora is not None and any(chunk.lora_slot >= 0 for chunk in chunks)
        triton = self.model.triton is not None
        graphs = self.decode_graphs is not None and self.decode_graphs.accepts(chunks)
        mixed = not graphs and self.mixed_graphs is not None and self.mixed_graphs.accepts(chunks)
        native_until = self._native_until if native and not graphs and not triton else 0
        kernel_layout = triton and not graphs
        inputs = self.inputs.prepare(
            chunks, native_until, batch.previous_token_ids, kernel_layout=kernel_layout
        )
        self._zero_new_blocks(batch.num_used_blocks)
        if self.lora is not None:  # each adapter's rows, laid out as the inputs lay out the chunks' rows
            # the graphs run the adapters' dense product, masked per row
            slots = [chunk.lora_slot for chunk in chunks] if lora else None
            self.lora.begin_step(slots, inputs.counts, static=graphs or mixed)
        if self.decode_graphs is not None and graphs:
            return self.decode_graphs(inputs, self.inputs.tables), {}
        if self.mixed_graphs is not None and mixed:
            return self.mixed_graphs(inputs, self.inputs.tables), {}
        if kernel_layout:
            meta = AttentionMetadata(
                inputs.slot_mapping, self.block_size, kernel_inputs=self._kernel_inputs(inputs)
            )
        else:
            meta = self._attention_metadata(chunks, inputs, native)
        logits = self.model(
            inputs.token_ids, inputs.positions, self.kv_caches, meta, inputs.logits_indices, inputs.embeds
        )
        return logits, inputs.prompt_rows

    def _sample(
        self, batch: ScheduledBatch, logits: torch.Tensor, prompt_rows: dict[int, slice]
    ) -> SamplerOutput:
        return self.sample_step(batch, StepForward(logits, prompt_rows)).result()

    def sample_on_device(
        self, batch: ScheduledBatch, logits: torch.Tensor, prompt_rows: dict[int, slice]
    ) -> DeviceSample:
        """Sample the chunks that end their known tokens; score the prompt rows whose logprobs were asked for; all
        on the logits' device."""
        chunks = batch.chunks
        sampling = [chunk for chunk in chunks if chunk.samples]
        rows = sample_rows(sampling)
        sample = self.sampler.sample(
            logits[: len(rows.params)],
            rows.params,
            rows.generators,
            rows.histories,
            bad_words=rows.bad_words,
            bitmask=batch.token_bitmask,
            banned_stop_ids=rows.banned_stop_ids,
        )
        if prompt_rows:
            sample.prompt_logprobs = {}
            for index, rows in prompt_rows.items():
                chunk = chunks[index]
                assert (
                    chunk.prompt_logprobs is not None and chunk.prompt_targets is not None
                )  # wanted, scored
                targets = transfer.upload(chunk.prompt_targets, torch.long, logits.device)
                sample.prompt_logprobs[index] = top_logprobs(logits[rows], targets, chunk.prompt_logprobs)
        return sample

    def _kernel_inputs(self, inputs: StepInputs) -> PagedAttentionInputs:
        """The Triton kernels' layout of the step: the staged starts and lengths, and each chunk's row of the
        block tables cut to the longest context (one device gather per step, shared by every layer)."""
        assert inputs.query_start is not None and inputs.seq_lens is not None  # staged with kernel_layout
        ends = inputs.starts + inputs.counts
        longest = int(ends.max())
        tables = self.inputs.tables[:, : -(-longest // self.block_size)].index_select(0, inputs.chunk_rows)
        return PagedAttentionInputs(
            slot_mapping=inputs.slot_mapping,
            block_tables=tables,
            query_start=inputs.query_start,
            seq_lens=inputs.seq_lens,
            block_size=self.block_size,
            max_query_len=int(inputs.counts.max()),
            max_seq_len=longest,
        )

    def _attention_metadata(
        self, chunks: list[SequenceChunk], inputs: StepInputs, native: bool
    ) -> AttentionMetadata:
        meta = AttentionMetadata(inputs.slot_mapping, self.block_size)
        row = meta.num_decode = next(
            (i for i, chunk in enumerate(chunks) if not chunk.is_decode), len(chunks)
        )
        for index in range(meta.num_decode, len(chunks)):
            meta.prefills.append(self._prefill_chunk(chunks[index], row, native, int(inputs.rows[index])))
            row += chunks[index].num_tokens
        if (
            native
        ):  # one native call attends the decodes and the short chunks, each row over its own table row
            meta.query_tables = self.inputs.tables
            meta.query_table_rows = inputs.table_rows
            meta.query_lens = inputs.context_lens
        elif meta.num_decode:
            self._decode_metadata(meta, inputs)
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

    def _decode_metadata(self, meta: AttentionMetadata, inputs: StepInputs) -> None:
        count = meta.num_decode
        context_lens = inputs.starts[:count] + 1
        max_len = int(context_lens.max())
        max_blocks = -(-max_len // self.block_size)
        meta.decode_len = max_len
        # each decode's table row, cut to the longest context (entries past a sequence's blocks are 0)
        meta.decode_block_tables = self.inputs.tables[:, :max_blocks].index_select(
            0, inputs.chunk_rows[:count]
        )
        if int(context_lens.min()) != max_len:
            positions = torch.arange(max_len, device=self.device).unsqueeze(0)
            meta.decode_mask = (positions < inputs.context_lens[:count].unsqueeze(1))[:, None, None, :]

    def _prefill_chunk(self, chunk: SequenceChunk, row: int, native: bool, table_row: int) -> PrefillChunk:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        prefill = PrefillChunk(token_start=row, num_tokens=chunk.num_tokens, context_start=start)
        if native and (end <= self._native_until or chunk.num_tokens <= NATIVE_QUERY_ROWS):
            # attends in place, in the step's native call
            prefill.native = True
        elif start:
            prefill.block_table = self.inputs.tables[table_row, : -(-end // self.block_size)]
            query_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
            prefill.mask = torch.arange(end, device=self.device).unsqueeze(0) <= query_pos
        return prefill

    @property
    def _native_until(self) -> int:
        """The prefill chunks the native call attends: those that end within this many tokens of their sequence's
        start (the others attend through SDPA); every chunk under batch invariance, since SDPA's sums follow the
        chunk's shape."""
        return sys.maxsize if self.model.batch_invariant else NATIVE_PREFILL_TOKENS

    def _zero_new_blocks(self, num_used_blocks: int) -> None:
        """Zero blocks on their first use (the cache is allocated uninitialised, so startup is instant)."""
        if num_used_blocks > self._num_zeroed_blocks:
            start, end = self._num_zeroed_blocks * self.block_size, num_used_blocks * self.block_size
            for kv_cache in self.kv_caches:
                kv_cache[:, start:end].zero_()
            self._num_zeroed_blocks = num_used_blocks

    def _capture_at_start(self, budget_s: float) -> None:
        """Capture graphs for up to ``budget_s`` seconds as the engine starts: on the Triton path every mixed-step
        token count first (a handful, the largest activations: the pool is sized by them), then decode shapes."""
        assert self.decode_graphs is not None and self.mixed_graphs is not None
        started = time.perf_counter()
        if self.lora is not None:  # no row uses an adapter, and the graphs record the adapters' product
            self.lora.begin_step(None, (), static=True)
        if self.model.triton is not None:
            self.mixed_graphs.capture_at_start(budget_s)
        self.decode_graphs.capture_at_start(max(0.0, budget_s - (time.perf_counter() - started)))

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
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None
        if self.graph_pool is not None:
            self.graph_pool.release()
            self.graph_pool = None
        self.kv_caches = []
        self.inputs.clear()
        self._gather_buffer = self._gather_buffer.new_empty((2, 0, 0))
        self.model = None  # pyright: ignore[reportAttributeAccessIssue]  # released: never used again
