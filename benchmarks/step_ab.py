"""The engine's step loop of two source trees side by side (measured by hand, not part of ``run.py``): output
tokens per second of an in-process engine generating greedily, ``ignore_eos``, on the built-in model and the
default model, at 1 and 32 concurrent requests; each tree in a fresh interpreter of its own (the best of three
generate calls), the trees alternating, best of a few rounds.

Run: ``python benchmarks/step_ab.py --before /path/to/other/checkout [--rounds 3] [--tokens 64]
[--option num_threads=1] [--after-option async_scheduling=true]``. Prints one line per model and concurrency:
tokens/s of each tree and after / before. On a busy machine, ``OMP_WAIT_POLICY=PASSIVE`` and a fixed
``num_threads`` keep spinning workers from stalling both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
MODELS = ("builtin", None)  # None: the default model (SmolLM2-135M-Instruct, GGUF weights kept as stored)
CONCURRENCY = (1, 32)
PROMPT_TOKENS = 32
REPEATS = 3  # generate calls per engine; the best counts


def worker(model: str | None, concurrent: int, tokens: int, options: dict) -> float:
    from enginekit import Engine, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range(PROMPT_TOKENS)]}
        for i in range(concurrent)
    ]
    with Engine(model, mode="inproc", **options) as engine:
        engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), progress=False)
        best = 0.0
        for _ in range(REPEATS):
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, progress=False)
            elapsed = time.perf_counter() - start
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return best


def run(tree: Path, model: str | None, concurrent: int, tokens: int, options: dict) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "sdk"))
    arguments = json.dumps({"model": model, "concurrent": concurrent, "tokens": tokens, "options": options})
    done = subprocess.run(
        [sys.executable, __file__, "--worker", arguments], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, help="the other checkout (its repository root)")
    parser.add_argument("--after", type=Path, default=HERE, help="this checkout unless given")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--option", action="append", default=[], help="an engine option of both trees, k=v")
    parser.add_argument(
        "--after-option", action="append", default=[], help="an engine option of the after tree"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(worker(job["model"], job["concurrent"], job["tokens"], job["options"]))
        return
    if args.before is None:
        parser.error("--before is required")
    both = {key: json.loads(value) for key, _, value in (o.partition("=") for o in args.option)}
    after = both | {key: json.loads(value) for key, _, value in (o.partition("=") for o in args.after_option)}
    for model in MODELS:
        for concurrent in CONCURRENCY:
            best = {"before": 0.0, "after": 0.0}
            for _ in range(args.rounds):
                best["before"] = max(best["before"], run(args.before, model, concurrent, args.tokens, both))
                best["after"] = max(best["after"], run(args.after, model, concurrent, args.tokens, after))
            print(
                f"{model or 'default'} x{concurrent}: before {best['before']:.1f} tok/s, "
                f"after {best['after']:.1f} tok/s, after/before {best['after'] / best['before']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
