"""Quality of the weights as stored, beside llama.cpp's: on real text (``tests/test_quant_quality.TEXT`` is the
same kind of paragraph), each token's log-likelihood with the default model's GGUF file computed as stored, against
the same file dequantized to float32 (``quantization="none"``), and llama.cpp's own deviation from that reference on
the same file and tokens.

Three ways of scoring the text as stored: in one step (more than 16 rows: the products run in float32 on dequantized
panels), in chunks of 8 tokens (the int8 kernels decode uses: the input quantized to int8, a scale per four values), and
llama.cpp (which quantizes its dot products' input too). ``measure`` returns a dict:
``{"tokens": n, "file": path, "threads": t, "deviation": {name: {"mean": nats, "max": nats}}}`` with ``name`` one of
``"as stored, one step"``, ``"as stored, chunks of 8"``, ``"llama.cpp"`` (absent with ``why_not`` when
llama-cpp-python does not import). The mean is the mean absolute difference per token; the issue's limit is 0.03.

``speed(threads, rounds)`` returns ``{"rates": {system: [tokens/s per round]}, "ratios": {...}}`` for one request
decoding 128 tokens, 16 concurrent requests of 32 tokens and a 512-token prompt's prefill (prompt tokens/s), the
engine with ``quantization="auto"`` and ``"none"`` and llama.cpp on the same file and threads, interleaved round by
round so the ratios hold on a loaded machine.

Run: ``python -m benchmarks.bench_quant [--threads N] [--speed]``; prints the dict(s) as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from enginekit import Engine, SamplingParams
from enginekit.model.formats.source import default_model_file

TEXT = (
    "The river Thames flows through southern England, including London, and reaches the North Sea at its estuary. "
    "At 346 kilometres it is the longest river entirely in England. Its name comes from an old word meaning dark, "
    "and the river has given its name to several other rivers around the world. Along its course lie Oxford, "
    "Reading, Windsor and Henley, and in London the river passes the Houses of Parliament, the Tower of London and "
    "the Thames Barrier, which protects the city from floods. For centuries the river carried most of the trade "
    "of the capital, and its docks were among the busiest in the world until container ships moved downstream."
)


def engine_logprobs(tokens: list[int] | None, quantization: str, chunk: int, threads: int):
    with Engine(
        mode="inproc",
        quantization=quantization,
        max_model_len=512,
        max_num_batched_tokens=chunk,
        num_threads=threads,
    ) as engine:
        prompt = tokens if tokens is not None else engine.tokenizer.encode(TEXT)
        scored = engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return prompt, [scored.prompt_logprobs[i][token].logprob for i, token in enumerate(prompt) if i > 0]


def llama_cpp_logprobs(path: str, tokens: list[int], threads: int) -> list[float]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=512, n_threads=threads, logits_all=True, verbose=False, n_batch=512
    )
    try:
        llm.eval(tokens)
        scores = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()
    top = scores.max(axis=1, keepdims=True)
    logsum = top[:, 0] + np.log(np.exp(scores - top).sum(axis=1))
    return [float(scores[i - 1, token] - logsum[i - 1]) for i, token in enumerate(tokens) if i > 0]


def _deviation(got: list[float], expected: list[float]) -> dict[str, float]:
    diffs = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs)}


def measure(threads: int = 2) -> dict[str, Any]:
    path = str(default_model_file())
    tokens, reference = engine_logprobs(None, "none", 2048, threads)
    figures: dict[str, Any] = {"tokens": len(tokens), "file": path, "threads": threads, "deviation": {}}
    figures["reference_mean_logprob"] = sum(reference) / len(reference)
    for name, chunk in (("as stored, one step", 2048), ("as stored, chunks of 8", 8)):
        _, got = engine_logprobs(tokens, "gguf", chunk, threads)
        figures["deviation"][name] = _deviation(got, reference)
    try:
        got = llama_cpp_logprobs(path, tokens, threads)
    except ImportError as error:
        figures["why_not"] = f"llama-cpp-python does not import: {error}"
    else:
        if all(math.isfinite(value) for value in got):
            figures["deviation"]["llama.cpp"] = _deviation(got, reference)
    return figures


def speed(threads: int = 2, rounds: int = 2) -> dict[str, Any]:
    import random
    import time

    from . import llama_cpp_runner

    path = str(default_model_file())
    rng = random.Random(31)
    workloads = {"one": (1, 32, 128), "concurrent": (16, 32, 32), "prefill": (1, 512, 1)}
    prompts = {
        name: [[rng.randrange(1000, 40000) for _ in range(p)] for _ in range(n)]
        for name, (n, p, _) in workloads.items()
    }
    engines = {
        q: Engine(mode="inproc", quantization=q, num_threads=threads, max_model_len=600)
        for q in ("auto", "none")
    }
    llm = llama_cpp_runner.LlamaCpp(path, max_sequences=16, max_length=600, threads=threads)
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in workloads}
    try:
        for _ in range(rounds + 1):  # the first round warms up and is dropped
            for name, (_, prompt_len, out) in workloads.items():
                params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
                for q, engine in engines.items():
                    start = time.perf_counter()
                    done = engine.generate(prompts[name], params)
                    elapsed = time.perf_counter() - start
                    made = sum(len(o.outputs[0].token_ids) for o in done)
                    rates[name].setdefault(q, []).append(
                        (prompt_len if name == "prefill" else made) / elapsed
                    )
                start = time.perf_counter()
                made = llm.generate(prompts[name], out, batched=True)
                elapsed = time.perf_counter() - start
                rates[name].setdefault("llama.cpp", []).append(
                    (prompt_len if name == "prefill" else made) / elapsed
                )
    finally:
        for engine in engines.values():
            engine.shutdown()
        llm.close()
    rates = {name: {k: v[1:] for k, v in by.items()} for name, by in rates.items()}

    def paired(a: list[float], b: list[float]) -> float:
        return sorted(x / y for x, y in zip(a, b, strict=True))[len(a) // 2]

    ratios = {
        f"{name}: auto / llama.cpp": paired(by["auto"], by["llama.cpp"]) for name, by in rates.items()
    } | {f"{name}: auto / none": paired(by["auto"], by["none"]) for name, by in rates.items()}
    ratios["concurrent auto / llama.cpp one request"] = paired(
        rates["concurrent"]["auto"], rates["one"]["llama.cpp"]
    )
    return {"threads": threads, "rounds": rounds, "rates": rates, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed", action="store_true", help="the speed figures instead of the quality ones")
    args = parser.parse_args()
    print(json.dumps(speed(args.threads) if args.speed else measure(args.threads), indent=1))


if __name__ == "__main__":
    main()
