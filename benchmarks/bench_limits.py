"""The machine's own limits, measured in the run: peak multiply-add rates per dtype the engine computes in,
memory read bandwidth, and the ZeroMQ round trip between two processes.

The peaks and the bandwidth come from ``machine_limits.c``, compiled when the benchmarks run (``cc -O2
-march=native -fopenmp``): register-only multiply-add loops (float32 FMA; bfloat16 and int8 dot products
where the CPU has them) and a STREAM-like read of a large array. Without a C compiler the peaks are not
measured (every "% of peak" on the page says n/a) and the bandwidth falls back to ``torch.sum``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .baselines import torch_threads, zmq_pingpong_roundtrip
from .common import log, session, usable_cores
from .figures import rate, summary
from .stats import markdown_table, summarize

SOURCE = Path(__file__).with_name("machine_limits.c")
DTYPES = {  # the program's kernel: what it measures
    "float32": ("fma32", "float32 fused multiply-adds", "GFLOP/s"),
    "bfloat16": ("bf16", "bfloat16 dot products into float32 (AVX512-BF16)", "GFLOP/s"),
    "int8": ("int8", "u8 x s8 dot products into int32 (AVX512-VNNI)", "GOP/s"),
}


def run_limits_bench(quick: bool) -> dict[str, Any]:
    figures = dict(machine_limits(quick))
    messages = 500 if quick else 2000
    log(f"limits: ZeroMQ round trip x{messages}")
    pingpong = zmq_pingpong_roundtrip(num_messages=messages)
    figures["zmq_round_trip_us"] = {
        "p50": pingpong["p50_us"],
        "p99": pingpong["p99_us"],
        "summary": summary(pingpong["summary"]),
        "payload_bytes": pingpong["payload_bytes"],
    }
    figures["targets"] = []
    return figures


def machine_limits(quick: bool) -> dict[str, Any]:
    """Peaks per dtype and read bandwidth, on all usable cores and on one; measured once per run."""
    ctx = session()
    if "limits" in ctx.cache:
        return ctx.cache["limits"]
    cores = usable_cores()
    repeats = 3 if quick else 5
    seconds = 0.1 if quick else 0.25
    mib = 256 if quick else 1024
    program, why = _build(ctx.workdir)
    figures: dict[str, Any] = {"cores": cores, "compiled": program is not None, "why_not": why, "peak": {}}
    if program is not None:
        for dtype, (kernel, _, unit) in DTYPES.items():
            log(f"limits: peak {dtype}")
            every = {count: _measure(program, kernel, count, repeats, seconds) for count in (cores, 1)}
            if every[cores] is None:
                continue
            figures["peak"][dtype] = {"all": every[cores], "one": every[1], "unit": unit}
        log("limits: read bandwidth")
        figures["read_gb_s"] = {
            "all": _measure(program, "read", cores, repeats, mib),
            "one": _measure(program, "read", 1, repeats, mib),
            "mib": mib,
            "how": "machine_limits.c",
        }
    else:
        figures["read_gb_s"] = {
            "all": _torch_read(cores, repeats, mib),
            "one": _torch_read(1, repeats, mib),
            "mib": mib,
            "how": "torch.sum",
        }
    ctx.cache["limits"] = figures
    return figures


def products_dtype(stored: bool, dtype: str) -> str:
    """The arithmetic a model's products run in at a batch of rows on this CPU: weights kept as stored take the
    bf16 path where the CPU has AVX-512 BF16 (6 rows or more), int8 dot products where it has AVX-512 VNNI; float
    weights compute in ``dtype``. Its peak is the one a share of peak is against."""
    if not stored:
        return dtype
    from enginekit.model.kernels.quant_gemm import native_quant_gemm

    native = native_quant_gemm()
    isa = native.best_isa if native is not None else "scalar"
    return {"avx512_bf16": "bfloat16", "avx512_vnni": "int8"}.get(isa, dtype)


def peak_gflops(limits: dict[str, Any], dtype: str) -> float | None:
    """The all-cores peak of ``dtype`` (float32 for a dtype without one of its own), or None."""
    peak = limits["peak"].get(dtype) or limits["peak"].get("float32")
    return None if peak is None else peak["all"]["median"]


def _build(folder: Path) -> tuple[Path | None, str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (set CC, or install gcc)"
    target = folder / "machine_limits"
    errors = []
    for flags in (["-O2", "-march=native", "-fopenmp"], ["-O2", "-fopenmp"]):
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(target)], capture_output=True, text=True, timeout=120
        )
        if result.returncode == 0:
            return target, ""
        errors.append(result.stderr.strip().splitlines()[-1:] or ["?"])
    return None, f"{compiler} failed: {errors[-1][0]}"


def _measure(
    program: Path, kernel: str, threads: int, repeats: int, amount: float
) -> dict[str, float] | None:
    result = subprocess.run(
        [str(program), kernel, str(threads), str(repeats), str(amount)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode == 2:
        return None
    if result.returncode != 0:
        raise RuntimeError(f"machine_limits {kernel} failed ({result.returncode}): {result.stderr.strip()}")
    return summary(float(line) for line in result.stdout.split())


def _torch_read(threads: int, repeats: int, mib: int) -> dict[str, float]:
    import torch

    data = torch.ones(mib * 2**20 // 4)
    samples = []
    with torch_threads(threads):
        data.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            samples.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return summary(summarize(samples))


def render_limits_bench(figures: dict[str, Any]) -> str:
    cores = figures["cores"]
    rows = []
    for dtype, (_, what, unit) in DTYPES.items():
        peak = figures["peak"].get(dtype)
        if peak is None:
            note = (
                "not measured: no C compiler"
                if not figures["compiled"]
                else "this CPU has no such instruction"
            )
            rows.append([f"peak {dtype}: {what}", note, ""])
            continue
        rows.append([f"peak {dtype}: {what}, {unit}", rate(peak["all"], 0), rate(peak["one"], 0)])
    read = figures["read_gb_s"]
    rows.append(
        [
            f"memory read bandwidth, GB/s ({read['how']}, {read['mib']} MiB of float32 read once)",
            rate(read["all"], 1),
            rate(read["one"], 1),
        ]
    )
    zmq = figures["zmq_round_trip_us"]
    rows.append(
        [
            f"ZeroMQ round trip between two processes, µs ({zmq['payload_bytes']}-byte message, ipc://; p99 "
            f"{zmq['p99']:.1f})",
            f"p50 {zmq['p50']:.1f}",
            "",
        ]
    )
    text = markdown_table(["limit", f"all {cores} cores", "one core"], rows, ["l", "r", "r"])
    why = "" if figures["compiled"] else f" The peaks were not measured: {figures['why_not']}."
    return (
        "Register-only multiply-add loops (twelve independent accumulators per thread, no memory traffic) "
        "give the most the cores can compute in each dtype the engine uses; a STREAM-like read gives the "
        "most memory can feed them; both from `benchmarks/machine_limits.c`, compiled at run time. Every "
        '"% of peak" and "% of the read bandwidth" on this page is against the all-cores column.'
        + why
        + "\n\n"
        + text
    )
