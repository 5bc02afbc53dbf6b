"""Whether oneDNN's bf16 matrix product beats the project's bf16 kernels (``quant_gemm.c``'s bf16 path) at a batched
decode's and a prefill's rows (16, 32, 64, 128, 512), on the default model's shapes: the measurement behind the
choice per instruction set in docs/architecture.md ("Why our own kernels").

oneDNN runs as torch calls it for a CPU bf16 linear (``mkldnn._linear_pointwise``, its ``brg_matmul``), on the weight
dequantized and rounded to bf16 once (2 bytes a value: 3.2x a Q4_1 file's), in place and also reordered once into
its blocked layout for the row count (``mkldnn._reorder_linear_weight``); each call rounds the float32 input to
bf16 and its bf16 output back to float32. That output is itself rounded to bf16 (torch's CPU ops give no float32
output for bf16 inputs), which the error column shows; ours sums into float32 and reads the stored weight.
Which implementation oneDNN picked is read from its verbose log in a child process (``brg_matmul:avx512_core_bf16``
on AVX-512 BF16, ``..._amx`` where it uses AMX tiles).

Run: ``python -m benchmarks.bench_bf16_choice [--quick] [--threads 1 2]``: a markdown table (our microseconds per
product, oneDNN's time as a multiple of ours: above 1 ours is faster) and the JSON. Ratios are measured side by
side in one run (the kernels take turns); absolute figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels.quant_gemm import native_quant_gemm, random_blocks

from .bench_kernel_choice import STREAM_BYTES, _time_all

SHAPES: dict[str, tuple[QType, int, int]] = {  # SmolLM2-135M's Q4_1 projections and Q8_0 LM head
    "qkv": (QType.Q4_1, 960, 576),
    "o": (QType.Q4_1, 576, 576),
    "gate_up": (QType.Q4_1, 3072, 576),
    "down": (QType.Q4_1, 576, 1536),
    "lm_head": (QType.Q8_0, 49152, 576),
}
ROWS = (16, 32, 64, 128, 512)
DECODE_ROWS = (
    32  # up to this many rows a call streams copies of the weight (as a decode step goes through its
)
# layers), past it one copy: a prefill is bound by arithmetic
KERNELS = ("ours", "onednn", "onednn_packed")
PROBE = (
    "import torch\n"
    "x, w = torch.randn(16, 64).bfloat16(), torch.randn(32, 64).bfloat16()\n"
    "torch.ops.mkldnn._linear_pointwise(x, w, None, 'none', [], '')\n"
)


def onednn_implementation() -> str:
    """The implementation oneDNN's verbose log names for a bf16 linear here, from a child process (the log is
    switched on by the environment at its first use)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    found = re.findall(r"primitive,exec,cpu,\w+,([^,]+),", done.stdout)
    return found[-1] if found else f"unknown (exit {done.returncode})"


def cpu_flags() -> list[str]:
    """The AVX-512 BF16 and AMX flags of this CPU (Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    return sorted(flag for flag in flags if flag.startswith(("amx", "avx512_bf16")))


def _relative(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float((result.double() - exact).norm() / exact.norm())


def _products(
    blocks: list[torch.Tensor], qtype: QType, n: int, k: int, rows: int
) -> dict[str, list[Callable]]:
    gemm = native_quant_gemm()
    assert gemm is not None
    onednn = torch.ops.mkldnn._linear_pointwise
    dense = [gemm.dequantize(b, qtype, n, k).to(torch.bfloat16) for b in blocks]
    packed = [torch.ops.mkldnn._reorder_linear_weight(d, rows) for d in dense]
    bf16 = torch.bfloat16
    return {
        "ours": [lambda x, b=b: gemm(x, b, qtype, n, k, path="bf16") for b in blocks],
        "onednn": [lambda x, d=d: onednn(x.to(bf16), d, None, "none", [], "").float() for d in dense],
        "onednn_packed": [lambda x, p=p: onednn(x.to(bf16), p, None, "none", [], "").float() for p in packed],
    }


def measure_shape(name: str, rows: tuple[int, ...], threads: tuple[int, ...], repeats: int) -> dict[str, Any]:
    gemm = native_quant_gemm()
    assert gemm is not None
    qtype, n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    one = random_blocks(qtype, n, k, gen)
    entry: dict[str, Any] = {"type": qtype.name, "out": n, "in": k, "us": {}, "error": {}, "copies": {}}
    for m in rows:
        copies = min(64, -(-STREAM_BYTES // one.numel())) if m <= DECODE_ROWS else 1
        entry["copies"][str(m)] = copies
        weights = [one] + [one.clone() for _ in range(copies - 1)]
        products = _products(weights, qtype, n, k, m)
        x = torch.randn(m, k, generator=gen)
        exact = x.double() @ gemm.dequantize(one, qtype, n, k).double().T
        entry["error"][str(m)] = {kernel: _relative(fs[0](x), exact) for kernel, fs in products.items()}
        calls = {kernel: (lambda fs=fs, x=x: [f(x) for f in fs]) for kernel, fs in products.items()}
        for count in threads:
            previous = torch.get_num_threads()
            torch.set_num_threads(count)
            try:
                times = _time_all(calls, repeats)
            finally:
                torch.set_num_threads(previous)
            entry["us"][f"{m}x{count}"] = {kernel: round(t / copies * 1e6, 1) for kernel, t in times.items()}
    return entry


def measure(threads: tuple[int, ...] = (1, 2), repeats: int = 15, quick: bool = False) -> dict[str, Any]:
    gemm = native_quant_gemm()
    if gemm is None or gemm.best_isa != "avx512_bf16":
        return {"skipped": "needs the native kernels on a CPU with AVX-512 BF16 (their bf16 path)"}
    report: dict[str, Any] = {
        "isa": gemm.best_isa,
        "cpu_flags": cpu_flags(),
        "onednn": onednn_implementation(),
        "torch": torch.__version__,
        "threads": list(threads),
        "shapes": {},
    }
    for name in SHAPES:
        report["shapes"][name] = measure_shape(name, ROWS, threads, min(repeats, 5) if quick else repeats)
    return report


def table(report: dict[str, Any]) -> str:
    if "shapes" not in report:
        return f"skipped: {report['skipped']}"
    lines = [
        f"oneDNN: {report['onednn']}; CPU flags: {', '.join(report['cpu_flags']) or 'none'}",
        "",
        "| shape | rows x threads | ours µs | oneDNN x | oneDNN packed x |",
        "|---|---|---:|---:|---:|",
    ]
    for name, entry in report["shapes"].items():
        for key, times in entry["us"].items():
            ours = times["ours"]
            lines.append(
                f"| {name} {entry['out']}x{entry['in']} {entry['type']} | {key} | {ours:.1f} | "
                f"{times['onednn'] / ours:.2f} | {times['onednn_packed'] / ours:.2f} |"
            )
    lines += ["", "relative RMS error against the float64 product of the dequantized weight:"]
    for name, entry in report["shapes"].items():
        errors = entry["error"][str(min(int(m) for m in entry["error"]))]
        lines.append(f"- {name}: " + ", ".join(f"{kernel} {value:.1e}" for kernel, value in errors.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="at most 5 repeats")
    args = parser.parse_args()
    result = measure(tuple(args.threads), args.repeats, args.quick)
    print(table(result))
    print(json.dumps(result, indent=1))
