"""The runner's plain view of one step: each scheduled request's chunk of tokens, its blocks, and what it
samples with (or which prompt tokens it scores)."""

from __future__ import annotations

from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.request import Request
from enginekit.model.batch import ScheduledBatch, SequenceChunk


def build_batch(
    scheduled: list[tuple[Request, int]], kv_cache: KVCacheManager, pending_rows: dict[str, int] | None = None
) -> tuple[ScheduledBatch, list[Request], list[Request]]:
    """The runner's plain view of this step (decodes first, then prefill chunks and decodes with proposals), the
    request of each chunk, and the requests that sample, in the runner's order. A request's proposals
    (``Request.spec_token_ids``) follow its last token in its chunk. ``pending_rows``: the sampling rows of the step before,
    by request, whose tokens are still on their way from the device (overlapped steps). The sampling side that
    depends on the requests' latest tokens (banned stop tokens, the bitmask) is ``fill_sampling``'s."""
    ordered = [item for item in scheduled if item[1] == 1] + [item for item in scheduled if item[1] != 1]
    block_ids = kv_cache.block_ids
    chunks, sampling = [], []
    for request, num_new in ordered:
        start, params = request.num_computed_tokens, request.sampling_params
        chunk = SequenceChunk(
            request.all_token_ids[start : start + num_new],
            start,
            block_ids[request.request_id],
            rope_long=request.rope_long,
            seq_id=request.request_id,
        )
        num_known = num_new - len(
            request.spec_token_ids
        )  # the rest: proposals (the scheduler cut them to fit)
        if request.spec_token_ids:
            chunk.draft_token_ids = request.spec_token_ids
            chunk.token_ids = chunk.token_ids + request.spec_token_ids
        elif chunk.num_tokens < num_new:  # its token was sampled by the step before and is on its way
            assert pending_rows is not None and num_new == 1  # a running request's next decode
            chunk.token_ids, chunk.sampled_row = [0], pending_rows[request.request_id]
        if start < request.num_prompt_tokens:
            _prompt_chunk(chunk, request, start, num_new)
        if start + num_known == request.num_tokens:
            chunk.sampling_params, chunk.generator = params, request.generator
            if params.has_penalties or request.bad_words:
                chunk.history = (request.all_token_ids, request.num_prompt_tokens)
            chunk.bad_words = request.bad_words
            sampling.append(request)
        chunks.append(chunk)
    batch = ScheduledBatch(chunks, kv_cache.pool.num_used_blocks, freed_seq_ids=kv_cache.take_freed())
    return batch, [r for r, _ in ordered], sampling


def _prompt_chunk(chunk: SequenceChunk, request: Request, start: int, num_new: int) -> None:
    end = min(start + num_new, request.num_prompt_tokens)
    if request.prompt_embeds is not None:
        chunk.prompt_embeds = request.prompt_embeds[start:end]
    if request.sampling_params.prompt_logprobs is not None and request.prompt_logprobs is not None:
        if start == 0:
            request.prompt_logprobs = []  # a preempted request scores its prompt again, from the start
        # Row p scores prompt token p + 1; the last prompt token scores the first output token, not this.
        targets = request.all_token_ids[start + 1 : min(end + 1, request.num_prompt_tokens)]
        if targets:
            chunk.prompt_logprobs, chunk.prompt_targets = request.sampling_params.prompt_logprobs, targets
