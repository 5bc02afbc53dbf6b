"""Scheduler: continuous batching with chunked prefill under a token budget and preemption by recompute.

Each step, running requests are served first (decodes and unfinished prefill chunks), then waiting requests
join while the token budget, ``max_num_seqs`` and free KV blocks allow. When blocks run out, the newest running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
The samples of one prompt (``n > 1``) join after the first of them has prefilled it, so that they find the
prompt's blocks in the prefix cache instead of computing them again. A request whose structured output is still
compiling waits (the requests behind it may start first), and so does a request of a LoRA adapter that is not
running while the running requests use ``max_loras`` adapters already.

With overlapped steps (``EngineConfig.async_scheduling``) a running request may have a token on its way from the
device (``Request.num_pending_tokens``): it counts as a token to compute, so the request is scheduled for its next
decode before its last token is known, unless that token ends it by length.

A decoding request may carry proposals (speculative decoding, ``Request.spec_token_ids``): they are scheduled with
its decode as far as the token budget and the free blocks allow, and dropped rather than preempt anything.

A model with ``longrope`` rotary embeddings (``long_rope_from``: its original length) rotates a sequence with the
short factors while it holds at most that many tokens and with the long ones for all its tokens beyond, as
transformers' Phi-3 does: a sequence that grows past the length while generating has its cache recomputed (its
blocks freed, back to the front of the queue), and its blocks hash apart from short-rotated ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.request import Request, RequestStatus
from enginekit.wire.messages import FinishReason


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    started: list[Request] = field(default_factory=list)  # now running: first scheduled, or resumed
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_rope_from: int | None = None,
        max_loras: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.long_rope_from = long_rope_from
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # LoRA adapters running at once (0: LoRA is off)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._turns_long(request) and request.num_computed_tokens > 0:
                del self.running[index]  # its cache holds short-rotated keys: compute it again
                self.kv_cache.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                self.waiting.appendleft(request)
                continue
            if request.num_pending_tokens and request.num_tokens >= request.max_num_tokens:
                index += 1  # its token on the way is its last (by length): nothing more to compute
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.spec_token_ids:
                num_new = self._with_proposals(request, num_new, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break
        if output.num_preempted:
            return output
        prefilling: set[str] | None = None  # parents with a sample mid-prefill, found when first needed
        loras: set[int] | None = None  # the keys of the running requests' adapters, found when first needed
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.is_waiting_for_grammar or request.num_pending_tokens:
                # NOTE: a request preempted while its last token is on its way joins once the token is known
                index += 1
                continue
            if request.parent_request_id is not None:
                if prefilling is None:
                    prefilling = {
                        r.parent_request_id for r in self.running if r.parent_request_id and r.is_prefilling
                    }
                if request.parent_request_id in prefilling:
                    index += 1  # a sibling is prefilling the shared prompt: join once its blocks are cached
                    continue
            if request.lora is not None:
                if loras is None:
                    loras = {r.lora.key for r in self.running if r.lora is not None}
                if request.lora.key not in loras and len(loras) >= self.max_loras:
                    index += 1  # every adapter slot is taken by running requests: wait for one to free
                    continue
                loras.add(request.lora.key)
            self._turns_long(request)
            computed = self.kv_cache.get_computed_blocks(request)
            num_hit = len(computed) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed):
                break
            del self.waiting[index]
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit)
            if prefilling is not None and request.parent_request_id is not None and request.is_prefilling:
                prefilling.add(request.parent_request_id)
            output.scheduled.append((request, num_new))
            output.started.append(request)
            budget -= num_new
        return output

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        del self.requests[request.request_id]

    def _turns_long(self, request: Request) -> bool:
        """Mark a longrope sequence that has grown past the original length; whether it just did."""
        if self.long_rope_from is None or request.rope_long or request.num_tokens <= self.long_rope_from:
            return False
        request.rope_long = True
        request.block_hashes.clear()  # its blocks hash in the long chain from now on
        return True

    def _with_proposals(self, request: Request, num_new: int, budget: int) -> int:
        """A decode's tokens with its proposals (speculative decoding): as many as the token budget and the free
        KV blocks allow (never preempting another request for a proposal); the rest are dropped."""
        proposals = request.spec_token_ids
        keep = min(len(proposals), budget - num_new)
        if keep > 0 and not self.kv_cache.can_allocate(request, num_new + keep):
            keep = 0  # the blocks are short: the decode alone, rather than a preemption for guesses
        if keep < len(proposals):
            del proposals[keep:]
            request.num_spec_forced = min(request.num_spec_forced, keep)
            if request.spec_masks is not None:
                request.spec_masks = request.spec_masks[: keep + 1]
        return num_new + keep

    def _preempt(self, request: Request) -> None:
        request.clear_proposals()
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
