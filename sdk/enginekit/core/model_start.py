"""Start the model an engine core drives: its other tensor-parallel ranks, its weights, its KV cache's size and the
runner that executes a step.

``start_model`` is the model half of an engine core's start, kept apart from the core's own bookkeeping
(scheduler, KV blocks, outputs): with ``tensor_parallel_size > 1`` it checks the model splits that many ways and
starts the ``TensorParallelExecutor`` before the weights load (rank 0 loads its slice into the executor's process
group), sizes the KV cache (on CUDA by profiling a step, unless a size is given), builds the runner and hands the
workers the block count. A start that fails stops the workers it started.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from enginekit.config import EngineConfig
from enginekit.core.kv_profile import profile_cuda_kv_budget
from enginekit.core.resources import KVCacheSize, kv_cache_budget, size_kv_cache
from enginekit.core.tp_executor import TensorParallelExecutor
from enginekit.errors import EngineStartupError
from enginekit.model.config import ModelConfig
from enginekit.model.loader import ModelSpec, check_tensor_parallel, load_model, load_model_spec
from enginekit.model.lora.model import lora_spec
from enginekit.model.runner import ModelRunner
from enginekit.model.text.tokenizer import Tokenizer

logger = logging.getLogger("enginekit.core")


@dataclass(frozen=True)
class StartedModel:
    """What ``start_model`` built; ``executor`` is ``None`` with one rank (the runner then runs every step)."""

    config: ModelConfig
    tokenizer: Tokenizer
    kv_size: KVCacheSize
    runner: ModelRunner
    executor: TensorParallelExecutor | None


def start_model(
    config: EngineConfig,
    spec: ModelSpec | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    engine_index: int = 0,
) -> StartedModel:
    """Load the model on ``device`` (every rank of it), size its KV cache and build its runner."""
    if config.debug_load_delay_s:
        time.sleep(config.debug_load_delay_s)
    spec = spec or load_model_spec(config.model, config.revision)
    model_config = spec.config
    cuda_at_start = torch.cuda.mem_get_info(device) if _profiles_cuda(config, device) else None
    executor = _start_tensor_parallel(
        config, model_config, device, profiles_cuda=cuda_at_start is not None, engine_index=engine_index
    )
    try:
        model = load_model(
            spec,
            device=device,
            dtype=dtype,
            seed=config.seed,
            quantization=config.quantization,
            comm=executor.group if executor is not None else None,
            batch_invariant=config.batch_invariant,
        )
        budget = kv_cache_budget(config, model_config, device, dtype)
        if cuda_at_start is not None:
            budget = profile_cuda_kv_budget(config, model, model_config, device, dtype, *cuda_at_start)
        kv_size = size_kv_cache(config, model_config, dtype, budget)
        max_blocks_per_seq = -(-kv_size.max_model_len // config.block_size)
        runner = ModelRunner(
            model,
            model_config,
            num_blocks=kv_size.num_blocks,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            seed=config.seed,
            fail_at_step=config.fail_at_step,
            decode_graphs=config.cuda_graphs,
            # NOTE: under tensor parallelism every rank captures a step together (its all-reduces): only as the
            # steps come, which every rank sees alike; a time budget would end differently on each rank
            graph_capture_s=config.cuda_graph_capture_s if executor is None else 0.0,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_blocks_per_seq=max_blocks_per_seq,
            lora=lora_spec(config),
        )
        if executor is not None:
            executor.attach(runner, kv_size.num_blocks, max_blocks_per_seq)
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise
    if config.cuda_graphs and device.type != "cuda":
        logger.warning("cuda_graphs=True on %s: decode steps run the padded path without graphs", device)
    return StartedModel(model_config, spec.tokenizer, kv_size, runner, executor)


def _profiles_cuda(config: EngineConfig, device: torch.device) -> bool:
    """Whether the KV cache is sized by profiling: on CUDA, unless a block count or byte budget is given."""
    return device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None


def _start_tensor_parallel(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    *,
    profiles_cuda: bool,
    engine_index: int,
) -> TensorParallelExecutor | None:
    """Start ranks 1..N-1 (``None`` with one rank), once the model is known to split ``tensor_parallel_size`` ways."""
    size = config.tensor_parallel_size
    if size <= 1:
        return None
    check_tensor_parallel(model_config, size)  # before any worker starts
    if profiles_cuda:
        raise EngineStartupError(
            f"tensor_parallel_size={size} on CUDA needs the KV cache's size given "
            "(kv_cache_memory_bytes or num_kv_blocks): the profiling step does not run across ranks yet",
            phase="model load",
        )
    return TensorParallelExecutor(config, device, engine_index=engine_index)
