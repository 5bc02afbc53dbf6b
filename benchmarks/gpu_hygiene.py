"""Restart hygiene on the device: after restarts, the device memory, the process and the gc are back at baseline.

- ``"mp"``: an engine (``cuda_graphs=True``: their memory pool must go too) restarted ``restarts`` times,
  generating each time (the same greedy tokens every time).
  After shutdown every engine process is gone, none of them nor the launcher is listed by ``nvidia-smi`` as
  holding GPU memory, the device's free memory (``torch.cuda.mem_get_info``, all
  processes) is back where it was before the first engine, and this process's threads, file descriptors and
  children are back at their baseline (``enginekit.diagnostics``).
- ``"inproc"``: the same in this process. After shutdown ``torch.cuda.memory_allocated()`` is back at its
  baseline, and so is the device's free memory once torch's cache is emptied; no engine tensor survives, and the
  gc freeze count, threads, fds and children are back at baseline.

Each mode starts with a warm-up engine (modules, kernels, the shared launcher and cuBLAS's workspace load once
per process), and its baseline is taken after that one shut down.

Two device checks carried over from the earlier GPU lifecycle check: ``kv_sizing`` (the KV cache sized to the
device at ``gpu_memory_utilization`` 0.5 and 0.9 stays within that share, and so does 0.5 while 256 requests
of 4,096 tokens decode at once with graphs on: the largest decode steps) and ``tp`` (two tensor-parallel ranks
over NCCL give one rank's tokens and leave no process behind; then a worker killed (SIGKILL) and one stopped
(SIGSTOP, ``tensor_parallel_stall_timeout=2``) during a long ``generate`` must each end the call in
``EngineDeadError`` naming rank 1: NCCL's collectives never raise on a dead peer, so the engine's watch of the
workers' processes, the group's abort and, past 5 s, the engine process's own exit end it; needs two GPUs).
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

from .gpu_model import engine_options

MIB = 2**20
GONE_TIMEOUT_S = 15.0  # a process or a buffer still there this long after shutdown has leaked
DEVICE_MEMORY_TOLERANCE_MIB = 64


def check_restarts(
    folder: str, device: str, mode: str, restarts: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Restart an engine on ``folder``'s model ``restarts`` times; then everything is back at baseline."""
    from enginekit import Engine
    from enginekit.diagnostics import snapshot, wait_until_clean

    options = engine_options(device, mode=mode, max_num_seqs=4, num_kv_blocks=64, cuda_graphs=True)
    log(f"hygiene: {mode}, warm-up engine")
    with Engine(folder, **options) as warm:
        reference = _serve(warm)
    baseline = snapshot()
    freeze_before = gc.get_freeze_count()
    allocated_before, free_before = _device_memory(device)
    pids, used_while_up, frozen_while_up, same = [], 0, 0, True
    started = time.perf_counter()
    engine = Engine(folder, **options)
    try:
        for restart in range(restarts + 1):
            if restart:
                log(f"hygiene: {mode}, restart {restart}/{restarts}")
                engine.restart()
            same = same and _serve(engine) == reference
            pids.append(engine.engine_pid)
            used_while_up = max(used_while_up, _device_used(device))
            frozen_while_up = max(frozen_while_up, gc.get_freeze_count())
    finally:
        engine.shutdown()
        del engine
    seconds = time.perf_counter() - started
    diff = wait_until_clean(baseline, timeout=GONE_TIMEOUT_S)
    running = _wait_gone([pid for pid in pids if mode != "inproc"], GONE_TIMEOUT_S)
    holding = sorted(set(pids + _launcher_pid()) & _gpu_processes()) if mode != "inproc" else []
    allocated_after, free_after = _wait_device_memory(device, free_before)
    freed_short_mib = (free_before - free_after) / MIB
    leaks = diff.leaks()
    return {
        "restarts": restarts,
        "seconds_per_start": round(seconds / (restarts + 1), 2),
        "same_tokens_every_start": same,
        "device_used_while_up_mib": round(used_while_up / MIB, 1),
        "free_before_mib": round(free_before / MIB, 1),
        "free_after_mib": round(free_after / MIB, 1),
        "allocated_before_mib": round(allocated_before / MIB, 2),
        "allocated_after_mib": round(allocated_after / MIB, 2),
        "gc_freeze_before": freeze_before,
        "gc_freeze_while_up": frozen_while_up,
        "gc_freeze_after": gc.get_freeze_count(),
        "snapshot_diff": diff.as_row(),
        "engine_processes_still_running": running,
        "engine_or_launcher_holding_gpu_memory": holding,
        "leaks": leaks,
        "passed": (
            same
            and not leaks
            and not running
            and not holding
            and gc.get_freeze_count() == freeze_before
            and allocated_after <= allocated_before
            and freed_short_mib <= DEVICE_MEMORY_TOLERANCE_MIB
        ),
    }


def check_kv_sizing(folder: str, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The KV cache sized to the device: the memory used stays within ``gpu_memory_utilization`` (plus 1 GiB: the
    profile cannot see what is allocated later, such as cuBLAS workspaces), and 0.9 gives the larger cache."""
    import torch

    from enginekit import Engine

    rows: dict[str, Any] = {}
    for utilization in (0.5, 0.9):
        log(f"kv_sizing: gpu_memory_utilization={utilization}")
        options = engine_options(device, mode="inproc", max_num_seqs=1024)
        with Engine(folder, gpu_memory_utilization=utilization, **options) as engine:
            _serve(engine)
            free, total = torch.cuda.mem_get_info()
            stats = engine.get_stats()
            rows[str(utilization)] = {
                "kv_cache_gib": round(stats["kv_cache_bytes"] / 2**30, 2),
                "kv_cache_tokens": stats["kv_cache_tokens"],
                "used_fraction": round((total - free) / total, 3),
                "within": total - free <= utilization * total + 2**30,
            }
        gc.collect()
        torch.cuda.empty_cache()
    log(
        f"kv_sizing: {LONGEST_REQUESTS} requests of {LONGEST_LEN} tokens at gpu_memory_utilization=0.5, graphs on"
    )
    rows["longest"] = _longest_requests(folder, device)
    rows["passed"] = (
        rows["0.5"]["within"]
        and rows["0.9"]["within"]
        and rows["0.9"]["kv_cache_gib"] > rows["0.5"]["kv_cache_gib"]
        and rows["longest"]["within"]
    )
    return rows


LONGEST_REQUESTS, LONGEST_LEN, LONGEST_NEW = 256, 4096, 32
LONGEST_SLACK = 512 * MIB  # what no profile sees: cuBLAS's workspaces of other streams, the context's growth


def _longest_requests(folder: str, device: str) -> dict[str, Any]:
    """256 requests of the longest length at once, decode graphs on: the largest decode steps the cache can hold.
    The device's memory in use (torch's cache kept, so its peak) must stay within half the device."""
    import torch

    from enginekit import Engine, SamplingParams

    options = engine_options(
        device, mode="inproc", max_num_seqs=LONGEST_REQUESTS, max_model_len=LONGEST_LEN, cuda_graphs=True
    )
    prompt_len = LONGEST_LEN - LONGEST_NEW
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 30_000 + 100 for j in range(prompt_len)]}
        for i in range(LONGEST_REQUESTS)
    ]
    params = SamplingParams(max_tokens=LONGEST_NEW, temperature=1.0, top_p=0.95, seed=0, ignore_eos=True)
    with Engine(folder, gpu_memory_utilization=0.5, **options) as engine:
        started = time.perf_counter()
        outputs = engine.generate(prompts, params, progress=False)
        seconds = time.perf_counter() - started
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        stats = engine.get_stats()
    return {
        "kv_cache_gib": round(stats["kv_cache_bytes"] / 2**30, 2),
        "tokens": sum(len(output.outputs[0].token_ids) for output in outputs),
        "seconds": round(seconds, 1),
        "used_fraction": round((total - free) / total, 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "within": total - free <= 0.5 * total + LONGEST_SLACK,
    }


def check_tensor_parallel(
    folder: str, device: str, restarts: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """``tensor_parallel_size=2``: one rank's greedy tokens, eagerly and with ``cuda_graphs=True`` (every rank
    captures the decode steps, their all-reduces included), and after restarts no engine process or worker left
    running. Skipped (passed) on CUDA with fewer than two GPUs."""
    from enginekit import Engine

    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < 2:
            return {"skipped": f"needs two GPUs, {torch.cuda.device_count()} visible", "passed": True}
    options = engine_options(device, mode="mp", max_num_seqs=4, num_kv_blocks=64)
    with Engine(folder, **options) as engine:
        reference = _serve(engine)
    pids: list[int] = []
    same = True
    engine = Engine(folder, tensor_parallel_size=2, **options)
    try:
        for restart in range(restarts + 1):
            if restart:
                log(f"tp: restart {restart}/{restarts}")
                engine.restart()
            same = same and _serve(engine) == reference
            pids += [engine.engine_pid, *engine.call_utility("debug_process")["tensor_parallel_workers"]]
    finally:
        engine.shutdown()
    log("tp: cuda_graphs=True")
    with Engine(folder, cuda_graphs=True, **options) as engine:
        graph_reference = _serve(engine)
    with Engine(folder, tensor_parallel_size=2, cuda_graphs=True, **options) as engine:
        same_with_graphs = _serve(engine) == graph_reference
        pids += [engine.engine_pid, *engine.call_utility("debug_process")["tensor_parallel_workers"]]
    failures = {how: _tp_worker_failure(folder, options, how) for how in ("SIGKILL", "SIGSTOP")}
    pids += [pid for failure in failures.values() for pid in failure.pop("pids")]
    running = _wait_gone(pids, GONE_TIMEOUT_S)
    return {
        "restarts": restarts,
        "same_tokens_as_one_rank": same,
        "same_tokens_with_graphs": same_with_graphs,
        "worker_failures": failures,
        "processes_still_running": running,
        "passed": same
        and same_with_graphs
        and not running
        and all(failure["passed"] for failure in failures.values()),
    }


def _tp_worker_failure(folder: str, options: dict[str, Any], how: str) -> dict[str, Any]:
    """Kill (``SIGKILL``) or stop (``SIGSTOP``) rank 1 during a long ``generate``: the call must fail naming it."""
    import os
    import signal
    import threading

    from enginekit import Engine, EngineDeadError, SamplingParams

    engine = Engine(folder, tensor_parallel_size=2, tensor_parallel_stall_timeout=2.0, **options)
    outcome: list[BaseException | None] = []
    started_generating = threading.Event()
    long = SamplingParams(max_tokens=engine.max_model_len - 16, temperature=0, ignore_eos=True)
    seconds = float("nan")
    try:
        (worker,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        pids = [engine.engine_pid, worker]

        def generate() -> None:
            try:
                for _ in engine.stream({"prompt_token_ids": [100, 2000, 3000]}, long):
                    started_generating.set()
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)
            finally:
                started_generating.set()

        caller = threading.Thread(target=generate, daemon=True)
        caller.start()
        started_generating.wait(120.0)
        started = time.monotonic()
        os.kill(worker, getattr(signal, how))
        caller.join(120.0)
        seconds = time.monotonic() - started
        if how == "SIGSTOP" and _running(worker):
            os.kill(worker, signal.SIGCONT)
    finally:
        engine.shutdown()
    error = outcome[0] if outcome else None
    named = isinstance(error, EngineDeadError) and "tensor-parallel worker rank 1" in str(error)
    return {"seconds_to_error": round(seconds, 2), "error": str(error)[:300], "passed": named, "pids": pids}


def _serve(engine: Any) -> list[list[int]]:
    from enginekit import SamplingParams

    prompts = [{"prompt_token_ids": [100 + i, 2000, 3000, 4000 + i]} for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in engine.generate(prompts, params, progress=False)]


def _device_memory(device: str) -> tuple[int, int]:
    """This process's allocated bytes and the device's free bytes (torch's cache emptied first); 0, 0 on CPU."""
    if not device.startswith("cuda"):
        return 0, 0
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


def _device_used(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def _wait_device_memory(device: str, free_before: int) -> tuple[int, int]:
    """Allocated and free bytes once the free memory is back (an exiting process returns it a moment later)."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        allocated, free = _device_memory(device)
        if free >= free_before - DEVICE_MEMORY_TOLERANCE_MIB * MIB or time.monotonic() > deadline:
            return allocated, free
        time.sleep(0.2)


def _launcher_pid() -> list[int]:
    """The shared launcher process, which forks engine processes and must never hold GPU memory itself."""
    from enginekit.runtime.launcher import Launcher

    launcher = Launcher._instance  # NOTE: the runtime's internals, as the lifecycle tests read them
    return [launcher.proc.pid] if launcher is not None else []


def _gpu_processes() -> set[int]:
    """Pids ``nvidia-smi`` lists as holding GPU memory (none without nvidia-smi; in a container it may list
    none either, and the device's free memory is the evidence then)."""
    if shutil.which("nvidia-smi") is None:
        return set()
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    return {int(line) for line in output.split() if line.strip().isdigit()}


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        running = [pid for pid in pids if _running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False
