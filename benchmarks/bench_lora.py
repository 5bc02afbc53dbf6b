"""What LoRA adapters cost: a batch of 32 requests on the default model with no adapter, all with one adapter, and
four adapters mixed (8 requests each), rank 16 on every projection, in one engine (``enable_lora=True``).

The adapters are random peft folders written here (``adapter_config.json``, ``adapter_model.safetensors``), of the
default model's shapes. Every request generates the same number of tokens (EOS ignored) from a fresh random prompt
(no prefix-cache hits), so the three batches step the same shapes and their times compare directly; the runs are
interleaved round by round. For comparison, Punica, whose batched kernels vLLM's LoRA is built on, reports about 2 ms
of added latency per token for 7B models on a GPU (arXiv 2310.18547); this section measures the CPU engine alone.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from .common import interleave, log, make_engine, paired_ratio, session
from .figures import rate, ratio, summary, target
from .stats import markdown_table

RANK = 16
NUM_ADAPTERS = 4
REQUESTS = 32
TARGET = 1.3  # four adapters mixed / no adapter, time of the batch
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(prompt_len=32, max_tokens=16, rounds=1)
    return dict(prompt_len=64, max_tokens=64, rounds=3)


def write_random_adapter(folder: Path, config: Any, *, rank: int, seed: int) -> Path:
    """A peft LoRA folder for a model of ``config`` (an enginekit ``ModelConfig``): every projection, random."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "q_proj": (q_size, hidden),
        "k_proj": (kv_size, hidden),
        "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for section, modules in MODULES.items():
            for module in modules:
                out_features, in_features = shapes[module]
                key = f"base_model.model.model.layers.{layer}.{section}.{module}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, in_features, generator=generator) * in_features**-0.5
                )
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [m for modules in MODULES.values() for m in modules],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


def run_lora_bench(quick: bool) -> dict[str, Any]:
    from enginekit import LoRARequest, SamplingParams

    ctx = session()
    size = sizes(quick)
    spec = ctx.model("smollm2")
    adapters = [
        LoRARequest(
            f"random-{i}",
            i + 1,
            str(write_random_adapter(ctx.workdir / f"lora-{i}", spec.config, rank=RANK, seed=i)),
        )
        for i in range(NUM_ADAPTERS)
    ]
    batches = {
        "none": [None] * REQUESTS,
        "one": [adapters[0]] * REQUESTS,
        "four": [adapters[i % NUM_ADAPTERS] for i in range(REQUESTS)],
    }
    params = SamplingParams(max_tokens=size["max_tokens"], temperature=0.0, ignore_eos=True)
    tokens = REQUESTS * size["max_tokens"]
    blocks = REQUESTS * (-(-(size["prompt_len"] + size["max_tokens"]) // 16) + 1) + 64
    log("lora: engine")
    engine = make_engine(
        spec,
        "inproc",
        num_threads=ctx.threads,
        enable_lora=True,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK,
        num_kv_blocks=blocks,
    )
    rng = random.Random(0)

    def timed(lora_requests: list[Any]) -> Any:
        def run() -> float:
            prompts = [
                {"prompt_token_ids": spec.random_prompt(size["prompt_len"], rng)} for _ in range(REQUESTS)
            ]
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, lora_request=lora_requests, progress=False)
            elapsed = time.perf_counter() - start
            got = sum(len(output.outputs[0].token_ids) for output in outputs)
            if got != tokens:
                raise RuntimeError(f"{got} tokens generated, expected {tokens}")
            return elapsed

        return run

    try:
        samples = interleave({name: timed(batch) for name, batch in batches.items()}, repeats=size["rounds"])
    finally:
        engine.shutdown()
    runs = {
        name: {
            "seconds": summary(times),
            "tokens_per_s": summary([tokens / t for t in times]),
            "over_none": summary(paired_ratio(times, samples["none"])),
        }
        for name, times in samples.items()
    }
    return {
        "threads": ctx.threads,
        "sizes": size,
        "model": spec.label,
        "rank": RANK,
        "requests": REQUESTS,
        "tokens": tokens,
        "runs": runs,
        "targets": [
            target(
                f"LoRA, {REQUESTS} requests of {NUM_ADAPTERS} rank-{RANK} adapters mixed: batch time / no adapter",
                TARGET,
                runs["four"]["over_none"],
                at_least=False,
                headline=True,
            )
        ],
    }


def render_lora_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    labels = {
        "none": "no adapter",
        "one": "one adapter (all 32 requests)",
        "four": f"{NUM_ADAPTERS} adapters mixed ({REQUESTS // NUM_ADAPTERS} requests each)",
    }
    rows = [
        [labels[name], rate(entry["tokens_per_s"], 0), rate(entry["seconds"], 2), ratio(entry["over_none"])]
        for name, entry in figures["runs"].items()
    ]
    return (
        f'{figures["model"]} (`Engine()`\'s file, weights as stored), `mode="inproc"`, {figures["threads"]} '
        f"threads, `enable_lora=True, max_loras={NUM_ADAPTERS}`: {figures['requests']} requests at once, random "
        f"prompts of {size['prompt_len']} tokens, greedy, {size['max_tokens']} tokens each (EOS ignored), "
        f"{size['rounds']} interleaved rounds after a warm-up. Adapters: random, rank {figures['rank']}, on "
        "q/k/v/o and gate/up/down of every layer. The adapters' product is added to each projection's output "
        "(the base weights stay as stored); a step with adapters runs the layers piece by piece instead of the "
        "fused native layer.\n\n"
        + markdown_table(
            ["batch", "tokens/s", "seconds", "time / no adapter"],
            rows,
            ["l", "r", "r", "r"],
        )
    )
