"""The default model (SmolLM2-135M-Instruct, as ``Engine()`` loads it) against transformers at its best, against
llama.cpp with its sequences batched and one at a time, and against the machine's own limits."""

from __future__ import annotations

import random
from typing import Any

from . import llama_cpp_runner
from .baselines import clear_model_cache
from .bench_limits import machine_limits, peak_gflops, products_dtype
from .bench_throughput import (
    measure_concurrencies,
    rows_table,
    transformers_at_its_best,
    transformers_curves,
    transformers_text,
)
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
)
from .figures import curve, median, rate, ratio, summary, target
from .stats import markdown_table


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            concurrency=(1, 4),
            llama_cpp=(1, 4),
            equal=(16, 8),
            prompt_range=(8, 32),
            output_range=(4, 16),
            repeats=1,
            llama_cpp_rounds=1,
            probe=(4, 1),
            compile=False,
            dtypes=("float32", "bfloat16"),
        )
    return dict(
        concurrency=(1, 8, 32),  # 128 of a 30-layer model against transformers: minutes more per round
        llama_cpp=(1, 8, 32),
        equal=(64, 32),
        prompt_range=(16, 128),
        output_range=(8, 64),
        repeats=2,
        llama_cpp_rounds=2,
        probe=(8, 2),
        # Measured by hand on 2026-12-03 (2 cores, loaded): the first compiled generate of this 30-layer model had
        # not ended after 9 minutes (a quarter of the run's budget); the tiny models' section shows what it gives.
        compile=False,
        compile_why_not="its first compiled generate of this 30-layer model ran past 9 minutes when measured, "
        "a quarter of the run's budget; the tiny models' section shows what it gives",
        # the engine's products run in bfloat16 where the CPU has it: transformers gets both dtypes
        dtypes=("float32", "bfloat16"),
    )


def run_real_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    threads = ctx.threads
    spec = ctx.model("smollm2")
    limits = machine_limits(quick)
    best = transformers_at_its_best(spec, size, threads)
    prompt_len, output_len = size["equal"]
    largest = equal_workload(max(size["concurrency"]), max(prompt_len, size["prompt_range"][1]), 64)
    engine = make_engine(spec, "inproc", num_threads=threads, num_kv_blocks=kv_blocks_for(largest) + 64)
    try:
        streamed = streamed_bytes(engine)
        rows = measure_concurrencies(engine, spec, size, threads, best, "real:")
    finally:
        engine.shutdown()
        clear_model_cache()
    dtype = products_dtype(streamed["stored"], streamed["dtype"])
    peak = peak_gflops(limits, dtype)
    bandwidth = limits["read_gb_s"]["all"]["median"]
    for row in rows:
        context = _mean_context(row, size)
        row["bytes_per_token"] = (
            streamed["weights"] / row["concurrency"] + streamed["kv_per_position"] * context
        )
        row["share_of_peak"] = None if peak is None else row["gflops"] / peak
        row["share_of_bandwidth"] = row["bytes_per_token"] * median(row["engine"]) / 1e9 / bandwidth
    llama_cpp = compare_llama_cpp(spec, size, threads)
    found = {(row["kind"], row["concurrency"]): row for row in rows}
    targets = []
    for kind, concurrency, goal in (
        ("equal", 1, 2.0),
        ("equal", 32, 1.2),
        ("mixed", 32, 2.5),
        ("staggered", 32, 2.5),
    ):
        row = found.get((kind, concurrency))
        if row is not None:
            targets.append(
                target(
                    f"real model, {kind} lengths, {concurrency} concurrent: engine / the fastest transformers",
                    goal,
                    row["ratio"],
                    headline=(kind, concurrency) in (("equal", 1), ("equal", 32)),
                )
            )
    top = largest_equal_row(rows)
    if top is not None and top["share_of_peak"] is not None:
        targets.append(
            target(
                f"real model, equal lengths, {top['concurrency']} concurrent: share of the {dtype} peak",
                0.4,
                top["share_of_peak"],
                unit="%",
                digits=0,
            )
        )
    measured = {entry["concurrency"]: entry["against_batched"] for entry in llama_cpp.get("rows", [])}
    for concurrency in (c for c in size["llama_cpp"] if c in (1, 8)):
        targets.append(  # n/a where llama.cpp is missing or crashed
            target(
                f"real model, {concurrency} concurrent: engine / llama.cpp (batched)",
                1.0,
                measured.get(concurrency, float("nan")),
                headline=True,
            )
        )
    equal = [r for r in rows if r["kind"] == "equal"]
    systems = {"engine": [(r["concurrency"], r["engine"]) for r in equal], **transformers_curves(rows)}
    for key, label in (("batched", "llama.cpp, batched"), ("one_at_a_time", "llama.cpp, one at a time")):
        systems[label] = [(e["concurrency"], e[key]) for e in llama_cpp.get("rows", [])]
    return {
        "threads": threads,
        "sizes": size,
        "model": spec.label,
        "streamed": streamed,
        "peak_gflops": peak,
        "peak_dtype": dtype,
        "read_gb_s": bandwidth,
        "transformers": best,
        "rows": rows,
        "llama_cpp": llama_cpp,
        "targets": targets,
        "curves": [
            curve(f"{spec.label}, equal lengths ({prompt_len}-token prompts, {output_len} tokens)", systems)
        ],
    }


def streamed_bytes(engine: Any) -> dict[str, Any]:
    """What one decode step of an in-process engine reads: every projection's weight (as stored, for weights kept
    as the GGUF file stores them, else its float tensor) and the other parameters (norms), each tensor once; not
    the token embedding, of which a step reads one row per token (a tied LM head counts it through the head);
    and the KV cache bytes per position of context."""
    from torch import nn

    model = engine._client._core.runner.model  # an in-process engine's model (benchmark access only)
    config = model.config
    seen: set[int] = set()
    weights, kinds = 0, set()
    float_bytes = 4
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        stored = getattr(module, "stored", None)
        for part in getattr(stored, "parts", ()):
            if part.blocks.data_ptr() not in seen:
                seen.add(part.blocks.data_ptr())
                weights += part.nbytes
                kinds.add(part.quant_type.name)
        for tensor in module.parameters(recurse=False):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                weights += tensor.numel() * tensor.element_size()
                kinds.add(str(tensor.dtype).removeprefix("torch."))
                float_bytes = tensor.element_size()
    kv_per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * float_bytes
    floats = {"float32", "bfloat16", "float16"}
    dtype = "bfloat16" if kinds <= {"bfloat16"} else "float32"
    return {
        "weights": weights,
        "dtypes": sorted(kinds),
        "dtype": dtype,
        "stored": bool(kinds - floats),
        "kv_per_position": kv_per_position,
    }


def _mean_context(row: dict[str, Any], size: dict[str, Any]) -> float:
    """The mean context a decoded token attends to in this row's workload."""
    if row["kind"] == "equal":
        prompt, output = size["equal"]
    else:
        prompt, output = (sum(size["prompt_range"]) / 2, sum(size["output_range"]) / 2)
    return prompt + output / 2


def compare_llama_cpp(spec: ModelSpec, size: dict[str, Any], threads: int) -> dict[str, Any]:
    """The engine against llama.cpp on the same GGUF file, equal lengths: llama.cpp with every sequence in one
    batch per step, and one sequence after another; the three interleaved. llama.cpp runs in a child process: if
    it crashes, the rows measured before stay and ``crashed`` says how it ended."""
    why = llama_cpp_runner.available()
    if why is not None:
        return {"why_not": why}
    prompt_len, output_len = size["equal"]
    rng = random.Random(11)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "version": llama_cpp_runner.version(),
        "weights": gguf_streamed_bytes(spec.hf_path),
    }
    engine = make_engine(spec, "inproc", num_threads=threads)
    llm = None
    try:
        llm = llama_cpp_runner.LlamaCppProcess(
            spec.hf_path,
            max_sequences=max(size["llama_cpp"]),
            max_length=prompt_len + output_len,
            threads=threads,
        )
        for concurrency in size["llama_cpp"]:
            log(f"real: llama.cpp x{concurrency}")

            def llama(batched: bool, concurrency: int = concurrency, llm: Any = llm) -> Any:
                def run() -> float:
                    prompts = [spec.random_prompt(prompt_len, rng) for _ in range(concurrency)]
                    tokens, elapsed = llm.generate(prompts, output_len, batched=batched)
                    return tokens / elapsed

                return run

            batch = equal_workload(concurrency, prompt_len, output_len)
            engine_run = engine_batch_runner(engine, spec, batch, threads=threads, seed=21)
            runners = {"engine": lambda r=engine_run: r().tokens_per_s, "batched": llama(True)}
            if concurrency > 1:
                runners["one_at_a_time"] = llama(False)
            samples = interleave(runners, repeats=size["llama_cpp_rounds"], warmup=1)
            if concurrency == 1:
                samples["one_at_a_time"] = samples["batched"]  # one sequence: the same thing
            rows.append(
                {
                    "concurrency": concurrency,
                    "engine": summary(samples["engine"]),
                    "batched": summary(samples["batched"]),
                    "one_at_a_time": summary(samples["one_at_a_time"]),
                    "against_batched": summary(paired_ratio(samples["engine"], samples["batched"])),
                    "against_one_at_a_time": summary(
                        paired_ratio(samples["engine"], samples["one_at_a_time"])
                    ),
                }
            )
    except llama_cpp_runner.LlamaCppCrashed as crash:
        log(f"real: {crash}")
        out["crashed"] = str(crash)
    finally:
        engine.shutdown()
        if llm is not None:
            llm.close()
    return {**out, "rows": rows}


def gguf_streamed_bytes(path: str) -> int:
    """The bytes of a GGUF's tensors a decode step reads: all but the token embedding, unless it is also the
    output (tied)."""
    from gguf import GGUFReader

    tensors = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(path).tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors:
        total -= tensors.get("token_embd.weight", 0)
    return total


def render_real_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    streamed = figures["streamed"]
    rows = figures["rows"]
    peak = figures["peak_gflops"]
    parts = [
        f"{figures['model']}, as `Engine()` loads it (weights {', '.join(streamed['dtypes'])}: "
        f'{streamed["weights"] / 1e6:.0f} MB read per decode step), `mode="inproc"`, {figures["threads"]} '
        f"threads; transformers loads the same GGUF file dequantized (to float32 or bfloat16: each configuration names its "
        f"dtype). Workloads as in the tiny "
        f"models' section, sized for a 30-layer model: *equal* {size['equal'][0]}-token prompts and "
        f"{size['equal'][1]} tokens; *mixed* prompts of {size['prompt_range'][0]}-{size['prompt_range'][1]} "
        f"tokens and outputs of {size['output_range'][0]}-{size['output_range'][1]}; *staggered* the mixed ones "
        f"arriving over half the engine's burst time (transformers gets them at time 0). {size['repeats']} "
        "interleaved rounds. *Bytes per token* is what a decoded token streams: the weights over the batch, "
        "plus its context's KV cache; *of bandwidth* is that times tokens/s over the measured read "
        "bandwidth (the prefill's time included, so a floor).\n",
        transformers_text(figures["transformers"]) + "\n",
        rows_table(
            rows,
            digits=1,
            peak=figures["peak_dtype"],
            extra=["bytes / token", "of bandwidth"],
            cells=lambda row: [
                f"{row['bytes_per_token'] / 1e6:.1f} MB",
                f"{100 * row['share_of_bandwidth']:.0f}%",
            ],
        ),
    ]
    one = next((r for r in rows if r["kind"] == "equal" and r["concurrency"] == 1), None)
    if one is not None:
        ceiling = figures["read_gb_s"] * 1e9 / one["bytes_per_token"]
        parts.append(
            f"At 1 concurrent request a token streams {one['bytes_per_token'] / 1e6:.0f} MB: the measured read "
            f"bandwidth ({figures['read_gb_s']:.1f} GB/s) allows at most {ceiling:.0f} tokens/s, and the engine "
            f"reaches {median(one['engine']):.1f} ({100 * median(one['engine']) / ceiling:.0f}% of that)."
            + peak_sentence(rows, peak, figures["peak_dtype"])
            + "\n"
        )
    parts.append(_llama_cpp_text(figures))
    return "\n".join(parts)


def largest_equal_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The equal-lengths row at the largest concurrency: the one the share-of-peak target and sentence are about."""
    equal = [row for row in rows if row["kind"] == "equal"]
    return max(equal, key=lambda row: row["concurrency"]) if equal else None


def peak_sentence(rows: list[dict[str, Any]], peak: float | None, dtype: str) -> str:
    """How much of the ``dtype`` peak the largest batch's equal row uses (empty without a peak)."""
    top = largest_equal_row(rows)
    if peak is None or top is None or top.get("share_of_peak") is None:
        return ""
    return (
        f" The largest batch's equal row ({top['concurrency']} concurrent) uses {100 * top['share_of_peak']:.1f}% "
        f"of the {dtype} peak ({peak:.0f} GFLOP/s), the arithmetic its products run in."
    )


def _llama_cpp_text(figures: dict[str, Any]) -> str:
    llama = figures["llama_cpp"]
    if "why_not" in llama:
        return f"**llama.cpp was not measured**: {llama['why_not']} (`make bench` installs it: the `llamacpp` dependency group).\n"
    crashed = ""
    if "crashed" in llama:
        where = "the rows below stop where it did" if llama["rows"] else "it has no rows"
        crashed = f"**llama.cpp crashed**, so {where} (its targets say n/a): {llama['crashed']}.\n\n"
    rows = [
        [
            e["concurrency"],
            rate(e["engine"], 1),
            rate(e["batched"], 1),
            rate(e["one_at_a_time"], 1),
            ratio(e["against_batched"]),
            ratio(e["against_one_at_a_time"]),
        ]
        for e in llama["rows"]
    ]
    engine_mb = figures["streamed"]["weights"] / 1e6
    return (
        f"**llama.cpp** (llama-cpp-python {llama['version']} in a child process, the same GGUF with its own quantized "
        f"kernels: {llama['weights'] / 1e6:.0f} MB of weights per step against the engine's {engine_mb:.0f} MB), equal "
        f"lengths, {figures['threads']} threads. *batched*: every sequence in one `llama_batch` per step through "
        "the low-level API (one context, a unified KV cache), as a llama.cpp server with parallel slots runs; "
        "*one at a time*: the sequences one after another, as `Llama.generate` runs them. Interleaved with the "
        f"engine, {figures['sizes']['llama_cpp_rounds']} rounds after a warm-up.\n\n"
        + crashed
        + (
            ""
            if not rows
            else markdown_table(
                [
                    "concurrent",
                    "engine tok/s",
                    "llama.cpp batched",
                    "llama.cpp one at a time",
                    "engine / batched",
                    "engine / one at a time",
                ],
                rows,
                ["r", "r", "r", "r", "r", "r"],
            )
        )
    )
