"""A step the engine core has handed to the model: its batch, the requests behind it, and its samples on their way.

The core fills a step's sampling side (``fill_sampling``) from its requests as they are when it samples: with
overlapped steps (``EngineConfig.async_scheduling``) that is after the step before has been applied, so the
grammar's bitmask follows the token just accepted, ``min_tokens`` counts it, the penalties and ``bad_words`` see it
(a sequence's history is its request's live token list), and a request that has just ended samples nothing of its
own (its row becomes a plain greedy one whose token is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginekit.core.request import Request
from enginekit.core.structured.manager import StructuredOutputManager
from enginekit.model.batch import ScheduledBatch, TokenBitmask
from enginekit.model.runner import StepForward
from enginekit.model.sampler import PendingSample, SamplerOutput
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import RequestStatus as WireStatus

_ENDED = SamplingParams(
    temperature=0.0, max_tokens=1
)  # the row of a request that ended before its step sampled


@dataclass
class LaunchedStep:
    """``requests``: the request of each chunk; ``sampling``: the requests that sample, in sampling-row order;
    ``scheduled``: what the scheduler gave each; ``changes``: the status changes of its scheduling."""

    batch: ScheduledBatch
    requests: list[Request]
    sampling: list[Request]
    changes: dict[str, WireStatus]
    forward: StepForward | None = None  # queued on the device, not sampled yet
    pending: PendingSample | None = None  # sampled, on its way to the host
    sampled: SamplerOutput | None = None  # on the host
    rows: dict[str, int] = field(default_factory=dict)  # request id -> its sampling row

    def result(self) -> SamplerOutput:
        """The step's samples on the host (waits for the copy back if it is still on its way)."""
        if self.sampled is None:
            assert self.pending is not None  # sampled before anyone asks
            self.sampled = self.pending.result()
            self.pending = None
        return self.sampled

    def sampling_rows(self) -> dict[str, int]:
        """Request id -> the row of its token among the step's samples (for the next step's pending tokens)."""
        if not self.rows:
            self.rows = {request.request_id: row for row, request in enumerate(self.sampling)}
        return self.rows


def fill_sampling(
    step: LaunchedStep, structured: StructuredOutputManager, eos_token_ids: tuple[int, ...]
) -> None:
    """The step's sampling side from its requests as they are now: EOS and stop tokens banned before
    ``min_tokens`` (EOS unless ``ignore_eos``), the structured outputs' bitmask, and plain rows for requests that
    ended since the step was scheduled. A chunk with proposals has a sampling row per proposal and one more: each
    row's bans count the proposals before it, and its mask is the one computed with them (``Request.spec_masks``)."""
    chunks = [chunk for chunk in step.batch.chunks if chunk.samples]
    grammars, rows, masks = [], [], []
    row = 0
    for chunk, request in zip(chunks, step.sampling):
        width = chunk.num_sample_rows
        if request.is_finished:
            chunk.sampling_params, chunk.generator, chunk.history, chunk.bad_words = _ENDED, None, None, None
            chunk.banned_stop_ids = ()
            row += width
            continue
        params = request.sampling_params
        short = params.min_tokens - request.num_output_tokens  # rows, from the first, that may not stop yet
        if short > 0:
            chunk.banned_stop_ids = params.stop_token_ids + (() if params.ignore_eos else eos_token_ids)
            chunk.num_banned_rows = min(short, width)
        else:
            chunk.banned_stop_ids = ()
        if request.spec_masks is not None:
            rows += range(row, row + width)
            masks.append(request.spec_masks[:width])
        elif request.grammar is not None:
            grammars.append((row, request.grammar.ready_matcher))
        row += width
    step.batch.token_bitmask = None
    if grammars:
        rows += [row for row, _ in grammars]
        masks.append(structured.bitmask([matcher for _, matcher in grammars]))
    if rows:
        bits = masks[0] if len(masks) == 1 else torch.cat(masks)
        order = sorted(range(len(rows)), key=rows.__getitem__)
        if order != list(range(len(rows))):  # in row order (the sampler fills every row at once when all are)
            rows, bits = [rows[i] for i in order], bits[order]
        step.batch.token_bitmask = TokenBitmask(rows, bits)
