"""Request: the engine core's state of one request (tokens, progress through the KV cache, status)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from enginekit.core.structured.manager import RequestGrammar
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreOutput, EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    from enginekit.core.lora import Adapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "bad_words",
        "block_hashes",
        "detokenizer",
        "final_only",
        "finish_reason",
        "first_scheduled_time",
        "generator",
        "grammar",
        "held_output",
        "lora",
        "max_num_tokens",
        "num_accepted_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_draft_tokens",
        "num_forced_tokens",
        "num_pending_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_spec_forced",
        "output_logprobs",
        "parent_request_id",
        "prompt_embeds",
        "prompt_logprobs",
        "request_id",
        "rope_long",
        "sampling_params",
        "spec_hits",
        "spec_masks",
        "spec_token_ids",
        "spec_trials",
        "status",
        "stop_reason",
    )

    def __init__(
        self, message: EngineCoreRequest, *, detokenizer, device: torch.device | None = None
    ) -> None:
        self.request_id = message.request_id
        self.sampling_params: SamplingParams = message.sampling_params
        self.arrival_time = message.arrival_time
        self.prompt_embeds: torch.Tensor | None = message.prompt_embeds
        self.all_token_ids: list[int] = list(message.prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids have not reached the host yet (an overlapped step's): they count
        # as tokens for the scheduler (the next step computes them) but are not in all_token_ids yet.
        self.num_pending_tokens = 0
        self.max_num_tokens = (
            2**62
        )  # where the request ends by length (the engine sets it: max_tokens, max_model_len)
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        # longrope: the sequence has grown past the rotary embedding's original length, so every token of it is
        # rotated with the long factors (the scheduler sets it, and recomputes what was rotated with the short)
        self.rope_long = False
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.detokenizer = detokenizer
        self.parent_request_id = message.parent_request_id
        self.first_scheduled_time = 0.0
        # Parts, one per prefill chunk, until sent; None once sent.
        self.prompt_logprobs: list[tuple[torch.Tensor, ...]] | None = []
        # Tokens produced but not sent yet (a final_only request's until it ends; a stream's between sends when
        # the engine's stream_interval is above 1), and their logprob rows.
        self.final_only = message.final_only
        self.held_output: EngineCoreOutput | None = None
        self.output_logprobs: list[tuple[torch.Tensor, ...]] = []
        seed = self.sampling_params.seed
        # on the device that samples (the engine's; rank 0's under tensor parallelism)
        self.generator = torch.Generator(device or "cpu").manual_seed(seed) if seed is not None else None
        self.grammar: RequestGrammar | None = None  # its structured output's matcher (compiled off the loop)
        self.bad_words: list[list[int]] | None = None  # SamplingParams.bad_words, tokenized
        self.lora: Adapter | None = None  # its LoRA adapter (``core/lora.py``), if it runs one
        # Speculative decoding (``core/speculative/plan.py``): this step's proposals (forced tokens first, then
        # the method's drafts), how many of them are forced, the grammar's mask of each of its rows (or None),
        # and the counts so far of the method's proposals, of those accepted, and of the forced tokens taken.
        self.spec_token_ids: list[int] = []
        self.num_spec_forced = 0
        self.spec_masks: torch.Tensor | None = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_forced_tokens = 0
        # its acceptance so far, for how many to propose (accepted proposals and trials, earlier ones decayed)
        self.spec_hits = 0.0
        self.spec_trials = 0.0

    def clear_proposals(self) -> None:
        """No proposals for this step (speculative decoding): none made yet, or the step's applied."""
        self.spec_token_ids, self.num_spec_forced, self.spec_masks = [], 0, None

    @property
    def num_tokens(self) -> int:
        """Known tokens and those on their way from the device (``num_pending_tokens``)."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_cacheable(self) -> bool:
        # Embedding prompts have no token ids to hash: their KV blocks are never shared. Prompt logprobs need
        # every prompt position computed, so such a request does not take cached blocks either.
        return self.prompt_embeds is None and self.sampling_params.prompt_logprobs is None

    @property
    def is_waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.is_ready

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
