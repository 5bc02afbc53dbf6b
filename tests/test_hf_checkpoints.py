"""Quick checks of the tiny Hugging Face checkpoint builder used by enginekit tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hf_checkpoints import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_checkpoint,
    corrupt_safetensors,
    hf_greedy,
    hf_greedy_with_margins,
    weight_files,
)

ARCHS = ["llama", "qwen2", "mistral"]
PROMPTS = [[5, 6, 7, 100], [9, 100], [100], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def _load_all(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_ckpts")
    return {arch: build_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_build_writes_hf_layout(checkpoints, arch):
    path = checkpoints[arch]
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    assert not (path / "model.safetensors.index.json").exists()

    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["rope_parameters"]["rope_theta"] != 10000.0

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert config["vocab_size"] >= tok.get_vocab_size()
    assert config["bos_token_id"] == tok.token_to_id(BOS_TOKEN)
    assert config["eos_token_id"] == tok.token_to_id(EOS_TOKEN)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"]
    assert gen["bos_token_id"] == config["bos_token_id"]
    assert tok.decode(tok.encode("the engine runs").ids) == "the engine runs"

    tensors = _load_all(path)
    assert "lm_head.weight" in tensors
    assert all(torch.isfinite(t).all() for t in tensors.values())
    biases = [k for k in tensors if k.endswith(".bias")]
    if arch == "qwen2":
        assert {k.rsplit(".", 2)[-2] for k in biases} == {"q_proj", "k_proj", "v_proj"}
        assert all(tensors[k].abs().min() > 0 for k in biases)
    else:
        assert biases == []


def test_build_is_deterministic_and_sharding_keeps_weights(tmp_path):
    a = build_checkpoint(tmp_path / "a", "qwen2", seed=3)
    b = build_checkpoint(tmp_path / "b", "qwen2", seed=3, sharded=True)

    index = json.loads((b / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in b.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert not (b / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards

    ta, tb = _load_all(a), _load_all(b)
    assert set(index["weight_map"]) == set(tb) == set(ta)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)

    c = build_checkpoint(tmp_path / "c", "qwen2", seed=4)
    tc = _load_all(c)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_tied_embeddings_omit_lm_head(tmp_path):
    path = build_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in _load_all(path)
    assert [len(t) for t in hf_greedy(path, PROMPTS[:2], 4)] == [4, 4]


def test_vocab_size_options(tmp_path):
    path = build_checkpoint(tmp_path / "big", "mistral", vocab_size=448, rope_theta=10000.0)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 448
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert _load_all(path)["model.embed_tokens.weight"].shape == (448, 64)
    with pytest.raises(ValueError):
        build_checkpoint(tmp_path / "small", "llama", vocab_size=100)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_greedy_lengths_determinism_and_margin(checkpoints, arch):
    path = checkpoints[arch]
    first = hf_greedy(path, PROMPTS, 8)
    assert [len(t) for t in first] == [8] * len(PROMPTS)
    assert hf_greedy(path, PROMPTS, 8) == first
    assert hf_greedy(path, PROMPTS[:1], 0) == [[]]

    # generate() with a KV cache equals a cache-free argmax loop, and the output depends on
    # more than the last prompt token.
    reference, margins = hf_greedy_with_margins(path, PROMPTS, 8)
    assert reference == first
    assert len({tuple(t) for t in first[:3]}) > 1
    flat = sorted(m for row in margins for m in row)
    assert flat[len(flat) // 2] > 0.5


@pytest.mark.parametrize("mode", ["truncate", "garbage"])
def test_corrupt_safetensors_breaks_loading(tmp_path, mode):
    path = build_checkpoint(tmp_path / "ckpt", "llama", sharded=True)
    files = weight_files(path)
    assert len(files) > 1
    for f in files:
        load_file(f)
    corrupt_safetensors(path, mode=mode)
    for f in files:
        with pytest.raises(Exception):  # noqa: B017
            load_file(f)


def test_hf_greedy_does_not_stop_at_eos(tmp_path):
    path = build_checkpoint(tmp_path / "eos", "llama")
    before = hf_greedy(path, PROMPTS[:2], 6)
    # Declare the first generated token to be EOS: decoding must still run the full length.
    eos = before[0][0]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data["eos_token_id"] = eos
        (path / name).write_text(json.dumps(data))
    assert hf_greedy(path, PROMPTS[:2], 6) == before
