"""The benchmark runner end to end on its cheapest section, and the page it renders from a run's JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.figures import summary, target  # noqa: E402
from benchmarks.report import render_page  # noqa: E402

from gguf_files import default_gguf_for_llama_cpp  # noqa: E402


def test_quick_limits_run_writes_json_and_page(tmp_path: Path) -> None:
    page, results = tmp_path / "docs" / "benchmarks.md", tmp_path / "results"
    command = [sys.executable, "benchmarks/run.py", "--quick", "--only", "limits"]
    done = subprocess.run(
        [*command, "--output", str(page), "--results-dir", str(results)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,  # under the suite's 300 s: a loaded CI machine takes several times the 10 s it takes idle
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = results.glob("*.json")
    result = json.loads(path.read_text())
    assert result["quick"] is True and result["commit"]
    limits = result["sections"]["limits"]["figures"]
    assert limits["read_gb_s"]["all"]["median"] > 0
    assert limits["zmq_round_trip_us"]["p50"] > 0
    if limits["compiled"]:
        assert limits["peak"]["float32"]["all"]["median"] > 0
    text = page.read_text()
    assert "**Quick run**" in text
    assert "## What can this machine do at most?" in text
    assert f"{limits['zmq_round_trip_us']['p50']:.1f}" in text  # the page's numbers are the JSON's
    assert path.name in text


def _result(sections: dict) -> dict:
    return {
        "date": "2026-12-03T20:00:00+00:00",
        "quick": False,
        "command": ".venv/bin/python benchmarks/run.py",
        "commit": "abc1234",
        "dirty": False,
        "duration_s": 60.0,
        "machine": {"cpu": "CPU", "usable_cores": 2, "busy_before_run": 0.0},
        "sections": sections,
    }


def test_page_collects_targets_and_notes_skipped_sections() -> None:
    ratio = summary([0.9, 0.95, 1.0])
    section = {
        "question": "Q?",
        "runtime_s": 1.0,
        "load_before": "0",
        "load_after": "0",
        "figures": {
            "targets": [target("mp / inproc", 0.97, ratio), target("restart", 0.5, 0.3, at_least=False)]
        },
    }
    skipped = {
        "question": "Quantized?",
        "load_before": "0",
        "skipped": "`benchmarks/bench_quant.py` is not here",
    }
    text = render_page(_result({"x": section, "quant": skipped}), "results/r.json", {})
    assert "| mp / inproc | >= 0.97x | 0.95x | 0.90x-1.00x | **NOT met** |" in text
    assert "| restart | <= 0.50x | 0.30x |  | met |" in text
    assert "1 of 2 targets met." in text
    assert "Not measured: `benchmarks/bench_quant.py` is not here." in text


@pytest.mark.parametrize("busy, loaded", [(0.05, False), (0.5, True)])
def test_page_says_when_the_machine_was_loaded(busy: float, loaded: bool) -> None:
    result = _result({})
    result["machine"]["busy_before_run"] = busy
    assert ("**The machine was loaded**" in render_page(result, "r.json", {})) is loaded


@pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")) or not shutil.which("objdump"),
    reason="needs a C compiler and objdump",
)
def test_peak_loops_keep_twelve_independent_chains(tmp_path: Path) -> None:
    """The peak loops' figure counts twelve instructions a trip; with twelve accumulators that start equal the
    compiler keeps one chain and runs one, so the figure was one chain's latency-bound rate times twelve. Each
    loop compiled as the bench compiles it must hold its instruction twelve times."""
    from benchmarks.bench_limits import SOURCE

    binary = tmp_path / "machine_limits"
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(SOURCE), "-o", str(binary)], check=True)
    listing = subprocess.run(
        ["objdump", "-d", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    functions = {"fma32": "fmadd", "bf16": "vdpbf16ps", "int8": "vpdpbusd"}
    found = 0
    for function, mnemonic in functions.items():
        body = listing.split(f"<{function}>:\n", 1)
        if len(body) < 2:
            continue  # not built for this CPU
        found += 1
        instructions = body[1].split("\n\n", 1)[0]
        assert instructions.count(mnemonic) >= 12, f"{function}: {instructions.count(mnemonic)} {mnemonic}"
    assert found, "no peak loop found in the disassembly"


def _row(kind: str, concurrency: int, share: float) -> dict:
    rate = summary([100.0, 110.0])
    return {
        "concurrency": concurrency,
        "kind": kind,
        "window_ms": None,
        "engine": rate,
        "baselines": {"generate, bfloat16, dynamic cache": rate},
        "baseline_label": "generate, bfloat16, dynamic cache",
        "baseline": rate,
        "ratio": summary([1.0, 1.1]),
        "gflops": share * 400.0,
        "share_of_peak": share,
    }


def test_the_peak_sentence_is_about_the_largest_batchs_equal_row() -> None:
    """The sentence names the equal row at the largest concurrency, not the largest share of any row (a mixed row
    at 32 used more of the peak than the equal one)."""
    from benchmarks.bench_real import peak_sentence

    rows = [_row("equal", 8, 0.41), _row("equal", 32, 0.39), _row("mixed", 32, 0.43)]
    text = peak_sentence(rows, 437.0, "bfloat16")
    assert "equal row (32 concurrent) uses 39.0% of the bfloat16 peak (437 GFLOP/s)" in text
    assert peak_sentence(rows, None, "bfloat16") == ""


def test_the_share_column_names_the_peak_it_divides_by() -> None:
    from benchmarks.bench_throughput import rows_table

    header = rows_table([_row("equal", 1, 0.16)], digits=1, peak="bfloat16").splitlines()[0]
    assert "of the bfloat16 peak" in header and "FMA" not in header
    assert "transformers `generate, bfloat16, dynamic cache` tok/s" in header


def test_a_row_with_two_transformers_bolds_the_faster_and_compares_with_it() -> None:
    from benchmarks.bench_throughput import rows_table, transformers_curves

    row = _row("mixed", 8, 0.2)
    row["baselines"] = {
        "generate, float32, dynamic cache": summary([50.0]),
        "generate_batch, float32": row["baseline"],
    }
    row["baseline_label"] = "generate_batch, float32"
    above = _row("mixed", 128, 0.2)  # continuous batching not run above the section's cap
    above["baselines"] = {"generate, float32, dynamic cache": above["baseline"]}
    above["baseline_label"] = "generate, float32, dynamic cache"
    lines = rows_table([row, above], digits=1).splitlines()
    assert "engine / the faster transformers" in lines[0]
    assert "| 50.0 | **105.0 (100.0-110.0)** |" in lines[2]
    assert "| **105.0 (100.0-110.0)** | not run |" in lines[3]
    curves = transformers_curves([{**row, "kind": "equal"}, {**above, "kind": "equal"}])
    assert [c for c, _ in curves["transformers generate_batch, float32"]] == [8]
    assert [c for c, _ in curves["transformers generate, float32, dynamic cache"]] == [8, 128]


def _git(root: Path, *command: str) -> bytes:
    return subprocess.run(["git", *command], cwd=root, check=True, capture_output=True).stdout


def test_a_runs_revision_records_its_uncommitted_diff_by_hash(tmp_path: Path) -> None:
    import hashlib

    from benchmarks.run import revision

    _git(tmp_path, "init", "-q")
    (tmp_path / "sdk").mkdir()
    (tmp_path / "sdk" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = revision(tmp_path)
    assert clean["dirty"] is False and clean["diff_sha256"] is None and clean["changed"] == []
    assert clean["commit"] == _git(tmp_path, "rev-parse", "--short", "HEAD").decode().strip()

    (tmp_path / "sdk" / "a.py").write_text("x = 2\n")
    (tmp_path / "sdk" / "new.py").write_text("y = 1\n")
    dirty = revision(tmp_path)
    assert dirty["dirty"] is True and dirty["changed"] == ["sdk/a.py"]
    assert dirty["diff_sha256"] == hashlib.sha256(_git(tmp_path, "diff", "HEAD")).hexdigest()
    assert dirty["untracked"] == ["sdk/new.py"]


def test_the_page_names_a_dirty_runs_diff_hash() -> None:
    result = _result({})
    result.update(dirty=True, diff_sha256="ab" * 32, changed=["sdk/a.py"], untracked=[])
    text = render_page(result, "r.json", {})
    assert "from commit abc1234 (**with uncommitted changes** to 1 file (sdk/a.py)" in text
    assert f"whose `git diff HEAD | sha256sum` is `{'ab' * 32}`" in text
    result.update(diff_sha256=None, changed=[])  # a run from before the hash was recorded
    assert "their diff not recorded: these figures are of no commit" in render_page(result, "r.json", {})
    assert "uncommitted" not in render_page(_result({}), "r.json", {})


def test_quantized_targets_are_against_the_ceiling_and_batched_llama_cpp_and_say_when_unmeasured() -> None:
    """The concurrent target is the share of the workload's arithmetic ceiling and the ratio to llama.cpp batched
    at the same concurrency; when llama.cpp crashed, its targets are listed as not measured, not left out."""
    from benchmarks.bench_quantized import _targets, llama_cpp_note

    runs = {name: {"rates": {}} for name in ("one", "concurrent", "prefill")}
    figures = {
        "sizes": {"decode": 128, "concurrent": 16, "prefill": 512},
        "runs": runs,
        "compute": {"share": summary([0.29, 0.31])},
    }
    runs["one"]["against_llama_cpp"] = summary([1.3])
    targets = {t["name"]: t for t in _targets(figures)}
    ceiling = targets["quantized, 16 concurrent: share of the workload's arithmetic ceiling"]
    assert (ceiling["goal"], ceiling["unit"], ceiling["met"]) == (0.5, "%", False)
    batched = targets["quantized, 16 concurrent: engine / llama.cpp batched"]
    assert batched["goal"] == 2.5 and batched["measured"] != batched["measured"]  # NaN: not measured
    section = {
        "question": "Q?",
        "runtime_s": 1.0,
        "load_before": "0",
        "figures": {"targets": list(targets.values())},
    }
    text = render_page(_result({"x": section}), "r.json", {})
    assert (
        "| quantized, 16 concurrent: engine / llama.cpp batched | >= 2.50x | n/a |  | not measured |" in text
    )
    assert "1 of 4 targets met (2 not measured: see their sections)." in text
    note = llama_cpp_note({"version": "0.3.36", "crashed": "llama.cpp's process was killed by SIGSEGV"})
    assert note.startswith("**llama.cpp crashed**") and "SIGSEGV" in note
    assert llama_cpp_note({"version": "0.3.36"}) == ""


def test_a_llama_cpp_child_that_crashes_at_start_raises_naming_the_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp runs in a child process: a segmentation fault there (a real one: a read at address 0) is an
    exception in the bench naming the signal, not the bench's death."""
    from benchmarks import llama_cpp_runner

    monkeypatch.setenv(llama_cpp_runner.FAULT_ENV, "start")
    with pytest.raises(llama_cpp_runner.LlamaCppCrashed, match="killed by SIGSEGV while loading the model"):
        llama_cpp_runner.LlamaCppProcess("unused.gguf", max_sequences=1, max_length=8, threads=1)


def test_llama_cpp_in_its_child_generates_every_sequences_tokens() -> None:
    from benchmarks import llama_cpp_runner

    with llama_cpp_runner.LlamaCppProcess(
        default_gguf_for_llama_cpp(), max_sequences=3, max_length=24, threads=1
    ) as llm:
        prompts = [[100 + i for i in range(8)], [200 + i for i in range(5)], [300 + i for i in range(12)]]
        for batched in (True, False):
            tokens, elapsed = llm.generate(prompts, 6, batched=batched)
            assert tokens == 18 and elapsed > 0


def test_a_llama_cpp_crash_at_its_first_decode_leaves_the_other_systems_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on Intel AMX hosts, where llama-cpp-python 0.3.36 built from source segfaults at its first decode: the
    interleave runs again without llama.cpp and says why."""
    from benchmarks import llama_cpp_runner
    from benchmarks.common import interleave

    path = default_gguf_for_llama_cpp()
    monkeypatch.setenv(llama_cpp_runner.FAULT_ENV, "decode")
    with llama_cpp_runner.LlamaCppProcess(path, max_sequences=2, max_length=16, threads=1) as llm:
        calls = []
        runners = {
            "engine": lambda: calls.append(1) or 1.0,
            "llama.cpp": lambda: llm.generate([[100, 101, 102]], 4, batched=True)[0],
        }
        samples, crash = llama_cpp_runner.interleave_surviving(
            runners, ["llama.cpp"], interleave, repeats=2, warmup=1
        )
    assert set(samples) == {"engine"} and samples["engine"] == [1.0, 1.0]
    assert crash is not None and "killed by SIGSEGV while generating for 1 sequence(s)" in crash


def test_transformers_continuous_batching_gives_each_request_its_own_length(tmp_path: Path) -> None:
    """The generate_batch baseline: one manager started per checkpoint and dtype, each call's requests stopping at
    their own lengths (the runner raises unless every request got exactly its tokens), a smaller batch served by
    the same manager, and its thread stopped with the model cache."""
    from benchmarks import baselines

    from hf_checkpoints import build_checkpoint

    build_checkpoint(tmp_path, "llama", vocab_size=512)
    try:
        mixed = baselines.hf_batch_runner(
            tmp_path, [5, 17, 9], [3, 11, 6], capacity=baselines.BatchCapacity(4, 40)
        )
        assert mixed() > 0 and mixed() > 0
        (manager,) = [entry[1] for entry in baselines._MANAGERS.values()]
        one = baselines.hf_batch_runner(tmp_path, [7], [4])
        assert one() > 0
        assert [entry[1] for entry in baselines._MANAGERS.values()] == [manager]  # the same manager served it
        assert manager.is_running()
    finally:
        baselines.clear_model_cache()
    assert not manager.is_running() and not baselines._MANAGERS


def test_the_real_models_llama_cpp_text_says_it_crashed() -> None:
    from benchmarks.bench_real import _llama_cpp_text

    figures = {
        "llama_cpp": {"version": "0.3.36", "weights": 97e6, "crashed": "killed by SIGSEGV", "rows": []},
        "streamed": {"weights": 97e6},
        "threads": 2,
        "sizes": {"llama_cpp_rounds": 2},
    }
    text = _llama_cpp_text(figures)
    assert "**llama.cpp crashed**, so it has no rows (its targets say n/a): killed by SIGSEGV." in text
    assert "| concurrent |" not in text
    missing = _llama_cpp_text({**figures, "llama_cpp": {"why_not": "`llama-cpp-python` is not installed"}})
    assert missing.startswith("**llama.cpp was not measured**: `llama-cpp-python` is not installed")


@pytest.mark.parametrize(
    ("mode", "callers"), [("inproc", "driver"), ("mp", "driver"), ("mp", "threads"), ("async", "tasks")]
)
def test_staggered_runners_serve_every_arrival(mode: str, callers: str) -> None:
    # the staggered sections drive the facade's internals (the driver pulls with the router's _pump): a change
    # there must show here, not only in a bench run
    from benchmarks.common import engine_staggered_runner, mixed_workload, session

    spec = session().model("builtin")
    workload = mixed_workload(6, (4, 24), (2, 10), seed=1)
    from enginekit import Engine

    with Engine("builtin", mode=mode, num_kv_blocks=128) as engine:
        run = engine_staggered_runner(
            engine, spec, workload, [0.0, 0.0, 0.01, 0.02, 0.02, 0.05], callers=callers
        )()
    assert run.tokens == workload.num_output_tokens and run.elapsed_s > 0
