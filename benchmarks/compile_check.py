"""Does ``torch.compile`` pay on the real model? Compile time and decode tokens/s against the eager engine.

What is compiled: each decoder layer's second half (residual add, post-attention RMSNorm, the gate/up
projection, SiLU-and-multiply, the down projection, residual add), the part with the most elementwise work
to fuse, with ``dynamic=True`` (batch size changes every step). Paged attention stays eager: its Python loop
over prefill chunks would recompile for every batch layout. Inductor cannot lower the engine's oneDNN linear
(``mkldnn._linear_pointwise`` on a plain weight), so the compiled half calls ``F.linear`` and lets inductor
choose; ``--freezing`` turns on inductor's weight freezing (it then pre-packs weights for oneDNN itself).

Each variant runs in a fresh process, one after the other: the default model in-process, 64-token prompts,
16 greedy tokens, 1, 8 and 32 concurrent, best of 2 after a warm-up. Not part of ``make bench`` (a
compile takes 10-25 s per variant here); the result is written up in docs/benchmarks.md.

Usage::

    .venv/bin/python benchmarks/compile_check.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CONCURRENCY = (1, 8, 32)
VARIANTS = ("eager", "compiled", "compiled, freezing")


def measure(variant: str) -> dict[str, float]:
    import random

    import torch
    import torch.nn.functional as F

    from enginekit import Engine, SamplingParams
    from enginekit.model import llama

    compiled = variant != "eager"
    if compiled:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = "freezing" in variant

        def second_half(
            layer: llama.DecoderLayer, hidden: torch.Tensor, attended: torch.Tensor
        ) -> torch.Tensor:
            hidden = hidden + attended
            gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(hidden)).split(
                layer.mlp.intermediate_size, dim=-1
            )
            return hidden + layer.mlp.down_proj(F.silu(gate) * up)

        compiled_half = torch.compile(second_half, dynamic=True)

        def forward(self, hidden, rotary, kv_cache, meta):  # type: ignore[no-untyped-def]
            return compiled_half(
                self, hidden, self.self_attn(self.input_layernorm(hidden), rotary, kv_cache, meta)
            )

        llama.DecoderLayer.forward = forward
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    result: dict[str, float] = {}
    with Engine(mode="inproc") as engine:
        if compiled:
            for layer in engine.client.core.runner.model.layers:
                layer.mlp.gate_up_proj.kernel = layer.mlp.down_proj.kernel = F.linear
        started = time.perf_counter()
        engine.generate("warm up", params)
        result["first generate s"] = time.perf_counter() - started
        for concurrency in CONCURRENCY:
            prompts = [
                {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}
                for _ in range(concurrency)
            ]
            engine.generate(prompts, params, progress=False)  # compiles this batch's shapes, if any
            best = 0.0
            for _ in range(2):
                started = time.perf_counter()
                engine.generate(prompts, params, progress=False)
                best = max(best, concurrency * params.max_tokens / (time.perf_counter() - started))
            result[f"x{concurrency} tok/s"] = best
    return result


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print(json.dumps(measure(sys.argv[2])))
        return 0
    results = {}
    for variant in VARIANTS:
        run = subprocess.run(
            [sys.executable, __file__, "--variant", variant], capture_output=True, text=True, check=False
        )
        if run.returncode != 0:
            print(f"{variant}: failed\n{run.stderr[-2000:]}")
            return 1
        results[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    columns = ["first generate s", *(f"x{c} tok/s" for c in CONCURRENCY)]
    print("| variant | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for variant, result in results.items():
        print(f"| {variant} | " + " | ".join(f"{result[c]:.1f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
