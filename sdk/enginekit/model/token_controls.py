"""Which tokens a sample may take: a structured output's bitmask, ``allowed_token_ids``, ``bad_words``,
``logit_bias`` and ``min_tokens`` (vLLM's definitions), applied to a step's logits for the whole batch at once, on
the logits' device.

Each control is one or two tensor operations over the rows that use it, fed by index lists whose length is the
control's size (the allowed ids, the banned tokens, the biased ones), never the vocabulary's.
"""

from __future__ import annotations

import torch

from enginekit.model import transfer
from enginekit.model.batch import TokenBitmask
from enginekit.sampling_params import SamplingParams

TokenHistory = tuple[list[int], int]  # all token ids of a sequence, and how many of them are the prompt
_LONG = torch.long


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """Set the logits of the tokens a row's bitmask does not allow to ``-inf``, in place. The mask travels packed
    (32 tokens a word) and is unpacked on the device."""
    vocab, device = logits.shape[1], logits.device
    # Little-endian int32 words are bytes in token order: bit j of byte k is token 8k + j.
    packed = transfer.upload_tensor(bitmask.bits, device).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    banned = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab] == 0
    if len(bitmask.rows) == len(logits) and bitmask.rows == list(range(len(logits))):
        logits.masked_fill_(banned, float("-inf"))  # every row constrained: no gather and scatter of the rows
        return
    rows = transfer.upload(bitmask.rows, _LONG, device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(banned, float("-inf")))


def needs_token_controls(
    params: SamplingParams, bad_words: list[list[int]] | None, banned_stop_ids: tuple[int, ...] = ()
) -> bool:
    return bool(params.allowed_token_ids is not None or params.logit_bias or bad_words or banned_stop_ids)


def apply_token_controls(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None,
    bad_words: list[list[list[int]] | None],
    banned_stop_ids: list[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """``allowed_token_ids`` (every other token banned), then ``bad_words`` (the last token of a word whose other
    tokens end the output so far), then ``logit_bias`` (added to the logits), then ``banned_stop_ids`` (EOS and
    stop tokens before ``min_tokens``), on a copy of ``logits``."""
    logits = logits.clone()
    device = logits.device
    allowed_rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed_rows:
        _keep_only_allowed(
            logits, [params[row].allowed_token_ids or () for row in allowed_rows], allowed_rows
        )
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for row, words in enumerate(bad_words):
        if words:
            history = histories[row] if histories is not None else None
            output = history[0][history[1] :] if history is not None else []
            tokens = banned_by_words(words, output)
            banned_rows += [row] * len(tokens)
            banned_tokens += tokens
    _fill(logits, banned_rows, banned_tokens, device)
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_tokens += p.logit_bias.keys()
            bias_values += p.logit_bias.values()
    if bias_rows:
        index = transfer.upload([bias_rows, bias_tokens], _LONG, device)
        values = transfer.upload(bias_values, logits.dtype, device)
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    stop_rows: list[int] = []
    stop_tokens: list[int] = []
    for row, ids in enumerate(banned_stop_ids or ()):
        stop_rows += [row] * len(ids)
        stop_tokens += ids
    _fill(logits, stop_rows, stop_tokens, device)
    return logits


def _keep_only_allowed(logits: torch.Tensor, allowed: list[tuple[int, ...]], rows: list[int]) -> None:
    device = logits.device
    local = [i for i, ids in enumerate(allowed) for _ in ids]
    tokens = [token for ids in allowed for token in ids]
    index = transfer.upload([local, tokens], _LONG, device)
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
    keep[index[0], index[1]] = True
    if len(rows) == len(logits):
        logits.masked_fill_(~keep, float("-inf"))
        return
    row_index = transfer.upload(rows, _LONG, device)
    logits.index_copy_(0, row_index, logits.index_select(0, row_index).masked_fill(~keep, float("-inf")))


def _fill(logits: torch.Tensor, rows: list[int], tokens: list[int], device: torch.device) -> None:
    """``logits[rows[i], tokens[i]] = -inf`` for every i."""
    if rows:
        index = transfer.upload([rows, tokens], _LONG, device)
        logits.index_put_((index[0], index[1]), logits.new_full((len(rows),), float("-inf")))


def banned_by_words(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete one of ``words`` (token sequences) after ``output``: a word's last token,
    when the tokens before it are the last tokens of the output (a one-token word is always banned)."""
    banned = set()
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or output[-prefix:] == word[:-1]:
            banned.add(word[-1])
    return sorted(banned)
