"""Where one decode step's time goes, measured by timing the engine core's parts in place."""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import time
from collections.abc import Iterator
from typing import Any

from .bench_scaling import DecodeBench, headroom
from .common import log, session
from .stats import markdown_table

CONTEXT = 128
PARTS = (
    ("schedule", "scheduler.schedule"),
    ("prepare", "runner: input and metadata preparation (execute minus forward and sampler)"),
    ("attention", "forward: paged attention (cache write, gather, SDPA), all layers called piece by piece"),
    (
        "fused",
        "forward: layers in one native call each (stored_layer.c: norms, projections, rotary, attention, MLP)",
    ),
    ("forward_rest", "forward: everything else (embedding, norms, projections, rotary, MLP, LM head)"),
    ("sampler", "sampler (logits to token ids)"),
    ("append", "outputs: append token, detokenize, stop checks, output objects"),
    ("cache_blocks", "kv_cache.cache_full_blocks (prefix-cache hashing)"),
    ("other", "rest of EngineCore.step"),
)


class _Timers:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, name: str, function: Any) -> Any:
        clock = time.perf_counter
        totals = self.totals
        totals.setdefault(name, 0.0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += clock() - t0

        return timed


@contextlib.contextmanager
def _instrumented(core: Any, timers: _Timers) -> Iterator[None]:
    """Wrap the engine core's parts with timers (instance attributes and one module global), then restore."""
    from enginekit.model.layers import attention as llama

    runner = core.runner
    targets = [
        (core.scheduler, "schedule", "schedule"),
        (runner, "execute", "execute"),
        (runner.model, "forward", "forward"),  # the module is called: time its forward
        (runner.sampler, "sample", "sampler"),
        (core.outputs, "token", "append"),
        (core.kv_cache, "cache_full_blocks", "cache_blocks"),
    ]
    saved = [(owner, attribute, vars(owner).get(attribute, _MISSING)) for owner, attribute, _ in targets]
    saved_attention = llama.paged_attention
    fused = [(layer, layer.fused) for layer in runner.model.layers if getattr(layer, "fused", None)]
    for owner, attribute, name in targets:
        setattr(owner, attribute, timers.wrap(name, getattr(owner, attribute)))
    llama.paged_attention = timers.wrap("attention", saved_attention)
    timers.totals.setdefault("fused", 0.0)
    for layer, call in fused:
        layer.fused = timers.wrap("fused", call)
    try:
        yield
    finally:
        llama.paged_attention = saved_attention
        for layer, call in fused:
            layer.fused = call
        for owner, attribute, original in saved:
            if original is _MISSING:
                delattr(owner, attribute)  # a method: back to the class's
            else:
                setattr(owner, attribute, original)


_MISSING = object()


def run_steps_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    batches = (1, 32) if quick else (1, 8, 32, 128)
    steps = 20 if quick else 60
    models = {}
    for spec in ctx.models():
        longest = CONTEXT + headroom(max(batches), CONTEXT, steps)
        bench = DecodeBench(spec, max(batches) * longest, longest)
        try:
            columns = {}
            for batch in batches:
                log(f"steps: {spec.key} batch {batch}")
                columns[str(batch)] = breakdown(bench, batch, steps)
            profile_batch = 32 if 32 in batches else batches[-1]
            profile = _profile(bench, profile_batch, steps)
        finally:
            bench.close()
        models[spec.key] = {
            "label": spec.label,
            "columns": columns,
            "profile_batch": profile_batch,
            "profile": profile,
        }
    return {"threads": ctx.threads, "steps": steps, "batches": list(batches), "models": models, "targets": []}


def render_steps_bench(figures: dict[str, Any]) -> str:
    parts = [
        "The engine core's parts are wrapped with timers in place (the scheduler, the runner's input "
        "preparation, the forward pass and its paged attention, the sampler, the output bookkeeping, the prefix "
        f"cache's hashing), then {figures['steps']} pure decode steps at context {CONTEXT} run in this process "
        f"({figures['threads']} threads). Milliseconds per step (share of the step); then the top functions of a "
        "cProfile of the same loop (its overhead inflates Python-heavy functions: read it for where, not how "
        "much).\n"
    ]
    batches = [str(b) for b in figures["batches"]]
    for model in figures["models"].values():
        parts.append(f"**{model['label']}**\n\n" + breakdown_table(model["columns"], batches, digits=3))
        parts.append(
            f"cProfile at batch {model['profile_batch']}:\n\n"
            + markdown_table(
                ["function", "calls per step", "own µs per step", "cumulative µs per step"],
                model["profile"],
                ["l", "r", "r", "r"],
            )
        )
        one = model["columns"][batches[0]]
        python = one["schedule"] + one["prepare"] + one["append"] + one["cache_blocks"] + one["other"]
        parts.append(
            f"At batch {batches[0]}, {100 * python / one['step']:.0f}% of a step is bookkeeping outside the forward "
            f"pass and the sampler; the forward pass is {100 * (one['attention'] + one['forward_rest']) / one['step']:.0f}% "
            f"(attention {100 * one['attention'] / one['step']:.0f}%"
            + (
                f"; the layers run in one native call each, {100 * one['fused'] / one['step']:.0f}%, their attention "
                "inside"
                if one.get("fused")
                else ""
            )
            + ").\n"
        )
    return "\n".join(parts)


def breakdown_table(columns: dict[str, dict[str, float]], batches: list[str], digits: int) -> str:
    """``breakdown``'s figures by batch as a table: each part's milliseconds a step and share, then the step."""
    rows = [
        [label]
        + [
            f"{columns[b][key]:.{digits}f} ({100 * columns[b][key] / columns[b]['step']:.0f}%)"
            for b in batches
        ]
        for key, label in PARTS
    ]
    rows.append(["**whole step**"] + [f"**{columns[b]['step']:.{digits}f}**" for b in batches])
    return markdown_table(["part", *(f"batch {b}" for b in batches)], rows, ["l"] + ["r"] * len(batches))


def breakdown(bench: DecodeBench, batch: int, steps: int) -> dict[str, float]:
    timers = _Timers()
    with bench.decoding(batch, CONTEXT, steps) as step:
        step()  # untimed, before the wrappers go in
        with _instrumented(bench.core, timers):
            total = sum(step() for _ in range(steps)) / 1e3
    t = {name: value / steps * 1e3 for name, value in timers.totals.items()}
    step_ms = total / steps * 1e3
    parts = {
        "schedule": t["schedule"],
        "prepare": t["execute"] - t["forward"] - t["sampler"],
        "attention": t["attention"],
        "fused": t["fused"],
        "forward_rest": t["forward"] - t["attention"] - t["fused"],
        "sampler": t["sampler"],
        "append": t["append"],
        "cache_blocks": t["cache_blocks"],
    }
    parts["other"] = step_ms - sum(parts.values())
    parts["step"] = step_ms
    return parts


def _profile(bench: DecodeBench, batch: int, steps: int, top: int = 12) -> list[list[Any]]:
    profiler = cProfile.Profile()
    with bench.decoding(batch, CONTEXT, steps) as step:
        step()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
    stats = pstats.Stats(profiler)
    entries = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in entries:
        where = function if filename == "~" else f"{_short_path(filename)}:{line}({function})"
        rows.append(
            [
                f"`{where}`",
                f"{calls / steps:.1f}",
                f"{own / steps * 1e6:.0f}",
                f"{cumulative / steps * 1e6:.0f}",
            ]
        )
    return rows


def _short_path(filename: str) -> str:
    for marker in ("enginekit/", "torch/", "site-packages/"):
        index = filename.find(marker)
        if index >= 0:
            return filename[index:]
    return filename.rsplit("/", 1)[-1]
