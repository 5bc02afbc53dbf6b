"""Greedy tokens equal Hugging Face transformers on tiny random checkpoints, through every engine feature."""

import json
import random

import pytest

from enginekit import Engine, EngineStartupError, SamplingParams
from hf_checkpoints import build_checkpoint, corrupt_safetensors, hf_greedy

MAX_TOKENS = 24


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, vocab_size) for _ in range(40)]
    prompts = [shared + [rng.randrange(2, vocab_size) for _ in range(20)]]  # 60 tokens: chunked
    prompts.append(shared + [rng.randrange(2, vocab_size) for _ in range(5)])  # shares 5 blocks
    for length in (1, 3, 9, 17, 30):
        prompts.append([rng.randrange(2, vocab_size) for _ in range(length)])
    return prompts


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {}),
        ("qwen2", {"sharded": True}),
        ("mistral", {"tie_word_embeddings": True, "rope_theta": 10000.0}),
    ],
)
def test_greedy_tokens_match_transformers(tmp_path, arch, options):
    path = build_checkpoint(tmp_path / arch, arch, **options)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab_size)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with Engine(
        str(path),
        mode="inproc",
        block_size=8,
        num_kv_blocks=16,
        max_model_len=128,
        max_num_batched_tokens=32,
    ) as engine:
        outputs = engine.generate(
            prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        )
        stats = engine.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # The run really exercised chunked prefill, the prefix cache and preemption.
    assert stats["num_steps"] > MAX_TOKENS
    assert stats["prefix_cache_hits"] >= 32
    assert outputs[1].num_cached_tokens >= 32
    assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_eos_from_generation_config_stops(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    prompt = make_prompts(384)[3]
    tokens = hf_greedy(path, [prompt], 12)[0]
    eos = tokens[4]
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = eos
    (path / "generation_config.json").write_text(json.dumps(config))
    with Engine(str(path), mode="inproc") as engine:
        stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
        ignored = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert ignored[0].outputs[0].token_ids == tokens


def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    with Engine(str(path), mode="inproc") as engine:
        out = engine.generate("the engine reads a tokenizer", SamplingParams(max_tokens=6, temperature=0))[0]
        ids = engine.tokenizer.encode("the engine reads a tokenizer")
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(path, [ids], 6)[0]
        assert out.text == engine.tokenizer.decode(out.outputs[0].token_ids)


def test_missing_model_folder(tmp_path):
    with pytest.raises(
        EngineStartupError,
        match=r"model '.*nowhere' is not a local folder or file, nor a Hugging Face repo id",
    ):
        Engine(str(tmp_path / "nowhere"), mode="inproc")


def test_missing_config_json(tmp_path):
    with pytest.raises(EngineStartupError, match=r"has no config\.json"):
        Engine(str(tmp_path), mode="inproc")


def test_missing_tokenizer(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    (path / "tokenizer.json").unlink()
    with pytest.raises(EngineStartupError, match=r"has no tokenizer\.json"):
        Engine(str(path), mode="inproc")


def test_corrupt_weights(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    corrupt_safetensors(path)
    with pytest.raises(EngineStartupError, match="cannot read weights file"):
        Engine(str(path), mode="inproc")


def test_unsupported_architecture(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartupError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        Engine(str(path), mode="inproc")


def test_unsupported_rope_scaling(tmp_path):
    path = build_checkpoint(tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineStartupError, match=r"unsupported rope type 'ntk-by-parts'.*supported: default"):
        Engine(str(path), mode="inproc")
