"""The speculative-decoding benchmark section: its figures from recorded runs, its targets on the page, its
workloads, and llama.cpp's high-level decoding (with and without prompt lookup) in its child process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_speculative as bench  # noqa: E402
from benchmarks.report import render_page  # noqa: E402
from benchmarks.spec_workloads import (  # noqa: E402
    chat_conversations,
    copy_conversations,
    copy_share,
    json_conversations,
)

from gguf_files import default_gguf_for_llama_cpp  # noqa: E402


def _run(
    rate: float,
    token_ids: list[list[int]],
    *,
    draft: int | None = None,
    accepted: int | None = None,
    forced: int | None = None,
    texts: list[str] | None = None,
) -> dict[str, Any]:
    """One timed run as ``_engine_runner`` returns it; counters ``None``: an engine without them."""
    return {
        "tokens_per_s": rate,
        "decode_tokens_per_s": rate * 1.1,
        "tokens": sum(len(ids) for ids in token_ids),
        "token_ids": token_ids,
        "prompt_ids": [[1, 2, 3, 4, 5, 6, 7, 8]] * len(token_ids),
        "texts": texts or [""] * len(token_ids),
        "counters": {"draft": draft, "accepted": accepted, "forced": forced, "steps": 10},
        "metrics": {"draft": draft, "accepted": accepted, "forced": forced},
    }


def _figures(llama: dict[str, Any] | None = None, *, counters: bool = True) -> dict[str, Any]:
    """Figures of a 1-request run with two rounds per cell: copy 2x, JSON 1.4x, chat 0.97x, n-gram / without."""
    copied = [[3, 4, 5, 6, 7, 8]] * 50  # 300 tokens copied from the prompt
    cells = []
    for workload, speedup in (("copy", 2.0), ("json", 1.4), ("chat", 0.97)):
        plain = [_run(100.0, copied, forced=0 if counters else None) for _ in range(2)]
        if counters:
            ngram = [_run(100.0 * speedup, copied, draft=200, accepted=150, forced=30) for _ in range(2)]
        else:
            ngram = [_run(100.0 * speedup, copied) for _ in range(2)]
        ngram[0]["token_ids"] = [[9, 9, 9, 9, 9, 9], *copied[1:]]  # one output parted at a near-tie
        samples = {"plain": plain, "ngram": ngram}
        with_llama = workload in ("copy", "chat") and llama is not None and "crashed" not in llama
        if with_llama:
            samples["llama.cpp"] = [_run(50.0, copied) for _ in range(2)]
            samples["llama.cpp lookup"] = [_run(60.0, copied) for _ in range(2)]
        cells.append(bench._cell(workload, 1, len(copied), samples, with_llama))
    figures = {
        "threads": 2,
        "sizes": bench.sizes(False),
        "model": "SmolLM2",
        "speculative_config": bench.SPECULATIVE,
        "llama_cpp_lookup": bench.LLAMA_LOOKUP,
        "llama_cpp": llama or {"why_not": "`llama-cpp-python` is not installed"},
        "cells": cells,
    }
    figures["targets"] = bench.targets(figures)
    return figures


def _page(figures: dict[str, Any]) -> str:
    section = {"question": "What does speculative decoding give?", "runtime_s": 1.0, "load_before": "0"}
    result = {
        "date": "2026-12-05T00:00:00+00:00",
        "quick": False,
        "command": ".venv/bin/python benchmarks/run.py",
        "commit": "abc1234",
        "duration_s": 60.0,
        "machine": {"cpu": "CPU", "usable_cores": 2},
        "sections": {"speculative": {**section, "figures": figures}},
    }
    return render_page(result, "r.json", {})


def test_the_targets_are_the_1_request_ratios_met_or_not_on_the_page() -> None:
    figures = _figures({"version": "0.3.36"})
    text = _page(figures)
    assert (
        "| speculative decoding (n-gram), 1 request, copy-heavy: tokens/s with / without | >= 1.80x | 2.00x |  | met |"
        in text
    )
    json_row = (
        "| speculative decoding (n-gram), 1 request, JSON extraction: tokens/s with / without | >= 1.50x |"
    )
    assert f"{json_row} 1.40x |  | **NOT met** |" in text
    chat_row = "| speculative decoding (n-gram), 1 request, free chat: tokens/s with / without | >= 0.95x |"
    assert f"{chat_row} 0.97x |  | met |" in text
    assert "2 of 3 targets met." in text
    assert [t["headline"] for t in figures["targets"]] == [True, False, False]


def test_a_cell_counts_acceptance_steps_identical_and_copied_outputs() -> None:
    cell = _figures({"version": "0.3.36"})["cells"][0]
    counters = cell["spec"]
    # two rounds of 300 tokens each: 400 proposed, 300 accepted, 60 forced
    assert (counters["draft"], counters["accepted"], counters["forced"]) == (400, 300, 60)
    assert counters["acceptance_rate"] == pytest.approx(0.75)
    own = 600 - 300 - 60  # the request-steps: tokens neither accepted nor forced
    assert counters["accepted_per_step"] == pytest.approx(300 / own)
    assert counters["tokens_per_step"] == pytest.approx(600 / own)
    assert counters["request_metrics"] == {"draft": 400, "accepted": 300, "forced": 60}
    assert cell["forced_without"] == 0
    assert cell["identical"] == 49 and cell["requests"] == 50
    assert cell["copy_share"]["plain"] == 1.0 and cell["copy_share"]["ngram"] == pytest.approx(49 / 50)
    assert cell["ratio"]["median"] == pytest.approx(2.0)
    assert cell["llama_cpp"]["ratio"]["median"] == pytest.approx(1.2)
    assert cell["llama_cpp"]["engine_decode_ratio"]["median"] == pytest.approx(200.0 / 60.0)
    text = bench.render_speculative_bench(_figures({"version": "0.3.36"}))
    assert "| copy-heavy | 1 | 100.0 (100.0-100.0) | 200.0 (200.0-200.0) | 2.00x (2.00-2.00) | 75% |" in text
    assert "| 0 / 60 | 49 of 50 | 100% / 98% |" in text
    assert (
        "| copy-heavy | 110.0 (110.0-110.0) | 220.0 (220.0-220.0) | 55.0 (55.0-55.0) | 66.0 (66.0-66.0) |"
        in text
    )
    assert "reported no speculative counters" not in text


def test_an_engine_without_counters_and_a_llama_cpp_crash_say_so() -> None:
    crashed = {"version": "0.3.36", "crashed": "llama.cpp's process was killed by SIGSEGV"}
    figures = _figures(crashed, counters=False)
    assert figures["cells"][0]["spec"]["acceptance_rate"] is None
    text = bench.render_speculative_bench(figures)
    assert "**This engine reported no speculative counters**" in text
    assert "| n/a | n/a | n/a / n/a |" in text
    assert "**llama.cpp crashed**" in text and "SIGSEGV" in text
    missing = bench.render_speculative_bench(_figures(None))
    assert "**llama.cpp was not measured**: `llama-cpp-python` is not installed" in missing


def test_copy_share_counts_the_output_tokens_inside_ngrams_of_the_prompt() -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16]
    assert copy_share(prompt, [11, 12, 13, 14]) == 1.0
    assert copy_share(prompt, [11, 12, 13, 14, 99, 98, 97, 96]) == 0.5
    assert copy_share(prompt, [11, 12, 13]) == 0.0  # shorter than a 4-gram
    assert copy_share(prompt, [11, 12, 14, 15]) == 0.0


def test_the_workloads_are_sixteen_fixed_conversations_each() -> None:
    for build in (copy_conversations, json_conversations, chat_conversations):
        first, second = build(), build()
        assert first == second and len(first) == 16
        assert len({c[0]["content"] for c in first}) == 16
    assert all(len(c[0]["content"].split()) > 200 for c in copy_conversations())
    assert bench.pick(list(range(16)), 2) == [0, 8] and bench.pick(list(range(16)), 16) == list(range(16))


@pytest.mark.parametrize("lookup", [None, {"max_ngram_size": 2, "num_pred_tokens": 3}])
def test_llama_cpp_generate_in_its_child_stops_at_max_tokens_and_times_the_first_token(
    lookup: dict[str, int] | None,
) -> None:
    from benchmarks import llama_cpp_runner

    path = default_gguf_for_llama_cpp()
    prompt = [100 + i % 7 for i in range(40)]  # repeats: something for the lookup to find
    with llama_cpp_runner.LlamaCppProcess(
        path, max_sequences=1, max_length=64, threads=1, kind="generate", prompt_lookup=lookup
    ) as llm:
        reply = llm.complete(prompt, 5, [])
        assert len(reply["token_ids"]) == 5
        assert 0 < reply["first_token_s"] <= reply["elapsed_s"]
        first = reply["token_ids"][0]
        stopped = llm.complete(prompt, 5, [first])  # its first token is a stop token: nothing generated
        assert stopped["token_ids"] == []
        with pytest.raises(RuntimeError, match="'generate' is not served by LlamaCppGenerate"):
            llm.generate([prompt], 2, batched=True)
