"""Quantized weights against llama.cpp: the default model's GGUF file kept as stored (``quantization="auto"``) and
dequantized at load (``"none"``), beside llama.cpp on the same file with the same threads.

One request of ``decode`` tokens, ``concurrent`` requests at once, and one long prompt's prefill, the three
systems interleaved round by round; what a decoded token streams against the measured read bandwidth; the engine
process's RSS with each setting; where a decode step's time goes at 1 and at ``concurrent`` requests.
"""

from __future__ import annotations

import random
from typing import Any

from . import llama_cpp_runner
from .bench_limits import machine_limits, peak_gflops, products_dtype
from .bench_real import gguf_streamed_bytes, streamed_bytes
from .bench_scaling import DecodeBench, headroom
from .bench_steps import CONTEXT, breakdown, breakdown_table
from .common import (
    ModelSpec,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    log,
    make_engine,
    paired_ratio,
    session,
    workload_flops,
)
from .figures import median, of, rate, ratio, summary, target
from .stats import markdown_table

SETTINGS = ("auto", "none")
LLAMA_KEYS = ("llama.cpp", "llama.cpp one at a time")
CEILING_GOAL = 0.5  # of the workload's arithmetic ceiling at ``concurrent`` requests
BATCHED_GOAL = 2.5  # against llama.cpp with the same ``concurrent`` sequences in one batch per step
_MB = 1e6


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(prompt=16, decode=16, concurrent=8, concurrent_decode=16, prefill=128, rounds=1, steps=8)
    return dict(prompt=32, decode=128, concurrent=16, concurrent_decode=32, prefill=512, rounds=3, steps=30)


def run_quantized_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    threads = ctx.threads
    spec = ctx.model("smollm2")
    limits = machine_limits(quick)
    bandwidth = limits["read_gb_s"]["all"]["median"]
    why_not = llama_cpp_runner.available()
    figures: dict[str, Any] = {
        "threads": threads,
        "sizes": size,
        "model": spec.label,
        "file": spec.hf_path,
        "read_gb_s": bandwidth,
        "llama_cpp": {"why_not": why_not} if why_not else {"version": llama_cpp_runner.version()},
    }
    figures["rss"] = engine_rss(spec, size)
    one = equal_workload(1, size["prompt"], size["decode"])
    many = equal_workload(size["concurrent"], size["prompt"], size["concurrent_decode"])
    prefill = equal_workload(1, size["prefill"], 1)
    blocks = kv_blocks_for(many) + kv_blocks_for(prefill)
    engines = {
        setting: make_engine(spec, "inproc", num_threads=threads, quantization=setting, num_kv_blocks=blocks)
        for setting in SETTINGS
    }
    llm = None
    try:
        if why_not is None:
            try:
                llm = llama_cpp_runner.LlamaCppProcess(
                    spec.hf_path,
                    max_sequences=size["concurrent"],
                    max_length=max(
                        size["prompt"] + max(size["decode"], size["concurrent_decode"]), size["prefill"] + 1
                    ),
                    threads=threads,
                )
            except llama_cpp_runner.LlamaCppCrashed as crash:
                figures["llama_cpp"]["crashed"] = str(crash)
        figures["streamed"] = {setting: streamed_bytes(engines[setting]) for setting in SETTINGS}
        figures["streamed"]["llama.cpp"] = {"weights": gguf_streamed_bytes(spec.hf_path)}
        runs = {}
        for name, workload in (("one", one), ("concurrent", many), ("prefill", prefill)):
            log(
                f"quant: {name} ({workload.size} x prompt {workload.prompt_lens[0]}, {workload.output_lens[0]} tokens)"
            )
            runners: dict[str, Any] = {}
            for setting, engine in engines.items():
                run = engine_batch_runner(engine, spec, workload, threads=threads, seed=31)
                runners[setting] = _rate(run, prefill=name == "prefill", workload=workload)
            if llm is not None:
                runners["llama.cpp"] = _llama_rate(
                    llm, spec, workload, batched=True, prefill=name == "prefill"
                )
                if name == "concurrent":
                    runners["llama.cpp one at a time"] = _llama_rate(llm, spec, workload, batched=False)
            samples, crash = llama_cpp_runner.interleave_surviving(
                runners, LLAMA_KEYS, interleave, repeats=size["rounds"], warmup=1
            )
            if crash is not None:  # the rest of the section runs without it
                log(f"quant: {crash}")
                figures["llama_cpp"]["crashed"] = crash
                if llm is not None:
                    llm.close()
                llm = None
            runs[name] = {
                "rates": {key: summary(values) for key, values in samples.items()},
                "against_none": summary(paired_ratio(samples["auto"], samples["none"])),
                **(
                    {"against_llama_cpp": summary(paired_ratio(samples["auto"], samples["llama.cpp"]))}
                    if "llama.cpp" in samples
                    else {}
                ),
                "_samples": samples,
            }
    finally:
        for engine in engines.values():
            engine.shutdown()
        if llm is not None:
            llm.close()
    for entry in runs.values():
        del entry["_samples"]
    figures["runs"] = runs
    figures["bandwidth"] = _bandwidth(figures, size)
    figures["compute"] = _compute_ceiling(figures, spec, many, limits)
    figures["steps"] = step_breakdown(spec, size)
    figures["targets"] = _targets(figures)
    return figures


def _rate(run: Any, *, prefill: bool, workload: Any) -> Any:
    """Generated tokens/s, or for a prefill run prompt tokens/s (the one generated token's time included)."""
    if not prefill:
        return lambda: run().tokens_per_s
    return lambda: workload.prompt_lens[0] / run().elapsed_s


def _llama_rate(llm: Any, spec: ModelSpec, workload: Any, *, batched: bool, prefill: bool = False) -> Any:
    rng = random.Random(41)

    def run() -> float:
        prompts = [spec.random_prompt(n, rng) for n in workload.prompt_lens]
        tokens, elapsed = llm.generate(prompts, workload.output_lens[0], batched=batched)
        return (workload.prompt_lens[0] if prefill else tokens) / elapsed

    return run


def engine_rss(spec: ModelSpec, size: dict[str, Any]) -> dict[str, Any]:
    """The engine process's resident memory (mp mode) with each setting, after it served one short request:
    the weights it maps or holds, its KV cache (the same for both) and the runtime."""
    import os

    import psutil

    rows = {}
    for setting in SETTINGS:
        log(f"quant: RSS with quantization={setting!r}")
        engine = make_engine(
            spec, "mp", quantization=setting, num_kv_blocks=kv_blocks_for(equal_workload(1, 16, 16))
        )
        try:
            run = engine_batch_runner(engine, spec, equal_workload(1, 16, 8), seed=5)
            run()
            memory = psutil.Process(engine.client.engine_pid).memory_info()
            rows[setting] = {"rss": memory.rss, "shared": getattr(memory, "shared", None)}
        finally:
            engine.shutdown()
    return {"file_bytes": os.path.getsize(spec.hf_path), **rows}


def _bandwidth(figures: dict[str, Any], size: dict[str, Any]) -> dict[str, Any]:
    """At one request: the bytes a decoded token streams (weights plus its context's KV cache), the tokens/s the
    measured read bandwidth allows at most, and the share of that limit each system reaches."""
    context = size["prompt"] + size["decode"] / 2
    out = {"context": context}
    rates = figures["runs"]["one"]["rates"]
    for system, streamed in figures["streamed"].items():
        kv = figures["streamed"]["auto"]["kv_per_position"] * context
        if system == "llama.cpp":
            kv /= 2  # its KV cache holds float16, the engine's float32
        per_token = streamed["weights"] + kv
        ceiling = figures["read_gb_s"] * 1e9 / per_token
        reached = median(rates.get(system))
        out[system] = {"bytes_per_token": per_token, "ceiling": ceiling, "share": reached / ceiling}
    return out


def _compute_ceiling(
    figures: dict[str, Any], spec: ModelSpec, workload: Any, limits: dict[str, Any]
) -> dict[str, Any]:
    """At ``concurrent`` requests a step is bound by arithmetic, not bytes: the workload's useful FLOPs per generated
    token against the peak of the arithmetic stored weights' products run in (``products_dtype``) give the most
    tokens/s the machine allows. With the share of it the engine reaches (its rounds' spread: a summary), and the
    share that ``BATCHED_GOAL`` x batched llama.cpp would take."""
    dtype = products_dtype(True, "float32")
    peak = peak_gflops(limits, dtype)
    if peak is None:
        return {}
    per_token = workload_flops(spec.config, workload) / sum(workload.output_lens)
    ceiling = peak * 1e9 / per_token
    rates = figures["runs"]["concurrent"]["rates"]
    out: dict[str, Any] = {
        "dtype": dtype,
        "peak_gflops": peak,
        "flops_per_token": per_token,
        "ceiling": ceiling,
    }
    out["share"] = summary(of(rates["auto"]).scaled(1.0 / ceiling))
    if "llama.cpp" in rates:
        out["batched_goal_share"] = BATCHED_GOAL * median(rates["llama.cpp"]) / ceiling
    return out


def step_breakdown(spec: ModelSpec, size: dict[str, Any]) -> dict[str, Any]:
    """Milliseconds per part of a pure decode step at 1 and ``concurrent`` requests, weights as stored."""
    batches = (1, size["concurrent"])
    steps = size["steps"]
    longest = CONTEXT + headroom(max(batches), CONTEXT, steps)
    bench = DecodeBench(spec, max(batches) * longest, longest, quantization="auto")
    try:
        columns = {}
        for batch in batches:
            log(f"quant: step breakdown at batch {batch}")
            columns[str(batch)] = breakdown(bench, batch, steps)
    finally:
        bench.close()
    return {"context": CONTEXT, "steps": steps, "columns": columns}


def _targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The section's targets; one against llama.cpp that was not measured (missing, crashed) is listed as such."""
    runs, size = figures["runs"], figures["sizes"]
    unmeasured = float("nan")
    targets = [
        target(
            f"quantized, 1 request x {size['decode']} tokens: engine / llama.cpp",
            1.2,
            runs["one"].get("against_llama_cpp", unmeasured),
            headline=True,
        ),
    ]
    if figures.get("compute"):
        targets.append(
            target(
                f"quantized, {size['concurrent']} concurrent: share of the workload's arithmetic ceiling",
                CEILING_GOAL,
                figures["compute"]["share"],
                unit="%",
                digits=0,
            )
        )
    targets += [
        target(
            f"quantized, {size['concurrent']} concurrent: engine / llama.cpp batched",
            BATCHED_GOAL,
            runs["concurrent"].get("against_llama_cpp", unmeasured),
        ),
        target(
            f"quantized, {size['prefill']}-token prefill: engine / llama.cpp",
            1.0,
            runs["prefill"].get("against_llama_cpp", unmeasured),
        ),
    ]
    return targets


def render_quantized_bench(figures: dict[str, Any]) -> str:
    size, runs = figures["sizes"], figures["runs"]
    streamed = figures["streamed"]
    llama = figures["llama_cpp"]
    has_llama = "llama.cpp" in runs["one"]["rates"]
    systems = ["auto", "none"] + (["llama.cpp"] if has_llama else [])
    label = {
        "auto": '`quantization="auto"` (as stored)',
        "none": '`quantization="none"` (float32)',
        "llama.cpp": f"llama.cpp {llama.get('version', '')}",
    }
    parts = [
        f'{figures["model"]}: `Engine()`\'s file, kept as stored (`quantization="auto"`, the default: '
        f'{", ".join(streamed["auto"]["dtypes"])}) and dequantized at load (`"none"`), `mode="inproc"`, '
        f"{figures['threads']} threads; llama.cpp on the same file with the same threads through llama-cpp-python's "
        f"low-level batch API. Greedy, EOS ignored, random prompts of {size['prompt']} tokens; "
        f"{size['rounds']} interleaved rounds after a warm-up. *Prefill*: one {size['prefill']}-token prompt "
        "and one generated token, in prompt tokens/s.\n"
    ]
    note = llama_cpp_note(llama)
    if note:
        parts.append(note)
    rows = []
    for name, what in (
        ("one", f"1 request, {size['decode']} tokens: tok/s"),
        ("concurrent", f"{size['concurrent']} concurrent, {size['concurrent_decode']} tokens each: tok/s"),
        ("prefill", f"{size['prefill']}-token prefill: prompt tok/s"),
    ):
        run = runs[name]
        row = [what] + [rate(run["rates"].get(s), 1) for s in systems]
        row += [ratio(run["against_none"])] + ([ratio(run.get("against_llama_cpp"))] if has_llama else [])
        rows.append(row)
    headers = ["", *(label[s] for s in systems), "auto / none"] + (["auto / llama.cpp"] if has_llama else [])
    parts.append(markdown_table(headers, rows, ["l"] + ["r"] * (len(headers) - 1)))
    concurrent = runs["concurrent"]
    if "llama.cpp" in concurrent["rates"]:
        parts.append(
            f"At {size['concurrent']} concurrent requests the engine generates "
            f"{ratio(concurrent['against_llama_cpp'], 2)} what llama.cpp does with the same {size['concurrent']} "
            f"sequences in one batch per step ({rate(concurrent['rates']['llama.cpp'], 1)} tok/s; one after another "
            f"{rate(concurrent['rates'].get('llama.cpp one at a time'), 1)}); the target is {BATCHED_GOAL:g}x.\n"
        )
    band = figures["bandwidth"]
    rows = [
        [
            label[s],
            f"{band[s]['bytes_per_token'] / _MB:.1f}",
            f"{band[s]['ceiling']:.0f}",
            f"{median(runs['one']['rates'].get(s)):.1f}",
            f"{100 * band[s]['share']:.0f}%",
        ]
        for s in systems
    ]
    parts.append(
        f"**The physical limit.** A decoded token at one request streams the weights a step reads (all but the token "
        f"embedding's unused rows) and its context's KV cache (mean context {band['context']:.0f}); the measured "
        f"read bandwidth, {figures['read_gb_s']:.1f} GB/s, allows at most bandwidth / bytes tokens/s.\n\n"
        + markdown_table(
            ["", "MB per token", "tok/s the bandwidth allows", "tok/s reached", "share of the limit"],
            rows,
            ["l", "r", "r", "r", "r"],
        )
    )
    compute = figures.get("compute")
    if compute:
        share = compute["share"]
        share_text = f"{100 * median(share):.0f}% ({100 * share['min']:.0f}-{100 * share['max']:.0f}%)"
        goal_share = compute.get("batched_goal_share")
        parts.append(
            f"**The arithmetic limit at {size['concurrent']} concurrent.** The workload's useful work is "
            f"{compute['flops_per_token'] / 1e6:.0f} MFLOP per generated token (its prompts, the layers and attention "
            "of every token, the LM head per generated token); the products run as "
            f"{compute['dtype']} arithmetic on this CPU, whose measured peak ({compute['peak_gflops']:.0f} GFLOP/s on "
            f"all cores, first section) allows at most {compute['ceiling']:.0f} tok/s. The engine reaches "
            f"{share_text} of that ceiling, its prefill, attention, sampler and Python included; the target is "
            f"{100 * CEILING_GOAL:.0f}%"
            + (
                f", and {BATCHED_GOAL:g}x batched llama.cpp would take {100 * goal_share:.0f}% of it.\n"
                if goal_share is not None
                else ".\n"
            )
        )
    rss = figures["rss"]
    parts.append(
        f"**Memory.** The engine process's RSS after one short request (mp mode; the file is "
        f'{rss["file_bytes"] / _MB:.0f} MB): `quantization="auto"` {rss["auto"]["rss"] / _MB:.0f} MB, '
        f'`"none"` {rss["none"]["rss"] / _MB:.0f} MB ({rss["none"]["rss"] / rss["auto"]["rss"]:.2f}x).\n'
    )
    steps = figures["steps"]
    parts.append(
        f"**Where a step's time goes** (weights as stored, pure decode at context {steps['context']}, "
        f"{steps['steps']} steps, ms per step and share):\n\n"
        + breakdown_table(steps["columns"], list(steps["columns"]), digits=2)
    )
    return "\n".join(parts)


def llama_cpp_note(llama: dict[str, Any]) -> str:
    """A line for the page when llama.cpp was not measured (not installed) or crashed; empty otherwise."""
    if "why_not" in llama:
        return (
            f"**llama.cpp was not measured**: {llama['why_not']} (`make bench` installs it: the `llamacpp` "
            "dependency group). Its rows and targets say n/a.\n"
        )
    if "crashed" in llama:
        return (
            f"**llama.cpp crashed**, so its figures from then on are missing (its targets say n/a, the engine's "
            f"rows were measured without it): {llama['crashed']}.\n"
        )
    return ""
