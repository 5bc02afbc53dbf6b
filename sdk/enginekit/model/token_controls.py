"""Which tokens a sample may take: a structured output's bitmask, ``allowed_token_ids``, ``bad_words``, and
``logit_bias``, applied to a step's logits for the whole batch at once (vLLM's definitions)."""

from __future__ import annotations

import numpy as np
import torch

from enginekit.model.batch import TokenBitmask
from enginekit.sampling_params import SamplingParams

TokenHistory = tuple[list[int], int]  # all token ids of a sequence, and how many of them are the prompt


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """Set the logits of the tokens a row's bitmask does not allow to ``-inf``, in place."""
    vocab = logits.shape[1]
    # Little-endian int32 words are bytes in token order: bit j of byte k is token 8k + j.
    bits = np.unpackbits(bitmask.bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(bits) == 0
    if len(bitmask.rows) == len(logits) and bitmask.rows == list(range(len(logits))):
        logits.masked_fill_(banned, float("-inf"))  # every row constrained: no gather and scatter of the rows
        return
    rows = torch.tensor(bitmask.rows)
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))


def needs_token_controls(params: SamplingParams, bad_words: list[list[int]] | None) -> bool:
    return bool(params.allowed_token_ids is not None or params.logit_bias or bad_words)


def apply_token_controls(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None,
    bad_words: list[list[list[int]] | None],
) -> torch.Tensor:
    """``allowed_token_ids`` (every other token banned), then ``bad_words`` (the last token of a word whose other
    tokens end the output so far), then ``logit_bias`` (added to the logits), on a copy of ``logits``."""
    logits = logits.clone()
    vocab = logits.shape[1]
    for row, (p, words) in enumerate(zip(params, bad_words)):
        if p.allowed_token_ids is not None:
            banned = torch.ones(vocab, dtype=torch.bool)
            banned[list(p.allowed_token_ids)] = False
            logits[row].masked_fill_(banned, float("-inf"))
        if words:
            history = histories[row] if histories is not None else None
            output = history[0][history[1] :] if history is not None else []
            for token in banned_by_words(words, output):
                logits[row, token] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    return logits


def banned_by_words(words: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete one of ``words`` (token sequences) after ``output``: a word's last token,
    when the tokens before it are the last tokens of the output (a one-token word is always banned)."""
    banned = set()
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            banned.add(word[-1])
    return banned
