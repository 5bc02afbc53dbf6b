"""OutputProcessor: the front end's view of each request, built up from the engine's per-step deltas."""

from __future__ import annotations

from collections.abc import Callable

from enginekit.outputs import CompletionOutput, RequestOutput
from enginekit.wire.messages import EngineCoreOutput, EngineCoreOutputs


class RequestState:
    """One request as its caller sees it: a live ``RequestOutput``, a version, and how it ended."""

    __slots__ = ("completion", "error", "finished", "listener", "output", "version")

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], want_logprobs: bool
    ) -> None:
        self.completion = CompletionOutput(0, "", [], logprobs=[] if want_logprobs else None)
        self.output = RequestOutput(request_id, prompt, prompt_token_ids, [self.completion])
        self.finished = False  # no more updates will come: it finished, or failed (then ``error`` is set)
        self.error: BaseException | None = None
        self.version = 0  # bumped on every update; consumers remember the last one they saw
        self.listener: Callable[[], None] | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def apply(self, delta: EngineCoreOutput) -> None:
        completion = self.completion
        completion.token_ids.extend(delta.new_token_ids)
        completion.text += delta.new_text
        if completion.logprobs is not None and delta.logprob_values is not None:
            for values, ids in zip(delta.logprob_values.tolist(), delta.logprob_token_ids.tolist()):
                completion.logprobs.append(dict(zip(ids, values)))
        self.output.num_cached_tokens = delta.num_cached_tokens
        if delta.error is not None:
            kind = TypeError if delta.error.kind == "TypeError" else ValueError
            self.fail(kind(delta.error.message))
            return
        if delta.finish_reason is not None:
            completion.finish_reason = delta.finish_reason.value
            completion.stop_reason = delta.stop_reason
            self.output.finished = self.finished = True
        self.version += 1

    def fail(self, error: BaseException) -> None:
        """End the request with ``error``: its waiters raise it."""
        self.error = error
        self.finished = True
        self.version += 1

    def snapshot(self) -> RequestOutput:
        """A copy that later updates do not change (what ``stream`` yields)."""
        c = self.completion
        completion = CompletionOutput(
            0,
            c.text,
            list(c.token_ids),
            c.finish_reason,
            c.stop_reason,
            list(c.logprobs) if c.logprobs is not None else None,
        )
        o = self.output
        return RequestOutput(
            o.request_id, o.prompt, o.prompt_token_ids, [completion], o.finished, o.num_cached_tokens
        )


class OutputProcessor:
    """Applies each batch of deltas to the request states it concerns, in arrival order."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def process(self, batch: EngineCoreOutputs) -> None:
        states = self.states
        for delta in batch.outputs:
            state = states.get(delta.request_id)
            if state is None:
                continue  # a request this front end already forgot (e.g. aborted and collected)
            state.apply(delta)
            if state.finished:
                del states[delta.request_id]
            if state.listener is not None:
                state.listener()

    def forget(self, states: list[RequestState]) -> list[str]:
        """Stop tracking these requests; returns the ids of those still unfinished (to abort)."""
        unfinished = [state.request_id for state in states if not state.finished]
        for request_id in unfinished:
            self.states.pop(request_id, None)
        return unfinished

    def fail_all(self, error: BaseException) -> None:
        """Fail every tracked request with ``error`` (the engine died or was shut down) and wake its waiters."""
        failed = list(self.states.values())
        self.states.clear()
        for state in failed:
            state.fail(error)
            if state.listener is not None:
                state.listener()
