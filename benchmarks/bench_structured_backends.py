"""Structured outputs: the two grammar backends on the default real model (SmolLM2-135M-Instruct GGUF).

``measure()`` returns the figures (no page of its own; the benchmark page may wire it in):

* ``backends[name]``: install weight (the package and what it requires that enginekit does not already need),
  tokenizer info build time, compile time of the workload's JSON schema cold (a new backend) and cached (the
  engine's cache by spec), and the mask time per step for 1 and 32 concurrent requests: ``fill`` (the backend
  writes the bitmask rows), ``apply`` (the sampler sets the disallowed logits to -inf), ``advance`` (each matcher
  takes its sampled token), replayed over the token sequences the engine generated for the workload.
* ``end_to_end``: 32 concurrent JSON-schema requests against the same 32 prompts unconstrained, in-process, side
  by side (interleaved repeats), as seconds per generated token, and their ratio per backend.

Run: ``PYTHONPATH=sdk python -m benchmarks.bench_structured_backends`` (prints the figures as JSON).
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from pathlib import Path
from typing import Any

BACKENDS = ("llguidance", "xgrammar")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
}
# What the package needs only for this backend (enginekit requires torch, numpy and tokenizers anyway).
EXTRA_REQUIREMENTS = {"llguidance": ("llguidance",), "xgrammar": ("xgrammar", "triton", "transformers")}
PEOPLE = [
    "Maria Lopez is 34 years old and lives in Madrid.",
    "Our new colleague, Tom Becker (age 51), moved here from Berlin.",
    "Aiko Tanaka, 27, works as a nurse in Osaka.",
    "The mayor of Lyon, Jean Martin, turned 62 last week.",
]


def installed_mib(distribution: str) -> float | None:
    """The size on disk of an installed distribution's files, MiB (``None`` if it is not installed)."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    total = 0
    for file in files:
        path = Path(str(file.locate()))
        if path.is_file():
            total += path.stat().st_size
    return total / 2**20


def _conversations(count: int) -> list[list[dict[str, str]]]:
    return [
        [
            {
                "role": "user",
                "content": f"Extract the person as JSON with name, age and city.\n{PEOPLE[i % len(PEOPLE)]}",
            }
        ]
        for i in range(count)
    ]


def _per_token(engine: Any, conversations: list, params: Any) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = engine.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return seconds / tokens, tokens


def _replay(backend: Any, compiled: Any, sequences: list[list[int]], vocab: int) -> dict[str, float]:
    """Mean seconds per step of fill, apply and advance for ``len(sequences)`` matchers over their tokens."""
    import torch

    from enginekit.core.structured.backend import bitmask_words
    from enginekit.model.batch import TokenBitmask
    from enginekit.model.token_controls import apply_token_bitmask

    matchers = [backend.matcher(compiled) for _ in sequences]
    fill = apply = advance = 0.0
    steps = max(len(s) for s in sequences)
    logits = torch.zeros(len(sequences), vocab)
    for step in range(steps):
        live = [i for i, s in enumerate(sequences) if step < len(s)]
        start = time.perf_counter()
        bits = torch.empty((len(live), bitmask_words(vocab)), dtype=torch.int32)
        backend.fill_bitmask([matchers[i] for i in live], bits)
        fill += time.perf_counter() - start
        start = time.perf_counter()
        apply_token_bitmask(logits, TokenBitmask(live, bits))
        apply += time.perf_counter() - start
        start = time.perf_counter()
        for i in live:
            assert matchers[i].accept(sequences[i][step])
        advance += time.perf_counter() - start
    return {
        "fill_ms": 1e3 * fill / steps,
        "apply_ms": 1e3 * apply / steps,
        "advance_ms": 1e3 * advance / steps,
    }


def measure(concurrency: int = 32, max_tokens: int = 48, repeats: int = 3) -> dict[str, Any]:
    from enginekit import Engine, SamplingParams, StructuredOutputsParams
    from enginekit.core.structured.manager import StructuredOutputManager, load_backend

    conversations = _conversations(concurrency)
    constrained = SamplingParams(
        max_tokens=max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    free = SamplingParams(max_tokens=max_tokens, temperature=0)
    figures: dict[str, Any] = {"concurrency": concurrency, "max_tokens": max_tokens, "backends": {}}
    ratios: dict[str, list[float]] = {name: [] for name in BACKENDS}
    per_token: dict[str, list[float]] = {name: [] for name in ("free", *BACKENDS)}
    with Engine(mode="inproc", max_model_len=512) as engine:
        core = engine.client.core
        tokenizer, vocab = core.tokenizer, core.model_config.vocab_size
        eos = list(core.model_config.eos_token_ids)
        sequences: list[list[int]] = []
        for name in BACKENDS:
            start = time.perf_counter()
            backend = load_backend(name, tokenizer, vocab, eos)
            init_s = time.perf_counter() - start
            spec = StructuredOutputsParams(json=SCHEMA).spec
            start = time.perf_counter()
            compiled = backend.compile(*spec)
            cold_s = time.perf_counter() - start
            manager = StructuredOutputManager(name, tokenizer, vocab, eos)
            manager.request_grammar(StructuredOutputsParams(json=SCHEMA)).future.result()
            start = time.perf_counter()
            manager.request_grammar(StructuredOutputsParams(json=SCHEMA)).future.result()
            cached_s = time.perf_counter() - start
            manager.shutdown()
            core.structured = StructuredOutputManager(name, tokenizer, vocab, eos)
            outputs = engine.chat(conversations, constrained, use_tqdm=False)
            sequences = [list(o.outputs[0].token_ids) for o in outputs]
            sequences = [
                s[:-1] if s and s[-1] in eos else s for s in sequences
            ]  # the matcher ends before EOS
            figures["backends"][name] = {
                "install_mib": {dist: installed_mib(dist) for dist in EXTRA_REQUIREMENTS[name]},
                "tokenizer_init_s": init_s,
                "compile_cold_s": cold_s,
                "compile_cached_s": cached_s,
                "mask_step_1": _replay(backend, compiled, sequences[:1], vocab),
                f"mask_step_{concurrency}": _replay(backend, compiled, sequences, vocab),
                "parsed": sum(_parses(o.outputs[0].text) for o in outputs),
            }
        for _ in range(repeats):  # interleaved: each backend beside its own free batch, in one run
            for name in BACKENDS:
                core.structured = StructuredOutputManager(name, tokenizer, vocab, eos)
                engine.chat(conversations[:1], constrained, use_tqdm=False)  # the grammar compiled once
                free_s, _ = _per_token(engine, conversations, free)
                json_s, _ = _per_token(engine, conversations, constrained)
                per_token["free"].append(free_s)
                per_token[name].append(json_s)
                ratios[name].append(json_s / free_s)
    figures["end_to_end"] = {
        "seconds_per_token": {key: statistics.median(values) for key, values in per_token.items()},
        "ratio_to_free": {name: statistics.median(values) for name, values in ratios.items()},
        "ratios": ratios,
    }
    return figures


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    import os

    print(json.dumps(measure(repeats=int(os.environ.get("REPEATS", "3"))), indent=1))
