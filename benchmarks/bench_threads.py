"""Section 3: which torch thread count each mode should default to on this machine."""

from __future__ import annotations

import math
from typing import Any

from .baselines import clear_model_cache, hf_generate_runner
from .common import (
    Context,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    make_engine,
    paired_ratio,
    usable_cores,
)
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Thread count per mode"


def run(ctx: Context, report: SectionReport) -> None:
    choices = sorted({1, usable_cores()})
    concurrency_list = ctx.pick((1, 8), (1, 8, 32))
    prompt_len, output_len = ctx.pick((16, 16), (128, 64))
    repeats = ctx.pick(2, 4)
    low, high = choices[0], choices[-1]
    report.method = f"""
The same batch workload ({prompt_len}-token prompts, {output_len} greedy tokens each) at each torch thread
count {", ".join(map(str, choices))}: inproc (this process's torch threads while the engine steps), mp
(`num_threads` of the engine process; the front end also needs CPU for receiving and processing outputs)
and transformers `generate` for reference. All variants alternate run by run. This process may use
{usable_cores()} core(s); the machine may run other work, which is when oversubscribed threads hurt most
(an OpenMP thread that is descheduled stalls the whole op).
"""
    if len(choices) == 1:
        report.findings.append("This machine has one core: there is no thread count to choose.")
        return
    gains: dict[str, list[Summary]] = {"inproc": [], "mp": [], "transformers": []}
    for spec in ctx.models():
        workload = equal_workload(max(concurrency_list), prompt_len, output_len)
        engines = {}
        try:
            for threads in choices:
                engines[("inproc", threads)] = make_engine(
                    spec, "inproc", num_threads=threads, num_kv_blocks=kv_blocks_for(workload)
                )
                engines[("mp", threads)] = make_engine(
                    spec, "mp", num_threads=threads, num_kv_blocks=kv_blocks_for(workload)
                )
            rows = []
            for concurrency in concurrency_list:
                ctx.log(f"threads: {spec.key} x{concurrency}")
                batch = equal_workload(concurrency, prompt_len, output_len)
                runners: dict[str, Any] = {}
                for (mode, threads), engine in engines.items():
                    runner = engine_batch_runner(
                        engine, spec, batch, threads=threads if mode == "inproc" else None, seed=threads
                    )
                    runners[f"{mode}-{threads}"] = lambda r=runner: r().tokens_per_s
                for threads in choices:
                    runners[f"transformers-{threads}"] = hf_generate_runner(
                        spec.hf_path, concurrency, batch.prompt_lens, batch.output_lens, num_threads=threads
                    )
                samples = interleave(runners, repeats=repeats, warmup=1)
                row: list[Any] = [concurrency]
                for mode in ("inproc", "mp", "transformers"):
                    for threads in choices:
                        row.append(fmt(summarize(samples[f"{mode}-{threads}"]), "", 0, thousands=True))
                    gain = paired_ratio(samples[f"{mode}-{high}"], samples[f"{mode}-{low}"])
                    gains[mode].append(gain)
                    row.append(f"{gain.median:.2f}x ({gain.min:.2f}-{gain.max:.2f})")
                rows.append(row)
        finally:
            for engine in engines.values():
                engine.shutdown()
            clear_model_cache()
        headers = ["concurrent"]
        for mode in ("inproc", "mp", "transformers"):
            headers += [f"{mode} {t}t tok/s" for t in choices] + [f"{mode} {high}t / {low}t"]
        report.table(
            f"{spec.label}: tokens/s by torch thread count", headers, rows, ["r"] + ["l"] * (len(headers) - 1)
        )
    for mode in ("inproc", "mp"):
        medians = [g.median for g in gains[mode]]
        geo = math.exp(sum(math.log(m) for m in medians) / len(medians))
        worst = min(g.min for g in gains[mode])
        pick = high if geo > 1.05 and worst > 0.8 else low
        report.findings.append(
            f"{mode}: {high} threads / {low} thread = {geo:.2f}x (geometric mean of the medians over models "
            f"and batch sizes), worst single round {worst:.2f}x -> default {pick} thread(s)"
            + (
                " (more threads are not clearly faster, and much slower when the machine is busy)"
                if pick == low
                else ""
            )
            + "."
        )
    report.limits = f"""
Each op of these tiny models runs for microseconds, so splitting it over {high} threads saves little (the
ratios above, on an idle machine) and costs a barrier per op; when any other process (or, in mp mode, the engine's own IO threads and the front
end) takes a core, a worker thread waits to be scheduled and every op waits for it. One thread avoids that
entirely and leaves the second core to the IO threads and the front end. More threads pay off only when the
ops are large (bigger hidden sizes, large batches) and the cores are otherwise idle.

What would move it: a default of `num_threads = max(1, usable_cores - 1)` in the engine process (leave a
core for the front end and the IO threads), and in inproc mode not changing the caller's process-wide torch
thread count unless asked (and restoring it at shutdown).
"""
