"""The KV cache sized to the machine: the CPU default under a memory limit, the cgroup and meminfo readings, the
CUDA budget's arithmetic, and the size reported by READY and get_stats()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from enginekit import Engine, EngineConfig
from enginekit.core import kv_profile, resources
from enginekit.core.host_memory import host_memory_available
from enginekit.core.resources import (
    CPU_KV_CACHE_BYTES,
    cpu_kv_cache_default,
    cuda_kv_cache_budget,
    kv_block_bytes,
    size_kv_cache,
)
from enginekit.errors import EngineStartupError
from enginekit.model.builtin import BUILTIN_CONFIG
from process_support import HANG_GUARD_S

GiB = 1024**3
MiB = 1024**2


def _meminfo(root, available_kib: int) -> None:
    (root / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kib} kB\n")


def test_meminfo_alone_without_a_cgroup(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    _meminfo(proc, 8 * 1024 * 1024)
    (proc / "self" / "cgroup").write_text("0::/\n")
    (tmp_path / "cg").mkdir()  # v2 root with no memory.max: no limit
    assert host_memory_available(str(proc), str(tmp_path / "cg")) == 8 * GiB


def test_cgroup_v2_limit_bounds_the_available_memory(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    _meminfo(proc, 8 * 1024 * 1024)
    (proc / "self" / "cgroup").write_text("0::/user.slice/job\n")
    job = tmp_path / "cg" / "user.slice" / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text(f"{2 * GiB}\n")
    (job / "memory.current").write_text(f"{512 * MiB}\n")
    (tmp_path / "cg" / "user.slice" / "memory.max").write_text("max\n")
    (tmp_path / "cg" / "user.slice" / "memory.current").write_text(f"{3 * GiB}\n")
    assert host_memory_available(str(proc), str(tmp_path / "cg")) == 2 * GiB - 512 * MiB


def test_cgroup_v1_parent_limit_in_a_container(tmp_path):
    """In a container the memory mount is the container's own cgroup, while /proc/self/cgroup names the host's
    path: the tail found under the mount is ours, and a parent's tighter limit counts."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    _meminfo(proc, 8 * 1024 * 1024)
    (proc / "self" / "cgroup").write_text("4:memory:/host/container/child\n1:cpu:/\n")
    mount = tmp_path / "cg" / "memory"
    child = mount / "child"
    child.mkdir(parents=True)
    (mount / "memory.limit_in_bytes").write_text(f"{1 * GiB}\n")
    (mount / "memory.usage_in_bytes").write_text(f"{768 * MiB}\n")
    (child / "memory.limit_in_bytes").write_text(f"{9223372036854771712}\n")  # v1's "no limit"
    (child / "memory.usage_in_bytes").write_text(f"{100 * MiB}\n")
    assert host_memory_available(str(proc), str(tmp_path / "cg")) == 256 * MiB


def test_cpu_default_is_bounded_by_available_memory_and_shared_by_ranks():
    config = EngineConfig(max_num_seqs=1024)
    block = kv_block_bytes(config, BUILTIN_CONFIG, torch.float32)
    assert cpu_kv_cache_default(config, BUILTIN_CONFIG, torch.float32, 64 * GiB) == CPU_KV_CACHE_BYTES
    assert cpu_kv_cache_default(config, BUILTIN_CONFIG, torch.float32, 2 * GiB) == GiB // 2
    two_ranks = EngineConfig(max_num_seqs=1024, data_parallel_size=2)
    assert cpu_kv_cache_default(two_ranks, BUILTIN_CONFIG, torch.float32, 2 * GiB) == GiB // 4
    # Never more than max_num_seqs requests of the longest length fill.
    few = EngineConfig(max_num_seqs=2, max_model_len=256)
    assert cpu_kv_cache_default(few, BUILTIN_CONFIG, torch.float32, 64 * GiB) == 2 * (256 // 16) * block


def test_a_machine_with_too_little_memory_refuses_to_start(monkeypatch):
    monkeypatch.setattr(resources, "host_memory_available", lambda: 4096)
    with pytest.raises(EngineStartupError, match=r"KV cache's budget .* sized to this machine\) holds less"):
        Engine("builtin", mode="inproc")


def test_cuda_budget_arithmetic():
    """vLLM's rule: utilization x total, less others' memory at start, the engine's peak and its non-torch use."""
    budget = cuda_kv_cache_budget(
        total=80 * GiB, free_at_start=78 * GiB, peak_allocated=16 * GiB, non_torch=GiB, utilization=0.9
    )
    assert budget == int(80 * GiB * 0.9) - 2 * GiB - 16 * GiB - GiB
    crowded = cuda_kv_cache_budget(
        total=80 * GiB, free_at_start=10 * GiB, peak_allocated=16 * GiB, non_torch=0, utilization=0.9
    )
    assert crowded < 0
    with pytest.raises(EngineStartupError, match="holds less than the 2 KV blocks"):
        size_kv_cache(EngineConfig(), BUILTIN_CONFIG, torch.bfloat16, crowded)


def test_explicit_budget_and_block_count_win():
    config = EngineConfig(kv_cache_memory_bytes=64 * MiB)
    size = size_kv_cache(
        config,
        BUILTIN_CONFIG,
        torch.float32,
        resources.kv_cache_budget(config, BUILTIN_CONFIG, torch.device("cpu"), torch.float32),
    )
    assert size.num_bytes == 64 * MiB and size.num_tokens == size.num_blocks * 16
    fixed = EngineConfig(num_kv_blocks=10)
    assert resources.kv_cache_budget(fixed, BUILTIN_CONFIG, torch.device("cpu"), torch.float32) is None
    assert size_kv_cache(fixed, BUILTIN_CONFIG, torch.float32, None).num_blocks == 10


def test_ready_and_stats_report_the_size_in_bytes_and_tokens():
    with Engine("builtin", mode="mp", kv_cache_memory_bytes=8 * MiB) as engine:
        stats = engine.get_stats()
        assert stats["kv_cache_bytes"] == 8 * MiB == engine._client.kv_cache_bytes
        assert stats["kv_cache_tokens"] == stats["num_kv_blocks"] * 16 == engine._client.kv_cache_tokens


CGROUP_V1 = "/sys/fs/cgroup/memory"

CHILD = """
import json, sys
from enginekit import Engine
from enginekit.core.host_memory import host_memory_available
available = host_memory_available()
ranks = int(sys.argv[2])
with Engine("builtin", mode=sys.argv[1], data_parallel_size=ranks) as engine:
    stats = engine.get_stats()
    print(json.dumps({"available": available, "bytes": stats["kv_cache_bytes"], "tokens": stats["kv_cache_tokens"],
                      "ready_bytes": engine._client.kv_cache_bytes,
                      "rank_bytes": [rank["kv_cache_bytes"] for rank in stats.get("ranks", [stats])]}))
"""


def _writable_memory_cgroup() -> bool:
    try:
        probe = os.path.join(CGROUP_V1, f"enginekit-probe-{uuid.uuid4().hex[:8]}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return False
    return True


@pytest.mark.skipif(
    not _writable_memory_cgroup(), reason="needs a writable cgroup v1 memory controller (root)"
)
@pytest.mark.parametrize(("mode", "ranks"), [("inproc", 1), ("mp", 1), ("mp", 2)])
def test_kv_cache_under_a_real_cgroup_memory_limit(mode, ranks):
    """A real cgroup (v1 memory controller) with a 1 GiB limit: the engine, started inside it (the mp engine
    process and its launcher too, forked from there), sizes its cache from what the limit leaves; two
    data-parallel ranks share that out."""
    group = os.path.join(CGROUP_V1, f"enginekit-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as file:
            file.write(str(GiB))
        command = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" {mode} {ranks}'
        result = subprocess.run(
            ["sh", "-c", command, sys.executable, CHILD], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        _remove_cgroup(group)
    # Without the limit this machine's default would be the builtin model's useful maximum (1 GiB).
    assert 0 < seen["available"] < GiB
    assert seen["bytes"] <= GiB // 4
    assert seen["bytes"] == seen["ready_bytes"] == sum(seen["rank_bytes"])
    assert all(size <= GiB // 4 // ranks for size in seen["rank_bytes"])
    assert (
        seen["tokens"] * kv_block_bytes(EngineConfig(), BUILTIN_CONFIG, torch.float32) // 16 == seen["bytes"]
    )


def _remove_cgroup(group: str) -> None:
    """Remove the test's cgroup once its last process (a launcher that exits after its front end) is gone."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            os.rmdir(group)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_profiling_step_runs_the_largest_step_through_the_model(monkeypatch):
    """The step CUDA sizing measures, run on CPU: every prompt of the largest batch is prefilled and sampled."""
    from enginekit.model.loader import load_model, load_model_spec
    from enginekit.model.runner import ModelRunner

    spec = load_model_spec("builtin")
    model = load_model(spec, device=torch.device("cpu"), dtype=torch.float32, seed=0, quantization="auto")
    config = EngineConfig(max_num_batched_tokens=300, max_num_seqs=7)
    seen = []
    execute = ModelRunner.execute
    monkeypatch.setattr(
        ModelRunner, "execute", lambda runner, batch: seen.append(batch) or execute(runner, batch)
    )
    cache_bytes = kv_profile.run_profile_step(config, model, spec.config, torch.device("cpu"), torch.float32)
    [batch] = seen
    assert [chunk.num_tokens for chunk in batch.chunks] == [43] * 6 + [42]  # 300 tokens
    assert all(chunk.samples for chunk in batch.chunks)
    assert cache_bytes == 7 * 3 * kv_block_bytes(config, spec.config, torch.float32)  # 3 blocks each


def test_cuda_budget_counts_the_decode_graphs_reserve():
    plain = cuda_kv_cache_budget(
        total=80 * GiB, free_at_start=80 * GiB, peak_allocated=10 * GiB, non_torch=GiB, utilization=0.9
    )
    reserve = resources.graph_reserve_bytes(3 * GiB, max_num_seqs=256, vocab_size=128_000)
    assert (
        reserve == 3 * GiB + 256 * 128_000 * 4
    )  # the pool's largest step, then one buffer of float32 logits
    with_graphs = cuda_kv_cache_budget(
        total=80 * GiB,
        free_at_start=80 * GiB,
        peak_allocated=10 * GiB,
        non_torch=GiB,
        utilization=0.9,
        graphs=reserve,
    )
    assert plain - with_graphs == reserve


def _builtin_model():
    from enginekit.model.loader import load_model, load_model_spec

    spec = load_model_spec("builtin")
    model = load_model(spec, device=torch.device("cpu"), dtype=torch.float32, seed=0, quantization="auto")
    return model, spec.config


def test_the_decode_profiling_step_decodes_every_row_at_its_context_over_one_sequences_cache(monkeypatch):
    """The step CUDA sizing measures for decodes, run on CPU through the real model: ``max_num_seqs`` rows, each
    attending over ``context`` tokens of one shared table, sampled by the sampler's heaviest path."""
    from enginekit.model.runner import ModelRunner

    model, model_config = _builtin_model()
    config = EngineConfig(max_num_seqs=8, max_model_len=512)
    seen = []
    execute = ModelRunner.execute

    def spy(runner, batch):
        seen.append((len(runner.kv_caches[0][0]), batch))
        return execute(runner, batch)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    cache_bytes = kv_profile.run_profile_decode(
        config, model, model_config, torch.device("cpu"), torch.float32, 300
    )
    [(slots, batch)] = seen
    tables = [chunk.block_table for chunk in batch.chunks]
    assert len(batch.chunks) == 8 and all(chunk.is_decode and chunk.start == 299 for chunk in batch.chunks)
    assert tables == [list(range(19))] * 8 and slots == 19 * 16  # a cache of one 300-token sequence
    assert all(chunk.sampling_params.top_p < 1 for chunk in batch.chunks)
    assert cache_bytes == 19 * kv_block_bytes(config, model_config, torch.float32)


class _FakeCudaMemory:
    """torch.cuda's memory counters for a device of ``total`` bytes, driven by the profiling steps below."""

    def __init__(self, total: int, weights: int) -> None:
        self.total, self.allocated, self.peak, self.reserved = total, weights, weights, weights

    def use(self, transient: int) -> None:
        self.peak = max(self.peak, self.allocated + transient)
        self.reserved = max(self.reserved, self.peak)

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: setattr(self, "reserved", self.allocated))
        monkeypatch.setattr(
            cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated)
        )
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(
            cuda, "mem_get_info", lambda device=None: (self.total - self.reserved, self.total)
        )


@pytest.mark.parametrize("graphs", [False, True])
def test_the_cuda_budget_takes_the_largest_decode_the_cache_can_hold_and_the_graphs_reserve(
    monkeypatch, graphs
):
    """The profiling's arithmetic with torch.cuda's counters played by a model of the device: the decode step is
    as long as the cache left after the prefill can hold, its activations (not its one-sequence cache) count in
    the peak, and with ``cuda_graphs`` the graphs' pool and logits are taken off too."""
    model, model_config = _builtin_model()
    config = EngineConfig(
        max_num_seqs=1024, max_model_len=4096, gpu_memory_utilization=0.5, cuda_graphs=graphs
    )
    block = kv_block_bytes(config, model_config, torch.bfloat16)
    device = _FakeCudaMemory(total=8 * GiB, weights=GiB)
    device.install(monkeypatch)
    contexts = []

    def prefill(*args):
        device.use(GiB)
        return 0

    def decode(config, model, model_config, device_, dtype, context):
        contexts.append(context)
        cache = -(-context // 16) * block
        device.use(cache + 2 * GiB)  # a decode heavier than the prefill: its activations set the peak
        return cache

    monkeypatch.setattr(kv_profile, "run_profile_step", prefill)
    monkeypatch.setattr(kv_profile, "run_profile_decode", decode)
    budget = kv_profile.profile_cuda_kv_budget(
        config, model, model_config, torch.device("cuda"), torch.bfloat16, 8 * GiB, 8 * GiB
    )
    after_prefill = 4 * GiB - 2 * GiB  # half of 8, less the weights and the prefill's activations
    assert contexts == [after_prefill // block * 16 // 1024] == [2048]  # 1,024 rows of 4,096 would not fit
    reserve = resources.graph_reserve_bytes(2 * GiB, 1024, model_config.vocab_size) if graphs else 0
    expected = 4 * GiB - 3 * GiB - reserve  # the decode's peak: weights and 2 GiB of activations
    assert budget == min(resources.useful_kv_cache_bytes(config, model_config, torch.bfloat16), expected)


@pytest.mark.parametrize("triton", [False, True])
def test_on_the_triton_path_the_graphs_reserve_holds_the_largest_prefill(monkeypatch, triton):
    """With Triton kernels, steps with prefill chunks are captured too (``MixedGraphs``): the graphs' pool then
    holds the largest prefill's activations when they exceed the largest decode's. Neither profiling step's own
    cache counts in them."""
    model, model_config = _builtin_model()
    monkeypatch.setattr(model, "triton", object() if triton else None)
    config = EngineConfig(max_num_seqs=512, max_model_len=4096, gpu_memory_utilization=0.5, cuda_graphs=True)
    device = _FakeCudaMemory(total=16 * GiB, weights=GiB)
    device.install(monkeypatch)

    def prefill(*args):
        device.use(GiB // 2 + 3 * GiB)  # its cache, then 3 GiB of activations
        return GiB // 2

    def decode(config, model, model_config, device_, dtype, context):
        device.use(GiB // 4 + 2 * GiB)
        return GiB // 4

    monkeypatch.setattr(kv_profile, "run_profile_step", prefill)
    monkeypatch.setattr(kv_profile, "run_profile_decode", decode)
    budget = kv_profile.profile_cuda_kv_budget(
        config, model, model_config, torch.device("cuda"), torch.bfloat16, 16 * GiB, 16 * GiB
    )
    captured = 3 * GiB if triton else 2 * GiB
    reserve = resources.graph_reserve_bytes(captured, 512, model_config.vocab_size)
    assert (
        budget == 8 * GiB - (GiB + GiB // 2 + 3 * GiB) - reserve
    )  # the prefill (and its cache) set the peak


def test_a_budget_sized_to_the_machine_stops_at_what_can_be_filled():
    config = EngineConfig(max_num_seqs=4, max_model_len=512)
    useful = resources.useful_kv_cache_bytes(config, BUILTIN_CONFIG, torch.float32)
    assert useful == 4 * (512 // 16) * kv_block_bytes(config, BUILTIN_CONFIG, torch.float32)
    assert cpu_kv_cache_default(config, BUILTIN_CONFIG, torch.float32, 1024 * GiB) == useful


def test_a_largest_decode_that_does_not_fit_fails_the_start_saying_what_to_lower(monkeypatch):
    model, model_config = _builtin_model()
    config = EngineConfig(max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=0.5)
    _FakeCudaMemory(total=8 * GiB, weights=GiB).install(monkeypatch)

    def decode(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monkeypatch.setattr(kv_profile, "run_profile_step", lambda *args: 0)
    monkeypatch.setattr(kv_profile, "run_profile_decode", decode)
    with pytest.raises(
        EngineStartupError, match=r"largest decode step \(64 requests of 1024 tokens.*max_num_seqs"
    ):
        kv_profile.profile_cuda_kv_budget(
            config, model, model_config, torch.device("cuda"), torch.bfloat16, 8 * GiB, 8 * GiB
        )
