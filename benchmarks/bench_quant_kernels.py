"""The GGUF kernels (``enginekit.model.kernels.quant_gemm``) on their own: bytes streamed per second at one row
against the machine's read bandwidth, GFLOP/s at 16, 128 and 512 rows against the float32 path on the dequantized
weight, each path (int8, float, panels) beside the one ``auto`` picks, and the int8 path's error.

Run: ``python -m benchmarks.bench_quant_kernels [--threads N] [--quick]``; prints one JSON object (``measure``'s
dict). Ratios are measured side by side in one run; absolute figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels.quant_gemm import (
    NATIVE_TYPES,
    int8_error_bound,
    native_quant_gemm,
    random_blocks,
)
from enginekit.model.layers.linear import linear_kernel

STREAM_BYTES = 96 << 20  # a decode step of the default model streams about this much (Q4_1 layers, Q8_0 head)
SHAPE = (2048, 2048)  # out, in: whole K-quant super-blocks
ROWS = (16, 128, 512)


def _best_time(run: Callable[[], Any], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(threads: int, repeats: int) -> float:
    """GB/s: the best time to sum 256 MB of float32 on ``threads`` threads."""
    data = torch.ones(64 << 20, dtype=torch.float32)
    with _threads(threads):
        return data.numel() * 4 / _best_time(data.sum, repeats) / 1e9


def stream(qtype: QType, threads: int, repeats: int) -> dict[str, float]:
    """One row through enough weights of ``qtype`` to leave the caches (``STREAM_BYTES`` stored): GB/s of stored
    bytes per path, and the float32 path on the dequantized weights (bytes it reads, and its time)."""
    gemm = native_quant_gemm()
    assert gemm is not None
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = SHAPE
    one = random_blocks(qtype, out_features, in_features, gen)
    weights = [one.clone() for _ in range(max(1, STREAM_BYTES // one.numel()))]
    x = torch.randn(1, in_features, generator=gen)
    stored = sum(weight.numel() for weight in weights)
    result: dict[str, float] = {"stored_mb": stored / 1e6}
    with _threads(threads):
        paths = ["auto", "float"] + (["int8"] if qtype not in (QType.F16, QType.BF16) else [])
        for path in paths:
            seconds = _best_time(
                lambda path=path: [gemm(x, w, qtype, out_features, in_features, path=path) for w in weights],
                repeats,
            )
            result[f"{path}_gbs"] = stored / seconds / 1e9
            result[f"{path}_ms"] = seconds * 1e3
        if qtype in (QType.Q4_1, QType.Q8_0):  # the default model's types: against float32
            dense = [gemm.dequantize(w, qtype, out_features, in_features) for w in weights]
            _, linear = linear_kernel(torch.device("cpu"), torch.float32)
            seconds = _best_time(lambda: [linear(x, w, None) for w in dense], repeats)
            result["float32_ms"] = seconds * 1e3
            result["float32_gbs_of_its_bytes"] = sum(w.numel() * 4 for w in dense) / seconds / 1e9
            result["speedup_over_float32"] = result["float32_ms"] / result["auto_ms"]
    return result


def rows_throughput(qtype: QType, threads: int, repeats: int, rows: tuple[int, ...]) -> dict[str, Any]:
    """GFLOP/s at each row count: ``auto``, each path, and the float32 path on the dequantized weight."""
    gemm = native_quant_gemm()
    assert gemm is not None
    gen = torch.Generator().manual_seed(1)
    out_features, in_features = SHAPE
    blocks = random_blocks(qtype, out_features, in_features, gen)
    dense = gemm.dequantize(blocks, qtype, out_features, in_features)
    _, linear = linear_kernel(torch.device("cpu"), torch.float32)
    result: dict[str, Any] = {}
    with _threads(threads):
        for m in rows:
            x = torch.randn(m, in_features, generator=gen)
            flops = 2 * m * out_features * in_features
            row = {"float32": flops / _best_time(lambda x=x: linear(x, dense, None), repeats) / 1e9}
            paths = ["auto", "float", "panels"] + (["int8"] if qtype not in (QType.F16, QType.BF16) else [])
            for path in paths:
                seconds = _best_time(
                    lambda x=x, path=path: gemm(x, blocks, qtype, out_features, in_features, path=path),
                    repeats,
                )
                row[path] = flops / seconds / 1e9
            result[str(m)] = {name: round(value, 1) for name, value in row.items()}
    return result


def int8_error(qtype: QType) -> dict[str, float]:
    """The int8 path's error relative to the exact product's size, for normal inputs and for inputs with a few
    large values per row (as hidden states have), with its bound."""
    gemm = native_quant_gemm()
    assert gemm is not None
    gen = torch.Generator().manual_seed(2)
    out_features, in_features = SHAPE
    blocks = random_blocks(qtype, out_features, in_features, gen)
    dense = gemm.dequantize(blocks, qtype, out_features, in_features)
    normal = torch.randn(16, in_features, generator=gen)
    outliers = normal.clone()
    outliers[:, torch.randint(0, in_features, (8,), generator=gen)] *= 30
    result = {}
    for name, x in (("normal", normal), ("outliers", outliers)):
        exact = x.double() @ dense.double().T
        error = gemm(x, blocks, qtype, out_features, in_features, path="int8").double() - exact
        result[f"{name}_relative_rms"] = float(error.norm() / exact.norm())
        result[f"{name}_bound_relative_rms"] = float(
            int8_error_bound(x, dense).double().norm() / exact.norm()
        )
    return result


def measure(threads: int | None = None, repeats: int = 5, quick: bool = False) -> dict[str, Any]:
    """Every figure above, for every native type (``quick``: the default model's two types, fewer rows)."""
    gemm = native_quant_gemm()
    if gemm is None:
        return {"native": None}
    threads = threads or torch.get_num_threads()
    types = [QType.Q4_1, QType.Q8_0] if quick else sorted(NATIVE_TYPES)
    report: dict[str, Any] = {
        "isa": gemm.best_isa,
        "threads": threads,
        "read_bandwidth_gbs": read_bandwidth(threads, repeats),
        "types": {},
    }
    for qtype in types:
        entry: dict[str, Any] = {"stream_1_row": stream(qtype, threads, repeats)}
        entry["rows_gflops"] = rows_throughput(qtype, threads, repeats, ROWS[:2] if quick else ROWS)
        if qtype not in (QType.F16, QType.BF16):
            entry["int8_error"] = int8_error(qtype)
        report["types"][qtype.name] = entry
    return report


class _threads:
    def __init__(self, count: int) -> None:
        self.count, self.previous = count, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(measure(args.threads, args.repeats, args.quick), indent=1))
