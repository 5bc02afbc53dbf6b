"""Section 4: IPC cost: utility round trips and request rate against raw ZeroMQ between two processes."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from .baselines import zmq_message_rate, zmq_pingpong_roundtrip
from .common import Context, ModelSpec, greedy, interleave, make_engine, paired_ratio
from .report import SectionReport
from .stats import fmt, percentile, summarize

TITLE = "IPC cost against raw ZeroMQ"
TARGET = 2.0
PROMPT_LEN = 8


def run(ctx: Context, report: SectionReport) -> None:
    spec = ctx.model("builtin")
    pings_per_block = ctx.pick(200, 500)
    blocks = ctx.pick(3, 6)
    num_requests = ctx.pick(1000, 10000)
    repeats = 2
    report.method = f"""
*Round trip*: `engine.call_utility("ping")` (async: `await engine.acall_utility("ping")`), one call at a
time on an idle engine, against a raw pyzmq ROUTER (this process) / DEALER (a child process) echo of a
64-byte message over ipc://. {blocks} blocks of {pings_per_block} round trips per variant, alternating; p50
and p99 are over all round trips of a variant, and the ratio's spread is over the blocks' p50 ratios.

*Request rate*: {num_requests:,} requests with {PROMPT_LEN}-token random prompts and `max_tokens=1`
submitted at once with `generate` (async: `agenerate`) on the built-in model, against the raw one-way
ZeroMQ message rate between two processes (64-byte messages, PUSH -> PULL, {num_requests:,} per sample).
"engine core alone" drives `EngineCore` directly in this process (no front end, no IPC): what the engine
itself sustains. All variants alternate, {repeats} rounds.
"""
    engines = {mode: make_engine(spec, mode, num_threads=ctx.threads) for mode in ("mp", "async", "inproc")}
    try:
        _round_trips(ctx, report, engines, pings_per_block, blocks)
        _request_rate(ctx, report, spec, engines, num_requests, repeats)
    finally:
        for engine in engines.values():
            engine.shutdown()
    report.limits = """
A raw ping-pong is one send and one receive per side. A utility call adds, per direction: a msgspec
encode and decode, a hop between the socket thread and the thread that handles the message (the engine's
input thread hands it to the busy loop through a queue; the result goes back through the output queue and
output thread; in mp mode the front end's receive thread resolves a Future the caller waits on), and each
of those hops is a thread wake-up that needs the GIL. On 2 cores these wake-ups dominate the round trip.
The request rate is bounded by the engine core itself (scheduling and prefilling many short prompts per
step, one attention call per prefill chunk, detokenizing) and by the front end (validating prompts, building
request and output objects), not by ZeroMQ, which moves orders of magnitude more messages per second (see the table).

What would move it: utility calls answered by the input thread when they need no engine state (ping), or
a busy loop that polls its queue without a thread hand-off; batching all adds of one `generate` call into
one message; and, for the request rate, batching prefill chunks into one attention call per layer.
"""


def _round_trips(ctx: Context, report: SectionReport, engines: dict, pings: int, blocks: int) -> None:
    pooled: dict[str, list[float]] = {"raw": [], "mp": [], "async": [], "inproc": []}
    block_p50: dict[str, list[float]] = {name: [] for name in pooled}
    for block in range(blocks):
        ctx.log(f"ipc: round trips, block {block + 1}/{blocks}")
        order = ["raw", "mp", "async", "inproc"]
        shift = block % len(order)
        for name in order[shift:] + order[:shift]:
            if name == "raw":
                samples = zmq_pingpong_roundtrip(num_messages=pings, warmup=100)["samples_us"]
            elif name == "async":
                samples = asyncio.run(_async_pings(engines["async"], pings))
            else:
                samples = _sync_pings(engines[name], pings)
            pooled[name].extend(samples)
            block_p50[name].append(percentile(sorted(samples), 50.0))
    rows = []
    raw = sorted(pooled["raw"])
    raw_p50, raw_p99 = percentile(raw, 50.0), percentile(raw, 99.0)
    for name, label in (
        ("raw", "raw pyzmq ROUTER/DEALER ping-pong"),
        ("mp", 'mp: call_utility("ping")'),
        ("async", 'async: await acall_utility("ping")'),
        ("inproc", 'inproc: call_utility("ping") (no IPC)'),
    ):
        values = sorted(pooled[name])
        p50, p99 = percentile(values, 50.0), percentile(values, 99.0)
        ratio = paired_ratio(block_p50[name], block_p50["raw"])
        rows.append(
            [
                label,
                f"{p50:.1f}",
                f"{p99:.1f}",
                f"{p50 / raw_p50:.2f}x ({ratio.min:.2f}-{ratio.max:.2f})",
                f"{p99 / raw_p99:.2f}x",
                len(values),
            ]
        )
        if name in ("mp", "async"):
            verdict = "met" if p50 / raw_p50 <= TARGET else "NOT met"
            report.targets.append(
                f"{name} utility round trip p50 <= {TARGET:.0f}x raw ZeroMQ: measured {p50:.1f} us vs "
                f"{raw_p50:.1f} us = {p50 / raw_p50:.2f}x: {verdict} (p99 {p99 / raw_p99:.2f}x)"
            )
    report.table(
        "Round trip, microseconds",
        ["variant", "p50 us", "p99 us", "p50 / raw (block spread)", "p99 / raw", "n"],
        rows,
        ["l", "r", "r", "l", "l", "r"],
    )


def _sync_pings(engine: Any, count: int) -> list[float]:
    clock = time.perf_counter_ns
    call = engine.call_utility
    for _ in range(20):
        call("ping")
    samples = []
    for _ in range(count):
        t0 = clock()
        call("ping")
        samples.append((clock() - t0) / 1e3)
    return samples


async def _async_pings(engine: Any, count: int) -> list[float]:
    clock = time.perf_counter_ns
    for _ in range(20):
        await engine.acall_utility("ping")
    samples = []
    for _ in range(count):
        t0 = clock()
        await engine.acall_utility("ping")
        samples.append((clock() - t0) / 1e3)
    return samples


def _request_rate(
    ctx: Context, report: SectionReport, spec: ModelSpec, engines: dict, num_requests: int, repeats: int
) -> None:
    rng = random.Random(0)
    params = greedy(1)

    def prompts() -> list:
        return [{"prompt_token_ids": spec.random_prompt(PROMPT_LEN, rng)} for _ in range(num_requests)]

    def facade(engine: Any) -> Any:
        def run() -> float:
            batch = prompts()
            t0 = time.perf_counter()
            if engine.mode == "async":
                outputs = asyncio.run(engine.agenerate(batch, params, progress=False))
            else:
                outputs = engine.generate(batch, params, progress=False)
            elapsed = time.perf_counter() - t0
            if sum(len(o.outputs[0].token_ids) for o in outputs) != num_requests:
                raise RuntimeError("some max_tokens=1 request did not produce its token")
            return num_requests / elapsed

        return run

    runners = {mode: facade(engine) for mode, engine in engines.items()}
    runners["core"] = lambda: _core_rate(spec, num_requests, rng)
    runners["raw"] = lambda: zmq_message_rate(num_messages=num_requests, repeats=1)["msgs_per_s"]
    ctx.log(f"ipc: {num_requests} max_tokens=1 requests x {repeats}")
    samples = interleave(runners, repeats=repeats, warmup=1)
    steps_before = engines["inproc"].get_stats()["num_steps"]
    engines["inproc"].generate(prompts(), params, progress=False)
    steps = engines["inproc"].get_stats()["num_steps"] - steps_before
    rows = []
    for name, label in (
        ("raw", "raw pyzmq PUSH -> PULL, messages/s"),
        ("mp", "mp: generate, requests/s"),
        ("async", "async: agenerate, requests/s"),
        ("inproc", "inproc: generate, requests/s"),
        ("core", "engine core alone, requests/s"),
    ):
        ratio = paired_ratio(samples[name], samples["raw"])
        rows.append(
            [
                label,
                fmt(summarize(samples[name]), "", 0, thousands=True),
                f"{ratio.median:.4f} ({ratio.min:.4f}-{ratio.max:.4f})",
            ]
        )
    report.table(
        f"{num_requests:,} requests with max_tokens=1 ({steps} engine steps per batch, max_num_seqs 128)",
        ["variant", "per second", "/ raw ZeroMQ messages/s"],
        rows,
        ["l", "l", "l"],
    )
    mp_vs_inproc = paired_ratio(samples["mp"], samples["inproc"])
    core_vs_inproc = paired_ratio(samples["core"], samples["inproc"])
    report.findings.append(
        f"mp reaches {mp_vs_inproc.median:.2f}x the inproc request rate; the engine core alone runs "
        f"{core_vs_inproc.median:.2f}x the inproc facade's rate, so "
        + (
            "the front end (prompt validation, request and output objects) costs more than IPC does."
            if core_vs_inproc.median > 1.2
            else "the engine core itself is the limit."
        )
    )


def _core_rate(spec: ModelSpec, num_requests: int, rng: random.Random) -> float:
    from enginekit import EngineConfig
    from enginekit.core.engine_core import EngineCore
    from enginekit.wire.messages import EngineCoreRequest

    core = EngineCore(EngineConfig.from_options(spec.engine_model))
    params = greedy(1)
    requests = [
        EngineCoreRequest(f"core-{i}", spec.random_prompt(PROMPT_LEN, rng), params, time.time())
        for i in range(num_requests)
    ]
    try:
        t0 = time.perf_counter()
        for request in requests:
            core.handle(request)
        finished = 0
        while core.has_work():
            outputs, _ = core.step()
            finished += sum(1 for o in outputs.outputs if o.finish_reason is not None) if outputs else 0
        elapsed = time.perf_counter() - t0
    finally:
        core.shutdown()
    if finished != num_requests:
        raise RuntimeError(f"the engine core finished {finished} of {num_requests} requests")
    return num_requests / elapsed
