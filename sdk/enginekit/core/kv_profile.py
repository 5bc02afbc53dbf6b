"""The profiling steps that size a CUDA device's KV cache: the largest prefill and the largest decode run through
the loaded model, each with a cache just large enough, and their peak allocation is measured; the budget's
arithmetic is ``core/resources.py``'s."""

from __future__ import annotations

import logging

import torch

from enginekit.config import EngineConfig
from enginekit.core.resources import (
    cuda_kv_cache_budget,
    graph_reserve_bytes,
    kv_block_bytes,
    longest_request,
    useful_kv_cache_bytes,
)
from enginekit.errors import EngineStartupError
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.decoder import Decoder
from enginekit.model.runner import ModelRunner
from enginekit.sampling_params import SamplingParams

logger = logging.getLogger("enginekit.core")


def profile_cuda_kv_budget(
    config: EngineConfig,
    model: Decoder,
    model_config,
    device: torch.device,
    dtype: torch.dtype,
    free_at_start: int,
    total: int,
) -> int:
    """Run the profiling steps on the loaded model and measure: the largest prefill (``run_profile_step``), then
    the largest decode the cache it leaves room for can hold (``run_profile_decode``: ``max_num_seqs`` rows of
    the longest length, shorter when the cache holds fewer tokens). The budget is ``cuda_kv_cache_budget`` of
    their peak, with the graphs' reserve when ``cuda_graphs`` is on, capped by ``useful_kv_cache_bytes``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before_prefill = torch.cuda.memory_allocated(device)
    prefill_cache = run_profile_step(config, model, model_config, device, dtype)
    torch.cuda.synchronize(device)
    prefill_peak = torch.cuda.max_memory_allocated(device)
    prefill_activations = max(0, prefill_peak - before_prefill - prefill_cache)
    free_now, _ = torch.cuda.mem_get_info(device)
    non_torch = max(0, (free_at_start - free_now) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()

    def budget(peak: int, graphs: int = 0) -> int:
        return cuda_kv_cache_budget(
            total=total,
            free_at_start=free_at_start,
            peak_allocated=peak,
            non_torch=non_torch,
            utilization=config.gpu_memory_utilization,
            graphs=graphs,
        )

    useful = useful_kv_cache_bytes(config, model_config, dtype)
    block_bytes = kv_block_bytes(config, model_config, dtype, model.tensor_parallel_size)
    tokens = max(0, min(useful, budget(prefill_peak))) // block_bytes * config.block_size
    rows = decode_rows(config)
    context = min(longest_request(config, model_config), max(1, tokens // rows))
    before_decode = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        cache_bytes = run_profile_decode(config, model, model_config, device, dtype, context)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise EngineStartupError(
            f"the largest decode step ({rows} requests of {context} tokens, what the KV cache left "
            f"beside the weights could hold) does not fit in the device's memory: lower max_num_seqs or "
            f"max_model_len, or raise gpu_memory_utilization",
            phase="kv cache",
        ) from None
    torch.cuda.synchronize(device)
    decode_peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    decode_activations = max(0, decode_peak - before_decode - cache_bytes)
    # the graphs' pool holds the largest captured step's activations: on the Triton path steps with prefill
    # chunks are captured too (model/mixed_graph.py), up to the largest prefill
    captured = max(decode_activations, prefill_activations if model.triton is not None else 0)
    graphs = (
        graph_reserve_bytes(captured, config.max_num_seqs, model_config.vocab_size)
        if config.cuda_graphs
        else 0
    )
    peak = max(prefill_peak, decode_peak - cache_bytes)
    result = budget(peak, graphs)
    logger.info(
        "KV cache budget %d bytes: %.2f of %d bytes, %d held by others at start, peak %d (the largest prefill "
        "%d; the largest decode, %d rows of %d tokens, %d), outside torch %d, graphs %d",
        result,
        config.gpu_memory_utilization,
        total,
        total - free_at_start,
        peak,
        prefill_peak,
        rows,
        context,
        decode_peak - cache_bytes,
        non_torch,
        graphs,
    )
    return min(useful, result)


def run_profile_step(
    config: EngineConfig, model: Decoder, model_config, device: torch.device, dtype: torch.dtype
) -> int:
    """Run the largest step the scheduler may build (``max_num_batched_tokens`` over up to ``max_num_seqs``
    prompts, each sampling) through ``model`` with a cache just large enough for it, then drop that cache.
    Returns that cache's bytes (the caller measures the step's activations without them)."""
    tokens = min(config.max_num_batched_tokens, config.max_num_seqs * longest_request(config, model_config))
    num_seqs = min(config.max_num_seqs, tokens)
    lengths = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    chunks, num_blocks = [], 0
    for length in lengths:
        blocks = -(-length // config.block_size)
        table = list(range(num_blocks, num_blocks + blocks))
        num_blocks += blocks
        chunks.append(SequenceChunk([0] * length, 0, table, SamplingParams(temperature=0.0, max_tokens=1)))
    _run_once(config, model, model_config, device, dtype, chunks, num_blocks)
    return num_blocks * kv_block_bytes(config, model_config, dtype, model.tensor_parallel_size)


def run_profile_decode(
    config: EngineConfig,
    model: Decoder,
    model_config,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
) -> int:
    """Run the largest decode step: ``decode_rows`` sequences of ``context`` tokens, each sampling. What such a
    step allocates (the torch path's gathered context and masks, the logits, the sampler's sort) depends on the
    rows' lengths, not on which blocks they read, so every row's table names the same blocks: the cache holds
    one sequence. Returns that cache's bytes (the caller measures the step's peak without them)."""
    table = list(range(-(-context // config.block_size)))
    # sampled with top-p: the sampler's heaviest path (a sort of every row's logits)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1)
    chunks = [SequenceChunk([0], context - 1, table, params) for _ in range(decode_rows(config))]
    _run_once(config, model, model_config, device, dtype, chunks, len(table))
    return len(table) * kv_block_bytes(config, model_config, dtype, model.tensor_parallel_size)


def decode_rows(config: EngineConfig) -> int:
    """The most sequences one decode step holds: ``max_num_seqs``, within ``max_num_batched_tokens``."""
    return min(config.max_num_seqs, config.max_num_batched_tokens)


def _run_once(
    config: EngineConfig,
    model: Decoder,
    model_config,
    device: torch.device,
    dtype: torch.dtype,
    chunks: list[SequenceChunk],
    num_blocks: int,
) -> None:
    """One step of ``chunks`` through ``model`` with a cache of ``num_blocks`` blocks, dropped after it."""
    runner = ModelRunner(
        model,
        model_config,
        num_blocks=num_blocks,
        block_size=config.block_size,
        device=device,
        dtype=dtype,
        seed=config.seed,
    )
    try:
        output = runner.execute(ScheduledBatch(chunks, num_used_blocks=num_blocks))
        assert len(output.token_ids) == len(chunks)  # every sequence sampled
    finally:
        runner.kv_caches = []  # the profiling cache; the model stays with the caller
