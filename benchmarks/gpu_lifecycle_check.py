"""GPU lifecycle check: restarting the engine on CUDA gives all device memory back.

Two checks, for a machine with an NVIDIA GPU:

1. ``"mp"``: 20 restarts on ``device="cuda"``, generating each time. Afterwards no process is left holding
   GPU memory: none of the engine processes (nor the launcher) is listed by
   ``nvidia-smi --query-compute-apps``, and none of them still runs.
2. ``"inproc"``: 20 restarts in this process on ``device="cuda"``. Afterwards
   ``torch.cuda.memory_allocated()`` is back at its baseline (taken after one warm-up engine) and no engine
   tensor survives (``enginekit.diagnostics``).
3. ``"decode"`` (timing, not a pass/fail check): the default real model in this process, float32 and
   bfloat16, greedy decode at 1, 8, 32 and 128 concurrent requests (64-token prompts, 32 tokens each):
   tokens/s and the median decode step time, from the engine's own step metrics; each eagerly and with
   ``cuda_graphs=True``, with the share of requests whose greedy tokens are the same on both paths (padding
   changes the matmul shapes, so low-precision rounding may differ in a few).
4. ``"kv_sizing"``: the default model in this process with the KV cache sized to the device, at
   ``gpu_memory_utilization`` 0.5 and 0.9 (``max_num_seqs=1024`` so that the cap of what the scheduler can fill
   does not bind): passes when the device's used memory stays within the share asked for (plus 1 GiB: the
   profile cannot see allocations made later, such as cuBLAS workspaces) and 0.9 gives the larger cache.

5. ``"tp"``: ``tensor_parallel_size=2`` (NCCL; needs two visible GPUs, else skipped and says so): the built-in
   model's greedy tokens equal one rank's, and after 5 restarts no engine process or tensor-parallel worker still
   runs or holds GPU memory. Then a worker is killed (SIGKILL), and another stopped (SIGSTOP, with
   ``tensor_parallel_stall_timeout=2``), each during a long ``generate``: the call must end in ``EngineDeadError``
   naming rank 1 (NCCL's collectives never raise on a dead peer: the engine's watch of the workers' processes,
   the group's abort and, past 5 s, the engine process's own exit end it), with the seconds it took.

The ``"mp"`` check runs first, while this process has not initialised CUDA itself, so that
``nvidia-smi`` lists engine processes only. Without CUDA the script prints why and exits 0 (skipped);
``--cpu`` runs the same loops on the CPU to try the script itself. Exit status 1 means a check failed.

Usage::

    .venv/bin/python benchmarks/gpu_lifecycle_check.py [--restarts 20] [--json result.json] [--cpu]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import time
from typing import Any

MIB = 2**20
GONE_TIMEOUT_S = 15.0  # an engine process that still holds GPU memory this long after shutdown has leaked
USED_MEMORY_TOLERANCE_MIB = 64  # the device's total used memory, before the first and after the last engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--cpu", action="store_true", help="run the loops on the CPU (tries the script)")
    args = parser.parse_args()

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("SKIPPED: CUDA is not available on this machine (run with --cpu to try the script on the CPU)")
        return 0
    device = "cpu" if args.cpu else "cuda"
    results: dict[str, Any] = {"device": device, "torch": torch.__version__, "restarts": args.restarts}
    results["mp"] = check_mp(device, args.restarts)  # first: this process has no CUDA context yet
    results["tp"] = check_tp(device, 5)  # before this process touches CUDA, too
    results["inproc"] = check_inproc(device, args.restarts)
    results["decode"] = time_decode(device, (1, 8) if args.cpu else (1, 8, 32, 128))
    results["kv_sizing"] = None if args.cpu else check_kv_sizing(device)
    results["gpu"] = None if args.cpu else torch.cuda.get_device_name(0)
    results["passed"] = (
        results["mp"]["passed"]
        and results["tp"]["passed"]
        and results["inproc"]["passed"]
        and (results["kv_sizing"] is None or results["kv_sizing"]["passed"])
    )
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as output:
            json.dump(results, output, indent=2)
    print("PASSED" if results["passed"] else "FAILED")
    return 0 if results["passed"] else 1


def check_mp(device: str, restarts: int) -> dict[str, Any]:
    """Restart a background engine; afterwards no engine process may hold GPU memory or still run."""
    from enginekit import Engine
    from enginekit.runtime.launcher import Launcher

    before = gpu_processes()
    used_before = gpu_memory_used_mib()
    engine_pids: list[int] = []
    seen_on_gpu: set[int] = set()
    started = time.perf_counter()
    engine = Engine("builtin", mode="mp", device=device)
    try:
        for _ in range(restarts):
            assert engine.generate("hello", _params())[0].finished
            engine_pids.append(engine.engine_pid)
            seen_on_gpu |= set(gpu_processes() or {}) & set(engine_pids)
            engine.restart()
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - started
    launcher = Launcher._instance.proc.pid if Launcher._instance is not None else None
    ours = set(engine_pids) | ({launcher} if launcher is not None else set())
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        after = gpu_processes()
        holding = sorted(ours & set(after or {}))
        running = sorted(pid for pid in engine_pids if _running(pid))
        if (not holding and not running) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    used_after = gpu_memory_used_mib()
    # NOTE: in a container nvidia-smi may not list processes of this PID namespace; then the device's total
    # used memory, back where it was before the first engine, is the evidence instead.
    growth = None if used_before is None or used_after is None else used_after - used_before
    return {
        "seconds_per_restart": round(seconds / restarts, 3),
        "engine_pids_seen_holding_gpu_memory_while_running": len(seen_on_gpu),
        "gpu_processes_before": before,
        "gpu_processes_after": after,
        "ours_holding_gpu_memory_after": holding,
        "engine_processes_still_running": running,
        "launcher_holds_gpu_memory": launcher in (after or {}),
        "gpu_memory_used_before_mib": used_before,
        "gpu_memory_used_after_mib": used_after,
        "passed": not holding and not running and (growth is None or growth <= USED_MEMORY_TOLERANCE_MIB),
    }


def check_tp(device: str, restarts: int) -> dict[str, Any]:
    """Two tensor-parallel ranks: the tokens of one, and nothing left running or holding GPU memory after
    restarts (the workers are the engine process's children). Skipped (passed) with fewer than two GPUs."""
    from enginekit import Engine

    if device == "cuda":
        visible = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if not visible.isdigit() or int(visible) < 2:
            return {
                "skipped": f"tensor_parallel_size=2 needs two GPUs, {visible or '?'} visible",
                "passed": True,
            }
    prompts = [f"tensor parallel {i}" for i in range(8)]
    options = {"mode": "mp", "device": device, "kv_cache_memory_bytes": 256 * MIB}
    with Engine("builtin", **options) as engine:
        reference = [o.outputs[0].token_ids for o in engine.generate(prompts, _params())]
    pids: list[int] = []
    started = time.perf_counter()
    engine = Engine("builtin", tensor_parallel_size=2, **options)
    try:
        same = True
        for _ in range(restarts):
            tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, _params())]
            same = same and tokens == reference
            pids += [engine.engine_pid, *engine.call_utility("debug_process")["tensor_parallel_workers"]]
            engine.restart()
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - started
    failures = {how: _tp_worker_failure(options, how) for how in ("SIGKILL", "SIGSTOP")}
    pids += [pid for failure in failures.values() for pid in failure.pop("pids")]
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        holding = sorted(set(pids) & set(gpu_processes() or {}))
        running = sorted(pid for pid in pids if _running(pid))
        if (not holding and not running) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "seconds_per_restart": round(seconds / restarts, 3),
        "same_greedy_tokens_as_one_rank": same,
        "worker_failures": failures,
        "ours_holding_gpu_memory_after": holding,
        "processes_still_running": running,
        "passed": same and not holding and not running and all(f["passed"] for f in failures.values()),
    }


def _tp_worker_failure(options: dict[str, Any], how: str) -> dict[str, Any]:
    """Kill (``SIGKILL``) or stop (``SIGSTOP``) rank 1 during a long ``generate``: the call must fail naming it."""
    import os
    import signal
    import threading

    from enginekit import Engine, EngineDeadError, SamplingParams

    engine = Engine("builtin", tensor_parallel_size=2, tensor_parallel_stall_timeout=2.0, **options)
    outcome: list[BaseException | None] = []
    long = SamplingParams(max_tokens=engine.max_model_len - 16, temperature=0, ignore_eos=True)
    try:
        (worker,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        pids = [engine.engine_pid, worker]

        def generate() -> None:
            try:
                engine.generate(["fail me"] * 2, long)
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        caller = threading.Thread(target=generate, daemon=True)
        caller.start()
        deadline = time.monotonic() + 120.0
        while not any(state.version for state in list(engine._router.processor.states.values())):
            if time.monotonic() > deadline:
                break  # never generating: the check fails below
            time.sleep(0.005)
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


def check_inproc(device: str, restarts: int) -> dict[str, Any]:
    """Restart an in-process engine; afterwards the CUDA allocator and the tensors are back at baseline."""
    import torch

    from enginekit import Engine
    from enginekit.diagnostics import snapshot, wait_until_clean

    with Engine("builtin", mode="inproc", device=device) as warm:
        assert warm.generate("warm up", _params())[0].finished
    baseline = snapshot()
    allocated_before = _allocated(torch, device)
    peak_running = 0
    started = time.perf_counter()
    engine = Engine("builtin", mode="inproc", device=device)
    for _ in range(restarts):
        assert engine.generate("hello", _params())[0].finished
        peak_running = max(peak_running, _allocated(torch, device))
        engine.restart()
    engine.shutdown()
    del engine
    seconds = time.perf_counter() - started
    gc.collect()
    diff = wait_until_clean(baseline, timeout=GONE_TIMEOUT_S)
    allocated_after = _allocated(torch, device)
    reserved_after = torch.cuda.memory_reserved() if device == "cuda" else 0
    return {
        "seconds_per_restart": round(seconds / restarts, 3),
        "allocated_before_mib": round(allocated_before / MIB, 2),
        "allocated_while_running_peak_mib": round(peak_running / MIB, 2),
        "allocated_after_mib": round(allocated_after / MIB, 2),
        "reserved_after_mib": round(reserved_after / MIB, 2),
        "snapshot_diff": diff.as_row(),
        "leaks": diff.leaks(),
        "passed": allocated_after <= allocated_before and not diff.leaks(),
    }


def check_kv_sizing(device: str) -> dict[str, Any]:
    """The KV cache sized to the device: the memory used stays within gpu_memory_utilization."""
    import torch

    from enginekit import Engine

    rows: dict[str, Any] = {}
    for utilization in (0.5, 0.9):
        with Engine(
            mode="inproc", device=device, gpu_memory_utilization=utilization, max_num_seqs=1024
        ) as engine:
            assert engine.generate("hello", _params())[0].finished
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
    rows["passed"] = (
        rows["0.5"]["within"]
        and rows["0.9"]["within"]
        and rows["0.9"]["kv_cache_gib"] > rows["0.5"]["kv_cache_gib"]
    )
    return rows


def time_decode(device: str, concurrency: tuple[int, ...]) -> dict[str, Any]:
    """Tokens/s and decode step time of the default model on ``device``, per dtype and concurrency."""
    import random

    import torch

    from enginekit import Engine, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    timings: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        tokens: dict[bool, list[list[int]]] = {}
        for graphs in (False, True):
            rng = random.Random(0)  # the same prompts on both paths
            tokens[graphs] = []
            with Engine(mode="inproc", device=device, dtype=dtype, cuda_graphs=graphs) as engine:
                engine.generate("warm up", params)
                for batch in concurrency:
                    prompts = [
                        {"prompt_token_ids": [rng.randrange(17, 49152) for _ in range(64)]}
                        for _ in range(batch)
                    ]
                    if device == "cuda":
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                    outputs = engine.generate(prompts, params, progress=False)
                    seconds = time.perf_counter() - started
                    tokens[graphs] += [list(output.outputs[0].token_ids) for output in outputs]
                    gaps = sorted(_decode_step_s(output) for output in outputs)
                    timings[f"{dtype} x{batch}{' graphs' if graphs else ''}"] = {
                        "tokens_per_s": round(batch * params.max_tokens / seconds, 1),
                        "decode_step_ms_p50": round(1e3 * gaps[len(gaps) // 2], 2) if gaps else None,
                    }
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        timings[f"{dtype} same greedy tokens with graphs"] = f"{same}/{len(tokens[False])}"
    return timings


def _decode_step_s(output: Any) -> float:
    """One request's mean time per output token after the first: a decode step's time at this batch size."""
    metrics, tokens = output.metrics, len(output.outputs[0].token_ids)
    return (metrics.last_token_time - metrics.first_token_time) / max(1, tokens - 1)


def gpu_processes() -> dict[int, int] | None:
    """``{pid: used MiB}`` of the processes holding GPU memory, or ``None`` without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    output = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    processes = {}
    for line in output.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit():
            processes[int(pid)] = int(used.strip()) if used.strip().isdigit() else -1
    return processes


def gpu_memory_used_mib() -> int | None:
    """Memory in use on GPU 0 as nvidia-smi reports it (all processes), or ``None`` without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    output = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout.strip()
    return int(output) if output.isdigit() else None


def _allocated(torch: Any, device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _params():
    from enginekit import SamplingParams

    return SamplingParams(max_tokens=16, temperature=0)


if __name__ == "__main__":
    sys.exit(main())
