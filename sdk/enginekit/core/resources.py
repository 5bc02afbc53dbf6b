"""Where an engine core runs and how large its KV cache is: the device and dtype, the block count and the
longest request that fits, and giving device memory back."""

from __future__ import annotations

import gc

import torch

from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError


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


def check_startup(config: EngineConfig, model_config) -> None:
    """Refuse what an engine core would refuse as it starts — a device that is not there, a ``max_model_len``
    the model or the KV cache cannot hold — without starting anything (a restart checks before it stops the
    engine that runs). Ranks that run on other hosts check their own device."""
    remote = config.data_parallel_remote_ranks
    if all(rank in remote for rank in config.data_parallel_ranks):
        return
    _, dtype = resolve_device(config)
    size_kv_cache(config, model_config, dtype)


def size_kv_cache(config: EngineConfig, model_config, dtype: torch.dtype) -> tuple[int, int]:
    """Number of KV blocks and the resulting max_model_len (a single request must always fit)."""
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
    block_bytes = per_token * config.block_size * torch.empty((), dtype=dtype).element_size()
    if config.num_kv_blocks is None and config.kv_cache_memory_bytes < 2 * block_bytes:
        raise EngineStartupError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds less than the 2 KV blocks an engine "
            f"needs: a block of {config.block_size} tokens takes {block_bytes} bytes for this model in "
            f"{str(dtype).removeprefix('torch.')}; give at least {2 * block_bytes}",
            phase="kv cache",
        )
    num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // block_bytes
    capacity = num_blocks * config.block_size
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise EngineStartupError(
                f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions",
                phase="model load",
            )
        if config.max_model_len > capacity:
            raise EngineStartupError(
                f"max_model_len={config.max_model_len} does not fit the KV cache ({capacity} tokens); "
                "raise num_kv_blocks or kv_cache_memory_bytes",
                phase="kv cache",
            )
        return num_blocks, config.max_model_len
    return num_blocks, min(limit, capacity)
