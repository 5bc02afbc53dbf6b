"""Parity with transformers: the engine's greedy tokens and their logprobs against transformers' in one dtype.

The engine generates greedily from every prompt (in-process, all prompts in one batch, ``logprobs=0``; eagerly, or
with ``cuda_graphs=True``, whose padded decode steps must give the same answers). Then transformers
(``from_pretrained`` of the same folder, in the same dtype) runs one forward pass over each prompt followed by the
engine's tokens, which gives its own log-probabilities at every step for the same context: teacher forcing, one
pass instead of a ``generate`` loop.
At each step the engine's token must be transformers' greedy choice, or within the dtype's tolerance of it in
transformers' log-probabilities (a near-tie, which two correct implementations may break either way, more often in
bfloat16), and the engine's log-probability of its token must be within the same tolerance of transformers'.
Because the context is always the engine's, every step is compared, also after a near-tie.

With an adapter (``write_adapter``: a random peft LoRA folder over every projection) the engine runs each prompt
twice in one batch, once with the adapter and once without (``enable_lora``), and the adapter's rows are compared
with transformers on the merged weights (``merged``: ``W + scale B A`` in place, put back after), the others with
the base model: on CUDA with ``cuda_graphs=True`` this checks the adapters' dense product that the graphs record.

The model's logits have a standard deviation of about 4 (``gpu_model.LOGIT_STD``), so a wrong token is typically
several nats below the best one: the tolerances are far below that, and far above rounding.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# nats. bfloat16 rounds a logit near the top (about 16) to steps of 0.125, and 16 layers add their own rounding.
TOLERANCE = {"float32": 0.02, "bfloat16": 1.0}
TEXT_PROMPT = "The engine reads a prompt, splits it into tokens and runs the model one step at a time."
PROMPT_LENGTHS = (1, 5, 16, 17, 100, 128)  # across KV-block boundaries (16 tokens a block)
ADAPTER_RANK, ADAPTER_ALPHA = 8, 16.0
ADAPTED = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def parity_prompts(
    tokenizer: Any, token_range: tuple[int, int], lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0
) -> list[list[int]]:
    """One encoded text prompt (through the saved tokenizer) and random token-id prompts of ``lengths``."""
    rng = random.Random(seed)
    prompts = [tokenizer.encode(TEXT_PROMPT)]
    prompts += [[rng.randrange(*token_range) for _ in range(n)] for n in lengths]
    return prompts


def check_parity(
    hf_model: Any,
    folder: str,
    device: str,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    cuda_graphs: bool = False,
    adapter: Path | None = None,
) -> dict[str, Any]:
    """Engine against transformers (``hf_model``: ``folder``'s model loaded in ``dtype`` on ``device``); with an
    ``adapter`` (``write_adapter``), each prompt with it and without it."""
    started = time.perf_counter()
    adapters = (
        [True] * len(prompts) + [False] * len(prompts) if adapter is not None else [False] * len(prompts)
    )
    runs = prompts * 2 if adapter is not None else prompts
    engine_tokens, engine_logprobs = _engine_greedy(
        folder, device, dtype, runs, max_tokens, cuda_graphs, adapter, adapters
    )
    reference = []
    for use_adapter in (True, False):
        rows = [(p, t) for p, t, a in zip(runs, engine_tokens, adapters) if a == use_adapter]
        if not rows:
            continue
        with merged(hf_model, adapter) if use_adapter and adapter is not None else contextlib.nullcontext():
            reference += [_hf_logprobs(hf_model, prompt, tokens, device) for prompt, tokens in rows]
    tolerance = TOLERANCE[dtype]
    rows = [compare(*args, tolerance) for args in zip(engine_tokens, engine_logprobs, reference)]
    return {
        "dtype": dtype,
        "cuda_graphs": cuda_graphs,
        "lora": adapter is not None,
        "prompts": len(runs),
        "prompt_lengths": [len(p) for p in runs],
        "tokens_per_prompt": max_tokens,
        "tokens": sum(len(tokens) for tokens in engine_tokens),
        "greedy_equal": sum(row["greedy_equal"] for row in rows),
        "prompts_all_greedy": sum(
            row["greedy_equal"] == len(tokens) for row, tokens in zip(rows, engine_tokens)
        ),
        "max_gap": max(row["max_gap"] for row in rows),
        "max_logprob_diff": max(row["max_logprob_diff"] for row in rows),
        "tolerance": tolerance,
        "passed": all(row["passed"] for row in rows),
        "seconds": round(time.perf_counter() - started, 1),
    }


def compare(tokens: list[int], logprobs: list[float], hf_logprobs: Any, tolerance: float) -> dict[str, Any]:
    """One prompt: at how many steps the engine's token is transformers' greedy one, the largest gap to it where
    not, and the largest difference of the tokens' log-probabilities.

    ``hf_logprobs`` is transformers' ``[len(tokens), vocab]`` float32 log-probabilities, step ``j`` given the prompt
    and ``tokens[:j]``.
    """
    import torch

    if len(tokens) != len(logprobs) or len(tokens) != hf_logprobs.shape[0]:
        raise RuntimeError(
            f"{len(tokens)} tokens, {len(logprobs)} logprobs, {hf_logprobs.shape[0]} reference steps"
        )
    chosen = hf_logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    best = hf_logprobs.max(dim=1)
    gaps = (best.values - chosen).tolist()
    diffs = (torch.tensor(logprobs) - chosen).abs().tolist()
    max_gap, max_diff = max(gaps, default=0.0), max(diffs, default=0.0)
    return {
        "greedy_equal": int((best.indices == torch.tensor(tokens)).sum()),
        "max_gap": max_gap,
        "max_logprob_diff": max_diff,
        "passed": max_gap <= tolerance and max_diff <= tolerance,
    }


def _engine_greedy(
    folder: str,
    device: str,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    cuda_graphs: bool,
    adapter: Path | None = None,
    adapters: list[bool] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's greedy tokens and their logprobs; ``adapters``: which prompts run ``adapter``."""
    from enginekit import Engine, LoRARequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    from .gpu_model import engine_options

    blocks = sum(-(-(len(p) + max_tokens) // 16) + 1 for p in prompts) + 16
    options = engine_options(
        device, dtype=dtype, max_num_seqs=len(prompts), num_kv_blocks=blocks, cuda_graphs=cuda_graphs
    )
    lora_requests = None
    if adapter is not None:
        options.update(enable_lora=True, max_loras=1, max_lora_rank=ADAPTER_RANK)
        request = LoRARequest("parity", 1, str(adapter))
        lora_requests = [request if use else None for use in (adapters or [])]
    with Engine(folder, mode="inproc", **options) as engine:
        outputs = engine.generate(
            [{"prompt_token_ids": p} for p in prompts], params, lora_request=lora_requests, progress=False
        )
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        [
            step[token].logprob
            for token, step in zip(output.outputs[0].token_ids, output.outputs[0].logprobs or [])
        ]
        for output in outputs
    ]
    return tokens, logprobs


def _hf_logprobs(model: Any, prompt: list[int], tokens: list[int], device: str) -> Any:
    """transformers' log-probabilities (float32, on the CPU) at each of ``tokens``' steps, teacher-forced."""
    import torch

    input_ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def write_adapter(hf_model: Any, folder: Path, seed: int = 1, strength: float = 0.3) -> Path:
    """A random peft LoRA folder for ``hf_model``'s every projection (rank ``ADAPTER_RANK``), its product about
    ``strength`` times the size of the base layer's output: enough to change the tokens."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    scale = ADAPTER_ALPHA / ADAPTER_RANK
    tensors = {}
    for prefix, weight in _adapted(hf_model):
        out_features, in_features = weight.shape
        a = torch.randn(ADAPTER_RANK, in_features, generator=generator) / in_features**0.5
        size = (
            float(weight.detach().float().std()) * in_features**0.5
        )  # the base output's size per unit input
        b = torch.randn(out_features, ADAPTER_RANK, generator=generator) * strength * size
        b /= scale * ADAPTER_RANK**0.5
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": ADAPTER_RANK,
        "lora_alpha": ADAPTER_ALPHA,
        "target_modules": [name for names in ADAPTED.values() for name in names],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@contextlib.contextmanager
def merged(hf_model: Any, adapter: Path) -> Iterator[None]:
    """``hf_model`` with ``adapter``'s product merged into its weights (``W + scale B A``, in the model's dtype),
    its own weights put back on the way out."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    scale = ADAPTER_ALPHA / ADAPTER_RANK
    saved = []
    with torch.no_grad():
        for prefix, weight in _adapted(hf_model):
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            saved.append((weight, weight.detach().clone()))
            delta = (b.float() @ a.float()) * scale
            weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def _adapted(hf_model: Any) -> Iterator[tuple[str, Any]]:
    """Each adapted projection of a transformers Llama: its tensors' name prefix in a peft folder, its weight."""
    for index, layer in enumerate(hf_model.model.layers):
        for section, names in ADAPTED.items():
            for name in names:
                yield (
                    f"base_model.model.model.layers.{index}.{section}.{name}",
                    getattr(getattr(layer, section), name).weight,
                )
