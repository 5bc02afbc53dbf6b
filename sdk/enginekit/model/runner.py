"""ModelRunner: owns the model and the KV-cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import torch

from enginekit.core.request import Request
from enginekit.model.attention import AttentionMetadata, PrefillChunk
from enginekit.model.config import ModelConfig
from enginekit.model.llama import LlamaForCausalLM
from enginekit.model.sampler import Sampler, SamplerOutput


class ExecutorError(RuntimeError):
    """The model runner failed; the engine cannot go on."""


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        fail_at_step: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        shape = (2, num_slots, config.num_kv_heads, config.head_dim)
        # Uninitialised, so memory is touched only as the cache fills; blocks are zeroed on first use.
        self.kv_caches = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self._num_zeroed_blocks = 0
        self.sampler = Sampler(seed=seed)
        self.fail_at_step = fail_at_step
        self.num_steps = 0

    def execute(
        self,
        scheduled: list[tuple[Request, int]],
        block_tables: dict[str, list[int]],
        num_used_blocks: int,
    ) -> tuple[list[Request], SamplerOutput]:
        """Run one forward pass; return the requests that sampled a token and what they sampled.

        ``num_used_blocks``: blocks ``[0, num_used_blocks)`` may be in use (the pool hands out fresh
        blocks in id order), so any of them not yet zeroed is zeroed first.
        """
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise ExecutorError(f"injected executor failure at step {self.num_steps} (fail_at_step)")
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sampling: list[Request] = []
        embeds: list[tuple[int, torch.Tensor]] = []
        size = self.block_size
        for request, num_new in (*decodes, *prefills):
            start = request.num_computed_tokens
            row = len(token_ids)
            table = block_tables[request.request_id]
            token_ids.extend(request.all_token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            slot_mapping.extend(table[p // size] * size + p % size for p in range(start, start + num_new))
            if request.prompt_embeds is not None and start < request.num_prompt_tokens:
                end = min(start + num_new, request.num_prompt_tokens)
                embeds.append((row, request.prompt_embeds[start:end]))
            if start + num_new == request.num_tokens:
                logits_rows.append(row + num_new - 1)
                sampling.append(request)
        meta = AttentionMetadata(
            torch.tensor(slot_mapping, dtype=torch.long, device=self.device), self.block_size
        )
        if decodes:
            self._decode_metadata(meta, decodes, block_tables)
        row = len(decodes)
        for request, num_new in prefills:
            meta.prefills.append(self._prefill_chunk(request, num_new, row, block_tables))
            row += num_new
        self._zero_new_blocks(num_used_blocks)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(token_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_caches,
                meta,
                torch.tensor(logits_rows, dtype=torch.long, device=self.device),
                [(r, e.to(self.device)) for r, e in embeds],
            )
            output = self.sampler(
                logits,
                [r.sampling_params for r in sampling],
                [r.generator for r in sampling],
            )
        return sampling, output

    def _decode_metadata(
        self,
        meta: AttentionMetadata,
        decodes: list[tuple[Request, int]],
        block_tables: dict[str, list[int]],
    ) -> None:
        context_lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        max_len = max(context_lens)
        max_blocks = -(-max_len // self.block_size)
        tables = [block_tables[r.request_id][:max_blocks] for r, _ in decodes]
        meta.num_decode = len(decodes)
        meta.decode_len = max_len
        meta.decode_block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long, device=self.device
        )
        if min(context_lens) != max_len:
            lens = torch.tensor(context_lens).unsqueeze(1)
            mask = torch.arange(max_len).unsqueeze(0) < lens
            meta.decode_mask = mask[:, None, None, :].to(self.device)

    def _prefill_chunk(
        self, request: Request, num_new: int, row: int, block_tables: dict[str, list[int]]
    ) -> PrefillChunk:
        start = request.num_computed_tokens
        chunk = PrefillChunk(token_start=row, num_tokens=num_new, context_start=start)
        if start:
            end = start + num_new
            table = block_tables[request.request_id][: -(-end // self.block_size)]
            chunk.block_table = torch.tensor(table, dtype=torch.long, device=self.device)
            query_pos = torch.arange(start, end).unsqueeze(1)
            chunk.mask = (torch.arange(end).unsqueeze(0) <= query_pos).to(self.device)
        return chunk

    def _zero_new_blocks(self, num_used_blocks: int) -> None:
        """Zero blocks on their first use (the cache is allocated uninitialised, so startup is instant)."""
        if num_used_blocks > self._num_zeroed_blocks:
            start, end = self._num_zeroed_blocks * self.block_size, num_used_blocks * self.block_size
            for kv_cache in self.kv_caches:
                kv_cache[:, start:end].zero_()
            self._num_zeroed_blocks = num_used_blocks

    def release(self) -> None:
        """Drop the model and the KV cache so their memory can be returned."""
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
