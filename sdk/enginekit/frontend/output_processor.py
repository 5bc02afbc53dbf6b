"""OutputProcessor: the front end's view of each request, built up from the engine's per-step deltas.

A request with ``n > 1`` samples is ``n`` engine requests (``"{i}_{request_id}"``) behind one ``RequestState``:
each sample fills its own ``CompletionOutput``, and the request finishes when all of them have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from enginekit.lora_request import LoRARequest
from enginekit.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestStatusName
from enginekit.sampling_params import RequestOutputKind, SamplingParams
from enginekit.wire.messages import EngineCoreOutput, EngineCoreOutputs, RequestStatus

if TYPE_CHECKING:
    from enginekit.frontend.prompts import PreparedRequest

_STATUS_NAMES: dict[RequestStatus, RequestStatusName] = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}

Decode = Callable[[int], str]


class RequestState:
    """One request as its caller sees it: a live ``RequestOutput``, a version, and how it ended."""

    __slots__ = (
        "_decode",
        "_prompt_sent",
        "_proposals",
        "_sent",
        "engine_ids",
        "error",
        "finished",
        "label",
        "listener",
        "output",
        "output_kind",
        "params",
        "version",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float = 0.0,
        engine_ids: list[str] | None = None,
        decode: Decode = str,
        messages: list | None = None,
        lora_request: LoRARequest | None = None,
        label: str = "",
    ) -> None:
        completions = [
            CompletionOutput(
                i,
                "",
                [],
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        metrics = RequestMetrics(arrival_time or time.time())
        self.output = RequestOutput(
            request_id,
            prompt,
            prompt_token_ids,
            completions,
            metrics=metrics,
            messages=messages,
            lora_request=lora_request,
        )
        self.engine_ids = engine_ids or [request_id]  # the engine's requests, one per sample
        self.params = params
        self.output_kind = params.output_kind
        self.finished = False  # no more updates will come: it finished, or failed (then ``error`` is set)
        self.error: BaseException | None = None
        self.label = label  # what starts the message of an error the engine sends (which prompt of a batch)
        self.version = 0  # bumped on every update; consumers remember the last one they saw
        self.listener: Callable[[], None] | None = None
        self._decode = decode
        self._sent = [(0, 0)] * params.n  # per sample: tokens and characters a delta stream has yielded
        self._prompt_sent = False
        self._proposals = [(0, 0, 0)] * params.n  # per sample: speculative decoding's counts (RequestMetrics)

    @classmethod
    def of(cls, prepared: PreparedRequest, decode: Decode) -> RequestState:
        """The state of a request as ``RequestBuilder`` prepared it."""
        p = prepared
        engine_ids = [r.request_id for r in p.engine_requests]
        return cls(
            p.request_id,
            p.text,
            p.prompt_token_ids,
            p.params,
            engine_ids=engine_ids,
            decode=decode,
            messages=p.messages,
            lora_request=p.lora_request,
            label=p.label,
        )

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def apply(self, delta: EngineCoreOutput, index: int = 0) -> None:
        output, completion = self.output, self.output.outputs[index]
        metrics = output.metrics
        assert metrics is not None
        if delta.status is not None or delta.finish_reason is not None:  # the engine's timing rides on these
            if delta.status is not None:
                output.status = _STATUS_NAMES[delta.status]
            metrics.first_scheduled_time = metrics.first_scheduled_time or delta.first_scheduled_time or None
            metrics.num_preemptions = max(metrics.num_preemptions, delta.num_preemptions)
        if delta.new_token_ids:
            now = time.time()
            # A final_only request's one output says when the engine produced its first token.
            metrics.first_token_time = metrics.first_token_time or delta.first_token_time or now
            metrics.last_token_time = now
            output.status = "running"
            completion.token_ids.extend(delta.new_token_ids)
        completion.text += delta.new_text
        if completion.logprobs is not None and delta.logprob_values is not None:
            completion.logprobs.extend(
                self._logprobs(delta.logprob_values, delta.logprob_token_ids, delta.logprob_ranks)
            )
            if completion.cumulative_logprob is not None:  # the sampled token is the first column
                completion.cumulative_logprob += sum(delta.logprob_values[:, 0].tolist())
        if delta.prompt_logprob_values is not None and output.prompt_logprobs is None:
            rows = self._logprobs(
                delta.prompt_logprob_values, delta.prompt_logprob_token_ids, delta.prompt_logprob_ranks
            )
            output.prompt_logprobs = [None, *rows]
        output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
        if (
            delta.num_draft_tokens or delta.num_forced_tokens
        ):  # the sample's counts so far; the request's: all
            self._proposals[index] = (
                delta.num_draft_tokens,
                delta.num_accepted_tokens,
                delta.num_forced_tokens,
            )
            drafts, accepted, forced = (sum(column) for column in zip(*self._proposals))
            metrics.num_draft_tokens, metrics.num_accepted_tokens = drafts, accepted
            metrics.num_forced_tokens = forced
        if delta.error is not None:
            kind = TypeError if delta.error.kind == "TypeError" else ValueError
            self.fail(kind(self.label + delta.error.message))
            return
        if delta.finish_reason is not None:
            completion.finish_reason = delta.finish_reason.value
            completion.stop_reason = delta.stop_reason
            if all(c.finish_reason is not None for c in output.outputs):
                output.finished = self.finished = True
                output.status = "finished"
                metrics.finished_time = time.time()
        self.version += 1

    def _logprobs(
        self, values: torch.Tensor, ids: torch.Tensor | None, ranks: torch.Tensor | None
    ) -> list[dict[int, Logprob]]:
        assert ids is not None  # the engine sends the token ids with the values
        rank_rows = ranks.tolist() if ranks is not None else [[None] * len(row) for row in ids.tolist()]
        return [
            {token: Logprob(value, rank, self._decode(token)) for value, token, rank in zip(v, i, r)}
            for v, i, r in zip(values.tolist(), ids.tolist(), rank_rows)
        ]

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``: its waiters raise it."""
        self.error = error
        self.finished = True
        self.version += 1

    def snapshot(self) -> RequestOutput:
        """A copy that later updates do not change (what ``stream`` yields): the output so far, or with
        ``RequestOutputKind.DELTA`` only what is new since the previous snapshot."""
        delta = self.output_kind is RequestOutputKind.DELTA
        completions = []
        for index, c in enumerate(self.output.outputs):
            tokens, chars = self._sent[index] if delta else (0, 0)
            logprobs = list(c.logprobs[tokens:]) if c.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    c.index,
                    c.text[chars:],
                    c.token_ids[tokens:],
                    c.finish_reason,
                    c.stop_reason,
                    logprobs,
                    c.cumulative_logprob,
                )
            )
            if delta:
                self._sent[index] = (len(c.token_ids), len(c.text))
        o = self.output
        prompt_logprobs = None if delta and self._prompt_sent else o.prompt_logprobs
        self._prompt_sent = self._prompt_sent or prompt_logprobs is not None
        return RequestOutput(
            o.request_id, o.prompt, o.prompt_token_ids, completions, o.finished, o.num_cached_tokens,
            prompt_logprobs, o.metrics, o.status, o.messages, o.lora_request,
        )  # fmt: skip


def watched(states: list[RequestState]) -> tuple[list[RequestOutput], list[SamplingParams]]:
    """What a viewer watches of these requests: their live outputs and their settings."""
    return [s.output for s in states], [s.params for s in states]


class OutputProcessor:
    """Applies each batch of deltas to the request states it concerns, in arrival order."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}  # by the caller's request id
        self._samples: dict[str, tuple[RequestState, int]] = {}  # by engine request id: a state and a sample

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for index, engine_id in enumerate(state.engine_ids):
            self._samples[engine_id] = (state, index)

    def check_new_ids(self, engine_ids: list[str]) -> None:
        """Refuse engine request ids that repeat, or that an unfinished request of this front end uses."""
        seen: set[str] = set()
        for engine_id in engine_ids:
            if engine_id in seen or engine_id in self._samples:
                raise ValueError(f"request id {engine_id!r} is already in use by an unfinished request")
            seen.add(engine_id)

    def process(self, batch: EngineCoreOutputs) -> None:
        samples = self._samples
        for delta in batch.outputs:
            entry = samples.get(delta.request_id)
            if entry is None:
                continue  # a request this front end already forgot (e.g. aborted and collected)
            state, index = entry
            state.apply(delta, index)
            if state.finished:
                self._remove(state)
            if state.listener is not None:
                state.listener()

    def engine_ids(self, request_ids: list[str]) -> list[str]:
        """The engine requests behind these request ids (a request of ``n`` samples has ``n``)."""
        ids = []
        for request_id in request_ids:
            state = self.states.get(request_id)
            ids.extend(state.engine_ids if state is not None else [request_id])
        return ids

    def forget(self, states: list[RequestState]) -> list[str]:
        """Stop tracking these requests; returns the engine ids still unfinished (to abort)."""
        unfinished = []
        for state in states:
            if self.states.get(state.request_id) is state:
                unfinished += [
                    engine_id
                    for engine_id, completion in zip(state.engine_ids, state.output.outputs)
                    if completion.finish_reason is None
                ]
                self._remove(state)
        return unfinished

    def fail_all(self, error: BaseException) -> None:
        """Fail every tracked request with ``error`` (the engine died or was shut down) and wake its waiters."""
        failed = list(self.states.values())
        self.states.clear()
        self._samples.clear()
        for state in failed:
            state.fail(error)
            if state.listener is not None:
                state.listener()

    def _remove(self, state: RequestState) -> None:
        self.states.pop(state.request_id, None)
        for engine_id in state.engine_ids:
            self._samples.pop(engine_id, None)
