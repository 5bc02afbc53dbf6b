"""Where an engine core runs and how large its KV cache is: the device and dtype, the block count and the
longest request that fits, and giving device memory back."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.decoder import Decoder
from enginekit.model.runner import ModelRunner
from enginekit.sampling_params import SamplingParams

logger = logging.getLogger("enginekit.core")

CPU_KV_CACHE_BYTES = 4 * 1024**3  # the CPU default's ceiling (as vLLM's CPU backend)
CPU_KV_CACHE_FRACTION = 0.25  # at most this share of the memory available to the process
NO_LIMIT = 1 << 62  # a cgroup limit at or past this is no limit (v1 writes 2**63 - 4096 for none)


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


def useful_kv_cache_bytes(config: EngineConfig, model_config, dtype: torch.dtype) -> int:
    """The most the scheduler can ever fill: ``max_num_seqs`` requests of the longest length. A budget sized to
    the machine stops there (the block pool's bookkeeping grows with its blocks; a small model on a large
    device would otherwise get millions of blocks nothing uses)."""
    blocks_per_seq = -(-_longest(config, model_config) // config.block_size)
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


def graph_reserve_bytes(decode_activations: int, max_num_seqs: int, vocab_size: int) -> int:
    """What captured decode graphs hold for as long as the engine runs: their shared memory pool, which keeps the
    largest captured step's activations (``decode_activations``, measured by the decode profiling step), and the
    one static logits buffer every graph writes into (``max_num_seqs`` rows of float32 logits)."""
    return decode_activations + max_num_seqs * vocab_size * 4


def host_memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may still take: ``MemAvailable`` of ``/proc/meminfo``, bounded by the memory cgroup's
    limit less its usage (v2 ``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes``), the smallest over the process's cgroup and every parent up to the mount."""
    available = _meminfo_available(os.path.join(proc, "meminfo"))
    for limit, usage in _cgroup_limits(os.path.join(proc, "self", "cgroup"), cgroup_root):
        available = min(available, max(0, limit - usage))
    return available


def _meminfo_available(path: str) -> int:
    with open(path) as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {path}")


def _cgroup_limits(self_cgroup: str, root: str) -> list[tuple[int, int]]:
    """``(limit, usage)`` of each memory cgroup that bounds this process (limited ones only)."""
    try:
        with open(self_cgroup) as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, mounted at the root
            mount, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            mount, limit_file, usage_file = (
                os.path.join(root, "memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        for directory in _cgroup_dirs(mount, path):
            limit = _read_int(os.path.join(directory, limit_file))
            usage = _read_int(os.path.join(directory, usage_file))
            if limit is not None and usage is not None and limit < NO_LIMIT:
                found.append((limit, usage))
    return found


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """The cgroup's directory and its parents up to the mount. In a container the mount is the container's own
    cgroup while ``/proc/self/cgroup`` names the host's path: the longest tail of the path found under the mount
    is the process's directory."""
    parts = [part for part in path.split("/") if part]
    for skip in range(len(parts) + 1):
        directory = os.path.join(mount, *parts[skip:])
        if os.path.isdir(directory):
            break
    else:
        return []
    dirs = []
    while True:
        dirs.append(directory)
        if os.path.normpath(directory) == os.path.normpath(mount):
            return dirs
        directory = os.path.dirname(directory)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    if text == "max":
        return NO_LIMIT
    return int(text) if text.isdigit() else None


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
    their peak, with the decode graphs' reserve when ``cuda_graphs`` is on, capped by ``useful_kv_cache_bytes``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(config, model, model_config, device, dtype)
    torch.cuda.synchronize(device)
    prefill_peak = torch.cuda.max_memory_allocated(device)
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
    context = min(_longest(config, model_config), max(1, tokens // config.max_num_seqs))
    before_decode = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache_bytes = run_profile_decode(config, model, model_config, device, dtype, context)
    torch.cuda.synchronize(device)
    decode_peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    decode_activations = max(0, decode_peak - before_decode - cache_bytes)
    graphs = (
        graph_reserve_bytes(decode_activations, config.max_num_seqs, model_config.vocab_size)
        if config.cuda_graphs
        else 0
    )
    peak = max(prefill_peak, decode_peak - cache_bytes)
    result = budget(peak, graphs)
    logger.info(
        "KV cache budget %d bytes: %.2f of %d bytes, %d held by others at start, peak %d (the largest prefill "
        "%d; the largest decode, %d rows of %d tokens, %d), outside torch %d, decode graphs %d",
        result,
        config.gpu_memory_utilization,
        total,
        total - free_at_start,
        peak,
        prefill_peak,
        config.max_num_seqs,
        context,
        decode_peak - cache_bytes,
        non_torch,
        graphs,
    )
    return min(useful, result)


def _longest(config: EngineConfig, model_config) -> int:
    return min(
        config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
    )


def run_profile_step(
    config: EngineConfig, model: Decoder, model_config, device: torch.device, dtype: torch.dtype
) -> int:
    """Run the largest step the scheduler may build (``max_num_batched_tokens`` over up to ``max_num_seqs``
    prompts, each sampling) through ``model`` with a cache just large enough for it, then drop that cache.
    Returns the step's token count."""
    tokens = min(config.max_num_batched_tokens, config.max_num_seqs * _longest(config, model_config))
    num_seqs = min(config.max_num_seqs, tokens)
    lengths = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    chunks, num_blocks = [], 0
    for length in lengths:
        blocks = -(-length // config.block_size)
        table = list(range(num_blocks, num_blocks + blocks))
        num_blocks += blocks
        chunks.append(SequenceChunk([0] * length, 0, table, SamplingParams(temperature=0.0, max_tokens=1)))
    _run_once(config, model, model_config, device, dtype, chunks, num_blocks)
    return tokens


def run_profile_decode(
    config: EngineConfig,
    model: Decoder,
    model_config,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
) -> int:
    """Run the largest decode step: ``max_num_seqs`` sequences of ``context`` tokens, each sampling. What such a
    step allocates (the torch path's gathered context and masks, the logits, the sampler's sort) depends on the
    rows' lengths, not on which blocks they read, so every row's table names the same blocks: the cache holds
    one sequence. Returns that cache's bytes (the caller measures the step's peak without them)."""
    table = list(range(-(-context // config.block_size)))
    # sampled with top-p: the sampler's heaviest path (a sort of every row's logits)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1)
    chunks = [SequenceChunk([0], context - 1, table, params) for _ in range(config.max_num_seqs)]
    _run_once(config, model, model_config, device, dtype, chunks, len(table))
    return len(table) * kv_block_bytes(config, model_config, dtype, model.tensor_parallel_size)


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
