"""Sampler: penalties, then greedy or temperature / min-p / top-k / top-p sampling with per-request seeded
generators; optional top-k logprobs with ranks. Everything runs where the logits are, in batched tensor operations.

The order follows vLLM: a structured output's bitmask first, then the token controls (``allowed_token_ids``,
``bad_words``, ``logit_bias``, and EOS and stop tokens banned before ``min_tokens``: ``model/token_controls.py``) and
the penalties (``model/penalties.py``; so greedy decoding sees them too), then temperature, min-p, top-k and top-p
shape the distribution a sample is drawn from. Logprobs are those of the model's own distribution after the bitmask,
before the token controls, penalties and temperature.

``sample`` leaves its result on the device (``DeviceSample``): the next step can read its ids there, and
``DeviceSample.to_host`` starts the one copy back of the step, O(rows x (1 + k)) values (``model/transfer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginekit.model import transfer
from enginekit.model.batch import SequenceChunk, TokenBitmask
from enginekit.model.penalties import apply_penalties
from enginekit.model.token_controls import (
    TokenHistory,
    apply_token_bitmask,
    apply_token_controls,
    needs_token_controls,
)
from enginekit.sampling_params import SamplingParams

LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # values, token ids, ranks: [rows, k + 1]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # [num_rows, k + 1]: the sampled token first, then the top k (only when some request asked for logprobs)
    logprob_values: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None
    # Per chunk of the batch that asked for prompt logprobs: (values, token ids, ranks), as top_logprobs gives.
    prompt_logprobs: dict[int, LogprobTensors] | None = None


@dataclass
class DeviceSample:
    """A step's samples, still on the logits' device: ``token_ids`` ``[rows]``, and the logprobs asked for."""

    token_ids: torch.Tensor
    logprobs: LogprobTensors | None = None
    prompt_logprobs: dict[int, LogprobTensors] | None = None

    def to_host(self, copy_stream: transfer.CopyStream | None = None) -> PendingSample:
        """Start the step's one copy back: the ids and the logprobs asked for (``transfer.to_host``)."""
        parts = [self.token_ids, *(self.logprobs or ())]
        chunks = sorted(self.prompt_logprobs or {})
        for index in chunks:
            parts += (self.prompt_logprobs or {})[index]
        copy = transfer.to_host(tuple(parts), copy_stream)
        return PendingSample(copy, self.logprobs is not None, chunks, self.token_ids)


class PendingSample:
    """A step's samples on their way to the host; ``result`` waits for them. ``device_token_ids``: the sampled ids
    where they were sampled (the next step's inputs may read them there)."""

    __slots__ = ("_chunks", "_copy", "_has_logprobs", "device_token_ids")

    def __init__(
        self, copy: transfer.HostCopy, has_logprobs: bool, chunks: list[int], device_token_ids: torch.Tensor
    ) -> None:
        self._copy, self._has_logprobs, self._chunks = copy, has_logprobs, chunks
        self.device_token_ids = device_token_ids

    def result(self) -> SamplerOutput:
        parts = list(self._copy.wait())
        output = SamplerOutput(parts.pop(0).tolist())
        if self._has_logprobs:
            output.logprob_values, output.logprob_token_ids, output.logprob_ranks = parts[:3]
            del parts[:3]
        if self._chunks:
            output.prompt_logprobs = {
                index: (parts[3 * i], parts[3 * i + 1], parts[3 * i + 2])
                for i, index in enumerate(self._chunks)
            }
        return output


@dataclass
class SampleRows:
    """What each sampling row of a step samples with: its parameters and generator, and (``None`` where no row
    needs them) its token history, bad words and the EOS and stop tokens it may not take yet."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[TokenHistory | None] | None = None
    bad_words: list[list[list[int]] | None] | None = None
    banned_stop_ids: list[tuple[int, ...]] | None = None


def sample_rows(chunks: list[SequenceChunk]) -> SampleRows:
    """The sampling rows of ``chunks`` (those that sample): one per chunk, or with proposals (speculative decoding)
    one per proposal and one more. A chunk's row j samples after its first j proposals, so its history ends with
    them, and it gets the stop-token bans while its output is shorter than ``min_tokens``
    (``SequenceChunk.num_banned_rows``). The optional lists are ``None`` when no row needs them."""
    params: list[SamplingParams] = []
    generators: list[torch.Generator | None] = []
    histories: list[TokenHistory | None] = []
    bad_words: list[list[list[int]] | None] = []
    bans: list[tuple[int, ...]] = []
    for chunk in chunks:
        assert chunk.sampling_params is not None  # a chunk that samples
        drafts = chunk.draft_token_ids
        if not drafts:  # a plain decode or the end of a prefill: one row
            params.append(chunk.sampling_params)
            generators.append(chunk.generator)
            histories.append(chunk.history)
            bad_words.append(chunk.bad_words)
            bans.append(chunk.banned_stop_ids)
            continue
        width = 1 + len(drafts)
        params += [chunk.sampling_params] * width
        generators += [chunk.generator] * width
        bad_words += [chunk.bad_words] * width
        bans += [chunk.banned_stop_ids if j < chunk.num_banned_rows else () for j in range(width)]
        if chunk.history is None:
            histories += [None] * width
        else:
            tokens, num_prompt = chunk.history
            histories += [(tokens + drafts[:j] if j else tokens, num_prompt) for j in range(width)]
    return SampleRows(
        params,
        generators,
        histories if any(h is not None for h in histories) else None,
        bad_words if any(bad_words) else None,
        bans if any(bans) else None,
    )


class Sampler:
    def __init__(self, *, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # for requests without their own seed

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of the rows without a seed of their own, on ``device`` (seeded with the engine's seed)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return generator

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory | None] | None = None,
        *,
        bad_words: list[list[list[int]] | None] | None = None,
        bitmask: TokenBitmask | None = None,
        banned_stop_ids: list[tuple[int, ...]] | None = None,
    ) -> SamplerOutput:
        """Sample every row and bring the result to the host (``sample``, then ``DeviceSample.to_host``)."""
        sample = self.sample(
            logits,
            params,
            generators,
            histories,
            bad_words=bad_words,
            bitmask=bitmask,
            banned_stop_ids=banned_stop_ids,
        )
        return sample.to_host().result()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory | None] | None = None,
        *,
        bad_words: list[list[list[int]] | None] | None = None,
        bitmask: TokenBitmask | None = None,
        banned_stop_ids: list[tuple[int, ...]] | None = None,
    ) -> DeviceSample:
        """One token per row of ``logits``, on their device. ``banned_stop_ids``: per row, the EOS and stop tokens
        it may not sample yet (``min_tokens``)."""
        if bitmask is not None:
            logits = logits.clone()  # NOTE: the logits may be a CUDA graph's static output
            apply_token_bitmask(logits, bitmask)
        raw = logits
        words: list[list[list[int]] | None] = bad_words if bad_words is not None else [None for _ in params]
        bans = banned_stop_ids if banned_stop_ids is not None else [() for _ in params]
        if any(needs_token_controls(p, w, b) for p, w, b in zip(params, words, bans)):
            logits = apply_token_controls(logits, params, histories, words, bans)
        if histories is not None and any(history is not None for history in histories):
            logits = apply_penalties(logits, params, histories)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) == len(params):
            token_ids = self._sample(logits, params, generators)
        else:
            token_ids = logits.argmax(dim=-1)
            if random_rows:
                rows = transfer.upload(random_rows, torch.long, logits.device)
                sampled = self._sample(
                    logits.index_select(0, rows),
                    [params[i] for i in random_rows],
                    [generators[i] for i in random_rows],
                )
                token_ids.index_copy_(0, rows, sampled)
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_logprobs is None:
            return DeviceSample(token_ids)
        return DeviceSample(token_ids, top_logprobs(raw, token_ids, max_logprobs))

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        device = logits.device
        temperature = transfer.upload([p.temperature for p in params], logits.dtype, device).unsqueeze(1)
        logits = _filter(logits / temperature, params)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race (Gumbel-max): a seeded row draws its noise from its own generator, so a seeded request
        # samples the same tokens whatever else is in the batch; the other rows draw from the engine's, at once.
        noise = torch.empty_like(probs)
        if not all(generators):
            noise.exponential_(generator=self.generator(device))
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobTensors:
    """``[n, k + 1]`` log-probabilities, token ids and ranks (1 = most likely): ``chosen`` first, then the top k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = chosen.unsqueeze(1)
    chosen_values = logprobs.gather(1, chosen)
    chosen_ranks = (logprobs > chosen_values).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, :0])
    top_ranks = torch.arange(1, k + 1, device=logits.device).expand(len(logprobs), k)
    return (
        torch.cat([chosen_values, top_values], dim=1),
        torch.cat([chosen, top_ids], dim=1),
        torch.cat([chosen_ranks, top_ranks], dim=1).to(torch.int32),
    )


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min-p, then top-k and top-p, on temperature-scaled logits."""
    device = logits.device
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        min_p = transfer.upload([p.min_p for p in params], logits.dtype, device).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p == 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if any(top_k):
        k = transfer.upload([min(k, vocab) if k else vocab for k in top_k], torch.long, device).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the better tokens
        cut = before > transfer.upload(top_p, probs.dtype, device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
