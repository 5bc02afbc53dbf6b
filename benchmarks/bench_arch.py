"""A second architecture against transformers: a tiny random Qwen3 (its q/k norms in every attention layer), the
tiny models' workloads, transformers at its best on the same weights."""

from __future__ import annotations

from typing import Any

from .baselines import clear_model_cache
from .bench_limits import machine_limits, peak_gflops
from .bench_throughput import (
    measure_rows,
    rows_table,
    transformers_at_its_best,
    transformers_curves,
    transformers_text,
)
from .common import equal_workload, kv_blocks_for, log, make_engine, session
from .figures import curve, median, target


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            concurrency=(1, 8),
            equal=(16, 16),
            prompt_range=(8, 64),
            output_range=(4, 32),
            repeats=1,
            probe=(8, 1),
            compile=False,
        )
    return dict(
        concurrency=(1, 8, 32),
        equal=(128, 64),
        prompt_range=(16, 256),
        output_range=(8, 128),
        repeats=2,
        probe=(8, 2),
        compile=False,
        compile_why_not="the tiny models' section shows what it gives at this model size",
    )


def run_arch_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    threads = ctx.threads
    spec = ctx.model("qwen3")
    limits = machine_limits(quick)
    best = transformers_at_its_best(spec, size, threads)
    largest = equal_workload(
        max(size["concurrency"]),
        max(size["equal"][0], size["prompt_range"][1]),
        max(size["equal"][1], size["output_range"][1]),
    )
    engine = make_engine(spec, "inproc", num_threads=threads, num_kv_blocks=kv_blocks_for(largest))
    rows: list[dict[str, Any]] = []
    try:
        for index, concurrency in enumerate(size["concurrency"]):
            log(f"arch: {spec.key} x{concurrency}")
            rows += measure_rows(
                engine, spec, concurrency, size, threads, best, warmup=1 if index == 0 else 0
            )
    finally:
        engine.shutdown()
        clear_model_cache()
    peak = peak_gflops(limits, "float32")
    for row in rows:
        row["share_of_peak"] = None if peak is None else row["gflops"] / peak
    found = {(row["kind"], row["concurrency"]): row for row in rows}
    top = max(size["concurrency"])
    targets = [
        target(
            f"qwen3, {kind} lengths, {top} concurrent: engine / the fastest transformers",
            goal,
            found[(kind, top)]["ratio"],
        )
        for kind, goal in (("equal", 1.0), ("mixed", 2.0))
        if (kind, top) in found
    ]
    equal = [r for r in rows if r["kind"] == "equal"]
    return {
        "threads": threads,
        "sizes": size,
        "label": spec.label,
        "transformers": best,
        "rows": rows,
        "targets": targets,
        "curves": [
            curve(
                f"{spec.label}, equal lengths",
                {
                    "engine": [(r["concurrency"], r["engine"]) for r in equal],
                    **transformers_curves(rows),
                },
            )
        ],
    }


def render_arch_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    equal = [r for r in figures["rows"] if r["kind"] == "equal"]
    return "\n".join(
        [
            f'**{figures["label"]}**, loaded from its Hugging Face folder by both, `mode="inproc"`, '
            f"{figures['threads']} threads; the tiny models' workloads and method (*equal* {size['equal'][0]}-token "
            f"prompts and {size['equal'][1]} tokens, *mixed* and *staggered* as there), {size['repeats']} "
            f"interleaved rounds. {transformers_text(figures['transformers'])}\n",
            rows_table(figures["rows"], digits=0),
            "Engine / transformers with equal lengths: "
            + ", ".join(f"{median(r['ratio']):.2f}x at {r['concurrency']}" for r in equal)
            + ".\n",
        ]
    )
