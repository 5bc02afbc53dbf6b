"""What structured outputs cost: a batch of JSON-schema requests on the default model against the same batch
unconstrained, per generated token, with each grammar backend; and what a grammar costs to compile, cold and
cached.

The unconstrained batch generates exactly the tokens the constrained one did (each request's ``max_tokens`` set
to its constrained output's length, EOS ignored), so both runs step the same batch shapes and the ratio of their
times is the ratio of their times per generated token.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from .common import interleave, log, make_engine, paired_ratio, session
from .figures import rate, ratio, summary, target
from .stats import markdown_table

BACKENDS = ("llguidance", "xgrammar")
TARGET = 1.15  # constrained / unconstrained time per generated token
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
PEOPLE = [
    ("Ada", 36, "London", "chess and rowing"),
    ("Bruno", 52, "Lisbon", "sailing"),
    ("Chiara", 29, "Turin", "climbing and jazz"),
    ("Dmitri", 41, "Riga", "cooking"),
    ("Eun-ji", 33, "Busan", "running and painting"),
    ("Femi", 24, "Lagos", "football"),
    ("Greta", 67, "Bergen", "knitting and hiking"),
    ("Hiro", 45, "Osaka", "photography"),
]


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(concurrent=16, max_tokens=16, rounds=1, cold=1, cached=5)
    return dict(concurrent=32, max_tokens=64, rounds=3, cold=4, cached=40)


def prompts(count: int) -> list[str]:
    out = []
    for i in range(count):
        name, age, city, hobbies = PEOPLE[i % len(PEOPLE)]
        out.append(
            f"Record {i}. {name} is {age + i // len(PEOPLE)} years old, lives in {city} and likes {hobbies}. "
            "Write this person as a JSON object with the keys name, age, city and hobbies.\nJSON: "
        )
    return out


def run_structured_outputs_bench(quick: bool) -> dict[str, Any]:
    from enginekit import SamplingParams, StructuredOutputsParams

    ctx = session()
    size = sizes(quick)
    spec = ctx.model("smollm2")
    batch = prompts(size["concurrent"])
    constrained = SamplingParams(
        max_tokens=size["max_tokens"],
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    backends: dict[str, Any] = {}
    for backend in BACKENDS:
        if backend != "llguidance" and importlib.util.find_spec(backend) is None:
            backends[backend] = {"why_not": f"`{backend}` is not installed (the `{backend}` extra)"}
            continue
        log(f"structured: {backend}")
        engine = make_engine(
            spec,
            "inproc",
            num_threads=ctx.threads,
            structured_outputs_backend=backend,
            num_kv_blocks=size["concurrent"] * (-(-(64 + size["max_tokens"]) // 16) + 1) + 64,
        )
        try:
            backends[backend] = _measure(engine, batch, constrained, size)
        finally:
            engine.shutdown()
    targets = [
        target(
            f"structured outputs ({name}), {size['concurrent']} concurrent JSON-schema requests: time per "
            "generated token / unconstrained",
            TARGET,
            entry["per_token"],
            at_least=False,
            headline=name == "llguidance",
        )
        for name, entry in backends.items()
        if "per_token" in entry
    ]
    return {
        "threads": ctx.threads,
        "sizes": size,
        "model": spec.label,
        "backends": backends,
        "targets": targets,
    }


def _measure(engine: Any, batch: list[str], constrained: Any, size: dict[str, Any]) -> dict[str, Any]:
    from enginekit import SamplingParams

    first = engine.generate(batch, constrained, progress=False)  # compiles the schema (cold), untimed
    lengths = [len(output.outputs[0].token_ids) for output in first]
    valid = sum(1 for output in first if _parses(output.outputs[0].text))
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    tokens = sum(lengths)

    def timed(params: Any) -> Any:
        def run() -> float:
            start = time.perf_counter()
            outputs = engine.generate(batch, params, progress=False)
            elapsed = time.perf_counter() - start
            got = sum(len(output.outputs[0].token_ids) for output in outputs)
            if got != tokens:
                raise RuntimeError(f"{got} tokens generated, expected {tokens}")
            return elapsed

        return run

    samples = interleave(
        {"constrained": timed(constrained), "unconstrained": timed(free)}, repeats=size["rounds"]
    )
    core = engine._client._core  # an in-process engine's core (benchmark access only)
    manager = core.structured
    init_s = manager.stats()["grammar_backend_init_s"]
    cold, cached = [], []
    from enginekit import StructuredOutputsParams

    for i in range(size["cold"]):  # a schema the engine has not seen: a compile
        params = StructuredOutputsParams(json={**SCHEMA, "title": f"record-{i}-{time.time_ns()}"})
        cold.append(_grammar_time(manager, params))
        for _ in range(max(1, size["cached"] // size["cold"])):  # the same again: from the cache
            cached.append(_grammar_time(manager, params))
    return {
        "tokens": tokens,
        "lengths": [min(lengths), max(lengths)],
        "valid_json": valid,
        "requests": len(batch),
        "constrained_s": summary(samples["constrained"]),
        "unconstrained_s": summary(samples["unconstrained"]),
        "per_token": summary(paired_ratio(samples["constrained"], samples["unconstrained"])),
        "backend_init_s": init_s,
        "compile_cold_ms": summary([s * 1e3 for s in cold]),
        "compile_cached_ms": summary([s * 1e3 for s in cached]),
    }


def _grammar_time(manager: Any, params: Any) -> float:
    start = time.perf_counter()
    grammar = manager.request_grammar(params)
    grammar.future.result(timeout=120)
    return time.perf_counter() - start


def _parses(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def render_structured_outputs_bench(figures: dict[str, Any]) -> str:
    size = figures["sizes"]
    rows = []
    notes = []
    for name, entry in figures["backends"].items():
        if "why_not" in entry:
            notes.append(f"{name}: not measured, {entry['why_not']}.")
            continue
        tokens = entry["tokens"]
        rows.append(
            [
                name,
                f"{tokens} ({entry['lengths'][0]}-{entry['lengths'][1]} per request)",
                f"{entry['valid_json']} of {entry['requests']}",
                rate({k: v * 1e3 / tokens if k != "n" else v for k, v in entry["constrained_s"].items()}, 2),
                rate(
                    {k: v * 1e3 / tokens if k != "n" else v for k, v in entry["unconstrained_s"].items()}, 2
                ),
                ratio(entry["per_token"]),
                f"{entry['backend_init_s'] * 1e3:.0f}",
                rate(entry["compile_cold_ms"], 1),
                rate(entry["compile_cached_ms"], 3),
            ]
        )
    text = (
        f'{figures["model"]} (`Engine()`\'s file, weights as stored), `mode="inproc"`, {figures["threads"]} '
        f"threads: {size['concurrent']} requests at once, each a short text to turn into a JSON object of a "
        f"four-key schema (`StructuredOutputsParams(json=...)`, greedy, `max_tokens={size['max_tokens']}`), against "
        "the same batch unconstrained with each request generating exactly as many tokens (EOS ignored). "
        f"{size['rounds']} interleaved rounds after the warm-up that compiles the schema. *Compile*: a schema "
        "the engine has not seen (cold) and the same one again (cached, a lookup), through the engine's own "
        "grammar manager; *backend init*: building the backend's view of the vocabulary, once per engine.\n\n"
    )
    if rows:
        text += markdown_table(
            [
                "backend",
                "tokens generated",
                "outputs that end as complete JSON (the rest reach max_tokens)",
                "ms per token, constrained",
                "ms per token, unconstrained",
                "constrained / unconstrained",
                "backend init, ms",
                "compile cold, ms",
                "compile cached, ms",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "r", "r"],
        )
    if notes:
        text += "\n" + " ".join(notes) + "\n"
    return text
