"""Generated tokens/s in-process against transformers ``generate`` on the same weights, on the two tiny models;
and what the real-model section shares with it: transformers at its best, and one concurrency's rows."""

from __future__ import annotations

import time
from typing import Any

from .baselines import clear_model_cache, hf_generate_runner
from .bench_limits import machine_limits, peak_gflops
from .common import (
    ModelSpec,
    Workload,
    engine_batch_runner,
    engine_staggered_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    log,
    make_engine,
    mixed_workload,
    paired_ratio,
    poisson_arrivals,
    session,
    workload_flops,
)
from .figures import curve, median, rate, ratio, summary, target
from .stats import markdown_table, summarize

CONCURRENCY = (1, 8, 32, 128)
QUICK_CONCURRENCY = (1, 8)  # --quick: the 32 and 128 rows take minutes
STAGGER_WINDOW = 0.5  # arrivals spread over this fraction of the time the burst of the same requests takes
# transformers' configurations: (cache, compiled)
HF_VARIANTS = {
    "dynamic cache": ("dynamic", False),
    "static cache": ("static", False),
    "static cache + torch.compile": ("static", True),
}
COMPILED = "static cache + torch.compile"


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            concurrency=QUICK_CONCURRENCY,
            equal=(16, 16),
            prompt_range=(8, 64),
            output_range=(4, 32),
            repeats=1,
            probe=(8, 2),
            compile=False,
        )
    return dict(
        concurrency=CONCURRENCY,
        equal=(128, 64),
        prompt_range=(16, 256),
        output_range=(8, 128),
        repeats=3,
        probe=(8, 3),
        compile=True,
    )


def run_throughput_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    threads = ctx.threads
    limits = machine_limits(quick)
    models = {}
    for spec in ctx.models():
        best = transformers_at_its_best(spec, size, threads)
        engine = make_engine(spec, "inproc", num_threads=threads, num_kv_blocks=kv_blocks_for(_largest(size)))
        try:
            rows = measure_concurrencies(engine, spec, size, threads, best, f"throughput: {spec.key}")
        finally:
            engine.shutdown()
            clear_model_cache()
        models[spec.key] = {"label": spec.label, "transformers": best, "rows": rows}
    peak = peak_gflops(limits, "float32")
    for model in models.values():
        for row in model["rows"]:
            row["share_of_peak"] = None if peak is None else row["gflops"] / peak
    targets = []
    for key, model in models.items():
        found = {(row["kind"], row["concurrency"]): row for row in model["rows"]}
        for kind, concurrency, goal in (("equal", 32, 1.0), ("mixed", 32, 2.0), ("staggered", 128, 2.0)):
            row = found.get((kind, concurrency))
            if row is not None:
                targets.append(
                    target(
                        f"{key}, {kind} lengths, {concurrency} concurrent: engine / transformers",
                        goal,
                        row["ratio"],
                        headline=kind == "equal",
                    )
                )
    return {
        "threads": threads,
        "sizes": size,
        "stagger_window": STAGGER_WINDOW,
        "peak_float32_gflops": peak,
        "models": models,
        "targets": targets,
        "curves": [
            curve(
                f"{model['label']}, equal lengths",
                {
                    "engine": [
                        (r["concurrency"], r["engine"]) for r in model["rows"] if r["kind"] == "equal"
                    ],
                    f"transformers ({model['transformers']['chosen']})": [
                        (r["concurrency"], r["baseline"]) for r in model["rows"] if r["kind"] == "equal"
                    ],
                },
            )
            for model in models.values()
        ],
    }


def transformers_at_its_best(spec: ModelSpec, size: dict[str, Any], threads: int) -> dict[str, Any]:
    """transformers' configurations on one equal workload, interleaved: the faster eager one (dynamic or static
    cache) is the baseline of every row; what torch.compile (on the static cache) gives at this shape, its
    compile not charged, is reported beside it."""
    concurrency, repeats = size["probe"]
    prompt_len, output_len = size["equal"]
    log(f"transformers: {spec.key}, its configurations at {concurrency} concurrent")
    runners, first_call_s = {}, {}
    compile_error = None
    for name, (cache, compiled) in HF_VARIANTS.items():
        if compiled and not size["compile"]:
            continue
        start = time.perf_counter()
        try:
            runner = hf_generate_runner(
                spec.hf_path,
                concurrency,
                prompt_len,
                output_len,
                num_threads=threads,
                cache=cache,
                compiled=compiled,
            )
            runner()  # the warm-up: for torch.compile, the compile
        except Exception as error:
            if not compiled:
                raise
            # torch.compile failing (no C++ compiler, a warning transformers logs) leaves the eager baselines
            compile_error = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            log(f"transformers: {spec.key}, {name} failed: {compile_error}")
            clear_model_cache()
            continue
        first_call_s[name] = time.perf_counter() - start
        runners[name] = runner
    samples = interleave(runners, repeats=repeats, warmup=0)
    rates = {name: summarize(values) for name, values in samples.items()}
    # The rows use the faster eager configuration: a compiled model compiles again for every new batch shape
    # (each concurrency and each mixed batch: tens of seconds each for a 4-layer model, more for 30 layers),
    # which a 35-minute run cannot afford; what compile gives is measured here, at the probe's shape.
    chosen = max((name for name in rates if not HF_VARIANTS[name][1]), key=lambda name: rates[name].median)
    compile_gain = summary(paired_ratio(samples[COMPILED], samples[chosen])) if COMPILED in samples else None
    return {
        "concurrency": concurrency,
        "lengths": [prompt_len, output_len],
        "rates": {name: summary(value) for name, value in rates.items()},
        "against_dynamic": {
            name: summary(paired_ratio(samples[name], samples["dynamic cache"])) for name in samples
        },
        "first_call_s": first_call_s,
        "chosen": chosen,
        "compile_gain": compile_gain,
        "compile_probed": size["compile"],
        "compile_why_not": compile_error
        or size.get("compile_why_not", "a quick run leaves out its minutes of compiling"),
        "options": dict(zip(("cache", "compiled"), HF_VARIANTS[chosen])),
    }


def measure_concurrencies(
    engine: Any, spec: ModelSpec, size: dict[str, Any], threads: int, best: dict[str, Any], tag: str
) -> list[dict[str, Any]]:
    """``measure_rows`` at each of the size's concurrencies; ``tag`` begins each progress line."""
    rows: list[dict[str, Any]] = []
    for index, concurrency in enumerate(size["concurrency"]):
        log(f"{tag} x{concurrency}")
        # a compiled transformers model compiles again for new shapes: each concurrency warms up
        warmup = 1 if index == 0 or best["options"]["compiled"] else 0
        rows += measure_rows(engine, spec, concurrency, size, threads, best, warmup=warmup)
    return rows


def measure_rows(
    engine: Any,
    spec: ModelSpec,
    concurrency: int,
    size: dict[str, Any],
    threads: int,
    best: dict[str, Any],
    *,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    """Equal, mixed and staggered rows at one concurrency, engine and transformers interleaved.

    *staggered*: the mixed requests arrive over a Poisson window of ``STAGGER_WINDOW`` x the engine's burst
    time; transformers gets all of them at time 0 (a static batch cannot take requests mid-``generate``, and
    charging it the window would flatter the engine)."""
    equal = equal_workload(concurrency, *size["equal"])
    mixed = mixed_workload(concurrency, size["prompt_range"], size["output_range"], seed=concurrency)

    def hf(workload: Workload) -> Any:
        return hf_generate_runner(
            spec.hf_path,
            concurrency,
            workload.prompt_lens,
            workload.output_lens,
            num_threads=threads,
            **best["options"],
        )

    runners: dict[str, Any] = {
        "engine-equal": _rate(engine_batch_runner(engine, spec, equal, threads=threads, seed=1)),
        "hf-equal": hf(equal),
        "engine-mixed": _rate(engine_batch_runner(engine, spec, mixed, threads=threads, seed=2)),
        "hf-mixed": hf(mixed),
    }
    samples = interleave(runners, repeats=size["repeats"], warmup=warmup)
    window = 0.0
    if concurrency > 1:
        window = STAGGER_WINDOW * mixed.num_output_tokens / summarize(samples["engine-mixed"]).median
        arrivals = poisson_arrivals(concurrency, window, seed=concurrency)
        staggered = {
            "engine-staggered": _rate(
                engine_staggered_runner(engine, spec, mixed, arrivals, threads=threads, seed=3)
            ),
            "hf-mixed-2": runners["hf-mixed"],
        }
        samples.update(interleave(staggered, repeats=size["repeats"], warmup=warmup))
    rows = []
    for kind, workload, engine_key, hf_key in (
        ("equal", equal, "engine-equal", "hf-equal"),
        ("mixed", mixed, "engine-mixed", "hf-mixed"),
        ("staggered", mixed, "engine-staggered", "hf-mixed-2"),
    ):
        if engine_key not in samples:
            continue
        flops_per_token = workload_flops(spec.config, workload) / workload.num_output_tokens
        engine_rate = summarize(samples[engine_key])
        rows.append(
            {
                "concurrency": concurrency,
                "kind": kind,
                "lengths": workload.describe(),
                "window_ms": window * 1e3 if kind == "staggered" else None,
                "engine": summary(engine_rate),
                "baseline": summary(samples[hf_key]),
                "ratio": summary(paired_ratio(samples[engine_key], samples[hf_key])),
                "flops_per_token": flops_per_token,
                "gflops": engine_rate.median * flops_per_token / 1e9,
            }
        )
    return rows


def _rate(runner: Any) -> Any:
    return lambda: runner().tokens_per_s


def _largest(size: dict[str, Any]) -> Workload:
    """A workload at least as large as any this section runs, to size the KV cache (no preemption)."""
    prompt_len = max(size["equal"][0], size["prompt_range"][1])
    output_len = max(size["equal"][1], size["output_range"][1])
    return equal_workload(max(size["concurrency"]), prompt_len, output_len)


def transformers_text(best: dict[str, Any]) -> str:
    """Which configuration of transformers the rows use, and what the others measured (the probe)."""
    others = ", ".join(
        f"{name} {best['against_dynamic'][name]['median']:.2f}x"
        + (
            f" (first call {best['first_call_s'][name]:.0f} s: the compile)"
            if name.endswith("torch.compile")
            else ""
        )
        for name in best["against_dynamic"]
        if name != "dynamic cache"
    )
    gain = best.get("compile_gain")
    if gain is not None and gain["median"] > 1.0:
        verdict = (
            f"torch.compile pays at this shape ({gain['median']:.2f}x the {best['chosen']} once compiled), but "
            "compiles again for every new batch shape, so the rows run eager: read the engine's ratios at this "
            f"shape as {gain['median']:.2f}x smaller against a compiled transformers"
        )
    elif gain is not None:
        verdict = f"torch.compile does not pay here ({gain['median']:.2f}x the {best['chosen']}), so the rows run eager"
    elif best.get("compile_probed"):
        verdict = f"torch.compile failed here ({best['compile_why_not']}), so the rows run eager"
    else:
        verdict = f"torch.compile was not tried ({best.get('compile_why_not', 'a quick run')})"
    return (
        f"transformers at its best: its configurations were run side by side on {best['concurrency']} concurrent "
        f"requests ({best['lengths'][0]}-token prompts, {best['lengths'][1]} tokens), against the dynamic cache: "
        f"{others}. The rows use the faster eager one, **{best['chosen']}**: {verdict}."
    )


def rows_table(
    rows: list[dict[str, Any]], *, digits: int, extra: list[str] | None = None, cells: Any = None
) -> str:
    """Engine against transformers, one row per workload and concurrency."""
    headers = [
        "concurrent",
        "workload",
        "engine tok/s",
        "transformers tok/s",
        "engine / transformers",
        "GFLOP/s",
        "of FMA peak",
    ]
    table = []
    for row in rows:
        kind = row["kind"] + (f" (arrivals over {row['window_ms']:.0f} ms)" if row.get("window_ms") else "")
        share = row.get("share_of_peak")
        line = [
            row["concurrency"],
            kind,
            rate(row["engine"], digits),
            rate(row["baseline"], digits),
            ratio(row["ratio"]),
            f"{row['gflops']:.1f}",
            "n/a" if share is None else f"{100 * share:.1f}%",
        ]
        if cells is not None:
            line += cells(row)
        table.append(line)
    headers += extra or []
    return markdown_table(headers, table, ["r", "l", "r", "r", "r", "r", "r"] + ["r"] * len(extra or []))


def render_throughput_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    parts = [
        f'`Engine(model, mode="inproc", num_threads={figures["threads"]})` runs `generate` on *N* requests '
        f"submitted at once; transformers runs `model.generate` on one batch of the same requests (left-padded, "
        f"same float32 weights, {figures['threads']} torch threads). Greedy, EOS ignored. *equal*: "
        f"{size['equal'][0]}-token prompts, {size['equal'][1]} tokens each; *mixed*: prompts of "
        f"{size['prompt_range'][0]}-{size['prompt_range'][1]} tokens, outputs of {size['output_range'][0]}-"
        f"{size['output_range'][1]} (transformers computes each batch until its longest request ends; only the "
        f"tokens asked for count); *staggered*: the mixed requests arrive as a Poisson process over "
        f"{figures['stagger_window']:g}x the engine's burst time, while transformers gets them all at time 0 "
        f"(not charged the window). {size['repeats']} interleaved rounds. GFLOP/s counts useful forward FLOPs; "
        "the share is of the float32 FMA peak measured in the first section.\n"
    ]
    for model in figures["models"].values():
        parts.append(f"**{model['label']}.** {transformers_text(model['transformers'])}\n")
        parts.append(rows_table(model["rows"], digits=0))
        equal = [r for r in model["rows"] if r["kind"] == "equal"]
        parts.append(
            "Engine / transformers with equal lengths: "
            + ", ".join(f"{median(r['ratio']):.2f}x at {r['concurrency']}" for r in equal)
            + ".\n"
        )
    return "\n".join(parts)
