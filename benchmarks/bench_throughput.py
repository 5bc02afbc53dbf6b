"""Section 1: generated tokens/s in-process against transformers ``generate`` on the same weights."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any

from .baselines import clear_model_cache, hf_generate_runner, matmul_gflops
from .common import (
    REPO_ROOT,
    Context,
    ModelSpec,
    Workload,
    _import_file,
    engine_batch_runner,
    engine_staggered_runner,
    equal_workload,
    greedy,
    interleave,
    kv_blocks_for,
    make_engine,
    mixed_workload,
    paired_ratio,
    poisson_arrivals,
    workload_flops,
)
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Generation throughput against transformers"
CONCURRENCY = (1, 8, 32, 128)
FINDINGS_ONLY = ("staggered-vs-t0", "threads-vs-driver")  # comparisons reported as findings, not rows
STAGGER_WINDOW = 0.5  # arrivals spread over this fraction of the time the burst of the same requests takes


def sizes(ctx: Context) -> dict[str, Any]:
    return ctx.pick(
        quick=dict(equal=(16, 16), prompt_range=(8, 64), output_range=(4, 32), repeats=2, matmul_n=512),
        full=dict(equal=(128, 64), prompt_range=(16, 256), output_range=(8, 128), repeats=3, matmul_n=1024),
    )


@dataclass(frozen=True)
class Row:
    """One workload at one concurrency: engine and transformers tokens/s and their per-round ratio."""

    concurrency: int
    kind: str  # equal, mixed, staggered, staggered-threads
    engine: Summary
    baseline: Summary | None
    ratio: Summary | None
    flops_per_token: float
    note: str = ""


def run(ctx: Context, report: SectionReport) -> None:
    size = sizes(ctx)
    threads = ctx.threads
    matmul = matmul_gflops(n=size["matmul_n"], repeats=ctx.pick(5, 10))
    limit = max(matmul["default"], matmul["single_thread"], key=lambda s: s.median)
    prompt_len, output_len = size["equal"]
    report.method = f"""
Every engine figure is `Engine("builtin", mode="inproc", num_threads={threads})` running `generate` on a batch of
*N* requests submitted at once; every transformers figure is `model.generate` on one batch of the same *N*
requests (same lengths, left-padded, same weights, float32, {threads} torch threads). Greedy, EOS ignored, so
token counts are fixed. Engine and transformers samples alternate run by run (interleaved), and the ratio is
the median of the per-round ratios (min-max). Every engine run uses fresh random prompts (no prefix-cache
hits).

- *equal*: every request has a {prompt_len}-token prompt and wants {output_len} tokens.
- *mixed*: prompt lengths uniform in {size["prompt_range"][0]}-{size["prompt_range"][1]}, output lengths
  uniform in {size["output_range"][0]}-{size["output_range"][1]} (seeded). transformers runs the whole batch
  until its longest request is done; only the tokens each request asked for are counted.
- *staggered*: the mixed requests arrive as a seeded Poisson process spread over a window of
  {STAGGER_WINDOW:g}x the engine's median time for the burst of the same requests (the window is in the row);
  the time runs from the start to the last completion. One driver thread submits each request at its
  arrival and pulls outputs in between (what `generate` does inside, with submissions between steps). A static batch cannot take requests
  mid-`generate`, so the transformers figure for this row is the measured mixed batch started when the
  last request has arrived: tokens / (window + generate time). The findings also give the ratio against
  transformers with every request there at time 0.
- GFLOP/s counts useful forward FLOPs (projections, causal attention, LM head; no padding) and is compared
  with this machine's measured dense matmul, the better of {threads} thread(s) and 1 thread:
  {fmt(limit, "GFLOP/s", 1)} ({matmul["n"]}x{matmul["n"]} {matmul["dtype"]}; {threads} threads
  {fmt(matmul["default"], "GFLOP/s", 1)}, 1 thread {fmt(matmul["single_thread"], "GFLOP/s", 1)}).
"""
    ratios: dict[tuple[str, str, int], Summary] = {}
    for spec in ctx.models():
        same = _same_tokens(spec)
        engine = make_engine(spec, "inproc", num_threads=threads, num_kv_blocks=kv_blocks_for(_largest(size)))
        rows: list[Row] = []
        try:
            for concurrency in CONCURRENCY:
                ctx.log(f"throughput: {spec.key} x{concurrency}")
                rows += _measure(engine, spec, concurrency, size, threads)
        finally:
            engine.shutdown()
            clear_model_cache()
        table = []
        for row in rows:
            if row.ratio is not None:
                ratios[(spec.key, row.kind, row.concurrency)] = row.ratio
            if row.kind in FINDINGS_ONLY:
                continue
            table.append(table_row(row, limit.median, rate_digits=0, gflops_digits=2))
        report.table(
            f"{spec.label}: generated tokens/s (greedy tokens identical to transformers for a check prompt: {same})",
            [
                "concurrent",
                "workload",
                "engine tok/s",
                "transformers tok/s",
                "engine / transformers",
                "engine GFLOP/s",
                "of matmul limit",
            ],
            table,
            ["r", "l", "l", "l", "l", "r", "r"],
        )
        for row in rows:
            if row.kind == "staggered" and row.concurrency == 32:
                at_zero = ratios.get((spec.key, "staggered-vs-t0", 32))
                threads_ratio = ratios.get((spec.key, "threads-vs-driver", 32))
                callers = (
                    "in-process callers on several threads take turns on the engine lock, and a thread that "
                    "steps keeps it while others wait to submit"
                    if threads_ratio.median < 0.8
                    else "no penalty for many caller threads here"
                )
                report.findings.append(
                    f"{spec.key}, 32 concurrent, staggered: against transformers with every request there at "
                    f"time 0 the engine reaches {at_zero.median:.2f}x. With one caller thread per request "
                    f"(`generate` from 32 threads) instead of one driver thread, throughput is "
                    f"{threads_ratio.median:.2f}x ({threads_ratio.min:.2f}-{threads_ratio.max:.2f}) the "
                    f"driver's: {callers}."
                )
    report.targets = _targets(ratios)
    report.limits = _limits(ratios, threads)


def gflops_of(row: Row) -> float:
    """The engine's useful GFLOP/s in this row."""
    return row.engine.median * row.flops_per_token / 1e9


def table_row(row: Row, peak_gflops: float, *, rate_digits: int, gflops_digits: int) -> list[Any]:
    """One row of an engine-against-transformers table, with its share of the matmul peak."""
    gflops = gflops_of(row)
    return [
        row.concurrency,
        row.kind + (f" ({row.note})" if row.note else ""),
        fmt(row.engine, "", rate_digits, thousands=True),
        "" if row.baseline is None else fmt(row.baseline, "", rate_digits, thousands=True),
        "" if row.ratio is None else f"{row.ratio.median:.2f}x ({row.ratio.min:.2f}-{row.ratio.max:.2f})",
        f"{gflops:.{gflops_digits}f}",
        f"{100 * gflops / peak_gflops:.1f}%",
    ]


def _largest(size: dict[str, Any]) -> Workload:
    """A workload at least as large as any this section runs, to size the KV cache (no preemption)."""
    prompt_len = max(size["equal"][0], size["prompt_range"][1])
    output_len = max(size["equal"][1], size["output_range"][1])
    return equal_workload(max(CONCURRENCY), prompt_len, output_len)


def _measure(
    engine: Any,
    spec: ModelSpec,
    concurrency: int,
    size: dict[str, Any],
    threads: int,
    *,
    dtype: str = "float32",
    warmup: int = 1,
) -> list[Row]:
    """Equal, mixed and staggered rows at one concurrency (and, at 32, the caller-thread comparison)."""
    equal = equal_workload(concurrency, *size["equal"])
    mixed = mixed_workload(concurrency, size["prompt_range"], size["output_range"], seed=concurrency)
    runners: dict[str, Any] = {
        "engine-equal": engine_batch_runner(engine, spec, equal, threads=threads, seed=1),
        "hf-equal": hf_generate_runner(
            spec.hf_path, concurrency, equal.prompt_lens, equal.output_lens, num_threads=threads, dtype=dtype
        ),
        "engine-mixed": engine_batch_runner(engine, spec, mixed, threads=threads, seed=2),
        "hf-mixed": hf_generate_runner(
            spec.hf_path, concurrency, mixed.prompt_lens, mixed.output_lens, num_threads=threads, dtype=dtype
        ),
    }
    rates = {name: (lambda r=runner: _rate(r())) for name, runner in runners.items()}
    samples = interleave(rates, repeats=size["repeats"], warmup=warmup)
    # The arrival window follows from the measured burst (median of the mixed runs), so a second round of
    # runs pairs the staggered engine with transformers' mixed batch again.
    burst_s = mixed.num_output_tokens / summarize(samples["engine-mixed"]).median
    window = STAGGER_WINDOW * burst_s
    if concurrency > 1:
        arrivals = poisson_arrivals(concurrency, window, seed=concurrency)
        second = {
            "engine-staggered": engine_staggered_runner(
                engine, spec, mixed, arrivals, threads=threads, seed=3
            ),
            "hf-mixed-2": runners["hf-mixed"],
        }
        if concurrency == 32:
            second["engine-staggered-threads"] = engine_staggered_runner(
                engine, spec, mixed, arrivals, threads=threads, seed=4, callers="threads"
            )
        rates = {name: (lambda r=runner: _rate(r())) for name, runner in second.items()}
        samples.update(interleave(rates, repeats=size["repeats"], warmup=warmup))

    def flops(workload: Workload) -> float:
        return workload_flops(spec.config, workload) / workload.num_output_tokens

    rows = []
    for kind, workload in (("equal", equal), ("mixed", mixed)):
        engine_rates, hf_rates = samples[f"engine-{kind}"], samples[f"hf-{kind}"]
        rows.append(
            Row(
                concurrency,
                kind,
                summarize(engine_rates),
                summarize(hf_rates),
                paired_ratio(engine_rates, hf_rates),
                flops(workload),
            )
        )
    if "engine-staggered" in samples:
        tokens = mixed.num_output_tokens
        waiting = [tokens / (window + tokens / rate) for rate in samples["hf-mixed-2"]]
        staggered = samples["engine-staggered"]
        note = f"arrivals over {window * 1e3:.0f} ms"
        rows.append(
            Row(
                concurrency,
                "staggered",
                summarize(staggered),
                summarize(waiting),
                paired_ratio(staggered, waiting),
                flops(mixed),
                note,
            )
        )
        rows.append(
            Row(
                concurrency,
                "staggered-vs-t0",
                summarize(staggered),
                None,
                paired_ratio(staggered, samples["hf-mixed-2"]),
                flops(mixed),
            )
        )
        if "engine-staggered-threads" in samples:
            by_threads = samples["engine-staggered-threads"]
            rows.append(
                Row(
                    concurrency,
                    "threads-vs-driver",
                    summarize(by_threads),
                    None,
                    paired_ratio(by_threads, staggered),
                    flops(mixed),
                )
            )
    return rows


def _rate(result: Any) -> float:
    return result if isinstance(result, float) else result.tokens_per_s


def _same_tokens(spec: ModelSpec) -> str:
    """Whether the engine and transformers decode the same greedy tokens for one prompt: the weights match."""
    checkpoints = _import_file("hf_checkpoints", REPO_ROOT / "tests" / "hf_checkpoints.py")
    prompt = spec.random_prompt(24, random.Random(7))
    expected = checkpoints.hf_greedy(spec.hf_path, [prompt], 16)[0]
    engine = make_engine(spec, "inproc")
    try:
        got = (
            engine.generate({"prompt_token_ids": prompt}, greedy(16), progress=False)[0].outputs[0].token_ids
        )
    finally:
        engine.shutdown()
    return "yes" if list(got) == list(expected) else f"NO ({list(got)[:6]}... vs {list(expected)[:6]}...)"


def _targets(ratios: dict[tuple[str, str, int], Summary]) -> list[str]:
    lines = []
    for model in ("builtin", "llama"):
        for kind, concurrency, goal in (("equal", 32, 1.0), ("staggered", 32, 2.0), ("staggered", 128, 2.0)):
            ratio = ratios.get((model, kind, concurrency))
            if ratio is None:
                continue
            verdict = "met" if ratio.median >= goal else "NOT met"
            what = "equal lengths" if kind == "equal" else "mixed lengths, staggered arrivals"
            lines.append(
                f"{model}, {what}, {concurrency} concurrent: >= {goal:.1f}x transformers -- "
                f"measured {ratio.median:.2f}x ({ratio.min:.2f}-{ratio.max:.2f}): {verdict}"
            )
    return lines


def _limits(ratios: dict[tuple[str, str, int], Summary], threads: int) -> str:
    single = [r.median for (m, k, c), r in ratios.items() if k == "equal" and c == 1]
    big = [r.median for (m, k, c), r in ratios.items() if k == "equal" and c == 128]
    return f"""
These models are tiny (hidden 128-256): one decode step is a handful of small matmuls, so the fraction of
the matmul limit is low for both the engine and transformers. At 1 concurrent request
(engine/transformers {statistics.median(single) if single else float("nan"):.2f}x) a step is dominated by
fixed per-step cost: Python in the scheduler and runner, building the step's index tensors, one
`scaled_dot_product_attention` call per layer and per prefill chunk, and per-op dispatch in torch (see the
step-breakdown section). At 128 concurrent (engine/transformers
{statistics.median(big) if big else float("nan"):.2f}x) the projections are batched and the paged-attention
gather (an `index_select` copy of every sequence's blocks per layer and step) takes a large share.
With mixed lengths the engine wins by not computing padding and finished requests (continuous batching);
with staggered arrivals it starts each request as soon as it arrives.

What would move it: fewer Python operations per step (build slot mappings and block tables with tensor ops,
reuse index buffers), a paged-attention kernel that reads the cache in place instead of gathering it, and
batching prefill chunks into one attention call. The real model (next section) is where these matter less:
there a step is mostly matmuls. Thread count matters on this {threads}-thread machine when
other processes compete for the cores (see the thread-count section).
"""
