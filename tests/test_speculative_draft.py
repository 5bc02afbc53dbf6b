"""The draft-model proposer (``core/speculative/draft_model.py``) on tiny checkpoints: a draft that is the target
proposes the target's own greedy continuation, also after the target rejected some of its proposals; a draft with
another vocabulary is refused; its cache gives blocks back and, when full, proposes nothing instead of failing."""

import logging
from dataclasses import dataclass, field

import pytest
import torch
from gguf import GGMLQuantizationType

from enginekit import Engine, EngineStartupError, SamplingParams
from enginekit.config import EngineConfig
from enginekit.core.speculative.draft_model import DraftModelProposer
from enginekit.model.loader import load_model_spec
from gguf_files import write_tiny_gguf
from hf_checkpoints import build_checkpoint, build_tokenizer

K = 4
ROUNDS = 3
GENERATED = ROUNDS * (K + 1)
PROMPTS = [
    [0, 40, 41, 42, 43, 44],
    [0, 7],
    list(range(50, 90)),  # past the token budget below: caught up over several passes
    [0, *range(200, 230)],
]


@dataclass
class Request:
    """The fields of a request a proposer reads (``ProposalRequest``)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = field(default=0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("spec-target") / "llama", "llama"))


@pytest.fixture(scope="module")
def reference(target):
    """The target's greedy continuation of a list of prompts, as the engine gives it."""
    with Engine(target, mode="inproc", num_kv_blocks=128) as engine:

        def continuation(prompts: list[list[int]], count: int = GENERATED) -> list[list[int]]:
            params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
            outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
            return [list(output.outputs[0].token_ids) for output in outputs]

        yield continuation


def make_proposer(target: str, draft: str, **options) -> DraftModelProposer:
    options = {"num_kv_blocks": 64, "max_num_batched_tokens": 16, **options}
    config = EngineConfig(
        model=target,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K},
        **options,
    )
    spec = load_model_spec(target)
    return DraftModelProposer.create(config, spec.config, spec.tokenizer, torch.device("cpu"), torch.float32)


def test_a_draft_that_is_the_target_proposes_its_greedy_continuation(target, reference):
    expected = reference(PROMPTS)
    proposer = make_proposer(target, target)
    requests = [Request(str(i), list(prompt)) for i, prompt in enumerate(PROMPTS)]
    limits = [K, 2, K, K]  # the second request is close to its max_tokens: fewer proposals
    done = [0] * len(requests)
    for _ in range(ROUNDS):
        proposals = proposer.propose(requests, limits)
        for i, (request, proposed) in enumerate(zip(requests, proposals)):
            assert proposed == expected[i][done[i] : done[i] + limits[i]]
            # the target accepts them all, and adds its own next token
            accepted = expected[i][done[i] : done[i] + len(proposed) + 1]
            request.all_token_ids += accepted
            done[i] += len(accepted)
    proposer.shutdown()


def test_after_a_rejection_it_recomputes_and_proposes_the_new_continuation(target, reference):
    proposer = make_proposer(target, target)
    prompt = PROMPTS[0]
    request = Request("r", list(prompt))
    first = proposer.propose([request], [K])[0]
    assert len(first) == K
    # the target kept the first proposal and sampled another token than the second
    other = 100 if first[1] != 100 else 101
    request.all_token_ids += [first[0], other]
    # and the engine's greedy continuation of that sequence
    expected = reference([request.all_token_ids])[0]
    assert proposer.propose([request], [K])[0] == expected[:K]
    # then rejected every proposal: a token none of them was
    rejected = expected[0] + 1
    request.all_token_ids += [rejected]
    expected = reference([request.all_token_ids])[0]
    assert proposer.propose([request], [K])[0] == expected[:K]


def test_tokens_gained_without_proposals_replace_the_fed_ones(target, reference):
    """Steps that asked for no proposals took other tokens than the draft fed itself: its cache is wrong from a
    position before the last one, and is computed again from there."""
    proposer = make_proposer(target, target)
    request = Request("r", [0, 7])
    proposed = proposer.propose([request], [K])[0]
    request.all_token_ids += [token + 1 for token in proposed]  # none of them the one fed
    expected = reference([request.all_token_ids])[0]
    assert proposer.propose([request], [K])[0] == expected[:K]


def test_a_draft_with_another_tokenizer_is_refused_by_name(target, tmp_path):
    draft = build_checkpoint(tmp_path / "other-tokens", "llama")
    build_tokenizer(320).save(str(draft / "tokenizer.json"))  # the same model sizes, other tokens
    with pytest.raises(
        EngineStartupError, match=r"other-tokens.*does not share the vocabulary.*llama"
    ) as error:
        make_proposer(target, str(draft))
    assert "tokenizers of 384 (target) and 320 (draft) tokens" in str(error.value)
    with pytest.raises(EngineStartupError, match="the built-in byte-level one"):
        make_proposer(target, "builtin")


def test_a_draft_padded_past_the_shared_tokens_proposes_only_the_targets_ids(target):
    draft = build_checkpoint(target + "-padded", "llama", vocab_size=448, seed=5)
    proposer = make_proposer(target, str(draft))
    proposals = proposer.propose(
        [Request(str(i), list(p)) for i, p in enumerate(PROMPTS)], [K] * len(PROMPTS)
    )
    assert all(len(proposed) == K for proposed in proposals)
    assert all(0 <= token < 384 for proposed in proposals for token in proposed)


def test_forget_gives_every_block_back(target):
    proposer = make_proposer(target, target)
    requests = [Request(str(i), list(prompt)) for i, prompt in enumerate(PROMPTS)]
    proposer.propose(requests, [K] * len(requests))
    assert proposer.pool.num_free_blocks < proposer.pool.num_blocks
    proposer.forget([request.request_id for request in requests])
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks
    assert proposer.sequences == {}
    # the runner forgot their block tables: the same ids start over
    assert proposer.propose(requests[:1], [K]) == proposer.propose(requests[:1], [K])


def test_a_full_draft_cache_proposes_nothing_for_what_does_not_fit(target, reference, caplog):
    caplog.set_level(logging.WARNING, logger="enginekit")
    # 2 blocks of 16 tokens, plus one of lookahead for the one sequence: 48 tokens
    proposer = make_proposer(target, target, num_kv_blocks=2, max_num_seqs=1)
    assert proposer.pool.num_blocks == 3
    long, short = Request("long", list(range(3, 40))), Request("short", [0, 5, 6])
    proposals = proposer.propose([long, short], [K, K])
    assert proposals[0] == reference([long.all_token_ids])[0][:K]
    assert proposals[1] == []
    proposer.propose([long, short], [K, K])
    assert sum("KV cache is full" in record.getMessage() for record in caplog.records) == 1
    proposer.forget(["long"])
    assert proposer.propose([short], [K]) == [reference([short.all_token_ids])[0][:K]]


def test_proposals_stop_at_the_drafts_positions(target, reference, tmp_path):
    draft = build_checkpoint(tmp_path / "short", "llama", max_position_embeddings=40)  # the target's weights
    proposer = make_proposer(target, str(draft))
    near, past = Request("near", list(range(3, 41))), Request("past", list(range(3, 45)))
    proposals = proposer.propose([near, past], [K, K])
    assert proposals == [reference([near.all_token_ids])[0][:3], []]  # positions 38, 39 fed: 3 proposals


def test_a_gguf_draft_keeps_its_weights_as_stored_and_proposes_the_greedy_continuation(tmp_path):
    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, weight_type=GGMLQuantizationType.Q8_0)
    proposer = make_proposer(str(path), str(path), quantization="gguf")
    stored = [
        module for module in proposer.runner.model.modules() if getattr(module, "stored", None) is not None
    ]
    assert stored  # the quantized matrices as the file stores them
    prompts = [[1, 40, 41, 42], [1, 50]]
    params = SamplingParams(max_tokens=K, temperature=0.0, ignore_eos=True)
    with Engine(str(path), mode="inproc", num_kv_blocks=64, quantization="gguf") as engine:
        outputs = engine.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
    requests = [Request(str(i), list(prompt)) for i, prompt in enumerate(prompts)]
    assert proposer.propose(requests, [K, K]) == [list(output.outputs[0].token_ids) for output in outputs]


# ---- through the engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_the_engine_verifies_a_draft_models_proposals_and_keeps_its_greedy_tokens(target, tmp_path, mode):
    """Another model with the target's vocabulary (other weights): some proposals rejected, the target's greedy
    tokens unchanged; the same model as its own draft: nearly every proposal accepted."""
    other = str(build_checkpoint(tmp_path / "other", "llama", seed=5))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    options = {"mode": mode, "num_kv_blocks": 128, "batch_invariant": True}
    with Engine(target, **options) as engine:
        expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    rates = {}
    for name, draft in (("other", other), ("self", target)):
        speculative = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": K,
            "adaptive": False,
        }
        with Engine(target, speculative_config=speculative, **options) as engine:
            outputs = engine.generate(prompts, params)
            stats = engine.get_stats()
        assert [o.outputs[0].token_ids for o in outputs] == expected, name
        assert stats["spec_num_draft_tokens"] > 0
        rates[name] = stats["spec_acceptance_rate"]
    assert rates["self"] > 0.9 and rates["other"] < rates["self"]


def test_the_engine_refuses_a_draft_of_another_vocabulary_as_it_starts(target, tmp_path):
    draft = build_checkpoint(tmp_path / "other-tokens", "llama")
    build_tokenizer(320).save(str(draft / "tokenizer.json"))
    speculative = {"method": "draft_model", "model": str(draft)}
    with pytest.raises(EngineStartupError, match="vocabular"):
        Engine(target, mode="inproc", num_kv_blocks=64, speculative_config=speculative)
