"""Sampler: greedy, filters, per-request seeds independent of the batch, logprobs."""

import torch

from enginekit.model.sampler import Sampler
from enginekit.sampling_params import SamplingParams

VOCAB = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_the_argmax():
    x = logits(4)
    out = Sampler(seed=0)(x, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == x.argmax(-1).tolist() and out.logprob_values is None


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    x = logits(3)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.5)]
    out = Sampler(seed=0)(x, params, [None] * 3)
    assert out.token_ids == x.argmax(-1).tolist()


def test_a_seed_decides_the_token_whatever_else_is_in_the_batch():
    x = logits(1, seed=1)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(seed=0)(x, [params], [seeded(7)]).token_ids[0]
    batch = torch.cat([logits(5, seed=2), x])
    mixed = Sampler(seed=123)(
        batch, [SamplingParams(temperature=0.7)] * 5 + [params], [None] * 5 + [seeded(7)]
    )
    assert mixed.token_ids[-1] == alone


def test_top_k_never_samples_outside_the_k_best():
    x = logits(1, seed=3)
    best = set(x[0].topk(3).indices.tolist())
    sampler = Sampler(seed=0)
    tokens = {sampler(x, [SamplingParams(top_k=3, temperature=5.0)], [None]).token_ids[0] for _ in range(200)}
    assert tokens <= best and len(tokens) > 1


def test_logprobs_put_the_sampled_token_first_then_the_top_k():
    x = logits(2, seed=4)
    out = Sampler(seed=0)(x, [SamplingParams(temperature=0, logprobs=3)] * 2, [None] * 2)
    expected = torch.log_softmax(x, -1)
    assert out.logprob_values.shape == (2, 4)
    assert out.logprob_token_ids[:, 0].tolist() == out.token_ids
    assert torch.allclose(out.logprob_values[:, 1:], expected.topk(3).values)
