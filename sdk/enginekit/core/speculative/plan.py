"""A step's proposals, before the scheduler, and what the step accepted of them, after it.

Before each step the engine core asks ``Speculation.propose`` for the running requests that decode (every token
computed but the last). A request's proposals (``Request.spec_token_ids``) are, in order:

1. **Forced tokens** (jump forward), for a structured output: while the grammar allows exactly one token, that
   token (certain: its row can sample nothing else); then the text the grammar forces after them, as the
   backend tokenizes it (``GrammarMatcher.jump_forward_tokens``: a proposal, since the model may tokenize the
   same text otherwise), without asking any method (the matcher is advanced through them, then rolled back);
2. **the method's drafts** (n-gram lookup, a draft model: ``Proposer``), after the forced tokens, kept while the
   grammar (if any) takes them.

The grammar's masks of every row are computed on the way (``Request.spec_masks``), so the step's bitmask costs
nothing more. The scheduler then schedules the decode with its proposals (as many as its token budget allows),
one pass of the model computes a row per proposal and one more, and each row samples as a request's next token
would after the proposals before it. ``accepted`` keeps the longest run of proposals equal to what the rows
sampled, and the one token after it.

Why this keeps the target distribution: a proposal is a point mass (the n-gram's tokens, the draft model's greedy
ones). Rejection sampling with a point-mass proposal d accepts d with probability p(d) and otherwise draws from p
with d removed and renormalised; drawing x from p and accepting when x == d does exactly that, with x as the draw
when it is not d. A greedy row's x is p's argmax, so greedy requests get the tokens they would get without
proposals (up to the rounding of a step's row count: exact with ``batch_invariant=True``).

A proposal is never longer than the room left: the request's ``max_tokens`` or ``max_model_len`` (one token is
always the model's own), and a ``longrope`` sequence's original length while it rotates with the short factors.

**How many to propose** (``adaptive``, the default). A proposal row costs the step ``ROW_COST`` of a one-row
decode step on this device, and earns the chance that it and every proposal before it are accepted. With B
decoding requests a step costs ``1 - c + c B`` and makes B tokens, so a row pays when its expected tokens beat
``θ = c B / (1 - c + c B)``. Each request keeps an estimate ``a`` of its per-token acceptance (accepted proposals
over trials, a verification's earlier ones weighted ``DECAY``, three in four before any), and proposes up to the
largest j with ``a**j >= θ``: a copying request at one request proposes all k, free chat soon none, and at 16
requests on a CPU (θ ≈ 0.87) only a request that nearly always copies proposes at all. A request that proposes
nothing lets its estimate drift back to the prior, so it is tried again later. Forced tokens are certain and
always taken. ``adaptive=False`` proposes k whenever the method has them.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from enginekit.core.speculative.proposer import Proposer
from enginekit.core.structured.backend import GrammarMatcher

if TYPE_CHECKING:
    from enginekit.config import EngineConfig
    from enginekit.core.request import Request
    from enginekit.core.structured.manager import StructuredOutputManager
    from enginekit.model.config import ModelConfig
    from enginekit.model.text.tokenizer import Tokenizer

logger = logging.getLogger("enginekit.core")

MAX_FORCED_TOKENS = 32  # forced tokens one step takes at most (each is a row of the step)
# What one more row costs a step, as a share of a one-row decode step. CPU: measured on the default model, 0.24-0.28
# a row (2 rows 1.24x, 5 rows 2.14x, 9 rows 3.15x on 2 Zen 4 cores: past one row its products are bound by
# arithmetic, not by the weight's bytes; ``benchmarks/spec_row_cost.py``); CUDA: an estimate, not measured yet (a
# decode step there is bound by the weight's bytes).
ROW_COST = {"cpu": 0.3, "cuda": 0.05}
DECAY = 0.8  # the weight of a request's earlier verifications in its acceptance estimate, per verification
# The estimate before any verification: three proposals in four accepted (optimistic, so that a request tries at
# all where rows cost more: a pessimistic start would never learn that it copies).
PRIOR_HITS, PRIOR_TRIALS = 3.0, 4.0


def make_proposer(
    config: EngineConfig,
    target: ModelConfig,
    tokenizer: Tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    *,
    num_blocks: int,
) -> Proposer | None:
    """The proposer ``config.speculative_config`` asks for (``None``: no speculative decoding); a draft model's
    cache holds as many tokens as the target's ``num_blocks``."""
    speculative = config.speculative
    if speculative is None:
        return None
    if speculative.method == "ngram":
        from enginekit.core.speculative.ngram import NgramProposer

        return NgramProposer(max_n=speculative.prompt_lookup_max, min_n=speculative.prompt_lookup_min)
    from enginekit.core.speculative.draft_model import DraftModelProposer

    return DraftModelProposer.create(config, target, tokenizer, device, dtype, num_blocks=num_blocks)


class _Continued:
    """A request seen by a proposer with its forced tokens already appended."""

    __slots__ = ("all_token_ids", "num_prompt_tokens", "request_id")

    def __init__(self, request: Request, forced: list[int]) -> None:
        self.request_id = request.request_id
        self.all_token_ids = request.all_token_ids + forced if forced else request.all_token_ids
        self.num_prompt_tokens = request.num_prompt_tokens


class Speculation:
    """Proposals for the decoding requests, and the counts of what was proposed, forced and accepted."""

    def __init__(
        self,
        proposer: Proposer | None,
        structured: StructuredOutputManager,
        *,
        num_speculative_tokens: int = 0,
        long_rope_from: int | None = None,
        adaptive: bool = True,
        row_cost: float = ROW_COST["cpu"],
        jump_forward: bool = True,
    ) -> None:
        self.proposer = proposer
        self.structured = structured
        self.k = num_speculative_tokens if proposer is not None else 0
        self.long_rope_from = long_rope_from
        self.adaptive = adaptive
        self.row_cost = row_cost
        self.jump_forward = jump_forward
        self.num_draft_tokens = 0  # the method's proposals that were verified
        self.num_accepted_tokens = 0  # of them, accepted
        self.num_forced_tokens = 0  # forced tokens taken (jump forward)
        self.num_spec_steps = 0  # request-steps that verified at least one proposal

    def propose(self, running: list[Request]) -> None:
        """Set the proposals (and masks) of every running request that decodes; the others get none."""
        k, jump = self.k, self.jump_forward
        decoding = [
            request
            for request in running
            if (k or (jump and request.grammar is not None))
            and not request.num_pending_tokens
            and request.num_computed_tokens == len(request.all_token_ids) - 1  # not prefilling
        ]
        if not decoding:
            return
        # every grammar's mask at once (the backend fills a batch in parallel): each request's first row
        matchers = {id(r): r.grammar.ready_matcher for r in decoding if r.grammar is not None}
        first_masks = (
            dict(zip(matchers, self.structured.bitmask(list(matchers.values())))) if matchers else {}
        )
        asking: list[tuple[Request, list[int], list[torch.Tensor] | None]] = []
        for request in decoding:
            request.clear_proposals()
            room = self._room(request)
            if request.grammar is None:
                if room > 0:
                    asking.append((request, [], None))
                continue
            first = first_masks[id(request)]
            forced, masks = self._forced(request, max(room, 0), first) if jump else ([], [first])
            if k and room > len(forced) and not request.grammar.ready_matcher.is_terminated():
                # the matcher stays advanced through the forced tokens, for the drafts after them
                asking.append((request, forced, masks))
            else:
                self._set(request, forced, [], masks)
        if not asking:
            return
        assert self.proposer is not None  # k > 0 only with a proposer
        threshold = self.threshold(len(running))
        limits = [min(self._worth(r, threshold), self._room(r) - len(forced)) for r, forced, _ in asking]
        for (request, forced, masks), limit in zip(asking, limits):
            if limit <= 0:
                self._set(request, forced, [], masks)
        asking = [item for item, limit in zip(asking, limits) if limit > 0]
        limits = [limit for limit in limits if limit > 0]
        drafts = (
            self.proposer.propose([_Continued(r, forced) for r, forced, _ in asking], limits)
            if asking
            else []
        )
        for (request, forced, masks), draft in zip(asking, drafts):
            if masks is not None:
                draft = self._grammar_takes(request, draft, masks)
            self._set(request, forced, draft, masks)

    def threshold(self, num_decoding: int) -> float:
        """The acceptance chance at which a proposal row pays for itself in a step of ``num_decoding`` requests."""
        c = self.row_cost
        return c * num_decoding / (1 - c + c * num_decoding)

    def _worth(self, request: Request, threshold: float) -> int:
        """How many proposals are worth their rows for this request now (all k when not ``adaptive``)."""
        if not self.adaptive:
            return self.k
        accept = (request.spec_hits + PRIOR_HITS) / (request.spec_trials + PRIOR_TRIALS)
        if accept <= threshold:  # not worth a row: drift back to the prior, to be tried again later
            request.spec_hits *= DECAY
            request.spec_trials *= DECAY
            return 0
        if accept >= 1.0:
            return self.k
        return min(self.k, int(math.log(threshold) / math.log(accept)))

    def _room(self, request: Request) -> int:
        """Proposals the request may take: one token of the step is always the model's own."""
        room = request.max_num_tokens - len(request.all_token_ids) - 1
        if self.long_rope_from is not None and not request.rope_long:
            room = min(room, self.long_rope_from - len(request.all_token_ids))
        return room

    def _forced(
        self, request: Request, room: int, first: torch.Tensor
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The tokens the grammar forces from here (the matcher advanced through them) and the mask of each row:
        ``first`` (the mask now), then the mask after each forced token."""
        assert request.grammar is not None
        matcher = request.grammar.ready_matcher
        masks = [first]
        forced: list[int] = []
        limit = min(room, MAX_FORCED_TOKENS)
        while len(forced) < limit and not matcher.is_terminated():
            token = only_token(masks[-1])
            if token is None or not matcher.accept(token):
                break
            forced.append(token)
            masks.append(self._next_mask(matcher, masks[-1]))
        if len(forced) < limit and not matcher.is_terminated():
            # the text forced past them, as the backend tokenizes it: the model may tokenize it otherwise
            jump = self._grammar_takes(request, matcher.jump_forward_tokens()[: limit - len(forced)], masks)
            forced += jump
        return forced, masks

    def _next_mask(self, matcher: GrammarMatcher, last: torch.Tensor) -> torch.Tensor:
        """The mask of the row after a token the matcher took; once it has ended, any (that row's token is never
        kept: the request stops at the one before)."""
        return last if matcher.is_terminated() else self.structured.bitmask([matcher])[0]

    def _grammar_takes(self, request: Request, draft: list[int], masks: list[torch.Tensor]) -> list[int]:
        """The drafts the grammar takes, from the first (the matcher advanced through them, a mask for each)."""
        assert request.grammar is not None
        matcher = request.grammar.ready_matcher
        taken = 0
        for token in draft:
            if matcher.is_terminated() or not _allows(masks[-1], token) or not matcher.accept(token):
                break
            taken += 1
            masks.append(self._next_mask(matcher, masks[-1]))
        return draft[:taken]

    def _set(
        self, request: Request, forced: list[int], draft: list[int], masks: list[torch.Tensor] | None
    ) -> None:
        if masks is not None:
            assert request.grammar is not None
            steps = len(forced) + len(draft)
            if steps:
                request.grammar.ready_matcher.rollback(steps)
            request.spec_masks = torch.stack(masks)  # row j: the mask after the first j proposals
        request.spec_token_ids = forced + draft if draft else forced
        request.num_spec_forced = len(forced)

    def accepted(self, request: Request, sampled: list[int]) -> int:
        """How many of the step's rows' tokens (``sampled``, one per row) the request keeps: the proposals that
        equal what their row sampled, from the first, and the token after them. Counts them."""
        proposals = request.spec_token_ids
        num_forced = request.num_spec_forced
        kept = 0
        while kept < len(proposals) and sampled[kept] == proposals[kept]:
            kept += 1
        num_draft = len(proposals) - num_forced
        if num_draft:
            self.num_spec_steps += 1
            self.num_draft_tokens += num_draft
            accepted_drafts = max(kept - num_forced, 0)
            rejected = accepted_drafts < num_draft  # the trial that ended the run
            request.spec_hits = DECAY * request.spec_hits + accepted_drafts
            request.spec_trials = DECAY * request.spec_trials + accepted_drafts + rejected
            self.num_accepted_tokens += accepted_drafts
            request.num_draft_tokens += num_draft
            request.num_accepted_tokens += accepted_drafts
        forced = min(kept, num_forced)
        self.num_forced_tokens += forced
        request.num_forced_tokens += forced
        return kept + 1

    def forget(self, request_ids: list[str]) -> None:
        if self.proposer is not None and request_ids:
            self.proposer.forget(request_ids)

    def stats(self) -> dict[str, float | int]:
        drafts = self.num_draft_tokens
        return {
            "spec_num_draft_tokens": drafts,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafts if drafts else 0.0,
            "spec_mean_accepted_per_step": self.num_accepted_tokens / self.num_spec_steps
            if self.num_spec_steps
            else 0.0,
            "spec_num_forced_tokens": self.num_forced_tokens,
        }

    def shutdown(self) -> None:
        if self.proposer is not None:
            self.proposer.shutdown()


def only_token(mask: torch.Tensor) -> int | None:
    """The one token a packed bitmask row allows, or ``None`` when it allows none or several."""
    words = mask.numpy().view(np.uint32)
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]])
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def _allows(mask: torch.Tensor, token: int) -> bool:
    word = token // 32
    return word < mask.numel() and bool((int(mask[word]) >> (token % 32)) & 1)
