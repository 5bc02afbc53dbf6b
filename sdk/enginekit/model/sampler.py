"""Sampler: penalties, then greedy or temperature / min-p / top-k / top-p sampling with per-request seeded
generators; optional top-k logprobs with ranks.

The order follows vLLM: a structured output's bitmask first, then the token controls (``allowed_token_ids``,
``bad_words``, ``logit_bias``, ``model/token_controls.py``) and the penalties (so greedy decoding sees them
too), then temperature, min-p, top-k and top-p shape the distribution a sample is drawn from. Logprobs are those
of the model's own distribution after the bitmask, before the token controls, penalties and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginekit.model.batch import TokenBitmask
from enginekit.model.token_controls import (
    TokenHistory,
    apply_token_bitmask,
    apply_token_controls,
    needs_token_controls,
)
from enginekit.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # [num_rows, k + 1]: the sampled token first, then the top k (only when some request asked for logprobs)
    logprob_values: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None
    # Per chunk of the batch that asked for prompt logprobs: (values, token ids, ranks), as top_logprobs gives.
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


class Sampler:
    def __init__(self, *, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory | None] | None = None,
        *,
        bad_words: list[list[list[int]] | None] | None = None,
        bitmask: TokenBitmask | None = None,
    ) -> SamplerOutput:
        logits = logits.cpu()
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        raw = logits
        words: list[list[list[int]] | None] = bad_words if bad_words is not None else [None for _ in params]
        if any(needs_token_controls(p, w) for p, w in zip(params, words)):
            logits = apply_token_controls(logits, params, histories, words)
        if histories is not None and any(history is not None for history in histories):
            logits = apply_penalties(logits, params, histories)
        token_ids = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            sampled = self._sample(
                logits[random_rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )
            for row, token in zip(random_rows, sampled):
                token_ids[row] = token
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_logprobs is None:
            return SamplerOutput(token_ids)
        values, ids, ranks = top_logprobs(raw, torch.tensor(token_ids), max_logprobs)
        return SamplerOutput(token_ids, values, ids, ranks)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = _filter(logits / temperature, params)
        probs = torch.softmax(logits, dim=-1)
        tokens = []
        for row, generator in enumerate(generators):
            # Exponential race (Gumbel-max): each row draws noise from its own generator, so a seeded
            # request samples the same tokens whatever else is in the batch.
            noise = torch.empty_like(probs[row]).exponential_(generator=generator or self.generator)
            tokens.append(int((probs[row] / noise).argmax()))
        return tokens


def top_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[n, k + 1]`` log-probabilities, token ids and ranks (1 = most likely): ``chosen`` first, then the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = chosen.unsqueeze(1)
    chosen_values = logprobs.gather(1, chosen)
    chosen_ranks = (logprobs > chosen_values).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, :0])
    top_ranks = torch.arange(1, k + 1).expand(len(logprobs), k)
    return (
        torch.cat([chosen_values, top_values], dim=1),
        torch.cat([chosen, top_ids], dim=1),
        torch.cat([chosen_ranks, top_ranks], dim=1).to(torch.int32),
    )


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties, per row."""
    logits = logits.clone()
    for row, (p, history) in enumerate(zip(params, histories)):
        if history is None or not p.has_penalties:
            continue
        token_ids, num_prompt = history
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
            scores = logits[row, seen]
            penalized = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
            logits[row, seen] = penalized
        output = token_ids[num_prompt:]
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[1]).to(
                logits.dtype
            )
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min-p, then top-k and top-p, on temperature-scaled logits."""
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        threshold = (
            torch.tensor([p.min_p for p in params]).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        )
        logits = logits.masked_fill(probs < threshold, float("-inf"))
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
