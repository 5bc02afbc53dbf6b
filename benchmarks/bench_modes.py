"""What the background process costs: ``"mp"`` and ``"async"`` throughput over ``"inproc"``, for ``generate`` and
for streams (``stream`` from a thread per request, ``astream`` from a task per request, and ``astream`` with
``output_kind=DELTA``)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .common import (
    ModelSpec,
    engine_batch_runner,
    engines_up,
    equal_workload,
    interleave,
    log,
    paired_ratio,
    session,
)
from .figures import median, rate, summary, target
from .stats import markdown_table

MODES = ("inproc", "mp", "async")
# (API, the modes it runs in): sync streams are a sync mode's; async mode's own API is astream
APIS = {
    "generate": MODES,
    "stream": ("inproc", "mp"),
    "astream": MODES,
    "astream, DELTA": MODES,
}
TARGETS = {"generate": 0.97, "stream": 0.90, "astream": 0.90, "astream, DELTA": 0.90}
SETS = 3  # fresh sets of engines per model: one set's median is one draw (engine processes differ run to run)
_TIMEOUT_S = 600.0


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(tiny=((8, 32), (16, 16), 2), real=((8,), (16, 8), 1))
    return dict(tiny=((8, 32), (128, 64), 4), real=((8,), (64, 32), 3))


def run_modes_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    models = {}
    for spec, (concurrency, lengths, repeats), apis in (
        (ctx.model("builtin"), size["tiny"], tuple(APIS)),
        (ctx.model("smollm2"), size["real"], ("generate", "astream")),
    ):
        models[spec.key] = compare_modes(spec, concurrency, lengths, repeats, apis, ctx.threads)
        models[spec.key]["label"] = spec.label
    targets = []
    for key, model in models.items():
        for row in model["rows"]:
            for mode in ("mp", "async"):
                found = row["ratios"].get(mode)
                if found is None:
                    continue
                targets.append(
                    target(
                        f"{key}, {row['api']}, {row['concurrency']} concurrent: {mode} / inproc",
                        TARGETS[row["api"]],
                        found,
                        digits=3,
                        headline=key == "smollm2" and row["api"] == "generate" and mode == "mp",
                    )
                )
    return {"threads": ctx.threads, "sizes": size, "models": models, "targets": targets}


def compare_modes(
    spec: ModelSpec,
    concurrency_list: tuple[int, ...],
    lengths: tuple[int, int],
    repeats: int,
    apis: tuple[str, ...],
    threads: int,
) -> dict[str, Any]:
    """Each API's tokens/s in each mode, the three engines up at once and their runs interleaved; the
    rounds split over fresh sets of engines, one set after the other."""
    prompt_len, output_len = lengths
    largest = equal_workload(max(concurrency_list), prompt_len, output_len)
    variants = {mode: {"mode": mode, "num_threads": threads} for mode in MODES}
    samples: dict[tuple[str, int, str], list[float]] = {}
    sets = max(1, min(SETS, repeats))
    for set_index in range(sets):
        rounds = repeats // sets + (1 if set_index < repeats % sets else 0)
        with engines_up(spec, variants, largest) as engines:
            for index, concurrency in enumerate(concurrency_list):
                batch = equal_workload(concurrency, prompt_len, output_len)
                for api in apis:
                    log(f"modes: {spec.key} {api} x{concurrency} (engine set {set_index + 1})")
                    runners = {
                        mode: api_runner(engines[mode], spec, batch, api, threads, seed=10 * set_index + i)
                        for i, mode in enumerate(APIS[api])
                    }
                    order = (
                        list(runners)[set_index % len(runners) :] + list(runners)[: set_index % len(runners)]
                    )
                    measured = interleave(
                        {m: runners[m] for m in order}, repeats=rounds, warmup=1 if index == 0 else 0
                    )
                    for mode, values in measured.items():
                        samples.setdefault((api, concurrency, mode), []).extend(values)
    rows = []
    for concurrency in concurrency_list:
        for api in apis:
            rates = {mode: samples[(api, concurrency, mode)] for mode in APIS[api]}
            rows.append(
                {
                    "api": api,
                    "concurrency": concurrency,
                    "rates": {mode: summary(values) for mode, values in rates.items()},
                    "ratios": {
                        mode: summary(paired_ratio(rates[mode], rates["inproc"]))
                        for mode in rates
                        if mode != "inproc"
                    },
                }
            )
    return {"lengths": list(lengths), "repeats": repeats, "sets": sets, "rows": rows}


def api_runner(
    engine: Any, spec: ModelSpec, workload: Any, api: str, threads: int, seed: int
) -> Callable[[], float]:
    """Tokens/s of one run of ``workload`` through ``api`` (fresh prompts each run)."""
    inproc_threads = threads if engine.mode == "inproc" else None
    if api == "generate":
        run = engine_batch_runner(engine, spec, workload, threads=inproc_threads, seed=seed)
        return lambda: run().tokens_per_s
    from enginekit import RequestOutputKind, SamplingParams

    kind = RequestOutputKind.DELTA if api.endswith("DELTA") else RequestOutputKind.CUMULATIVE
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=kind)
        for n in workload.output_lens
    ]
    rng = random.Random(seed)
    expected = workload.num_output_tokens
    consume = _threads_streams if api == "stream" else _task_streams

    def run() -> float:
        prompts = [{"prompt_token_ids": spec.random_prompt(n, rng)} for n in workload.prompt_lens]
        from .baselines import torch_threads

        with torch_threads(inproc_threads):
            start = time.perf_counter()
            tokens = consume(engine, prompts, params, kind is RequestOutputKind.DELTA)
            elapsed = time.perf_counter() - start
        if tokens != expected:
            raise RuntimeError(f"{api} gave {tokens} tokens, expected {expected}")
        return tokens / elapsed

    return run


def _tokens(outputs: list[Any], delta: bool) -> int:
    if not outputs:
        return 0
    if delta:
        return sum(len(output.outputs[0].token_ids) for output in outputs)
    return len(outputs[-1].outputs[0].token_ids)


def _threads_streams(engine: Any, prompts: list, params: list, delta: bool) -> int:
    counts = [0] * len(prompts)
    errors: list[BaseException] = []

    def consume(index: int) -> None:
        try:
            counts[index] = _tokens(list(engine.stream(prompts[index], params[index])), delta)
        except BaseException as error:
            errors.append(error)

    workers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(prompts))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(_TIMEOUT_S)
        if worker.is_alive():
            raise TimeoutError(f"a stream did not end within {_TIMEOUT_S:.0f} s")
    if errors:
        raise errors[0]
    return sum(counts)


def _task_streams(engine: Any, prompts: list, params: list, delta: bool) -> int:
    async def consume(index: int) -> int:
        return _tokens([output async for output in engine.astream(prompts[index], params[index])], delta)

    async def every() -> int:
        counts = await asyncio.wait_for(
            asyncio.gather(*(consume(i) for i in range(len(prompts)))), _TIMEOUT_S
        )
        return sum(counts)

    return asyncio.run(every())


def render_modes_bench(figures: dict[str, Any]) -> str:
    parts = [
        f"Three engines of each model are up at once (`num_threads={figures['threads']}`), one per mode, and "
        "their runs alternate, so they see the same machine; the rounds are split over fresh sets of engines "
        "started one after the other. *generate*: *N* requests through `generate` (async: `await agenerate`), "
        "one output per request end. *stream*: a thread per request iterating `engine.stream` (the sync modes). "
        "*astream*: an asyncio task per request iterating `engine.astream`; *astream, DELTA*: the same with "
        "`output_kind=DELTA`. Streams get an output per step. A ratio is the median of per-round ratios.\n"
    ]
    for model in figures["models"].values():
        rows = []
        for row in model["rows"]:
            rows.append(
                [
                    row["api"],
                    row["concurrency"],
                    *(rate(row["rates"].get(mode), 1) for mode in MODES),
                    *(
                        ""
                        if mode not in row["ratios"]
                        else f"{median(row['ratios'][mode]):.3f} ({row['ratios'][mode]['min']:.3f}-{row['ratios'][mode]['max']:.3f})"
                        for mode in ("mp", "async")
                    ),
                    f">= {TARGETS[row['api']]:.2f}",
                ]
            )
        prompt_len, output_len = model["lengths"]
        parts.append(
            f"**{model['label']}**: {prompt_len}-token prompts, {output_len} tokens each, {model['repeats']} rounds "
            f"over {model['sets']} set(s) of engines; tokens/s.\n\n"
            + markdown_table(
                ["API", "concurrent", "inproc", "mp", "async", "mp / inproc", "async / inproc", "target"],
                rows,
                ["l", "r", "r", "r", "r", "r", "r", "l"],
            )
        )
    missed = [t["name"] for t in figures["targets"] if not t["met"]]
    parts.append(
        f"{len(figures['targets']) - len(missed)} of {len(figures['targets'])} mode ratios meet their targets"
        + (f"; below: {'; '.join(missed)}." if missed else ".")
        + "\n"
    )
    return "\n".join(parts)
