"""Why the GGUF weights run through the project's own kernels: ``native_quant_gemm()`` (path ``auto``) side by side
with torch's packed int4/int8 kernels (the weight repacked once, as a loader would), the float32 linear on the
dequantized weight (what ``quantization="none"`` runs) and ggml's CPU ``mul_mat`` (the library llama-cpp-python
ships, called through ctypes), on the default model's shapes and a 4096x4096 one, at 1, 4, 16 and 512 rows.

Run: ``python -m benchmarks.bench_kernel_choice [--quick] [--threads 1 2]``; prints a markdown table (microseconds
per product for the project's kernels, every other kernel's time as a multiple of theirs: above 1 they are slower)
and one JSON object (``measure``'s dict, with each kernel's error against the float64 product of the dequantized
weight). Ratios are measured side by side in one run; absolute figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels.quant_gemm import INT8_MAX_ROWS, native_quant_gemm, random_blocks
from enginekit.model.layers.linear import linear_kernel

# name: (type, out_features, in_features) -- SmolLM2-135M's Q4_1 projections and Q8_0 LM head, and a larger one.
SHAPES: dict[str, tuple[QType, int, int]] = {
    "qkv": (QType.Q4_1, 960, 576),
    "o": (QType.Q4_1, 576, 576),
    "gate_up": (QType.Q4_1, 3072, 576),
    "down": (QType.Q4_1, 576, 1536),
    "lm_head": (QType.Q8_0, 49152, 576),
    "4096": (QType.Q4_1, 4096, 4096),
}
ROWS = (1, 4, 16, 512)
KERNELS = ("enginekit", "torch_int4", "torch_int4_bf16", "torch_int8", "torch_int8_bf16", "float32", "ggml")
MIN_SECONDS = 0.0005  # each timing repeats the call until it takes at least this long (best of many: the
# machine is shared, and a timing that a neighbour's process interrupts is dropped)
SLOW_SECONDS = 0.2  # a call slower than this is timed once
STREAM_BYTES = 64 << 20  # stored bytes each call goes through at decode rows: twice the test machine's L3
GIVE_UP_SECONDS = 1.0  # a kernel slower than this at some rows is not timed at more rows


def _time_all(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Seconds per call of each: the best of ``repeats`` timings, each of enough calls to last ``MIN_SECONDS``,
    the kernels taking turns (so a neighbour's load falls on all of them alike). A call slower than
    ``SLOW_SECONDS`` is timed once."""
    counts: dict[str, int] = {}
    best: dict[str, float] = {}
    for kernel, run in calls.items():
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        if first > SLOW_SECONDS:
            start = time.perf_counter()
            run()
            best[kernel] = time.perf_counter() - start
            continue
        start = time.perf_counter()
        run()
        counts[kernel] = max(1, int(MIN_SECONDS / max(time.perf_counter() - start, 1e-7)))
        best[kernel] = float("inf")
    for _ in range(repeats):
        for kernel, count in counts.items():
            run = calls[kernel]
            start = time.perf_counter()
            for _ in range(count):
                run()
            best[kernel] = min(best[kernel], (time.perf_counter() - start) / count)
    return best


# ---- torch's packed kernels ------------------------------------------------------------------------------------


def _q4_fields(blocks: torch.Tensor, qtype: QType, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """A Q4_1 / Q4_0 weight's 4-bit values ``[n, k]`` (int32, 0..15), block scales and minimums ``[n, k/32]``."""
    size = 20 if qtype == QType.Q4_1 else 18
    raw = blocks.view(n, k // 32, size)
    scale = raw[:, :, 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    low = raw[:, :, 2:4].contiguous().view(torch.float16).float().squeeze(-1) if qtype == QType.Q4_1 else None
    nibbles = raw[:, :, size - 16 :].to(torch.int32)
    values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).view(n, k)  # ggml: low nibbles first, then high
    minimum = low if low is not None else -8 * scale
    return values, scale, minimum


def torch_int4(
    blocks: torch.Tensor, qtype: QType, n: int, k: int, dtype: torch.dtype = torch.float32
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Q4_1 / Q4_0 through ``_weight_int4pack_mm_for_cpu``, repacked once. Its weight is ``(q - 8) * scale +
    zero`` per group of 32, ggml's ``q * d + m``: scale ``d``, zero ``m + 8 d`` (Q4_0: ``m = -8 d``). The scales
    and the input are of the input's ``dtype`` (bfloat16: rounded, so the weight is no longer the stored one);
    the call takes and gives float32, converting around the kernel."""
    values, scale, minimum = _q4_fields(blocks, qtype, n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    scales_zeros = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
    if dtype == torch.float32:
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, scales_zeros).float()


def torch_int8(
    dense: torch.Tensor, dtype: torch.dtype = torch.float32
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``_weight_int8pack_mm``: one scale per output row, so a Q8_0 weight (a scale per block of 32) does not
    map onto it: it is quantized again from the dequantized weight, per row (its error is in the report)."""
    scales = dense.abs().amax(dim=1).clamp(min=1e-12) / 127
    quantized = torch.round(dense / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(dtype)
    if dtype == torch.float32:
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, quantized, scales)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dtype), quantized, scales).float()


# ---- ggml's CPU backend, through ctypes ---------------------------------------------------------------------------

GGML_TYPES = {QType.Q4_1: 3, QType.Q8_0: 8, QType.Q4_0: 2}
GGML_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _Plan(ctypes.Structure):  # struct ggml_cplan, with room to spare should a release add fields at its end
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("spare", ctypes.c_byte * 256),
    ]


class Ggml:
    """ggml's ``mul_mat`` on one stored weight, from the libraries inside llama-cpp-python (``load`` gives
    ``None`` with the reason when they are missing)."""

    def __init__(self, folder: Path) -> None:
        mode = getattr(ctypes, "RTLD_GLOBAL", 0)
        self.base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=mode)
        b, c = self.base, self.cpu
        b.ggml_init.restype, b.ggml_init.argtypes = ctypes.c_void_p, [_InitParams]
        b.ggml_free.argtypes = [ctypes.c_void_p]
        b.ggml_new_tensor_2d.restype = ctypes.c_void_p
        b.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        b.ggml_mul_mat.restype, b.ggml_mul_mat.argtypes = ctypes.c_void_p, [ctypes.c_void_p] * 3
        b.ggml_new_graph.restype, b.ggml_new_graph.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        b.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_get_data.restype, b.ggml_get_data.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        b.ggml_nbytes.restype, b.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        b.ggml_tensor_overhead.restype = ctypes.c_size_t
        b.ggml_graph_overhead.restype = ctypes.c_size_t
        c.ggml_graph_plan.restype = _Plan
        c.ggml_graph_plan.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        c.ggml_graph_compute.restype = ctypes.c_int
        c.ggml_graph_compute.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Plan)]
        c.ggml_cpu_init()
        self.isa = (
            "avx512_vnni" if c.ggml_cpu_has_avx512_vnni() else "avx2" if c.ggml_cpu_has_avx2() else "other"
        )

    @classmethod
    def load(cls) -> tuple[Ggml | None, str]:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            return None, "llama-cpp-python is not installed (pip install 'enginekit[bench]')"
        folder = Path(spec.origin).parent / "lib"
        if not (folder / "libggml-cpu.so").exists():
            return None, f"no libggml-cpu.so in {folder}"
        try:
            return cls(folder), ""
        except (OSError, AttributeError) as error:
            return None, f"ggml's libraries could not be used: {error}"

    def product(
        self, weights: list[torch.Tensor], qtype: QType, n: int, k: int, x: torch.Tensor, threads: int
    ) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
        """A call computing ``x @ weight.T`` for every weight, one graph of a ``mul_mat`` each (it returns the
        first product, a view of ggml's tensor), and one freeing it all."""
        b = self.base
        m, stored = x.shape[0], weights[0].numel()
        overhead = (3 * len(weights) + 2) * b.ggml_tensor_overhead() + b.ggml_graph_overhead()
        size = len(weights) * (stored + 4 * m * n) + 4 * x.numel() + overhead
        ctx = b.ggml_init(_InitParams(size + (1 << 20), None, False))
        if not ctx:
            raise RuntimeError("ggml_init failed")
        inputs = b.ggml_new_tensor_2d(ctx, GGML_F32, k, m)
        ctypes.memmove(b.ggml_get_data(inputs), x.data_ptr(), x.numel() * 4)
        graph = b.ggml_new_graph(ctx)
        outs = []
        for blocks in weights:
            weight = b.ggml_new_tensor_2d(ctx, GGML_TYPES[qtype], k, n)
            if b.ggml_nbytes(weight) != stored:
                b.ggml_free(ctx)
                raise RuntimeError("ggml's row size differs from the stored one")
            ctypes.memmove(b.ggml_get_data(weight), blocks.data_ptr(), stored)
            outs.append(b.ggml_mul_mat(ctx, weight, inputs))  # [n, m] in ggml's order: m rows of n
            b.ggml_build_forward_expand(graph, outs[-1])
        plan = self.cpu.ggml_graph_plan(graph, threads, None)
        work = ctypes.create_string_buffer(max(plan.work_size, 1))
        plan.work_data = ctypes.cast(work, ctypes.c_void_p)
        result = torch.frombuffer(
            (ctypes.c_float * (m * n)).from_address(b.ggml_get_data(outs[0])), dtype=torch.float32
        ).view(m, n)

        def run() -> torch.Tensor:
            if self.cpu.ggml_graph_compute(graph, ctypes.byref(plan)) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            return result

        def free() -> None:
            b.ggml_free(ctx)
            work.raw  # noqa: B018 -- the work buffer lives until the context is freed

        return run, free


# ---- the measurement -------------------------------------------------------------------------------------------


def _through(products: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """Every product of ``x``; the first one's result."""
    outs = [product(x) for product in products]
    return outs[0]


def _error(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float((result.double() - exact).norm() / exact.norm())


def measure_shape(
    name: str, rows: tuple[int, ...], threads: tuple[int, ...], repeats: int, ggml: Ggml | None
) -> dict[str, Any]:
    """Every kernel on one shape: seconds per product at each row count and thread count, and each kernel's
    relative RMS error at 16 rows against the float64 product of the dequantized weight.

    Up to ``INT8_MAX_ROWS`` rows each call goes through copies of the weight of ``STREAM_BYTES`` stored bytes in
    all (as a decode step goes through every layer's), so no kernel reads its weight from the cache; a prefill's
    rows are bound by arithmetic and use one copy."""
    gemm = native_quant_gemm()
    assert gemm is not None
    qtype, n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    one = random_blocks(qtype, n, k, gen)
    _, linear = linear_kernel(torch.device("cpu"), torch.float32)
    entry: dict[str, Any] = {
        "type": qtype.name,
        "out": n,
        "in": k,
        "error_16_rows": {},
        "us": {},
        "copies": {},
    }
    too_slow: set[str] = set()
    for m in rows:
        copies = min(256, -(-STREAM_BYTES // one.numel())) if m <= INT8_MAX_ROWS else 1
        entry["copies"][str(m)] = copies
        weights = [one] + [one.clone() for _ in range(copies - 1)]
        dense = [gemm.dequantize(w, qtype, n, k) for w in weights]
        packed: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
        if qtype in (QType.Q4_1, QType.Q4_0):
            packed["torch_int4"] = [torch_int4(w, qtype, n, k) for w in weights]
            packed["torch_int4_bf16"] = [torch_int4(w, qtype, n, k, torch.bfloat16) for w in weights]
        if qtype == QType.Q8_0:
            packed["torch_int8"] = [torch_int8(d) for d in dense]
            packed["torch_int8_bf16"] = [torch_int8(d, torch.bfloat16) for d in dense]
        x = torch.randn(m, k, generator=gen)
        products: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "enginekit": [lambda x, w=w, gemm=gemm: gemm(x, w, qtype, n, k) for w in weights],
            "float32": [lambda x, d=d: linear(x, d, None) for d in dense],
            **packed,
        }
        calls = {kernel: functools.partial(_through, fs, x) for kernel, fs in products.items()}
        if m == 16:
            exact = x.double() @ dense[0].double().T
            entry["error_16_rows"] = {kernel: _error(call(), exact) for kernel, call in calls.items()}
        for count in threads:
            previous = torch.get_num_threads()
            torch.set_num_threads(count)
            free: Callable[[], None] = lambda: None  # noqa: E731
            try:
                timed: dict[str, Callable[[], Any]] = {
                    kernel: call for kernel, call in calls.items() if kernel not in too_slow
                }
                if ggml is not None and "ggml" not in too_slow:
                    timed["ggml"], free = ggml.product(weights, qtype, n, k, x, count)
                    if m == 16 and count == threads[0]:
                        entry["error_16_rows"]["ggml"] = _error(
                            timed["ggml"](), x.double() @ dense[0].double().T
                        )
                times = {kernel: seconds / copies for kernel, seconds in _time_all(timed, repeats).items()}
            finally:
                free()
                torch.set_num_threads(previous)
            too_slow |= {kernel for kernel, seconds in times.items() if seconds > GIVE_UP_SECONDS}
            entry["us"][f"{m}x{count}"] = {
                kernel: round(seconds * 1e6, 1) for kernel, seconds in times.items()
            }
    return entry


def measure(threads: tuple[int, ...] = (1, 2), repeats: int = 15, quick: bool = False) -> dict[str, Any]:
    gemm = native_quant_gemm()
    if gemm is None:
        return {"native": None, "skipped": "the native kernels cannot be used here (the log says why)"}
    ggml, why = Ggml.load()
    report: dict[str, Any] = {
        "isa": gemm.best_isa,
        "ggml_isa": ggml.isa if ggml else None,
        "torch": torch.__version__,
        "threads": list(threads),
        "skipped": {"ggml": why} if why else {},
        "shapes": {},
    }
    start = time.perf_counter()
    for name in SHAPES:
        report["shapes"][name] = measure_shape(
            name, ROWS, threads, min(repeats, 5) if quick else repeats, ggml
        )
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report


def table(report: dict[str, Any]) -> str:
    """The report as markdown: the project's kernels in microseconds, every other kernel as a multiple of that."""
    if not report.get("shapes"):
        return f"skipped: {report.get('skipped')}"
    others = list(KERNELS[1:])
    lines = [
        "| shape | type | rows x threads | enginekit µs | " + " | ".join(f"{k} x" for k in others) + " |",
        "|---|---|---|---:|" + "---:|" * len(others),
    ]
    for name, entry in report["shapes"].items():
        for key, times in entry["us"].items():
            ours = times["enginekit"]
            cells = [f"{times[k] / ours:.2f}" if k in times else "-" for k in others]
            lines.append(
                f"| {name} {entry['out']}x{entry['in']} | {entry['type']} | {key} | {ours:.1f} | "
                + " | ".join(cells)
                + " |"
            )
    lines.append("")
    lines.append("relative RMS error at 16 rows against the float64 product of the dequantized weight:")
    for name, entry in report["shapes"].items():
        errors = ", ".join(f"{k} {v:.1e}" for k, v in entry["error_16_rows"].items())
        lines.append(f"- {name}: {errors}")
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
