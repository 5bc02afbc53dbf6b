"""IPC cost: utility round trips and request rate against raw ZeroMQ between two processes."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from .baselines import zmq_message_rate, zmq_pingpong_roundtrip
from .common import ModelSpec, engines_up, equal_workload, greedy, interleave, log, paired_ratio, session
from .figures import rate, summary, target
from .stats import markdown_table, percentile

TARGET = 2.0  # a utility round trip's p50 over raw ZeroMQ's
PROMPT_LEN = 8


def run_ipc_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    spec = ctx.model("builtin")
    pings, blocks = (200, 3) if quick else (500, 6)
    num_requests = 500 if quick else 10000
    repeats = 2
    variants = {mode: {"mode": mode, "num_threads": ctx.threads} for mode in ("mp", "async", "inproc")}
    with engines_up(spec, variants, equal_workload(1, PROMPT_LEN, 1)) as engines:
        trips = _round_trips(engines, pings, blocks)
        requests = _request_rate(spec, engines, num_requests, repeats)
    targets = [
        target(
            f"{mode} utility round trip p50 / raw ZeroMQ p50",
            TARGET,
            trips["rows"][mode]["p50"] / trips["rows"]["raw"]["p50"],
            at_least=False,
        )
        for mode in ("mp", "async")
    ]
    return {
        "pings": pings,
        "blocks": blocks,
        "num_requests": num_requests,
        "repeats": repeats,
        "round_trips": trips,
        "requests": requests,
        "targets": targets,
    }


def _round_trips(engines: dict, pings: int, blocks: int) -> dict[str, Any]:
    pooled: dict[str, list[float]] = {"raw": [], "mp": [], "async": [], "inproc": []}
    block_p50: dict[str, list[float]] = {name: [] for name in pooled}
    for block in range(blocks):
        log(f"ipc: round trips, block {block + 1}/{blocks}")
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
    rows = {}
    for name, values in pooled.items():
        values = sorted(values)
        rows[name] = {
            "p50": percentile(values, 50.0),
            "p99": percentile(values, 99.0),
            "n": len(values),
            "block_ratio": summary(paired_ratio(block_p50[name], block_p50["raw"])),
        }
    return {"rows": rows}


def render_ipc_bench(figures: dict[str, Any]) -> str:
    trips = figures["round_trips"]["rows"]
    raw = trips["raw"]
    labels = {
        "raw": "raw pyzmq ROUTER/DEALER ping-pong",
        "mp": 'mp: call_utility("ping")',
        "async": 'async: await acall_utility("ping")',
        "inproc": 'inproc: call_utility("ping") (no IPC)',
    }
    trip_rows = [
        [
            label,
            f"{trips[name]['p50']:.1f}",
            f"{trips[name]['p99']:.1f}",
            f"{trips[name]['p50'] / raw['p50']:.2f}x ({trips[name]['block_ratio']['min']:.2f}-{trips[name]['block_ratio']['max']:.2f})",
            trips[name]["n"],
        ]
        for name, label in labels.items()
    ]
    requests = figures["requests"]
    request_labels = {
        "raw": "raw pyzmq PUSH -> PULL, messages/s",
        "mp": "mp: generate, requests/s",
        "async": "async: agenerate, requests/s",
        "inproc": "inproc: generate, requests/s",
        "core": "engine core alone, requests/s",
    }
    request_rows = [
        [label, rate(requests["rates"][name], 0), f"{requests['against_raw'][name]['median']:.4f}"]
        for name, label in request_labels.items()
    ]
    mp_inproc = requests["mp_over_inproc"]["median"]
    core_inproc = requests["core_over_inproc"]["median"]
    return (
        f'*Round trip*: `call_utility("ping")` one call at a time on an idle engine, against a raw pyzmq echo '
        f"of a 64-byte message between two processes; {figures['blocks']} blocks of {figures['pings']} round trips "
        "per variant, alternating (spread: the blocks' p50 ratios). *Request rate*: "
        f"{figures['num_requests']:,} requests of {PROMPT_LEN} tokens and `max_tokens=1` submitted at once "
        f"({requests['steps']} engine steps per batch), against raw ZeroMQ's one-way message rate; \"engine core "
        f'alone" drives `EngineCore` in this process (no front end, no IPC). {figures["repeats"]} rounds.\n\n'
        + markdown_table(
            ["variant", "p50 µs", "p99 µs", "p50 / raw", "n"], trip_rows, ["l", "r", "r", "l", "r"]
        )
        + "\n"
        + markdown_table(["variant", "per second", "/ raw ZeroMQ"], request_rows, ["l", "r", "r"])
        + f"\nmp reaches {mp_inproc:.2f}x the inproc request rate, and the engine core alone {core_inproc:.2f}x "
        "the inproc facade's: "
        + (
            "the front end (prompt checks, request and output objects) costs more than the IPC does.\n"
            if core_inproc > 1.2
            else "the engine core itself is the limit.\n"
        )
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


def _request_rate(spec: ModelSpec, engines: dict, num_requests: int, repeats: int) -> dict[str, Any]:
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
    log(f"ipc: {num_requests} max_tokens=1 requests x {repeats}")
    samples = interleave(runners, repeats=repeats, warmup=1)
    steps_before = engines["inproc"].get_stats()["num_steps"]
    engines["inproc"].generate(prompts(), params, progress=False)
    steps = engines["inproc"].get_stats()["num_steps"] - steps_before
    return {
        "steps": steps,
        "rates": {name: summary(values) for name, values in samples.items()},
        "against_raw": {
            name: summary(paired_ratio(values, samples["raw"])) for name, values in samples.items()
        },
        "mp_over_inproc": summary(paired_ratio(samples["mp"], samples["inproc"])),
        "core_over_inproc": summary(paired_ratio(samples["core"], samples["inproc"])),
    }


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
