"""Speed on the check's model: output tokens/s of enginekit and of transformers, against the chip's own limits.

The limits are measured in the same run: memory bandwidth from a large device-to-device copy (bytes read plus
bytes written, over the copy's time) and the bfloat16 matmul rate from a large ``torch.matmul``. Against them a
batch of ``B`` requests has two ceilings: reading every weight once a step (``B * bandwidth / weight bytes``
tokens/s) and doing each token's ``2 * params`` FLOP (``peak / (2 * params)`` tokens/s, whatever ``B``). The
check reports the share of each, and the limit of both together (the time to read the weights plus the time of
the FLOP, no overlap).

Four engines (``"mp"`` and ``"inproc"``, eager and with ``cuda_graphs=True``, bfloat16) and transformers
``generate`` (bfloat16, on the same device) run the same workload: ``B`` requests of ``prompt_len`` random tokens
and ``new_tokens`` greedy tokens each, EOS ignored, submitted at once; tokens/s is every output token over the
wall time of the call, prefill included. The systems run in rounds, in rotating order, after a short warm-up at
each batch size (which captures the graphs a timed run replays). transformers is slow on large batches: its
number of new tokens is cut to fit ``hf_budget_s`` a call (from a timed warm-up call), and the row says so. Each
system's time at a batch size is thus bounded: ``B * new_tokens`` at its own rate, or transformers' budget.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .figures import summary
from .stats import summarize

if TYPE_CHECKING:
    from enginekit.config import EngineMode

ENGINES: dict[str, tuple[EngineMode, bool]] = {  # name: (mode, cuda_graphs)
    "enginekit mp, eager": ("mp", False),
    "enginekit mp, graphs": ("mp", True),
    "enginekit inproc, eager": ("inproc", False),
    "enginekit inproc, graphs": ("inproc", True),
}
TRANSFORMERS = "transformers generate"
WARMUP_TOKENS = 4  # a warm-up run's decode steps with every request decoding (see _warmup_tokens)


# --------------------------------------------------------------------------------------
# The chip's limits
# --------------------------------------------------------------------------------------


def measure_limits(device: str) -> dict[str, Any]:
    """Copy bandwidth (GB/s) and bfloat16 matmul rate (TFLOP/s) of ``device``, medians over repeats."""
    import torch

    cuda = device.startswith("cuda")
    copy_bytes = int((2 if cuda else 0.25) * 2**30)
    n = 8192 if cuda else 1024
    copy_s = _copy_seconds(device, copy_bytes, repeats=10 if cuda else 5)
    matmul_s = _matmul_seconds(device, n, repeats=20 if cuda else 5)
    if cuda:
        torch.cuda.empty_cache()
    return {
        "bandwidth_gb_s": 2 * copy_bytes / copy_s / 1e9,
        "bf16_tflop_s": 2 * n**3 / matmul_s / 1e12,
        "copy_gib": copy_bytes / 2**30,
        "matmul_n": n,
        "how": "median of timed torch copies (read + write bytes) and bfloat16 torch.matmul calls, after warm-up",
    }


def _copy_seconds(device: str, num_bytes: int, repeats: int) -> float:
    import torch

    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _timed(lambda: target.copy_(source), device, repeats)


def _matmul_seconds(device: str, n: int, repeats: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return _timed(lambda: torch.matmul(a, b), device, repeats)


def _timed(call: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``call`` on ``device``: CUDA events around each call on a synchronized device."""
    import torch

    for _ in range(warmup):
        call()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return summarize(times).median


def ceilings(limits: dict[str, Any], model: dict[str, Any], batch: int) -> dict[str, float]:
    """Tokens/s limits of a ``batch``-request decode step on this chip: bandwidth, arithmetic, both."""
    read_s = model["weight_bytes"] / (limits["bandwidth_gb_s"] * 1e9)
    flop_s = 2 * model["num_params"] * batch / (limits["bf16_tflop_s"] * 1e12)
    return {
        "bandwidth_limit": batch / read_s,
        "arithmetic_limit": batch / flop_s,
        "limit": batch / (read_s + flop_s),
    }


# --------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------


def measure_speed(
    folder: str,
    hf_model: Any,
    device: str,
    *,
    batch_sizes: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    hf_budget_s: float,
    token_range: tuple[int, int],
    limits: dict[str, Any],
    model: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every system at every batch size; rows of tokens/s with their shares of the chip's limits."""
    from .common import equal_workload, greedy, kv_blocks_for
    from .gpu_model import engine_options

    rng = random.Random(0)
    largest = equal_workload(max(batch_sizes), prompt_len, new_tokens)
    options = engine_options(device, max_num_seqs=max(batch_sizes), num_kv_blocks=kv_blocks_for(largest))
    rows = []
    engines = _start_engines(folder, options, log)
    try:
        for batch in batch_sizes:
            runners: dict[str, Callable[[], tuple[float, int]]] = {}
            for name, engine in engines.items():
                log(f"speed: warm-up, {name}, batch {batch}")
                warmup = _warmup_tokens(engine, batch, prompt_len, new_tokens)
                _engine_call(engine, batch, prompt_len, warmup, token_range, rng, greedy)
                runners[name] = lambda engine=engine, batch=batch: _engine_call(
                    engine, batch, prompt_len, new_tokens, token_range, rng, greedy
                )
            log(f"speed: warm-up, {TRANSFORMERS}, batch {batch}")
            runners[TRANSFORMERS] = _hf_runner(
                hf_model, device, batch, prompt_len, new_tokens, hf_budget_s, rng, token_range
            )
            samples: dict[str, list[tuple[float, int]]] = {name: [] for name in runners}
            names = list(runners)
            for round_index in range(repeats):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    log(f"speed: {name}, batch {batch}, round {round_index + 1}/{repeats}")
                    samples[name].append(runners[name]())
            for name in names:
                rates = [rate for rate, _ in samples[name]]
                mode, graphs = ENGINES.get(name, ("transformers", False))
                limit = ceilings(limits, model, batch)
                median = summarize(rates).median
                rows.append(
                    {
                        "system": name,
                        "mode": mode,
                        "cuda_graphs": graphs,
                        "batch": batch,
                        "new_tokens": samples[name][0][1],
                        "tokens_per_s": summary(rates),
                        "bandwidth_share": median / limit["bandwidth_limit"],
                        "arithmetic_share": median / limit["arithmetic_limit"],
                        "limit_share": median / limit["limit"],
                    }
                )
        staggered = measure_staggered(
            engines, max(batch_sizes), prompt_len, new_tokens, token_range, rng, log
        )
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {
        "staggered": staggered,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "engine_options": options,
        "ceilings": {str(batch): ceilings(limits, model, batch) for batch in batch_sizes},
        "rows": rows,
        "mp_over_inproc": mp_over_inproc(rows),
    }


def measure_staggered(
    engines: dict[str, Any],
    batch: int,
    prompt_len: int,
    new_tokens: int,
    token_range: tuple[int, int],
    rng: random.Random,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Steps with a prefill chunk against pure decode steps, per output token, in one run of each in-process
    engine: ``3 * batch`` requests submitted at once to an engine holding ``batch`` at a time, each with
    ``new_tokens / 2`` to ``new_tokens`` new tokens, so that requests arrive as others end and their prompts
    share steps with the running decodes. Each step's time is the time to the next step's start; only steps of
    at least ``batch / 2`` sequences count (not the start or the drain)."""
    from enginekit import SamplingParams

    rows = []
    for name, engine in engines.items():
        if ENGINES[name][0] != "inproc":  # the steps are timed in this process
            continue
        log(f"speed: staggered arrivals, {name}, {3 * batch} requests")
        steps = []
        for _ in range(
            2
        ):  # the first run a warm-up (the shapes it meets first are captured then), fresh prompts
            prompts = [
                {"prompt_token_ids": [rng.randrange(*token_range) for _ in range(prompt_len)]}
                for _ in range(3 * batch)
            ]
            params = [
                SamplingParams(
                    max_tokens=rng.randint(max(1, new_tokens // 2), new_tokens),
                    temperature=0.0,
                    ignore_eos=True,
                )
                for _ in prompts
            ]
            steps = timed_steps(engine, prompts, params)
        spans = [
            (mixed, after[0] - start, sampled)
            for (start, mixed, count, sampled, _), after in itertools.pairwise(steps)
            if count >= batch / 2 and sampled
        ]
        kinds = {}
        for kind in (False, True):
            chosen = [(seconds, sampled) for mixed, seconds, sampled in spans if mixed == kind]
            seconds, tokens = sum(s for s, _ in chosen), sum(t for _, t in chosen)
            kinds["mixed" if kind else "decode"] = {
                "steps": len(chosen),
                "ms_per_step": 1e3 * seconds / len(chosen) if chosen else float("nan"),
                "us_per_token": 1e6 * seconds / tokens if tokens else float("nan"),
            }
        ratio = kinds["mixed"]["us_per_token"] / kinds["decode"]["us_per_token"]
        rows.append(
            {"system": name, "cuda_graphs": ENGINES[name][1], "batch": batch, **kinds, "ratio": ratio}
        )
    return rows


def timed_steps(
    engine: Any, prompts: list[dict], params: list[Any]
) -> list[tuple[float, bool, int, int, int]]:
    """Generate ``prompts`` on an in-process engine, noting as each step starts: the time, whether it holds a
    prefill chunk, its sequences, its sampled rows and the tokens its sequences attend to (their contexts)."""
    runner = engine.client.core.runner
    steps: list[tuple[float, bool, int, int, int]] = []
    forward_step = runner.forward_step

    def timed(scheduled):
        chunks = scheduled.chunks
        mixed = not all(chunk.is_decode for chunk in chunks)
        samples = sum(chunk.samples for chunk in chunks)
        contexts = sum(chunk.start + chunk.num_tokens for chunk in chunks)
        steps.append((time.perf_counter(), mixed, len(chunks), samples, contexts))
        return forward_step(scheduled)

    runner.forward_step = timed
    try:
        engine.generate(prompts, params, progress=False)
    finally:
        del runner.forward_step  # the class's method again
    return steps


def mp_over_inproc(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median tokens/s of mp over inproc, per batch size, eager and with graphs."""
    by_key = {(row["mode"], row["cuda_graphs"], row["batch"]): row["tokens_per_s"]["median"] for row in rows}
    ratios: dict[str, dict[str, float]] = {}
    for (mode, graphs, batch), rate in by_key.items():
        inproc = by_key.get(("inproc", graphs, batch))
        if mode == "mp" and inproc:
            ratios.setdefault("graphs" if graphs else "eager", {})[str(batch)] = rate / inproc
    return ratios


def _start_engines(folder: str, options: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    from enginekit import Engine

    engines: dict[str, Any] = {}
    try:
        for name, (mode, graphs) in ENGINES.items():
            log(f"speed: starting {name}")
            engines[name] = Engine(folder, mode=mode, cuda_graphs=graphs, **options)
    except BaseException:
        for engine in engines.values():
            engine.shutdown()
        raise
    return engines


def _warmup_tokens(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> int:
    """New tokens of a warm-up run that steps through the batch sizes of a timed one: the prompts are prefilled
    in chunks of ``max_num_batched_tokens``, so the requests start (and end) decoding a chunk apart, and a timed
    run's last steps decode ever smaller batches, each a graph to capture on first use."""
    chunks = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    return min(new_tokens, chunks + WARMUP_TOKENS)


def _engine_call(
    engine: Any,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    token_range: tuple[int, int],
    rng: random.Random,
    greedy: Callable[[int], Any],
) -> tuple[float, int]:
    """One ``generate`` of fresh random prompts (no prefix-cache hits): its tokens/s, and the new tokens each."""
    prompts = [
        {"prompt_token_ids": [rng.randrange(*token_range) for _ in range(prompt_len)]} for _ in range(batch)
    ]
    started = time.perf_counter()
    outputs = engine.generate(prompts, greedy(new_tokens), progress=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    if tokens != batch * new_tokens:
        raise RuntimeError(
            f"the engine generated {tokens} tokens, expected {batch * new_tokens} (ignore_eos)"
        )
    return tokens / elapsed, new_tokens


def _hf_runner(
    model: Any,
    device: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    budget_s: float,
    rng: random.Random,
    token_range: tuple[int, int],
) -> Callable[[], tuple[float, int]]:
    """A function timing one transformers ``generate`` call on ``batch`` random prompts, in bfloat16 on
    ``device``; its new tokens are cut to fit ``budget_s`` (estimated from a timed warm-up call)."""
    import torch
    from transformers import GenerationConfig

    def call(tokens: int) -> tuple[float, int]:
        ids = [[rng.randrange(*token_range) for _ in range(prompt_len)] for _ in range(batch)]
        input_ids = torch.tensor(ids, device=device)
        config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=tokens,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
        )
        model.generation_config = config  # else generate() takes unset options (EOS) from the checkpoint
        _synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        _synchronize(device)
        elapsed = time.perf_counter() - started
        generated = int(out.shape[1]) - prompt_len
        if generated != tokens:
            raise RuntimeError(f"transformers generated {generated} tokens a request, expected {tokens}")
        return batch * tokens / elapsed, tokens

    probe = min(WARMUP_TOKENS * 2, new_tokens)
    call(probe)  # the warm-up: the first call at a batch size pays one-time costs
    rate, _ = call(
        probe
    )  # prefill included, it underestimates the decode rate: the cut errs on the safe side
    fits = int(budget_s * rate / batch)
    tokens = max(probe, min(new_tokens, fits))
    return lambda: call(tokens)


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
