"""Generated tokens/s in-process against transformers ``generate`` on the same weights, on the two tiny models;
and what the real-model section shares with it: transformers at its best, and one concurrency's rows."""

from __future__ import annotations

import time
from typing import Any

from .baselines import BatchCapacity, clear_model_cache, hf_batch_runner, hf_generate_runner
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
REFERENCE = "generate, float32, dynamic cache"  # transformers' defaults: what the others are compared with


def hf_variants(size: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """transformers' configurations a section probes, by label: ``generate`` with the dynamic and the static cache
    (and the static one through torch.compile where ``size["compile"]``), and continuous batching
    (``generate_batch``'s scheduler), in each of ``size["dtypes"]`` (float32 alone by default)."""
    variants: dict[str, dict[str, Any]] = {}
    for dtype in size.get("dtypes", ("float32",)):
        for cache, compiled in (("dynamic", False), ("static", False), ("static", True)):
            if compiled and not size["compile"]:
                continue
            label = f"generate, {dtype}, {cache} cache" + (" + torch.compile" if compiled else "")
            variants[label] = {"api": "generate", "dtype": dtype, "cache": cache, "compiled": compiled}
        variants[f"generate_batch, {dtype}"] = {"api": "generate_batch", "dtype": dtype}
    return variants


def hf_runner(
    spec: ModelSpec, variant: dict[str, Any], workload: Workload, threads: int, size: dict[str, Any]
) -> Any:
    """A function that runs ``workload`` once with transformers configured as ``variant`` and returns tokens/s."""
    if variant["api"] == "generate_batch":
        largest = _largest(size)
        capacity = BatchCapacity(largest.size, largest.prompt_lens[0] + largest.output_lens[0])
        return hf_batch_runner(
            spec.hf_path,
            workload.prompt_lens,
            workload.output_lens,
            num_threads=threads,
            dtype=variant["dtype"],
            capacity=capacity,
        )
    return hf_generate_runner(
        spec.hf_path,
        workload.size,
        workload.prompt_lens,
        workload.output_lens,
        num_threads=threads,
        dtype=variant["dtype"],
        cache=variant["cache"],
        compiled=variant["compiled"],
    )


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
        # transformers' continuous batching attends, on a CPU (sdpa), every query over all the batch's keys under a
        # mask: measured by hand at 128 concurrent (built-in model, loaded 2-core machine) 150 tok/s against
        # generate's 1,570, a minute a call, which the run's budget cannot take for a baseline that far behind
        batch_max_concurrency=32,
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
                        f"{key}, {kind} lengths, {concurrency} concurrent: engine / the fastest transformers",
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
                    **transformers_curves(model["rows"]),
                },
            )
            for model in models.values()
        ],
    }


def transformers_at_its_best(spec: ModelSpec, size: dict[str, Any], threads: int) -> dict[str, Any]:
    """transformers' configurations (``hf_variants``) on one equal workload, interleaved. The rows run the fastest
    eager ``generate`` (``chosen``) and the fastest continuous batching (``chosen_batch``) beside it, each row's
    ratio against the faster of them there. What torch.compile gives at this shape, its compile not charged, is
    reported beside it (a compiled model compiles again for each new batch shape, which the rows' many shapes
    cannot afford)."""
    concurrency, repeats = size["probe"]
    prompt_len, output_len = size["equal"]
    workload = equal_workload(concurrency, prompt_len, output_len)
    variants = hf_variants(size)
    log(f"transformers: {spec.key}, {len(variants)} configurations at {concurrency} concurrent")
    runners, first_call_s = {}, {}
    compile_error = None
    for name, variant in variants.items():
        start = time.perf_counter()
        try:
            runner = hf_runner(spec, variant, workload, threads, size)
            runner()  # the warm-up: for torch.compile, the compile
        except Exception as error:
            if not variant.get("compiled"):
                raise
            # torch.compile failing (no C++ compiler, a warning transformers logs) leaves the eager baselines
            compile_error = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            log(f"transformers: {spec.key}, {name} failed: {compile_error}")
            continue
        first_call_s[name] = time.perf_counter() - start
        runners[name] = runner
    samples = interleave(runners, repeats=repeats, warmup=0)
    rates = {name: summarize(values) for name, values in samples.items()}

    def fastest(api: str) -> str | None:
        names = [n for n in rates if variants[n]["api"] == api and not variants[n].get("compiled")]
        return max(names, key=lambda n: rates[n].median) if names else None

    chosen = fastest("generate")
    assert chosen is not None
    chosen_batch = fastest("generate_batch")
    compiled = [n for n in rates if variants[n].get("compiled")]
    best_compiled = max(compiled, key=lambda n: rates[n].median) if compiled else None
    row_variants = [chosen] + ([chosen_batch] if chosen_batch else [])
    return {
        "concurrency": concurrency,
        "lengths": [prompt_len, output_len],
        "variants": {name: variants[name] for name in rates},
        "rates": {name: summary(value) for name, value in rates.items()},
        "reference": REFERENCE,
        "against_reference": {
            name: summary(paired_ratio(samples[name], samples[REFERENCE])) for name in samples
        },
        "first_call_s": first_call_s,
        "chosen": chosen,
        "chosen_batch": chosen_batch,
        "row_variants": row_variants,
        "compiled": best_compiled,
        "compile_gain": None
        if best_compiled is None
        else summary(paired_ratio(samples[best_compiled], samples[chosen])),
        "batch_max_concurrency": size.get("batch_max_concurrency"),
        "compile_probed": size["compile"],
        "compile_why_not": compile_error
        or size.get("compile_why_not", "a quick run leaves out its minutes of compiling"),
    }


def measure_concurrencies(
    engine: Any, spec: ModelSpec, size: dict[str, Any], threads: int, best: dict[str, Any], tag: str
) -> list[dict[str, Any]]:
    """``measure_rows`` at each of the size's concurrencies; ``tag`` begins each progress line."""
    rows: list[dict[str, Any]] = []
    compiled = any(best["variants"][name].get("compiled") for name in best["row_variants"])
    for index, concurrency in enumerate(size["concurrency"]):
        log(f"{tag} x{concurrency}")
        # a compiled transformers model compiles again for new shapes: each concurrency warms up
        warmup = 1 if index == 0 or compiled else 0
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
    """Equal, mixed and staggered rows at one concurrency, the engine and each of ``best["row_variants"]`` of
    transformers interleaved; each row's ``ratio`` is against the faster transformers there (``baseline_label``).

    *staggered*: the mixed requests arrive over a Poisson window of ``STAGGER_WINDOW`` x the engine's burst
    time; transformers gets all of them at time 0 (a static batch cannot take requests mid-``generate``, and
    charging it the window would flatter the engine)."""
    equal = equal_workload(concurrency, *size["equal"])
    mixed = mixed_workload(concurrency, size["prompt_range"], size["output_range"], seed=concurrency)
    labels = [
        label
        for label in best["row_variants"]
        if best["variants"][label]["api"] != "generate_batch"
        or concurrency <= size.get("batch_max_concurrency", concurrency)
    ]

    def hf(workload: Workload) -> dict[str, Any]:
        return {
            f"hf-{workload.name}:{label}": hf_runner(spec, best["variants"][label], workload, threads, size)
            for label in labels
        }

    runners: dict[str, Any] = {
        "engine-equal": _rate(engine_batch_runner(engine, spec, equal, threads=threads, seed=1)),
        **hf(equal),
        "engine-mixed": _rate(engine_batch_runner(engine, spec, mixed, threads=threads, seed=2)),
        **hf(mixed),
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
            **{f"hf-staggered:{label}": runners[f"hf-mixed:{label}"] for label in labels},
        }
        samples.update(interleave(staggered, repeats=size["repeats"], warmup=warmup))
    rows = []
    for kind, workload in (("equal", equal), ("mixed", mixed), ("staggered", mixed)):
        engine_key = f"engine-{kind}"
        if engine_key not in samples:
            continue
        flops_per_token = workload_flops(spec.config, workload) / workload.num_output_tokens
        engine_rate = summarize(samples[engine_key])
        baselines = {label: samples[f"hf-{kind}:{label}"] for label in labels}
        faster = max(labels, key=lambda label: summarize(baselines[label]).median)
        rows.append(
            {
                "concurrency": concurrency,
                "kind": kind,
                "lengths": workload.describe(),
                "window_ms": window * 1e3 if kind == "staggered" else None,
                "engine": summary(engine_rate),
                "baselines": {label: summary(values) for label, values in baselines.items()},
                "baseline_label": faster,
                "baseline": summary(baselines[faster]),
                "ratio": summary(paired_ratio(samples[engine_key], baselines[faster])),
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
    """Which configurations of transformers the rows run, and what every configuration measured (the probe)."""
    reference = best["reference"]
    others = ", ".join(
        f"`{name}` {best['against_reference'][name]['median']:.2f}x"
        + (
            f" (first call {best['first_call_s'][name]:.0f} s: the compile)"
            if best["variants"][name].get("compiled")
            else ""
        )
        for name in best["against_reference"]
        if name != reference
    )
    gain = best.get("compile_gain")
    if gain is not None and gain["median"] > 1.0:
        verdict = (
            f"torch.compile pays at this shape (`{best['compiled']}` {gain['median']:.2f}x `{best['chosen']}` once "
            "compiled), but compiles again for every new batch shape, so the rows run eager: read the engine's "
            f"ratios at this shape as {gain['median']:.2f}x smaller against a compiled transformers"
        )
    elif gain is not None:
        verdict = (
            f"torch.compile does not pay here (`{best['compiled']}` {gain['median']:.2f}x `{best['chosen']}`), "
            "so the rows run eager"
        )
    elif best.get("compile_probed"):
        verdict = f"torch.compile failed here ({best['compile_why_not']}), so the rows run eager"
    else:
        verdict = f"torch.compile was not tried ({best.get('compile_why_not', 'a quick run')})"
    rows = " and ".join(f"`{name}`" for name in best["row_variants"])
    against = (
        ", the fastest of each kind, and each row's ratio is against the faster of them there (in bold)"
        if len(best["row_variants"]) > 1
        else ", the fastest"
    )
    if best.get("batch_max_concurrency") is not None and best["chosen_batch"] is not None:
        verdict += (
            f"; `{best['chosen_batch']}` is not run above {best['batch_max_concurrency']} concurrent: on a CPU its "
            "sdpa path attends every query over all the batch's keys, about 10x slower than `generate` at 128 "
            "when measured"
        )
    return (
        f"transformers at its best: its configurations were run side by side on {best['concurrency']} concurrent "
        f"requests ({best['lengths'][0]}-token prompts, {best['lengths'][1]} tokens), against `{reference}` "
        f"(its defaults): {others}. `generate` runs the requests as one left-padded batch; `generate_batch` is its "
        "continuous batching (requests join and leave the running batch, no padding; one manager kept across "
        f"calls, sdpa attention). The rows run {rows}{against}: {verdict}."
    )


def transformers_curves(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, float]]]]:
    """Each transformers configuration's tokens/s against concurrency over the equal rows, for ``curve``."""
    equal = [row for row in rows if row["kind"] == "equal"]
    labels = dict.fromkeys(label for row in equal for label in row["baselines"])
    return {
        f"transformers {label}": [
            (row["concurrency"], row["baselines"][label]) for row in equal if label in row["baselines"]
        ]
        for label in labels
    }


def rows_table(
    rows: list[dict[str, Any]],
    *,
    digits: int,
    peak: str = "float32",
    extra: list[str] | None = None,
    cells: Any = None,
) -> str:
    """Engine against transformers, one row per workload and concurrency: one column per transformers
    configuration the rows ran (the faster in bold), the ratio against the faster; ``peak`` names the dtype
    whose peak the rows' ``share_of_peak`` divides by."""
    labels = list(dict.fromkeys(label for row in rows for label in row["baselines"]))
    headers = [
        "concurrent",
        "workload",
        "engine tok/s",
        *(f"transformers `{label}` tok/s" for label in labels),
        "engine / transformers" if len(labels) == 1 else "engine / the faster transformers",
        "GFLOP/s",
        f"of the {peak} peak",
        *(extra or []),
    ]
    table = []
    for row in rows:
        kind = row["kind"] + (f" (arrivals over {row['window_ms']:.0f} ms)" if row.get("window_ms") else "")
        share = row.get("share_of_peak")
        baselines = []
        for label in labels:
            text = rate(row["baselines"][label], digits) if label in row["baselines"] else "not run"
            baselines.append(f"**{text}**" if len(labels) > 1 and label == row["baseline_label"] else text)
        line = [
            row["concurrency"],
            kind,
            rate(row["engine"], digits),
            *baselines,
            ratio(row["ratio"]),
            f"{row['gflops']:.1f}",
            "n/a" if share is None else f"{100 * share:.1f}%",
        ]
        if cells is not None:
            line += cells(row)
        table.append(line)
    return markdown_table(headers, table, ["r", "l"] + ["r"] * (len(headers) - 2))


def render_throughput_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    parts = [
        f'`Engine(model, mode="inproc", num_threads={figures["threads"]})` runs `generate` on *N* requests '
        f"submitted at once; transformers runs the same requests on the same float32 weights with "
        f"{figures['threads']} torch threads. Greedy, EOS ignored. *equal*: "
        f"{size['equal'][0]}-token prompts, {size['equal'][1]} tokens each; *mixed*: prompts of "
        f"{size['prompt_range'][0]}-{size['prompt_range'][1]} tokens, outputs of {size['output_range'][0]}-"
        f"{size['output_range'][1]} (`generate` computes each batch until its longest request ends, `generate_batch` "
        f"stops each request at its end; only the tokens asked for count); *staggered*: the mixed requests arrive as a Poisson process over "
        f"{figures['stagger_window']:g}x the engine's burst time, while transformers gets them all at time 0 "
        f"(not charged the window). {size['repeats']} interleaved rounds. GFLOP/s counts useful forward FLOPs; "
        "the share is of the float32 peak (fused multiply-adds) measured in the first section.\n"
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
