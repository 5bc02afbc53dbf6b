"""Section 7: where one decode step's time goes, measured by timing the engine core's parts in place."""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import time
from collections.abc import Iterator
from typing import Any

from .bench_scaling import DecodeBench, headroom
from .common import Context
from .report import SectionReport

TITLE = "Step breakdown: where a decode step's time goes"
CONTEXT = 128
PARTS = (
    ("schedule", "scheduler.schedule"),
    ("prepare", "runner: input and metadata preparation (execute minus forward and sampler)"),
    ("attention", "forward: paged attention (cache write, gather, SDPA), all layers"),
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
        (runner, "model", "forward"),
        (runner, "sampler", "sampler"),
        (core, "_append_token", "append"),
        (core.kv_cache, "cache_full_blocks", "cache_blocks"),
    ]
    saved = [(owner, attribute, vars(owner).get(attribute, _MISSING)) for owner, attribute, _ in targets]
    saved_attention = llama.paged_attention
    for owner, attribute, name in targets:
        setattr(owner, attribute, timers.wrap(name, getattr(owner, attribute)))
    llama.paged_attention = timers.wrap("attention", saved_attention)
    try:
        yield
    finally:
        llama.paged_attention = saved_attention
        for owner, attribute, original in saved:
            if original is _MISSING:
                delattr(owner, attribute)  # a method: back to the class's
            else:
                setattr(owner, attribute, original)


_MISSING = object()


def run(ctx: Context, report: SectionReport) -> None:
    batches = ctx.pick((1, 32), (1, 8, 32, 128))
    steps = ctx.pick(20, 60)
    report.method = f"""
The engine core's parts are wrapped with timers in place (the scheduler's `schedule`, the runner's
`execute`, the model's forward, the sampler, the paged-attention function, the output bookkeeping and the
prefix-cache hashing) and {steps} pure decode steps at context {CONTEXT} are run (`EngineCore.step`, this
process, {ctx.threads} torch threads). Each row is milliseconds per step and its share of the step. The
timers themselves add about a microsecond per wrapped call. A cProfile run of the same loop follows (its
own overhead inflates Python-heavy functions; read it for where, not for how much).
"""
    for spec in ctx.models():
        longest = CONTEXT + headroom(max(batches), CONTEXT, steps)
        bench = DecodeBench(spec, max(batches) * longest, longest)
        columns: dict[int, dict[str, float]] = {}
        profile_rows: list[list[Any]] = []
        try:
            for batch in batches:
                ctx.log(f"steps: {spec.key} batch {batch}")
                columns[batch] = _breakdown(bench, batch, steps)
            profile_batch = 32 if 32 in batches else batches[-1]
            profile_rows = _profile(bench, profile_batch, steps)
        finally:
            bench.close()
        rows = []
        for key, label in PARTS:
            row: list[Any] = [label]
            for batch in batches:
                parts = columns[batch]
                row.append(f"{parts[key]:.3f} ({100 * parts[key] / parts['step']:.0f}%)")
            rows.append(row)
        rows.append(["**whole step**"] + [f"**{columns[b]['step']:.3f}**" for b in batches])
        report.table(
            f"{spec.label}: ms per decode step (share of the step), context {CONTEXT}",
            ["part"] + [f"batch {b}" for b in batches],
            rows,
            ["l"] + ["l"] * len(batches),
        )
        report.table(
            f"{spec.label}: cProfile of {steps} decode steps at batch {profile_batch}, top functions by own time",
            ["function", "calls per step", "own us per step", "cumulative us per step"],
            profile_rows,
            ["l", "r", "r", "r"],
        )
        one = columns[batches[0]]
        python_share = (
            one["schedule"] + one["prepare"] + one["append"] + one["cache_blocks"] + one["other"]
        ) / one["step"]
        report.findings.append(
            f"{spec.key}: at batch {batches[0]}, {100 * python_share:.0f}% of a step is Python bookkeeping "
            f"outside the forward pass and sampler; the forward pass itself is "
            f"{100 * (one['attention'] + one['forward_rest']) / one['step']:.0f}% "
            f"(attention {100 * one['attention'] / one['step']:.0f}%)."
        )
    report.limits = """
At small batches the step is bound by fixed per-op and per-step overhead, not by arithmetic: the forward
pass launches roughly fifteen small torch ops per layer, each paying Python and dispatcher overhead of a
few microseconds, and the runner rebuilds its slot mappings and block tables from Python lists every step.
At large batches the paged-attention gather and the per-request output bookkeeping grow with the batch.

What would move it: build decode metadata incrementally (keep a block-table tensor on the engine and
append to it) instead of from Python lists; skip per-token detokenization for requests that do not stream
text (detokenize once at the end); a fused paged-attention op that reads the cache in place; fusing rotary
and the QKV split; and on GPU, CUDA graphs for the decode step.
"""


def _breakdown(bench: DecodeBench, batch: int, steps: int) -> dict[str, float]:
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
        "forward_rest": t["forward"] - t["attention"],
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
