"""The GPU check: parity, speed against the chip's limits, and restart hygiene, on any CUDA machine, in minutes.

It needs nothing downloaded: it builds its own model, a random Llama with Llama-3.2-1B's shapes and the default
model's 49,152-token tokenizer (``benchmarks/gpu_model.py``), then runs its phases, each timed:

1. ``build``: the model, saved with ``save_pretrained`` beside the tokenizer (``--tokenizer``, see docs/gpu.md);
2. ``limits``: the chip's copy bandwidth and bfloat16 matmul rate (``gpu_speed.py``);
3. ``parity``: the engine's greedy tokens against transformers, float32 and bfloat16, and bfloat16 with
   ``cuda_graphs=True`` (``gpu_parity.py``);
4. ``speed``: 1, 64 and 256 requests of 128-token prompts and 128 new tokens, enginekit mp and inproc, eager and
   with ``cuda_graphs=True``, beside transformers ``generate``; then staggered arrivals in process (768 requests,
   256 at a time, prompts sharing steps with decodes): a token's time in steps with a prefill chunk against pure
   decode steps (``gpu_speed.py``);
5. ``kernels``: the Triton path against the torch path: the start with an empty and a warm Triton cache, the
   device operations of a decode step, and 256 requests at context 4,096 against the KV + weight bytes limit
   (``gpu_kernels.py``);
6. ``hygiene``: mp and in-process restarts leave the device memory, gc freeze count, threads, fds and children at
   their baseline (``gpu_hygiene.py``);
7. ``kv_sizing`` (CUDA) and ``tp`` (two GPUs; on the CPU only when asked with ``--phases``).

It writes one JSON file (on CUDA, the 1B model's, into ``benchmarks/results/gpu/``, which the benchmark page shows as its GPU
section), prints the same tables, and says which of issues 45 and 46's targets are met. Exit status 1: parity or a
hygiene check failed (a target not met is a finding, not a failure). ``--tiny --device cpu`` runs every phase
on a small model of the same family on the CPU in about a minute: that is how it is tested without a GPU.

Usage::

    python -m benchmarks.gpu_check --tokenizer .gpu/tok            # on a GPU machine (docs/gpu.md)
    python -m benchmarks.gpu_check --tiny --device cpu             # try it on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .figures import target
from .gpu_model import LLAMA_1B, SPECIAL_TOKENS, TINY, build_model_folder, load_transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_RESULTS = REPO_ROOT / "benchmarks" / "results" / "gpu"
PHASES = ("limits", "parity", "speed", "kernels", "hygiene", "kv_sizing", "tp")
SCHEMA = 1
FULL = {"batch_sizes": "1,64,256", "prompt_len": 128, "new_tokens": 128, "restarts": 3, "parity_tokens": 24}
SMALL = {"batch_sizes": "1,8,32", "prompt_len": 16, "new_tokens": 8, "restarts": 2, "parity_tokens": 8}
PARITY_RUNS = {  # name: dtype, cuda_graphs, a LoRA adapter on half the rows
    "float32": ("float32", False, False),
    "bfloat16": ("bfloat16", False, False),
    "bfloat16, graphs": ("bfloat16", True, False),
    "bfloat16, graphs, LoRA": ("bfloat16", True, True),
}
SMALL_PARITY_PROMPTS = (5, 17, 40)  # besides the text prompt; the 1B model's: gpu_parity.PROMPT_LENGTHS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TQDM_DISABLE", "1")):
        os.environ.setdefault(name, value)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print(
            "SKIPPED: CUDA is not available here (run with --tiny --device cpu to try the check on the CPU)"
        )
        return 0
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available on this machine")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="enginekit-gpu-check-"))
    try:
        result = run_check(args, device, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    path = Path(args.json) if args.json else default_json_path(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    from .gpu_report import render_gpu_check

    print(render_gpu_check(result, path.name))
    print(f"wrote {path}")
    if device.startswith("cuda") and not args.json:
        print("render the benchmark page with it: .venv/bin/python benchmarks/report.py")
    print("PASSED" if result["passed"] else "FAILED")
    return 0 if result["passed"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument(
        "--tiny", action="store_true", help="a small model and workload (tries the check on CPU)"
    )
    parser.add_argument("--tokenizer", type=Path, help="a folder with the default model's tokenizer.json")
    parser.add_argument(
        "--phases", help=f"comma-separated, from {', '.join(PHASES)} (default: all but tp on CPU)"
    )
    parser.add_argument(
        "--batch-sizes", help=f"requests at once (default {FULL['batch_sizes']}; tiny {SMALL['batch_sizes']})"
    )
    parser.add_argument("--prompt-len", type=int, help="prompt tokens of each request (default 128; tiny 16)")
    parser.add_argument("--new-tokens", type=int, help="new tokens of each request (default 128; tiny 8)")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds per batch size (default 1)")
    parser.add_argument(
        "--restarts", type=int, help="restarts per mode in the hygiene phase (default 3; tiny 2)"
    )
    parser.add_argument(
        "--parity-tokens", type=int, help="greedy tokens per parity prompt (default 24; tiny 8)"
    )
    parser.add_argument(
        "--hf-budget-s",
        type=float,
        default=10.0,
        help="seconds a transformers call may take (cuts its new tokens)",
    )
    parser.add_argument(
        "--workdir", help="where the model is built (kept; default: a temporary folder, removed)"
    )
    parser.add_argument(
        "--json", help="the result file (default: benchmarks/results/gpu/ on CUDA, else a temp file)"
    )
    args = parser.parse_args(argv)
    defaults = SMALL if args.tiny else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batch_sizes = tuple(int(size) for size in str(args.batch_sizes).split(","))
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--batch-sizes, --prompt-len, --new-tokens and --repeats must be at least 1")
    chosen = [name.strip() for name in (args.phases or "").split(",") if name.strip()]
    unknown = [name for name in chosen if name not in PHASES]
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    args.phases = tuple(chosen) if chosen else None
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there (see docs/gpu.md)")
    return args


def run_check(args: argparse.Namespace, device: str, workdir: Path) -> dict[str, Any]:
    """Every phase in order, each timed and kept apart: a phase that raises is recorded as failed."""
    import torch

    cuda = device.startswith("cuda")
    if cuda and torch.device(device).index is not None:  # what mem_get_info, synchronize, ... take then
        torch.cuda.set_device(torch.device(device))
    elif (
        not cuda
    ):  # one thread, as the engines (gpu_model.engine_options): a busy machine stalls thread pools
        torch.set_num_threads(1)
    phases = args.phases or tuple(p for p in PHASES if cuda or p != "tp")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "gpu_check",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.gpu_check " + " ".join(sys.argv[1:]),
        **revision(),
        "device": device,
        "tiny": args.tiny,
        "machine": machine(device),
        "phase_s": {},
    }
    log = _logger(started)
    folder = workdir / "model"
    log(f"build: {(TINY if args.tiny else LLAMA_1B).label}")
    t0 = time.perf_counter()
    result["model"] = build_model_folder(folder, TINY if args.tiny else LLAMA_1B, args.tokenizer, device)
    result["phase_s"]["build"] = round(time.perf_counter() - t0, 1)
    log(f"build: done in {result['phase_s']['build']:.1f} s")
    token_range = (SPECIAL_TOKENS, result["model"]["shape"]["vocab_size"])
    state: dict[str, Any] = {"hf_model": None}  # transformers' bf16 model, loaded once for parity and speed
    steps: dict[str, Callable[[], Any]] = {
        "limits": lambda: _limits(device),
        "parity": lambda: _parity(state, str(folder), device, token_range, args),
        "speed": lambda: _speed(args, state, str(folder), device, token_range, result, log),
        "kernels": lambda: _kernels(args, state, str(folder), device, token_range, result, log),
        "hygiene": lambda: _hygiene(state, str(folder), device, args.restarts, log),
        "kv_sizing": lambda: _kv_sizing(state, str(folder), device, log),
        "tp": lambda: _tp(state, str(folder), device, log),
    }
    for name in PHASES:
        if name not in phases:
            continue
        log(f"{name}: start")
        t0 = time.perf_counter()
        try:
            result[name] = steps[name]()
        except Exception:
            result[name] = {"error": traceback.format_exc(limit=8), "passed": False}
            log(result[name]["error"])
        result["phase_s"][name] = round(time.perf_counter() - t0, 1)
        log(f"{name}: done in {result['phase_s'][name]:.1f} s")
        if cuda:
            torch.cuda.empty_cache()
    result["duration_s"] = round(time.perf_counter() - started, 1)
    result["targets"] = targets(result)
    result["passed"] = all(
        result[name].get("passed", True) for name in PHASES if isinstance(result.get(name), dict)
    )
    return result


def _limits(device: str) -> dict[str, Any]:
    from .gpu_speed import measure_limits

    return measure_limits(device)


def _parity(
    state: dict[str, Any], folder: str, device: str, token_range: tuple[int, int], args: argparse.Namespace
) -> dict[str, Any]:
    from enginekit.model.text.tokenizer import load_tokenizer

    from .gpu_parity import PROMPT_LENGTHS, check_parity, parity_prompts, write_adapter

    lengths = SMALL_PARITY_PROMPTS if args.tiny else PROMPT_LENGTHS
    prompts = parity_prompts(load_tokenizer(Path(folder)), token_range, lengths)
    checks = {}
    for name, (dtype, graphs, lora) in PARITY_RUNS.items():
        if dtype == "bfloat16":
            reference = _hf_model(state, folder, device)
        else:
            reference = load_transformers(folder, dtype, device)
        adapter = write_adapter(reference, Path(folder).parent / "adapter") if lora else None
        checks[name] = check_parity(
            reference, folder, device, dtype, prompts, args.parity_tokens, cuda_graphs=graphs, adapter=adapter
        )
        del reference
        _free_device_cache()
    return {**checks, "passed": all(check["passed"] for check in checks.values())}


def _hf_model(state: dict[str, Any], folder: str, device: str) -> Any:
    """transformers' bfloat16 model of ``folder`` on ``device``, loaded on first use."""
    if state["hf_model"] is None:
        state["hf_model"] = load_transformers(folder, "bfloat16", device)
    return state["hf_model"]


def _speed(
    args: argparse.Namespace,
    state: dict[str, Any],
    folder: str,
    device: str,
    token_range: tuple[int, int],
    result: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    from .gpu_speed import measure_speed

    limits = _measured_limits(result, device)
    return measure_speed(
        folder,
        _hf_model(state, folder, device),
        device,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        hf_budget_s=args.hf_budget_s,
        token_range=token_range,
        limits=limits,
        model=result["model"],
        log=log,
    )


def _kernels(
    args: argparse.Namespace,
    state: dict[str, Any],
    folder: str,
    device: str,
    token_range: tuple[int, int],
    result: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    from .gpu_kernels import measure_kernels

    _drop_hf_model(state)  # transformers is done by now
    return measure_kernels(
        folder,
        device,
        result["model"],
        _measured_limits(result, device),
        tiny=args.tiny,
        token_range=token_range,
        log=log,
    )


def _measured_limits(result: dict[str, Any], device: str) -> dict[str, Any]:
    """The ``limits`` phase's figures, measured now when that phase did not run or failed."""
    from .gpu_speed import measure_limits

    limits = result.get("limits")
    return limits if limits and "error" not in limits else measure_limits(device)


def _hygiene(
    state: dict[str, Any], folder: str, device: str, restarts: int, log: Callable[[str], None]
) -> dict[str, Any]:
    from .gpu_hygiene import check_restarts

    _drop_hf_model(state)  # transformers is done by now
    modes = {mode: check_restarts(folder, device, mode, restarts, log) for mode in ("mp", "inproc")}
    return {**modes, "passed": all(check["passed"] for check in modes.values())}


def _kv_sizing(state: dict[str, Any], folder: str, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    if not device.startswith("cuda"):
        return {"skipped": "the KV cache is sized to the device on CUDA only", "passed": True}
    from .gpu_hygiene import check_kv_sizing

    _drop_hf_model(state)  # the device's memory for the engine alone (transformers is done by now)
    return check_kv_sizing(folder, device, log)


def _tp(state: dict[str, Any], folder: str, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    from .gpu_hygiene import check_tensor_parallel

    _drop_hf_model(state)
    return check_tensor_parallel(folder, device, 2, log)


def _drop_hf_model(state: dict[str, Any]) -> None:
    state["hf_model"] = None
    _free_device_cache()


def _free_device_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# Targets (issue 45), from the measured figures
# --------------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issues 45 and 46's targets for the 1B model on one H200-class GPU (bfloat16, graphs on, mp: the default mode)."""
    speed = result.get("speed") or {}
    rows = {(row["system"], row["batch"]): row for row in speed.get("rows", [])}

    def figure(batch: int, key: str) -> float:
        row = rows.get(("enginekit mp, graphs", batch))
        if row is None:
            return float("nan")
        return row["tokens_per_s"]["median"] if key == "tokens_per_s" else row[key]

    found = [
        target(
            "GPU: 256 requests, output tokens/s", 40000, figure(256, "tokens_per_s"), unit="tok/s", digits=0
        ),
        target(
            "GPU: 256 requests, share of the arithmetic limit",
            0.20,
            figure(256, "arithmetic_share"),
            unit="%",
            digits=0,
        ),
        target(
            "GPU: 64 requests, output tokens/s", 20000, figure(64, "tokens_per_s"), unit="tok/s", digits=0
        ),
        target("GPU: 1 request, output tokens/s", 1000, figure(1, "tokens_per_s"), unit="tok/s", digits=0),
        target(
            "GPU: 1 request, share of the bandwidth limit",
            0.50,
            figure(1, "bandwidth_share"),
            unit="%",
            digits=0,
        ),
    ]
    for row in speed.get("staggered", []):
        if row["cuda_graphs"]:
            found.append(
                target(
                    f"GPU: staggered arrivals, {row['batch']} requests: time a token in steps with a prefill chunk "
                    "/ in pure decode steps",
                    1.2,
                    row["ratio"],
                    at_least=False,
                )
            )
    found.append(
        target(
            "GPU: 1 request, share of the bandwidth limit (issue 46)",
            0.60,
            figure(1, "bandwidth_share"),
            unit="%",
            digits=0,
        )
    )
    long = ((result.get("kernels") or {}).get("paths") or {}).get("triton", {}).get("long")
    found.append(
        target(
            "GPU: 256 requests at context 4,096, a decode step's share of the KV + weight bytes limit (Triton, "
            "graphs, inproc)",
            0.50,
            long["limit_share"] if long else float("nan"),
            unit="%",
            digits=0,
        )
    )
    ratios = speed.get("mp_over_inproc", {}).get("graphs", {})
    for batch in speed.get("batch_sizes", []):
        requests = f"{batch} request{'' if batch == 1 else 's'}"
        found.append(
            target(f"GPU: mp / inproc with graphs, {requests}", 0.95, ratios.get(str(batch), float("nan")))
        )
    return found


# --------------------------------------------------------------------------------------
# What the run was
# --------------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = properties.name
        info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["gpus_visible"] = torch.cuda.device_count()
    return info


def revision() -> dict[str, Any]:
    def git(*command: str) -> str:
        try:
            done = subprocess.run(
                ["git", *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    # NOTE: a copy of the tree without its .git (a GPU machine's) takes the commit from ENGINEKIT_COMMIT.
    return {
        "commit": git("rev-parse", "--short", "HEAD") or os.environ.get("ENGINEKIT_COMMIT") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def default_json_path(result: dict[str, Any]) -> Path:
    stamp = result["date"][:19].replace("-", "").replace(":", "").replace("T", "-")
    name = f"{stamp}-{result['commit']}{'-tiny' if result['tiny'] else ''}.json"
    if result["device"].startswith("cuda") and not result["tiny"]:  # the page shows these
        return GPU_RESULTS / name
    return Path(tempfile.gettempdir()) / f"enginekit-gpu-check-{name}"


def _logger(started: float) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    return log


if __name__ == "__main__":
    sys.exit(main())
