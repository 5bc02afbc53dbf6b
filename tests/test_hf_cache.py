"""A Hugging Face repo id resolves through the local Hugging Face cache (``huggingface_hub``'s layout), which the
tests populate themselves under a temporary ``HF_HOME``: nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from enginekit import Engine, EngineStartupError, SamplingParams
from enginekit.model.formats.source import hub_cache_dir, resolve_model
from hf_checkpoints import build_checkpoint

PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2]]
MAIN_COMMIT = "a" * 40
TAG_COMMIT = "b" * 40


def cache_repo(hub: Path, repo_id: str, folder: Path, commit: str, ref: str = "main") -> Path:
    """Put ``folder``'s files where ``huggingface_hub`` keeps a snapshot: ``models--org--name/snapshots/<commit>``
    with ``refs/<ref>`` naming the commit."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def tokens(model: str, mode: str = "inproc", **options) -> list[list[int]]:
    with Engine(model, mode=mode, block_size=8, num_kv_blocks=32, max_model_len=64, **options) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return build_checkpoint(root / "main", "qwen3"), build_checkpoint(root / "v1", "qwen3", seed=1)


@pytest.fixture
def hf_home(tmp_path, monkeypatch, checkpoints) -> Path:
    """A temporary HF_HOME holding org/tiny-qwen3 at main and at the tag v1; offline."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main, v1 = checkpoints
    cache_repo(home / "hub", "org/tiny-qwen3", main, MAIN_COMMIT)
    cache_repo(home / "hub", "org/tiny-qwen3", v1, TAG_COMMIT, ref="v1")
    return home


def test_a_repo_id_in_the_cache_runs_as_its_folder(hf_home, checkpoints):
    main, _ = checkpoints
    source = resolve_model("org/tiny-qwen3")
    assert (source.format, source.name) == ("hf", "org/tiny-qwen3")
    assert source.path == hf_home / "hub" / "models--org--tiny-qwen3" / "snapshots" / MAIN_COMMIT
    assert tokens("org/tiny-qwen3") == tokens(str(main))


def test_the_background_process_resolves_it_too(hf_home, checkpoints):
    assert tokens("org/tiny-qwen3", mode="mp") == tokens(str(checkpoints[0]))


def test_a_revision_picks_that_snapshot(hf_home, checkpoints):
    main, v1 = checkpoints
    assert resolve_model("org/tiny-qwen3", "v1").path.name == TAG_COMMIT
    assert resolve_model("org/tiny-qwen3", MAIN_COMMIT).path.name == MAIN_COMMIT
    assert tokens("org/tiny-qwen3", revision="v1") == tokens(str(v1)) != tokens(str(main))


def test_hf_hub_cache_wins_over_hf_home(tmp_path, hf_home, monkeypatch, checkpoints):
    hub = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert hub_cache_dir() == hub
    with pytest.raises(EngineStartupError, match="not in the Hugging Face cache"):
        resolve_model("org/tiny-qwen3")
    cache_repo(hub, "org/tiny-qwen3", checkpoints[1], TAG_COMMIT)
    assert resolve_model("org/tiny-qwen3").path == hub / "models--org--tiny-qwen3" / "snapshots" / TAG_COMMIT


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_a_missing_model_offline_says_how_to_fetch_it(hf_home, mode):
    with pytest.raises(EngineStartupError) as error:
        Engine("org/not-cached", mode=mode)
    message = str(error.value)
    assert "'org/not-cached' is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message
    assert "hf download org/not-cached" in message
    with pytest.raises(EngineStartupError, match="hf download org/tiny-qwen3 --revision v2"):
        resolve_model("org/tiny-qwen3", "v2")


def test_a_repo_without_a_checkpoint_is_refused(hf_home, tmp_path):
    (tmp_path / "gguf-only").mkdir()
    (tmp_path / "gguf-only" / "README.md").write_text("weights in model.gguf")
    cache_repo(hf_home / "hub", "org/only-gguf", tmp_path / "gguf-only", MAIN_COMMIT)
    with pytest.raises(EngineStartupError, match=r"'org/only-gguf' holds no config\.json.*GGUF repo"):
        resolve_model("org/only-gguf")


def test_a_revision_needs_a_repo_id(hf_home, checkpoints):
    with pytest.raises(EngineStartupError, match="revision='v1' applies to a Hugging Face repo id"):
        resolve_model(str(checkpoints[0]), "v1")
    with pytest.raises(EngineStartupError, match="revision='v1' applies"):
        Engine("builtin", mode="inproc", revision="v1")


def test_neither_a_path_nor_a_repo_id(hf_home):
    with pytest.raises(EngineStartupError, match=r"not a local folder or file, nor a Hugging Face repo id"):
        resolve_model("./no/such/folder")
