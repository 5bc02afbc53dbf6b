"""Section: data parallelism — N engine processes behind one front end, against one."""

from __future__ import annotations

from typing import Any

from .common import (
    Context,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    make_engine,
    paired_ratio,
)
from .report import SectionReport
from .stats import fmt, summarize

TITLE = "Data parallel: two engine processes against one"
TARGET = 1.6  # N=2 with one thread per rank against N=1 with one thread, on the built-in model


def run(ctx: Context, report: SectionReport) -> None:
    concurrency_list = ctx.pick((64,), (64, 128))
    prompt_len, output_len = ctx.pick((16, 16), (32, 32))
    repeats = ctx.pick(2, 5)
    # The real model's steps are 50-100x the built-in one's: at the full size its rows alone took over half
    # an hour, so it runs 64 concurrent only, with shorter outputs and fewer rounds.
    real_concurrency, real_output_len, real_repeats = 64, 16, ctx.pick(2, 3)
    report.method = f"""
Many short requests ({prompt_len}-token prompts, {output_len} greedy tokens each, all submitted at once) through
`Engine.generate` in `"mp"` mode, three engines up at once and run alternately: one rank with one torch thread,
one rank with two, and `data_parallel_size=2` with one thread per rank (the default split on this machine:
`max(1, cores // ranks)`). With two ranks the client sends each request to the rank with the fewest
unfinished ones, so each rank runs half the batch. Ratios are medians of per-round ratios (min-max).
The real model runs {real_concurrency} concurrent requests of {real_output_len} tokens, {real_repeats} rounds (its
steps are 50-100x the built-in model's).
"""
    variants = {
        "N=1, 1 thread": {"num_threads": 1},
        "N=1, 2 threads": {"num_threads": 2},
        "N=2, 1 thread each": {"data_parallel_size": 2, "num_threads": 1},
    }
    for spec in ctx.dp_models():
        concurrencies, outputs, rounds = (
            (concurrency_list, output_len, repeats)
            if spec.key == "builtin"
            else ((real_concurrency,), real_output_len, real_repeats)
        )
        workload = equal_workload(max(concurrencies), prompt_len, outputs)
        engines = {
            name: make_engine(spec, "mp", num_kv_blocks=kv_blocks_for(workload), **options)
            for name, options in variants.items()
        }
        rows = []
        try:
            for concurrency in concurrencies:
                ctx.log(f"dp: {spec.key} x{concurrency}")
                batch = equal_workload(concurrency, prompt_len, outputs)
                runners: dict[str, Any] = {}
                for i, (name, engine) in enumerate(engines.items()):
                    runner = engine_batch_runner(engine, spec, batch, seed=i)
                    runners[name] = lambda r=runner: r().tokens_per_s
                samples = interleave(runners, repeats=rounds, warmup=1)
                one_thread = paired_ratio(samples["N=2, 1 thread each"], samples["N=1, 1 thread"])
                two_threads = paired_ratio(samples["N=2, 1 thread each"], samples["N=1, 2 threads"])
                rows.append(
                    [concurrency]
                    + [fmt(summarize(samples[name]), "", 0, thousands=True) for name in variants]
                    + [
                        f"{one_thread.median:.2f}x ({one_thread.min:.2f}-{one_thread.max:.2f})",
                        f"{two_threads.median:.2f}x ({two_threads.min:.2f}-{two_threads.max:.2f})",
                    ]
                )
                if spec.key == "builtin":
                    verdict = "met" if one_thread.median >= TARGET else "NOT met"
                    report.targets.append(
                        f"data parallel, {spec.key}, {concurrency} concurrent: N=2 (1 thread each) / N=1 (1 thread) "
                        f"= {one_thread.median:.2f}x (target >= {TARGET}x): {verdict}"
                    )
        finally:
            for engine in engines.values():
                engine.shutdown()
        report.table(
            f"{spec.label}: generated tokens/s",
            [
                "concurrent",
                *(f"{name} tok/s" for name in variants),
                "N=2 / N=1 (1 thread)",
                "N=2 / N=1 (2 threads)",
            ],
            rows,
            ["r"] + ["l"] * (len(variants) + 2),
        )
    report.limits = """
Two ranks run two step loops at once: each engine process spends most of a step in Python (scheduling, batch
preparation, detokenization) on a small model, and the GIL serializes that within one process. Two processes do
it in parallel, so the gain is highest where the step is Python-bound (the built-in model) and smallest where it
is matmul-bound (the real model, where two ranks split the same two cores one thread each). On this 2-core machine
the front end (receiving and routing outputs) and the engines' IO threads compete for the same cores, which is
what keeps the ratio below 2.
"""
