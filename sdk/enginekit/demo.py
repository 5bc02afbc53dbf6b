"""``python -m enginekit.demo``: chat with the default model (SmolLM2-135M-Instruct) in every mode.

Each mode answers the same questions and streams one answer. Start time and generation speed are reported
apart, and speed is measured warm (after a first short request), so the figures compare the modes fairly.
"""

from __future__ import annotations

import argparse
import time

from enginekit import Engine, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me one tip for writing clear code.",
    "What is a large language model, in one sentence?",
]
STREAMED = "Write a haiku about a notebook kernel."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default=None, help="a local folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="inproc,mp,async")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    reference = None
    for mode in args.modes.split(","):
        started = time.perf_counter()
        with Engine(args.model, mode=mode) as engine:
            ready = time.perf_counter() - started
            engine.generate("warm up", SamplingParams(max_tokens=2))
            print(f"[{mode}] engine ready in {ready:.2f} s (pid {engine.engine_pid})")
            began = time.perf_counter()
            outputs = engine.chat(conversations, params)
            elapsed = time.perf_counter() - began
            for question, output in zip(QUESTIONS, outputs):
                print(f"  Q: {question}\n  A: {output.text.strip()}")
            print(f"  Q: {STREAMED}\n  A: ", end="", flush=True)
            shown = 0
            for chunk in engine.stream_chat([{"role": "user", "content": STREAMED}], params):
                print(chunk.text[shown:], end="", flush=True)
                shown = len(chunk.text)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(
                f"\n  {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s (warm, 3 answers at once)"
            )
        ids = [o.outputs[0].token_ids for o in outputs]
        reference = reference or ids
        same = (
            "the same tokens as the first mode"
            if ids == reference
            else "DIFFERENT tokens from the first mode"
        )
        print(f"  -> {same}\n")


if __name__ == "__main__":
    main()
