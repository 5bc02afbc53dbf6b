"""Repetition, presence and frequency penalties (transformers' and vLLM's definitions), for every penalized row of a
step at once, on the logits' device.

Each penalized row's tokens go up flat (one list for all the rows, with each token's row and whether it is an
output token); the seen-token masks and the output counts are built on the device by scatter, never by a loop over
the vocabulary.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from enginekit.model import transfer
from enginekit.model.token_controls import TokenHistory
from enginekit.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties, per row."""
    rows = [row for row, (p, h) in enumerate(zip(params, histories)) if h is not None and p.has_penalties]
    if not rows:
        return logits
    device = logits.device
    penalized = [histories[row] or ([], 0) for row in rows]
    lengths = np.array([len(token_ids) for token_ids, _ in penalized], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(token_ids for token_ids, _ in penalized), np.int64)
    row_of = np.repeat(np.arange(len(rows)), lengths)
    # each token's place in its row, against the row's prompt length: which tokens are output tokens
    offsets = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    is_output = offsets >= np.repeat(np.array([num_prompt for _, num_prompt in penalized]), lengths)
    tokens = transfer.upload(np.stack([row_of, flat, is_output]), torch.long, device)
    scale = transfer.upload(
        [
            [params[row].repetition_penalty, params[row].frequency_penalty, params[row].presence_penalty]
            for row in rows
        ],
        logits.dtype,
        device,
    )
    row_index = transfer.upload(rows, torch.long, device)
    scores = logits.index_select(0, row_index)
    seen = torch.zeros_like(scores, dtype=torch.bool)
    seen[tokens[0], tokens[1]] = True
    repetition = scale[:, 0:1]
    scores = torch.where(seen, torch.where(scores < 0, scores * repetition, scores / repetition), scores)
    counts = torch.zeros_like(scores).index_put_(
        (tokens[0], tokens[1]), tokens[2].to(scores.dtype), accumulate=True
    )
    scores = scores - (scale[:, 1:2] * counts + scale[:, 2:3] * (counts > 0).to(scores.dtype))
    logits = logits.clone()
    logits.index_copy_(0, row_index, scores)
    return logits
