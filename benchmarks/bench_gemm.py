"""The float32 projections on CPU: the native skinny GEMM (``skinny_gemm.c``) against oneDNN and MKL with the weight
packed once, as at load, and against the kernels that read it in place.

Each kernel runs the default model's projection shapes (SmolLM2-135M: fused QKV, output, fused gate/up, down,
LM head) at 1 to 128 rows, interleaved sample by sample so that background load hits all of them alike; a
figure is the best of ``repeats`` timings, in microseconds a call. The kernels:

- ``F.linear``: torch's own (MKL's GEMM, which packs the weight inside every call);
- ``onednn``: oneDNN's inner product on the ``[out, in]`` weight in place (``mkldnn._linear_pointwise``);
- ``onednn packed``: the same with the weight reordered once for oneDNN (``mkldnn._reorder_linear_weight``);
- ``mkl packed``: MKL's packed GEMM, the weight packed once for the call's row count
  (``mkl._mkl_reorder_linear_weight``; one packing per row count, so not usable for varying batches as is);
- ``skinny``: the native kernel (AVX2 and FMA code on either ISA), at up to 128 rows.

Run: ``python -m benchmarks.bench_gemm [--isa avx512|avx2|both] [--quick]``; prints one JSON object per ISA
(``measure``'s dict). ``avx2`` caps torch's own kernels at AVX2 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``) in a fresh process: what an AVX2-only machine runs, at this machine's clock.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from enginekit.model.kernels.native import MAX_ROWS, native_skinny_gemm

# out, in of the default model's projections (hidden 576, 9 + 2 x 3 heads of 64, intermediate 1536, vocab 49152)
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _kernels(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, weight)}
    onednn = torch.ops.mkldnn._linear_pointwise
    kernels["onednn"] = lambda x: onednn(x, weight, None, "none", [], "")
    reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    kernels["onednn packed"] = lambda x: onednn(x, reordered, None, "none", [], "")
    if torch.backends.mkl.is_available():
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        kernels["mkl packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, rows)
    skinny = native_skinny_gemm()
    if skinny is not None and rows <= MAX_ROWS:
        kernels["skinny"] = lambda x: skinny(x, weight, None)
    return kernels


def _interleaved_best(kernels: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(kernels, float("inf"))
    for run in kernels.values():
        run()
    for _ in range(repeats):
        for name, run in kernels.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def measure(
    rows: tuple[int, ...] = ROWS, repeats: int = 20, shapes: dict[str, tuple[int, int]] = SHAPES
) -> dict:
    """Microseconds a call of every kernel, by shape and rows; each checked against ``F.linear`` first."""
    torch.manual_seed(0)
    figures: dict[str, Any] = {
        "isa": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
        "threads": torch.get_num_threads(),
        "us": {},
    }
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features) / in_features**0.5
        for m in rows:
            x = torch.randn(m, in_features)
            kernels = _kernels(weight, m)
            expected = F.linear(x, weight)
            for kernel_name, kernel in kernels.items():
                torch.testing.assert_close(kernel(x), expected, rtol=1e-4, atol=1e-4, msg=kernel_name)
            # the LM head is 28M multiply-adds a row: fewer repeats keep the run short
            calls = {k: functools.partial(kernel, x) for k, kernel in kernels.items()}
            times = _interleaved_best(calls, repeats if name != "lm_head" else 3)
            figures["us"][f"{name} {out_features}x{in_features} rows={m}"] = {
                k: round(v, 1) for k, v in times.items()
            }
    return figures


def measure_isa(isa: str, quick: bool = False) -> dict:
    """``measure`` in a fresh process whose torch kernels are capped at ``isa`` (``avx2``) or not (``avx512``)."""
    env = dict(os.environ, **(AVX2_ENV if isa == "avx2" else {}))
    code = f"import json; from benchmarks.bench_gemm import measure, ROWS; print(json.dumps(measure({_args(quick)})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _args(quick: bool) -> str:
    return "rows=(1, 8, 32, 128), repeats=10" if quick else "repeats=60"


def markdown(figures: dict) -> str:
    """One table of ``measure``'s figures: microseconds a call, the fastest of each row in bold."""
    us = figures["us"]
    kernels = list(dict.fromkeys(k for row in us.values() for k in row))
    lines = [
        f"torch kernels at {figures['isa']} (oneDNN: {figures['onednn_max_isa']}), {figures['threads']} threads; "
        "microseconds a call, best of the interleaved repeats; the fastest in bold.",
        "",
        "| shape, rows | " + " | ".join(kernels) + " |",
        "| :--- | " + " | ".join("---:" for _ in kernels) + " |",
    ]
    for key, row in us.items():
        fastest = min(row.values())
        cells = [
            "-" if k not in row else f"**{row[k]:.0f}**" if row[k] == fastest else f"{row[k]:.0f}"
            for k in kernels
        ]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--isa", choices=("avx512", "avx2", "both"), default="both")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="tables instead of JSON")
    args = parser.parse_args(argv)
    for isa in ("avx512", "avx2") if args.isa == "both" else (args.isa,):
        figures = measure_isa(isa, args.quick)
        print(markdown(figures) if args.markdown else json.dumps(figures))


if __name__ == "__main__":
    main()
