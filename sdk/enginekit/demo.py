"""``python -m enginekit.demo``: generate with the built-in tiny model in every mode, no download needed."""

from __future__ import annotations

import argparse
import time

from enginekit import Engine, SamplingParams

PROMPTS = [
    "Once upon a time",
    "The engine schedules requests in",
    "Paged attention stores keys and values",
    "A notebook kernel can restart",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", default="inproc,mp,async")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print("enginekit demo: the built-in tiny model (random weights, so the text is gibberish by design)\n")
    reference = None
    for mode in args.modes.split(","):
        started = time.perf_counter()
        with Engine(mode=mode) as engine:
            ready = time.perf_counter()
            outputs = engine.generate(PROMPTS, params)
            done = time.perf_counter()
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(
                f"[{mode}] engine pid {engine.engine_pid}, ready in {ready - started:.2f}s, "
                f"{tokens} tokens in {done - ready:.2f}s ({tokens / (done - ready):.0f} tok/s)"
            )
            for out in outputs:
                print(f"  {out.prompt!r} -> {out.text!r}")
            print("  streaming:", end=" ", flush=True)
            shown = 0
            for chunk in engine.stream(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0)):
                print(chunk.text[shown:], end="", flush=True)
                shown = len(chunk.text)
            print()
        texts = [o.text for o in outputs]
        if reference is None:
            reference = texts
        status = "same tokens as the first mode" if texts == reference else "DIFFERENT from the first mode"
        print(f"  -> {status}\n")


if __name__ == "__main__":
    main()
