"""The kernels phase of the GPU check: what the Triton path changes against the torch path, on the check's model.

For each path (``triton``: the Triton kernels, the default on CUDA; ``torch``: ``ENGINEKIT_TRITON_KERNELS=0``):

- ``start``: a fresh process (``python -m benchmarks.gpu_kernels FOLDER DEVICE``) starts an in-process engine and
  generates two tokens, twice: first with an empty Triton cache (``TRITON_CACHE_DIR``: what the first start on a
  machine pays, every kernel variant compiled as it is first launched), then again with the cache that left (a
  later start);
- ``launches``: the device operations (kernels, copies, fills) of one eager decode step, from the torch profiler: a
  generate of 20 new tokens less one of 4 (the same prompt length), over the 16 decode steps between; and per
  layer (the step's own operations, such as the embedding, the LM head and the sampler, spread over the layers);
- ``long``: 256 requests of 3,968-token prompts and 128 new tokens at once, with graphs; each pure decode step is
  timed (to the next step's start) against what reading the weights and every request's KV cache once takes at
  the copy bandwidth measured by the ``limits`` phase: the median step's share of that limit.

On the CPU the Triton kernels do not run: only the torch path, with aten operations counted in place of device
operations and a small long-context workload (the CPU run checks the script, not the figures).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .gpu_model import engine_options

REPO_ROOT = Path(__file__).resolve().parent.parent
PATHS = {"triton": "1", "torch": "0"}  # ENGINEKIT_TRITON_KERNELS of each path
LONG = {"requests": 256, "prompt_len": 3968, "new_tokens": 128}
LONG_TINY = {"requests": 8, "prompt_len": 56, "new_tokens": 8}
SHORT_STEPS, LONG_STEPS = 4, 20  # the two generates whose difference is 16 decode steps
PROBE_TIMEOUT_S = 600


def measure_kernels(
    folder: str,
    device: str,
    model: dict[str, Any],
    limits: dict[str, Any],
    *,
    tiny: bool,
    token_range: tuple[int, int],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Start, launches and long contexts of each path (the torch path alone off CUDA)."""
    paths = ("triton", "torch") if device.startswith("cuda") else ("torch",)
    rows: dict[str, Any] = {}
    for path in paths:
        log(f"kernels: {path} path, start in a fresh process (empty Triton cache, then warm)")
        row: dict[str, Any] = {"start": _start_probes(folder, device, path)}
        with _path_env(path):
            log(f"kernels: {path} path, launches of a decode step")
            row["launches"] = _launches(folder, device, model, token_range)
            sizes = LONG_TINY if tiny else LONG
            log(f"kernels: {path} path, {sizes['requests']} requests of {sizes['prompt_len']}-token prompts")
            row["long"] = _long_contexts(folder, device, model, limits, sizes, token_range)
        rows[path] = row
    # the Triton path must have run its kernels, and the torch path not
    passed = all(row["launches"]["triton"] == (path == "triton") for path, row in rows.items())
    return {"paths": rows, "passed": passed}


@contextlib.contextmanager
def _path_env(path: str) -> Iterator[None]:
    """``ENGINEKIT_TRITON_KERNELS`` for the engines started inside (read as an engine loads its model)."""
    before = os.environ.get("ENGINEKIT_TRITON_KERNELS")
    os.environ["ENGINEKIT_TRITON_KERNELS"] = PATHS[path]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ENGINEKIT_TRITON_KERNELS", None)
        else:
            os.environ["ENGINEKIT_TRITON_KERNELS"] = before


def _start_probes(folder: str, device: str, path: str) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="enginekit-triton-cache-")
    try:
        runs = {}
        for label in ("cold", "warm"):
            env = {**os.environ, "ENGINEKIT_TRITON_KERNELS": PATHS[path], "TRITON_CACHE_DIR": cache}
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.gpu_kernels", folder, device],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            )
            if done.returncode:
                raise RuntimeError(f"the start probe failed ({done.returncode}):\n{done.stderr[-3000:]}")
            runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
        return runs
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def probe(folder: str, device: str) -> dict[str, Any]:
    """In a fresh process: import, start an in-process engine, generate 2 tokens, then 2 more for another
    prompt; seconds of each."""
    t0 = time.perf_counter()
    from enginekit import Engine

    from .common import greedy

    imported = time.perf_counter()
    engine = Engine(folder, **engine_options(device, mode="inproc", max_num_seqs=4, num_kv_blocks=64))
    try:
        started = time.perf_counter()
        engine.generate({"prompt_token_ids": list(range(100, 132))}, greedy(2), progress=False)
        first = time.perf_counter()
        engine.generate({"prompt_token_ids": list(range(200, 232))}, greedy(2), progress=False)
        second = time.perf_counter()
        triton = engine.client.core.runner.model.triton is not None
    finally:
        engine.shutdown()
    return {
        "import_s": imported - t0,
        "engine_start_s": started - imported,
        "first_generate_s": first - started,
        "second_generate_s": second - first,
        "triton": triton,
    }


def _launches(
    folder: str, device: str, model: dict[str, Any], token_range: tuple[int, int]
) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from enginekit import Engine

    from .common import greedy

    cuda = device.startswith("cuda")
    rng = random.Random(1)

    def prompt() -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(*token_range) for _ in range(32)]}

    counts = {}
    with Engine(folder, **engine_options(device, mode="inproc", max_num_seqs=4, num_kv_blocks=64)) as engine:
        triton = engine.client.core.runner.model.triton is not None
        engine.generate(prompt(), greedy(LONG_STEPS), progress=False)  # the warm-up: every kernel compiled
        for steps in (SHORT_STEPS, LONG_STEPS):
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
                engine.generate(prompt(), greedy(steps), progress=False)
                if cuda:
                    torch.cuda.synchronize()
            counts[steps] = _operations(profiler.events(), cuda)
    per_step = (counts[LONG_STEPS] - counts[SHORT_STEPS]) / (LONG_STEPS - SHORT_STEPS)
    return {
        "triton": triton,
        "counted": "device operations (kernels, copies, fills)" if cuda else "aten operations (CPU)",
        "per_decode_step": per_step,
        "per_layer": per_step / model["shape"]["num_hidden_layers"],
    }


def _operations(events: Any, cuda: bool) -> int:
    """Device operations in a profile on CUDA (kernels, copies, fills), aten operations on the CPU."""
    if cuda:
        return sum(1 for event in events if str(event.device_type).endswith("CUDA"))
    return sum(1 for event in events if event.name.startswith("aten::"))


def _long_contexts(
    folder: str,
    device: str,
    model: dict[str, Any],
    limits: dict[str, Any],
    sizes: dict[str, int],
    token_range: tuple[int, int],
) -> dict[str, Any]:
    from enginekit import Engine

    from .common import equal_workload, greedy, kv_blocks_for
    from .gpu_speed import timed_steps

    requests, prompt_len, new_tokens = sizes["requests"], sizes["prompt_len"], sizes["new_tokens"]
    options = engine_options(
        device,
        mode="inproc",
        max_num_seqs=requests,
        num_kv_blocks=kv_blocks_for(equal_workload(requests, prompt_len, new_tokens)),
        max_model_len=prompt_len + new_tokens,
        cuda_graphs=True,
    )
    rng = random.Random(2)
    prompts = [
        {"prompt_token_ids": [rng.randrange(*token_range) for _ in range(prompt_len)]}
        for _ in range(requests)
    ]
    with Engine(folder, **options) as engine:
        steps = timed_steps(engine, prompts, [greedy(new_tokens)] * requests)
    shape = model["shape"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_bytes_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2  # bf16
    bandwidth = limits["bandwidth_gb_s"] * 1e9
    decodes = [
        (after[0] - step[0], (model["weight_bytes"] + step[4] * kv_bytes_per_token) / bandwidth)
        for step, after in itertools.pairwise(steps)
        if not step[1] and step[2] >= requests / 2
    ]
    if not decodes:
        raise RuntimeError("no pure decode step of at least half the requests was timed")
    seconds = sorted(s for s, _ in decodes)[len(decodes) // 2]
    shares = sorted(limit / s for s, limit in decodes)
    return {
        **sizes,
        "decode_steps": len(decodes),
        "median_step_ms": 1e3 * seconds,
        "decode_tokens_per_s": requests / seconds,
        "limit_share": shares[len(shares) // 2],
        "kv_bytes_per_token": kv_bytes_per_token,
    }


if __name__ == "__main__":  # the start probe, in a fresh process: its result as the last line of stdout
    print(json.dumps(probe(sys.argv[1], sys.argv[2])))
