"""Where an engine core runs and how large its KV cache is: the device and dtype, the block count and the
longest request that fits, and giving device memory back. The budget's inputs come from ``host_memory.py`` (what
this process may still take on the host) and ``kv_profile.py`` (the profiling steps that measure a CUDA device)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from enginekit.config import EngineConfig
from enginekit.core.host_memory import host_memory_available
from enginekit.errors import EngineStartupError

logger = logging.getLogger("enginekit.core")

CPU_KV_CACHE_BYTES = 4 * 1024**3  # the CPU default's ceiling (as vLLM's CPU backend)
CPU_KV_CACHE_FRACTION = 0.25  # at most this share of the memory available to the process


def release_device_memory(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # NOTE: before empty_cache: tensors held only by cycles are not free until collected
        torch.cuda.empty_cache()


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    name = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineStartupError("device='cuda' was asked for but CUDA is not available", phase="model load")
    default = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, config.dtype or default)


def resolve_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine core overlaps its steps: ``async_scheduling`` as given, else on CUDA (the device runs one
    step while the host schedules and prepares the next) and not on CPU (the host runs the forward pass itself:
    there is nothing to overlap). Never under tensor parallelism or with speculative decoding (the config refuses
    ``True`` there)."""
    if config.tensor_parallel_size > 1 or config.speculative_config is not None:
        return False
    if config.async_scheduling is not None:
        return config.async_scheduling
    return device.type == "cuda"


def check_startup(config: EngineConfig, model_config) -> None:
    """Refuse what an engine core would refuse as it starts — a device that is not there, a ``max_model_len``
    the model or the KV cache cannot hold — without starting anything (a restart checks before it stops the
    engine that runs). Ranks that run on other hosts check their own device; a CUDA cache sized by profiling
    is checked by the engine itself, once it has measured."""
    remote = config.data_parallel_remote_ranks
    if all(rank in remote for rank in config.data_parallel_ranks):
        return
    device, dtype = resolve_device(config)
    if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        check_max_model_len(config, model_config, capacity=None)
        return
    size_kv_cache(config, model_config, dtype, kv_cache_budget(config, model_config, device, dtype))


@dataclass(frozen=True)
class KVCacheSize:
    """What an engine's KV cache holds: blocks, the bytes of one, and the longest request that fits."""

    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_block_bytes(
    config: EngineConfig, model_config, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """Bytes of one KV block for this model and dtype (one worker's share of the heads under tensor parallel)."""
    kv_heads = max(1, model_config.num_kv_heads // tensor_parallel_size)
    per_token = 2 * model_config.num_layers * kv_heads * model_config.head_dim
    return per_token * config.block_size * torch.empty((), dtype=dtype).element_size()


def kv_cache_budget(
    config: EngineConfig, model_config, device: torch.device, dtype: torch.dtype
) -> int | None:
    """The KV cache's byte budget before any profiling: the one given, or on CPU the machine's default
    (``cpu_kv_cache_default``); ``None`` when ``num_kv_blocks`` fixes the size, or when CUDA is to be profiled."""
    if config.num_kv_blocks is not None:
        return None
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        return None
    return cpu_kv_cache_default(config, model_config, dtype, host_memory_available())


def cpu_kv_cache_default(config: EngineConfig, model_config, dtype: torch.dtype, available: int) -> int:
    """The CPU default: ``CPU_KV_CACHE_BYTES`` (4 GiB), at most ``CPU_KV_CACHE_FRACTION`` (a quarter) of the
    memory available to this process (``available``: ``host_memory_available()``) shared out between the
    data-parallel ranks on this machine, and never more than ``max_num_seqs`` requests of the longest length
    can fill at once (more would be address space nothing uses)."""
    local_ranks = config.data_parallel_size - len(config.data_parallel_remote_ranks)
    if config.data_parallel_rank is not None:
        local_ranks = (
            config.data_parallel_size
        )  # external load balancing: the other ranks share the machine too
    share = int(available * CPU_KV_CACHE_FRACTION) // max(1, local_ranks)
    return min(CPU_KV_CACHE_BYTES, share, useful_kv_cache_bytes(config, model_config, dtype))


def longest_request(config: EngineConfig, model_config) -> int:
    """The longest request the config allows: ``max_model_len``, within the model's positions (before any cache
    caps it)."""
    return min(
        config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
    )


def useful_kv_cache_bytes(config: EngineConfig, model_config, dtype: torch.dtype) -> int:
    """The most the scheduler can ever fill: ``max_num_seqs`` requests of the longest length. A budget sized to
    the machine stops there (the block pool's bookkeeping grows with its blocks; a small model on a large
    device would otherwise get millions of blocks nothing uses)."""
    blocks_per_seq = -(-longest_request(config, model_config) // config.block_size)
    return config.max_num_seqs * blocks_per_seq * kv_block_bytes(config, model_config, dtype)


def cuda_kv_cache_budget(
    *,
    total: int,
    free_at_start: int,
    peak_allocated: int,
    non_torch: int,
    utilization: float,
    graphs: int = 0,
) -> int:
    """The CUDA budget after profiling: ``utilization`` of the device's memory, less what others held when the
    engine started (``total - free_at_start``), less this engine's peak during the profiling steps (weights and
    activations of the largest prefill and the largest decode; ``torch.cuda.max_memory_allocated``), its memory
    outside torch's allocator (the CUDA context, NCCL buffers: ``non_torch``) and what decode graphs will hold
    apart from it (``graphs``: their memory pool and static logits, ``graph_reserve_bytes``). Negative when nothing
    is left."""
    return int(total * utilization) - (total - free_at_start) - peak_allocated - non_torch - graphs


def graph_reserve_bytes(activations: int, max_num_seqs: int, vocab_size: int) -> int:
    """What captured graphs hold for as long as the engine runs: their shared memory pool, which keeps the largest
    captured step's ``activations`` (measured by the profiling steps: the largest decode's, or the largest
    prefill's where steps with prefill chunks are captured too), and the one static logits buffer every graph
    writes into (``max_num_seqs`` rows of float32 logits; ``model/graph_pool.py``)."""
    return activations + max_num_seqs * vocab_size * 4


def check_max_model_len(config: EngineConfig, model_config, capacity: int | None) -> int:
    """The longest request: ``max_model_len`` if given (within the model's positions and the cache's
    ``capacity`` in tokens), else the model's limit capped by the capacity."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit if capacity is None else min(limit, capacity)
    if config.max_model_len > limit:
        raise EngineStartupError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions",
            phase="model load",
        )
    if capacity is not None and config.max_model_len > capacity:
        raise EngineStartupError(
            f"max_model_len={config.max_model_len} does not fit the KV cache ({capacity} tokens); "
            "raise num_kv_blocks, kv_cache_memory_bytes or gpu_memory_utilization",
            phase="kv cache",
        )
    return config.max_model_len


def size_kv_cache(
    config: EngineConfig, model_config, dtype: torch.dtype, budget: int | None, tensor_parallel_size: int = 1
) -> KVCacheSize:
    """Number of KV blocks from ``num_kv_blocks`` or a byte ``budget``, and the resulting max_model_len (a single
    request must always fit)."""
    block_bytes = kv_block_bytes(config, model_config, dtype, tensor_parallel_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        assert budget is not None  # kv_cache_budget or the profiling step gave one
        if budget < 2 * block_bytes:
            given = (
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
                if config.kv_cache_memory_bytes is not None
                else f"the KV cache's budget ({max(0, budget)} bytes, sized to this machine)"
            )
            raise EngineStartupError(
                f"{given} holds less than the 2 KV blocks an engine needs: a block of {config.block_size} "
                f"tokens takes {block_bytes} bytes for this model in {str(dtype).removeprefix('torch.')}; "
                f"give at least {2 * block_bytes}",
                phase="kv cache",
            )
        num_blocks = budget // block_bytes
    max_model_len = check_max_model_len(config, model_config, num_blocks * config.block_size)
    return KVCacheSize(num_blocks, config.block_size, block_bytes, max_model_len)
