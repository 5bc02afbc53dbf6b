"""Scheduler: continuous batching with chunked prefill under a token budget and preemption by recompute.

Each step, running requests are served first (decodes and unfinished prefill chunks), then waiting requests
join while the token budget, ``max_num_seqs`` and free KV blocks allow. When blocks run out, the newest running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed later.
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
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                output.num_preempted += 1
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed = self.kv_cache.get_computed_blocks(request)
            num_hit = len(computed) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit)
            output.scheduled.append((request, num_new))
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

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
