"""Each architecture and rope type gives transformers' greedy tokens (float32, tiny random checkpoints), and what
is not implemented is refused by name."""

import json
import random

import pytest

from enginekit import Engine, EngineStartupError, SamplingParams
from hf_checkpoints import build_checkpoint, hf_greedy

MAX_TOKENS = 20
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in (1, 7, 33, 70)]


CASES = {
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "yarn-rope": ("llama", {"rope_parameters": YARN, "rope_theta": 10000.0}),
    "linear-rope": ("qwen2", {"rope_parameters": LINEAR}),
    "qwen3": ("qwen3", {}),
    "qwen3-head-dim": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
}


def run_engine(path, batch, mode="inproc"):
    with Engine(
        str(path), mode=mode, block_size=8, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32
    ) as engine:
        outputs = engine.generate(
            batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(tmp_path, case):
    arch, options = CASES[case]
    path = build_checkpoint(tmp_path / case, arch, **options)
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"])
    assert run_engine(path, batch) == hf_greedy(path, batch, MAX_TOKENS)


def test_background_process_matches_transformers(tmp_path):
    path = build_checkpoint(tmp_path / "qwen3", "qwen3", head_dim=32, rope_parameters=LLAMA3)
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"], seed=1)
    assert run_engine(path, batch, mode="mp") == hf_greedy(path, batch, MAX_TOKENS)


def test_the_rope_scaling_changes_the_tokens(tmp_path):
    """The llama3 parity case above would pass with the scaling ignored if it did not change the tokens."""
    plain = build_checkpoint(tmp_path / "plain", "llama")
    scaled = build_checkpoint(tmp_path / "scaled", "llama", rope_parameters=LLAMA3)
    batch = prompts(json.loads((plain / "config.json").read_text())["vocab_size"])
    assert hf_greedy(plain, batch, MAX_TOKENS) != hf_greedy(scaled, batch, MAX_TOKENS)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        ({"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, change, named):
    path = build_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(EngineStartupError, match=r"supported|needs") as error:
        Engine(str(path), mode="inproc")
    assert named in str(error.value)
