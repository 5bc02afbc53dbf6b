"""What the model runner is asked to compute in one step: plain data, built by the engine core's scheduler.

The runner knows nothing of requests, queues or the KV-cache bookkeeping; it gets each sequence's new tokens,
where they go in the cache, and how to sample the ones that need a next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginekit.sampling_params import SamplingParams


@dataclass
class SequenceChunk:
    """One sequence's new tokens in this step: a single-token decode or a (chunk of a) prefill.

    Attributes
    ----------
    token_ids
        The new tokens (their keys and values are computed and written to the cache).
    start
        Tokens of this sequence already in the cache: the position of the first new token.
    block_table
        The sequence's KV-cache block ids (at least enough for ``start + len(token_ids)`` tokens).
    sampling_params, generator
        Set when the chunk ends the sequence's known tokens, so a next token must be sampled.
    history
        The sequence's token ids and how many are the prompt's, when its penalties or bad words need them.
    bad_words
        Token sequences the sample must not complete (``SamplingParams.bad_words``, tokenized).
    banned_stop_ids
        EOS and stop token ids the sample may not take yet: the request has fewer than ``min_tokens`` output tokens.
    prompt_embeds
        Embeddings that replace the token embeddings of the chunk's first rows (embedding prompts).
    prompt_logprobs, prompt_targets
        For a prompt chunk whose prompt logprobs are wanted: how many top tokens, and the prompt token each row
        predicts (the next one; the last prompt token predicts nothing of the prompt).
    rope_long
        ``longrope``: the sequence is rotated with the long factors (``Request.rope_long``).
    sampled_row
        Set when the chunk's one token was sampled by the step before and is not on the host yet (overlapped
        steps): its row of that step's sampled ids (``ScheduledBatch.previous_token_ids``); ``token_ids`` holds a
        placeholder.
    seq_id
        The sequence's id while it holds its blocks (its request's), so the runner keeps its block table from step to
        step and writes only the new block ids; ``None``: a sequence of this step only.
    lora_slot
        The LoRA adapter slot its rows run (``enable_lora``), ``-1`` for none: the base model's.
    draft_token_ids
        Speculative decoding: the proposed tokens that end ``token_ids`` (a decode's last known token, then the
        proposals). Each of the chunk's last ``1 + len(draft_token_ids)`` rows samples: row j the token after
        the first j proposals, so one pass verifies them all (``core/speculative/``).
    num_banned_rows
        How many of the chunk's sampling rows, from the first, get ``banned_stop_ids`` (the rows whose output
        so far is shorter than ``min_tokens``).
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sampling_params: SamplingParams | None = None
    generator: torch.Generator | None = None
    history: tuple[list[int], int] | None = None
    bad_words: list[list[int]] | None = None
    banned_stop_ids: tuple[int, ...] = ()
    prompt_embeds: torch.Tensor | None = None
    prompt_logprobs: int | None = None
    prompt_targets: list[int] | None = None
    rope_long: bool = False
    sampled_row: int | None = None
    seq_id: str | None = None
    lora_slot: int = -1
    draft_token_ids: list[int] = field(default_factory=list)
    num_banned_rows: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.sampling_params is not None

    @property
    def num_sample_rows(self) -> int:
        """The rows that sample: none, one, or one and one per proposal (speculative decoding)."""
        return 1 + len(self.draft_token_ids) if self.sampling_params is not None else 0

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1


@dataclass
class TokenBitmask:
    """The tokens a structured output allows, for some of a step's samples: ``bits[i]`` (``int32`` words, bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed) is the mask of sampling row ``rows[i]``."""

    rows: list[int]
    bits: torch.Tensor


@dataclass
class ScheduledBatch:
    """Every sequence chunk of one step (single-token decodes first), and how many cache blocks may be in use.

    ``num_used_blocks``: blocks ``[0, num_used_blocks)`` may hold data (the pool hands out fresh blocks in id
    order), so the runner zeroes any of them it has not zeroed yet before the forward pass. ``token_bitmask``:
    the structured outputs' masks of the chunks that sample (rows in sampling order). ``freed_seq_ids``: the
    sequences whose blocks were freed since the last batch (finished, aborted or preempted): the runner forgets
    their block tables. ``previous_token_ids``: the ids the step before sampled, still on the device (overlapped
    steps), which the chunks with a ``sampled_row`` take their token from.
    """

    chunks: list[SequenceChunk] = field(default_factory=list)
    num_used_blocks: int = 0
    token_bitmask: TokenBitmask | None = None
    freed_seq_ids: list[str] = field(default_factory=list)
    previous_token_ids: torch.Tensor | None = None
