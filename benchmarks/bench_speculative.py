"""Speculative decoding: the default model with and without n-gram prompt lookup (``speculative_config``), side
by side in one run, at 1 request and at 16 concurrent, on three workloads (``spec_workloads.py``): copying from a
~400-token passage, a JSON extraction with a fixed-key schema, and free chat. Beside it, at 1 request on the
copy-heavy and free-chat workloads, llama.cpp with and without its own prompt lookup decoding
(llama-cpp-python's ``LlamaPromptLookupDecoding``), in its child process.

Both engines run in this process (``mode="inproc"``), greedy, each request ending at its end of turn (or its
JSON's end) or at ``max_tokens``. The systems are interleaved round by round after a warm-up that also fills
each engine's prefix cache: the prompts repeat every round, so the timed rounds measure generation, not prefill.
The speculative engine's counters (``get_stats()``: proposed, accepted and forced tokens) are read around every
timed run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from . import llama_cpp_runner
from .baselines import torch_threads
from .bench_quantized import llama_cpp_note
from .common import interleave, log, make_engine, paired_ratio, session
from .figures import number, rate, ratio, summary, target
from .spec_workloads import SCHEMA, chat_conversations, copy_conversations, copy_share, json_conversations
from .stats import markdown_table

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# llama.cpp's lookup: the same number of proposals, matched on the context's last 4..1 tokens
LLAMA_LOOKUP = {"max_ngram_size": 4, "num_pred_tokens": 5}
VARIANTS = ("plain", "ngram")
LLAMA_KEYS = ("llama.cpp", "llama.cpp lookup")
WORKLOADS = ("copy", "json", "chat")
LABELS = {"copy": "copy-heavy", "json": "JSON extraction", "chat": "free chat"}
GOALS = {"copy": 1.8, "json": 1.5, "chat": 0.95}  # tokens/s with n-gram / without, at 1 request
STAT_KEYS = {
    "draft": "spec_num_draft_tokens",
    "accepted": "spec_num_accepted_tokens",
    "forced": "spec_num_forced_tokens",
    "steps": "num_steps",
}
METRIC_KEYS = {"draft": "num_draft_tokens", "accepted": "num_accepted_tokens", "forced": "num_forced_tokens"}


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(
            concurrency=(1, 4),
            one_requests=1,  # requests run one after another in a 1-request run
            max_tokens={"copy": 48, "json": 64, "chat": 32},
            rounds=1,
        )
    # JSON's 128 tokens let most outputs close their object; the section takes <= 4 min on 2 cores
    return dict(
        concurrency=(1, 16), one_requests=2, max_tokens={"copy": 96, "json": 128, "chat": 64}, rounds=2
    )


def conversations(workload: str) -> list[Any]:
    return {"copy": copy_conversations, "json": json_conversations, "chat": chat_conversations}[workload]()


def params_for(workload: str, max_tokens: int) -> Any:
    from enginekit import SamplingParams, StructuredOutputsParams

    if workload == "json":
        # compact JSON: every key and separator is a token the grammar forces
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def pick(items: Sequence[Any], count: int) -> list[Any]:
    """``count`` of ``items`` spread over them (each passage or record kind gets its turn)."""
    return [items[i * len(items) // count] for i in range(count)]


def run_speculative_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    spec = ctx.model("smollm2")
    why_not = llama_cpp_runner.available()
    llama: dict[str, Any] = {"why_not": why_not} if why_not else {"version": llama_cpp_runner.version()}
    longest = 512 + max(size["max_tokens"].values()) + SPECULATIVE["num_speculative_tokens"] + 16
    blocks = max(size["concurrency"]) * (-(-longest // 16) + 1) + 64
    log("speculative: engines")
    engines = {
        variant: make_engine(
            spec,
            "inproc",
            num_threads=ctx.threads,
            num_kv_blocks=blocks,
            # without: every token sampled (no jump forward either), the engine before speculative decoding
            **({"speculative_config": dict(SPECULATIVE)} if variant == "ngram" else {"jump_forward": False}),
        )
        for variant in VARIANTS
    }
    llms: dict[str, Any] = {}
    cells: list[dict[str, Any]] = []
    try:
        stops = _stop_token_ids(engines["plain"])
        if why_not is None:
            for key, lookup in zip(LLAMA_KEYS, (None, LLAMA_LOOKUP)):
                try:
                    llms[key] = llama_cpp_runner.LlamaCppProcess(
                        spec.hf_path,
                        max_sequences=1,
                        max_length=longest,
                        threads=ctx.threads,
                        kind="generate",
                        prompt_lookup=lookup,
                    )
                except llama_cpp_runner.LlamaCppCrashed as crash:
                    llama["crashed"] = str(crash)
                    break
            if "crashed" in llama:
                _close_all(llms)
        for concurrency in size["concurrency"]:
            for workload in WORKLOADS:
                count = size["one_requests"] if concurrency == 1 else concurrency
                batch = pick(conversations(workload), count)
                params = params_for(workload, size["max_tokens"][workload])
                log(f"speculative: {workload} at {concurrency} ({len(batch)} requests)")
                runners: dict[str, Callable[[], dict[str, Any]]] = {
                    variant: _engine_runner(engine, batch, params, concurrency, ctx.threads)
                    for variant, engine in engines.items()
                }
                with_llama = concurrency == 1 and workload in ("copy", "chat") and bool(llms)
                if with_llama:
                    prompt_ids = _rendered(engines["plain"], batch, params)
                    for key, llm in llms.items():
                        runners[key] = _llama_runner(llm, prompt_ids, params.max_tokens, stops)
                samples, crash = llama_cpp_runner.interleave_surviving(
                    runners, LLAMA_KEYS, interleave, repeats=size["rounds"], warmup=1
                )
                if crash is not None:
                    log(f"speculative: {crash}")
                    llama["crashed"] = crash
                    _close_all(llms)
                cells.append(_cell(workload, concurrency, len(batch), samples, with_llama))
    finally:
        for engine in engines.values():
            engine.shutdown()
        _close_all(llms)
    figures: dict[str, Any] = {
        "threads": ctx.threads,
        "sizes": size,
        "model": spec.label,
        "speculative_config": SPECULATIVE,
        "llama_cpp_lookup": LLAMA_LOOKUP,
        "llama_cpp": llama,
        "cells": cells,
    }
    figures["targets"] = targets(figures)
    return figures


def _stop_token_ids(engine: Any) -> list[int]:
    # NOTE: the facade's model spec (what engine.chat stops at): end of sequence and the template's end of turn
    model = engine._spec
    return sorted(set(model.config.eos_token_ids) | set(model.end_of_turn_token_ids))


def _rendered(engine: Any, batch: list[Any], params: Any) -> list[list[int]]:
    """The token ids ``engine.chat`` sends for ``batch``'s conversations: what llama.cpp gets too."""
    from enginekit.frontend.chat import render_chat

    prompts, _ = render_chat(engine._spec, batch, params)
    return [prompt.prompt_token_ids for prompt in prompts]


def _close_all(llms: dict[str, Any]) -> None:
    for llm in llms.values():
        llm.close()
    llms.clear()


def _engine_runner(
    engine: Any, batch: list[Any], params: Any, concurrency: int, threads: int
) -> Callable[[], dict[str, Any]]:
    """A timed run of ``batch``: all at once, or (``concurrency`` 1) one request after another."""

    def run() -> dict[str, Any]:
        before = engine.get_stats()
        with torch_threads(threads):
            start = time.perf_counter()
            if concurrency == 1:
                outputs = [engine.chat(conversation, params, progress=False)[0] for conversation in batch]
            else:
                outputs = engine.chat(batch, params, progress=False)
            elapsed = time.perf_counter() - start
        after = engine.get_stats()
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        tokens = sum(len(ids) for ids in token_ids)
        counters = {
            name: after[key] - before[key] if key in after and key in before else None
            for name, key in STAT_KEYS.items()
        }
        metrics = {
            name: sum(getattr(output.metrics, key, 0) or 0 for output in outputs)
            if all(hasattr(output.metrics, key) for output in outputs)
            else None
            for name, key in METRIC_KEYS.items()
        }
        decode_s = sum(
            output.metrics.last_token_time - output.metrics.first_token_time
            for output in outputs
            if output.metrics.first_token_time is not None and output.metrics.last_token_time is not None
        )
        return {
            "tokens_per_s": tokens / elapsed,
            # one request at a time: generated tokens after the first / the time from the first to the last
            "decode_tokens_per_s": (tokens - len(outputs)) / decode_s
            if concurrency == 1 and decode_s
            else None,
            "tokens": tokens,
            "token_ids": token_ids,
            "prompt_ids": [list(output.prompt_token_ids) for output in outputs],
            "texts": [output.outputs[0].text for output in outputs],
            "counters": counters,
            "metrics": metrics,
        }

    return run


def _llama_runner(
    llm: Any, prompts: list[list[int]], max_tokens: int, stops: list[int]
) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        replies = [llm.complete(prompt, max_tokens, stops) for prompt in prompts]
        tokens = sum(len(reply["token_ids"]) for reply in replies)
        elapsed = sum(reply["elapsed_s"] for reply in replies)
        decode_s = sum(reply["elapsed_s"] - reply["first_token_s"] for reply in replies)
        return {
            "tokens_per_s": tokens / elapsed if elapsed else 0.0,
            "decode_tokens_per_s": (tokens - len(replies)) / decode_s if decode_s else 0.0,
            "tokens": tokens,
            "token_ids": [reply["token_ids"] for reply in replies],
        }

    return run


def _cell(
    workload: str, concurrency: int, requests: int, samples: dict[str, list[dict[str, Any]]], with_llama: bool
) -> dict[str, Any]:
    """One workload at one concurrency: rates, ratios, the speculative engine's counters, outputs compared."""
    plain, ngram = samples["plain"], samples["ngram"]

    def rates(runs: list[dict[str, Any]], key: str = "tokens_per_s") -> list[float]:
        return [run[key] for run in runs]

    cell: dict[str, Any] = {
        "workload": workload,
        "concurrency": concurrency,
        "requests": requests,
        "tokens_per_s": {variant: summary(rates(samples[variant])) for variant in VARIANTS},
        "ratio": summary(paired_ratio(rates(ngram), rates(plain))),
        "tokens": {variant: samples[variant][0]["tokens"] for variant in VARIANTS},
        "identical": sum(a == b for a, b in zip(plain[0]["token_ids"], ngram[0]["token_ids"])),
        "copy_share": {
            variant: _mean_copy_share(samples[variant][0]["prompt_ids"], samples[variant][0]["token_ids"])
            for variant in VARIANTS
        },
        "spec": _spec_counters(ngram),
        "forced_without": _sum_counter(plain, "forced"),
    }
    if workload == "json":
        cell["valid_json"] = {variant: _count_json(samples[variant][0]["texts"]) for variant in VARIANTS}
    if concurrency == 1:
        cell["decode_tokens_per_s"] = {
            variant: summary(rates(samples[variant], "decode_tokens_per_s")) for variant in VARIANTS
        }
    if with_llama and all(key in samples for key in LLAMA_KEYS):
        base, lookup = samples["llama.cpp"], samples["llama.cpp lookup"]
        cell["llama_cpp"] = {
            "decode_tokens_per_s": {
                key: summary(rates(samples[key], "decode_tokens_per_s")) for key in LLAMA_KEYS
            },
            "tokens_per_s": {key: summary(rates(samples[key])) for key in LLAMA_KEYS},
            "ratio": summary(paired_ratio(rates(lookup), rates(base))),
            "decode_ratio": summary(
                paired_ratio(rates(lookup, "decode_tokens_per_s"), rates(base, "decode_tokens_per_s"))
            ),
            "identical": sum(a == b for a, b in zip(base[0]["token_ids"], lookup[0]["token_ids"])),
            "same_as_engine": sum(a == b for a, b in zip(base[0]["token_ids"], plain[0]["token_ids"])),
            "engine_decode_ratio": summary(
                paired_ratio(rates(ngram, "decode_tokens_per_s"), rates(lookup, "decode_tokens_per_s"))
            ),
        }
    return cell


def _sum_counter(runs: list[dict[str, Any]], name: str) -> int | None:
    values = [run["counters"][name] for run in runs]
    return None if any(v is None for v in values) else int(sum(values))


def _spec_counters(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The speculative engine's counters over the timed rounds: proposed, accepted and forced tokens, the
    acceptance rate, and the accepted tokens per request-step (a request's verify step keeps its accepted
    proposals and one token of its own, so its steps are the tokens that were neither accepted nor forced)."""
    totals = {name: _sum_counter(runs, name) for name in STAT_KEYS}
    tokens = sum(run["tokens"] for run in runs)
    out: dict[str, Any] = {**totals, "generated": tokens}
    metrics = [run["metrics"] for run in runs]
    out["request_metrics"] = {
        name: None if any(m[name] is None for m in metrics) else int(sum(m[name] for m in metrics))
        for name in METRIC_KEYS
    }
    draft, accepted, forced = totals["draft"], totals["accepted"], totals["forced"]
    out["acceptance_rate"] = accepted / draft if draft and accepted is not None else None
    if accepted is not None:
        own = tokens - accepted - (forced or 0)
        out["accepted_per_step"] = accepted / own if own > 0 else None
        out["tokens_per_step"] = tokens / own if own > 0 else None
    return out


def _mean_copy_share(prompts: list[list[int]], outputs: list[list[int]]) -> float:
    return sum(copy_share(p, o) for p, o in zip(prompts, outputs)) / len(outputs)


def _count_json(texts: list[str]) -> int:
    import json

    count = 0
    for text in texts:
        try:
            json.loads(text)
        except ValueError:
            continue
        count += 1
    return count


def targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """At 1 request, tokens/s with n-gram speculation / without, per workload."""
    out = []
    for cell in figures["cells"]:
        if cell["concurrency"] != 1:
            continue
        workload = cell["workload"]
        out.append(
            target(
                f"speculative decoding (n-gram), 1 request, {LABELS[workload]}: tokens/s with / without",
                GOALS[workload],
                cell["ratio"],
                headline=workload == "copy",
            )
        )
    return out


def _requests(count: int) -> str:
    return "1 request" if count == 1 else f"{count} requests"


def _counter(value: Any, digits: int = 0, unit: str = "") -> str:
    return "n/a" if value is None else number(value, unit, digits)


def render_speculative_bench(figures: dict[str, Any]) -> str:
    size, config = figures["sizes"], figures["speculative_config"]
    k = config["num_speculative_tokens"]
    cells = figures["cells"]
    reported = any(cell["spec"]["draft"] is not None for cell in cells)
    parts = [
        f'{figures["model"]} (`Engine()`\'s file, weights as stored), `mode="inproc"`, {figures["threads"]} threads: '
        f"the same engine without speculation (`jump_forward=False`: every token sampled) and with "
        f"`speculative_config={config}` (and jump forward, the default), interleaved round by round "
        f"({size['rounds']} rounds after a warm-up). Greedy; each request ends at its end of turn, its JSON's "
        f"end or `max_tokens` ({', '.join(f'{LABELS[w]} {n}' for w, n in size['max_tokens'].items())}). "
        "The prompts repeat every round, so after the warm-up their prefill comes from the prefix cache and "
        "tokens/s (generated tokens / wall time) measures generation. Workloads "
        "(`benchmarks/spec_workloads.py`): *copy-heavy*, 300-470-token prompts (chat template included) of a "
        "passage with a task that copies from it (repeat a paragraph, extract the sentences that mention a word, "
        "rewrite with a word replaced); *JSON extraction*, a staff-directory entry (about 185 tokens) written as "
        "an object of eight fixed keys (`StructuredOutputsParams(json=..., disable_any_whitespace=True)`: the "
        "keys and separators are text the grammar forces, which the speculative engine proposes as jump forward, "
        "verified with the n-gram proposals); *free "
        f"chat*, short open questions. At 1 request, {_requests(size['one_requests'])} one after another; at more, "
        "all at once.\n",
    ]
    rows = []
    for cell in cells:
        counters = cell["spec"]
        share = cell["copy_share"]
        rows.append(
            [
                LABELS[cell["workload"]],
                str(cell["concurrency"]),
                rate(cell["tokens_per_s"]["plain"], 1),
                rate(cell["tokens_per_s"]["ngram"], 1),
                ratio(cell["ratio"]),
                _counter(counters.get("acceptance_rate"), 0, "%"),
                _counter(counters.get("accepted_per_step"), 2),
                f"{_counter(cell['forced_without'])} / {_counter(counters['forced'])}",
                f"{cell['identical']} of {cell['requests']}",
                f"{100 * share['plain']:.0f}% / {100 * share['ngram']:.0f}%",
            ]
        )
    parts.append(
        markdown_table(
            [
                "workload",
                "concurrent",
                "without: tok/s",
                "n-gram: tok/s",
                "n-gram / without",
                "proposals accepted",
                "accepted per request-step",
                "forced tokens (without / n-gram)",
                "greedy outputs identical",
                "output copied from the prompt (without / n-gram)",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "r", "r", "r"],
        )
    )
    json_cells = [cell for cell in cells if "valid_json" in cell]
    if json_cells:
        parts.append(
            "Outputs that parse as JSON (without / n-gram; the rest reached `max_tokens`): "
            + ", ".join(
                f"{c['valid_json']['plain']} / {c['valid_json']['ngram']} of {c['requests']} at {c['concurrency']}"
                for c in json_cells
            )
            + ".\n"
        )
    if not reported:
        parts.append(
            "**This engine reported no speculative counters** (`get_stats()` has no `spec_num_draft_tokens`): "
            "it did not speculate, so the two columns measure the same decoding.\n"
        )
    parts.append(
        "*Proposals accepted*: accepted / proposed tokens (`get_stats()`, over the timed rounds); *accepted per "
        "request-step*: accepted tokens / the request-steps that verified them (each keeps its accepted proposals "
        "and one token of its own, so a request-step yields 1 + this many tokens, plus any forced ones); *output "
        "copied*: the share of output tokens inside a 4-token sequence that also occurs in the prompt. Greedy "
        "outputs are compared token for token: with the weights as stored, a verify step scores "
        f"up to {k + 1} rows at once, whose products may round apart from one row's, so where two tokens nearly "
        'tie the outputs can part (`quantization="none"` is the exact path).\n'
    )
    parts.append(
        f"**What the ratio means on this CPU.** At one request a step streams all the weights once whatever its "
        f"row count, so verifying {k} proposals and the next token costs about what one token costs: the ratio "
        "is about the tokens a request-step yields, less the time to find proposals and score the extra rows. "
        "At 16 concurrent a step is closer to bound by arithmetic, so rejected proposals cost more there.\n"
    )
    parts.append(_llama_cpp_text(figures))
    return "\n".join(part for part in parts if part)


def _llama_cpp_text(figures: dict[str, Any]) -> str:
    llama = figures["llama_cpp"]
    note = llama_cpp_note(llama)
    measured = [cell for cell in figures["cells"] if "llama_cpp" in cell]
    lookup = figures["llama_cpp_lookup"]
    text = (
        f"**Against llama.cpp's own lookup decoding**, at 1 request on the copy-heavy and free-chat prompts (the "
        f"same token ids): llama-cpp-python {llama.get('version', '')}'s `Llama.generate`, greedy, one sequence at "
        f"a time, without and with `draft_model=LlamaPromptLookupDecoding(max_ngram_size="
        f"{lookup['max_ngram_size']}, num_pred_tokens={lookup['num_pred_tokens']})`, in the same rounds as the "
        "engine. llama.cpp reuses no prefix between prompts, so both systems are compared on decode tokens/s: "
        "generated tokens after the first / the time from the first to the last.\n"
    )
    if note:
        return text + "\n" + note
    if not measured:
        return ""
    rows = []
    for cell in measured:
        ll = cell["llama_cpp"]
        rows.append(
            [
                LABELS[cell["workload"]],
                rate(cell["decode_tokens_per_s"]["plain"], 1),
                rate(cell["decode_tokens_per_s"]["ngram"], 1),
                rate(ll["decode_tokens_per_s"]["llama.cpp"], 1),
                rate(ll["decode_tokens_per_s"]["llama.cpp lookup"], 1),
                ratio(ll["decode_ratio"]),
                ratio(ll["engine_decode_ratio"]),
                f"{ll['identical']} of {cell['requests']}",
            ]
        )
    return (
        text
        + "\n"
        + markdown_table(
            [
                "workload",
                "engine without: decode tok/s",
                "engine n-gram",
                "llama.cpp without",
                "llama.cpp lookup",
                "llama.cpp lookup / without",
                "engine n-gram / llama.cpp lookup",
                "llama.cpp outputs identical",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "r"],
        )
    )
