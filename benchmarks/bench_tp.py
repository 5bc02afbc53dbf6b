"""Tensor parallelism on this CPU: two model ranks of one engine against one rank with all the threads and with
one thread, and what a gloo all_reduce costs (each decode step pays 2 per layer, one for the embedding and a
gather of the logits)."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
from typing import Any

from .bench_dp import three_way_measure, three_way_rows
from .common import (
    REPO_ROOT,
    engines_up,
    equal_workload,
    session,
    usable_cores,
)
from .stats import markdown_table

ALL = "TP=1, all threads"
ONE = "TP=1, 1 thread"
TWO = "TP=2"  # the engine's threads shared out: all threads / 2 per rank
ALLREDUCE_ROWS = (1, 16, 64)


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(builtin=((1, 16), (16, 32), 2), llama=((1, 16), (16, 32), 2))
    return dict(builtin=((1, 16), (32, 64), 4), llama=((1, 16), (32, 64), 4))


def run_tp_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    cores = usable_cores()
    size = sizes(quick)
    variants = {
        ALL: {"mode": "mp", "num_threads": cores},
        ONE: {"mode": "mp", "num_threads": 1},
        TWO: {"mode": "mp", "tensor_parallel_size": 2, "num_threads": cores},
    }
    models = {}
    for key in ("builtin", "llama"):
        spec = ctx.model(key)
        concurrency_list, (prompt_len, output_len), repeats = size[key]
        rows = []
        with engines_up(
            spec, variants, equal_workload(max(concurrency_list), prompt_len, output_len)
        ) as engines:
            threads = {
                name: engine.call_utility("debug_process", rank=0)["torch_threads"]
                for name, engine in engines.items()
            }
            rows = three_way_measure(
                engines,
                spec,
                concurrency_list,
                (prompt_len, output_len),
                repeats,
                (ALL, ONE, TWO),
                f"tp: {key}",
            )
        config = spec.config
        models[key] = {
            "label": spec.label,
            "lengths": [prompt_len, output_len],
            "repeats": repeats,
            "rows": rows,
            "threads": threads,
            "hidden": config.hidden_size,
            "collectives_per_step": 2 * config.num_layers + 2,
        }
    hidden_sizes = sorted({model["hidden"] for model in models.values()})
    allreduce = {str(hidden): allreduce_us(hidden, 50 if quick else 200) for hidden in hidden_sizes}
    spec = ctx.model("llama")
    return {
        "cores": cores,
        "models": models,
        "allreduce_us": allreduce,
        "parity": parity(spec),
        "death_s": [death_latency_s(spec) for _ in range(3)],
    }


def parity(spec: Any) -> dict[str, Any]:
    """Greedy tokens and their logprobs at TP=2 against TP=1: equal tokens, and the largest logprob difference
    (the row-parallel sums add partial products in another order)."""
    import torch

    from enginekit import Engine, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(8)]
    found = {}
    for size in (1, 2):
        with Engine(spec.engine_model, mode="mp", num_kv_blocks=128, tensor_parallel_size=size) as engine:
            outputs = engine.generate(prompts, params, progress=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        logprobs = [
            [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
        ]
        found[size] = tokens, torch.tensor(logprobs)
    return {
        "same_tokens": found[1][0] == found[2][0],
        "max_logprob_diff": float((found[1][1] - found[2][1]).abs().max()),
    }


def death_latency_s(spec: Any) -> float:
    """Seconds from a SIGKILL of the worker, mid-generate, to the call's ``EngineDeadError``."""
    import os
    import signal
    import threading
    import time

    from enginekit import Engine, EngineDeadError, SamplingParams

    engine = Engine(spec.engine_model, mode="mp", num_kv_blocks=256, tensor_parallel_size=2)
    failed: list[float] = []

    def generate() -> None:
        try:
            engine.generate(
                [{"prompt_token_ids": [10, 20, 30]}],
                SamplingParams(max_tokens=3000, ignore_eos=True),
                progress=False,
            )
        except EngineDeadError:
            failed.append(time.monotonic())

    try:
        (worker,) = engine.call_utility("debug_process")["tensor_parallel_workers"]
        caller = threading.Thread(target=generate)
        caller.start()
        time.sleep(1.0)
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        caller.join(30)
    finally:
        engine.shutdown()
    return failed[0] - killed if failed else float("nan")


def allreduce_us(hidden: int, iterations: int) -> dict[str, float]:
    """Median microseconds of one gloo all_reduce of ``[rows, hidden]`` float32 between two processes (the
    group the engine uses: ``enginekit.model.parallel.ProcessGroup``), for each of ``ALLREDUCE_ROWS``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "benchmarks.bench_tp", str(port), str(hidden), str(iterations)]
    procs = [
        subprocess.Popen([*command, str(rank)], cwd=REPO_ROOT, stdout=subprocess.PIPE) for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    return json.loads(outputs[0])


def _allreduce_rank(port: int, hidden: int, iterations: int, rank: int) -> None:
    import datetime
    import time

    import torch
    from torch._C._distributed_c10d import TCPStore

    from enginekit.model.parallel import ProcessGroup

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    group = ProcessGroup(rank, 2, torch.device("cpu"), store=store)
    found = {}
    for rows in ALLREDUCE_ROWS:
        tensor = torch.ones(rows, hidden)
        times = []
        for i in range(iterations + 20):
            start = time.perf_counter()
            group.all_reduce(tensor)
            if i >= 20:
                times.append((time.perf_counter() - start) * 1e6)
            tensor.fill_(1.0)
        found[str(rows)] = statistics.median(times)
    group.close()
    if rank == 0:
        print(json.dumps(found))


def _step_times(model: dict[str, Any]) -> str:
    """One request's decode step time per variant (1 / its tokens/s), when the run had a one-request row."""
    single = [row for row in model["rows"] if row["concurrency"] == 1]
    if not single:
        return ""
    step_ms = {name: 1000 / values["median"] for name, values in single[0]["rates"].items()}
    listed = ", ".join(f"{name} {ms:.1f} ms" for name, ms in step_ms.items())
    return f"At one request a step takes {listed}."


def render_tp_bench(figures: dict[str, Any]) -> str:
    parts = [
        f'`Engine(..., mode="mp")` three ways, all up at once and run alternately: one rank with all '
        f"{figures['cores']} threads, one rank with one thread, and `tensor_parallel_size=2` (the engine's "
        f"{figures['cores']} threads shared out: each rank runs its share). *N* requests submitted at once through "
        "`generate`. Greedy tokens are the same in all three (`tests/test_tensor_parallel.py`; the parity line below).\n"
    ]
    for model in figures["models"].values():
        rows = three_way_rows(model["rows"], (ALL, ONE, TWO))
        threads = ", ".join(f"{name}: {count}" for name, count in model["threads"].items())
        cost = figures["allreduce_us"][str(model["hidden"])]
        per_step = model["collectives_per_step"]
        parts.append(
            f"**{model['label']}**: {model['lengths'][0]}-token prompts, {model['lengths'][1]} tokens each, "
            f"{model['repeats']} rounds; tokens/s. torch threads of rank 0: {threads}. A step pays {per_step} "
            f"collectives (2 per layer, the embedding's sum, the logits' gather); one all_reduce of a "
            f"[1, {model['hidden']}] row costs {cost['1']:.0f} µs here ({cost['16']:.0f} µs at 16 rows, "
            f"{cost['64']:.0f} µs at 64), about {per_step * cost['1'] / 1000:.2f} ms per one-request decode step "
            f"before any compute. {_step_times(model)}\n\n"
            + markdown_table(
                ["concurrent", ALL, ONE, TWO, "TP=2 / TP=1 all threads", "TP=2 / TP=1 1 thread"],
                rows,
                ["r", "r", "r", "r", "r", "r"],
            )
        )
    parity_found, deaths = figures.get("parity"), figures.get("death_s")
    if parity_found is not None:
        parts.append(
            f"Parity on the tiny Llama, 8 prompts x 32 greedy tokens: the same tokens at TP=2 as at TP=1: "
            f"{'yes' if parity_found['same_tokens'] else 'NO'}; largest logprob difference "
            f"{parity_found['max_logprob_diff']:.1e}. A worker killed mid-generate fails the call with "
            f"`EngineDeadError` after {', '.join(f'{s * 1000:.0f}' for s in deaths)} ms (3 tries).\n"
        )
    parts.append(
        "Why it does not pay here: both ranks share the same two cores the one-rank engine uses, so TP=2 adds no "
        "compute, only splits each product in two (each half too small to keep a core busy on these models) and "
        "adds the collectives above, each a round trip through the kernel's loopback TCP that waits for the "
        "slower rank. Tensor parallelism pays where each rank has its own device (GPUs over NVLink) and the "
        "model is too big or too slow for one; on a CPU, data parallelism (the `dp` section) is the way to use "
        "more cores."
    )
    return "\n".join(parts)


if __name__ == "__main__":
    _allreduce_rank(*(int(arg) for arg in sys.argv[1:5]))
