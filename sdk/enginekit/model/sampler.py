"""Sampler: greedy, temperature, top-k, top-p; per-request seeded generators; optional top-k logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginekit.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # [num_rows, k + 1]: the sampled token first, then the top k (only when some request asked for logprobs)
    logprob_values: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None


class Sampler:
    def __init__(self, *, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        logits = logits.cpu()
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        token_ids = greedy.tolist()
        if random_rows:
            sampled = self._sample(
                logits[random_rows],
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
            for row, token in zip(random_rows, sampled):
                token_ids[row] = token
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_logprobs is None:
            return SamplerOutput(token_ids)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(token_ids).unsqueeze(1)
        top_values, top_ids = (
            logprobs.topk(max_logprobs, dim=-1) if max_logprobs else (logprobs[:, :0], chosen[:, :0])
        )
        values = torch.cat([logprobs.gather(1, chosen), top_values], dim=1)
        ids = torch.cat([chosen, top_ids], dim=1)
        return SamplerOutput(token_ids, values, ids)

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = _top_k_top_p(logits / temperature, params)
        probs = torch.softmax(logits, dim=-1)
        tokens = []
        for row, generator in enumerate(generators):
            # Exponential race (Gumbel-max): each row draws noise from its own generator, so a seeded
            # request samples the same tokens whatever else is in the batch.
            noise = torch.empty_like(probs[row]).exponential_(generator=generator or self.generator)
            tokens.append(int((probs[row] / noise).argmax()))
        return tokens


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p == 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if any(top_k):
        k = torch.tensor([min(k, vocab) if k else vocab for k in top_k]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the better tokens
        cut = before > torch.tensor(top_p).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
