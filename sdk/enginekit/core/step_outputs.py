"""StepOutputs: what each request hears from the engine core, gathered until the step hands it back.

A sampled token becomes its request's delta (the token, its text, logprobs, a status change) or, when it stops
the request, the final output. Aborts, refusals and the status changes of requests that produced no token
this step get an output of their own. The engine core's ``step`` takes them all at once (``take``).

A ``final_only`` request (its caller wants only the end) sends no token until it ends: its tokens and logprobs
gather in one output that is sent whole when it stops or is aborted. Its status changes (scheduled, preempted)
still get an output of their own, rare events that tell the front end it runs. A ``generate`` of many requests
then costs no message, and no wake-up of the front end, on a step where none of them starts or ends.

With ``stream_interval`` N above 1, a streamed request's tokens after its first gather the same way and are
sent every N forward steps (counted for the whole engine, so all streams are sent on the same steps), and
when it ends: a message, and in a background engine a wake-up of the front end, every N steps instead of
every step.
"""

from __future__ import annotations

import logging
import time

import torch

from enginekit.core.request import Request
from enginekit.core.scheduler import Scheduler
from enginekit.core.structured.dead_ends import is_banned, no_token_left
from enginekit.model.sampler import SamplerOutput
from enginekit.wire.messages import EngineCoreOutput, FinishReason, InvalidRequest, RequestError
from enginekit.wire.messages import RequestStatus as WireStatus

logger = logging.getLogger("enginekit.core")

SHUTTING_DOWN = "engine shutting down"


class StepOutputs:
    def __init__(
        self,
        scheduler: Scheduler,
        *,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        stream_interval: int = 1,
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        self.pending: list[EngineCoreOutput] = []
        self.num_generated_tokens = 0
        self._holding: dict[str, Request] = {}  # streamed requests with tokens held until the next send step
        self._num_steps = 0

    def take(self) -> list[EngineCoreOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    # ---- requests that never run --------------------------------------------------------------------
    def shutting_down(self, request_id: str) -> None:
        self.pending.append(
            EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT, stop_reason=SHUTTING_DOWN)
        )

    def refuse(self, request_id: str, error: BaseException) -> None:
        """Answer a request the engine will not serve with the error its caller gets."""
        logger.warning("rejected request %s: %s", request_id, error)
        kind = "TypeError" if isinstance(error, TypeError) else "ValueError"
        self.pending.append(
            EngineCoreOutput(
                request_id, [], finish_reason=FinishReason.ABORT, error=RequestError(kind, str(error))
            )
        )

    def refuse_invalid(self, message: InvalidRequest) -> None:
        """Answer a request that could not be decoded (the engine process found it so)."""
        if message.request_id in self.scheduler.requests:
            logger.warning("dropped an undecodable request under the running id %s", message.request_id)
            return
        logger.warning("rejected request %s: %s", message.request_id, message.error.message)
        self.pending.append(
            EngineCoreOutput(message.request_id, [], finish_reason=FinishReason.ABORT, error=message.error)
        )

    # ---- a step's tokens ----------------------------------------------------------------------------
    def token(
        self,
        request: Request,
        sampled: SamplerOutput,
        row: int,
        status: WireStatus | None,
        *,
        more: bool = False,
    ) -> None:
        """Append the token sampled in ``row`` to its request and emit the delta, or the final output when it
        stops the request; ``status`` is the request's status change this step, if any. ``more``: another token
        of the request follows in this step (accepted proposals): the delta waits for the last of them."""
        token_id = sampled.token_ids[row]
        request.all_token_ids.append(token_id)
        request.num_pending_tokens = max(request.num_pending_tokens - 1, 0)
        self.num_generated_tokens += 1
        if request.grammar is not None and not _grammar_takes(request, token_id):
            self.fail(request, ValueError(_no_token_left(request, token_id)))
            return
        finish_reason, stop_reason = self._check_stop(request, token_id)
        interval = self.stream_interval > 1 and request.num_output_tokens > 1
        if request.final_only or interval or more or request.held_output is not None:
            self._gather(request, token_id, sampled, row)
            if finish_reason is not None:
                self.finish(request, finish_reason, stop_reason)
                return
            if not (request.final_only or interval or more):  # the last of this step's run: send it now
                output = _complete(request)
                output.new_text = request.detokenizer.flush()
                if status is not None:
                    _stamp(output, request, status)
                self.pending.append(output)
                return
            if interval and not request.final_only:
                self._holding[request.request_id] = request
            if status is not None:
                self.report_status({request.request_id: status})
            return
        output = EngineCoreOutput(
            request.request_id, [token_id], num_cached_tokens=max(request.num_cached_tokens, 0)
        )
        params = request.sampling_params
        if params.logprobs is not None:
            rows = _logprob_rows(sampled, row, params.logprobs + 1)
            output.logprob_values, output.logprob_token_ids, output.logprob_ranks = rows
        if status is not None:
            _stamp(output, request, status)
        if request.prompt_logprobs is not None and params.prompt_logprobs is not None:
            _attach_prompt_logprobs(output, request, params.prompt_logprobs)
        _count_proposals(output, request)
        if finish_reason is None:
            output.new_text = request.detokenizer.flush()
            self.pending.append(output)
        else:
            self.finish(request, finish_reason, stop_reason, output)

    def end_step(self) -> None:
        """A forward step ended: on every ``stream_interval``-th, send the tokens held for streamed requests."""
        self._num_steps += 1
        if not self._holding or self._num_steps % self.stream_interval:
            return
        for request in self._holding.values():
            output = _complete(request)
            output.new_text = request.detokenizer.flush()
            self.pending.append(output)
        self._holding.clear()

    @staticmethod
    def _gather(request: Request, token_id: int, sampled: SamplerOutput, row: int) -> None:
        """A token not sent yet: into the output its request will send (when it ends, or at the next send step
        of a stream)."""
        output = request.held_output
        if output is None:
            output = request.held_output = EngineCoreOutput(request.request_id, [])
        output.new_token_ids.append(token_id)
        if request.num_output_tokens == 1:
            output.first_token_time = time.time()
        params = request.sampling_params
        if params.logprobs is not None:
            request.output_logprobs.append(_logprob_rows(sampled, row, params.logprobs + 1))
        if request.prompt_logprobs is not None and params.prompt_logprobs is not None:
            _attach_prompt_logprobs(output, request, params.prompt_logprobs)

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, str | int | None]:
        """Whether ``token_id``, just appended, ends its request: a stop string, EOS, a stop token or a limit."""
        params = request.sampling_params
        num_output = request.num_output_tokens
        stop_string = request.detokenizer.update(token_id)
        if stop_string is not None:
            return FinishReason.STOP, stop_string
        if num_output >= params.min_tokens and not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP, None
        if num_output >= params.min_tokens and token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if request.grammar is not None and request.grammar.ready_matcher.is_terminated():
            return FinishReason.STOP, None  # the structured output is complete: nothing more can follow
        if (params.max_tokens is not None and num_output >= params.max_tokens) or len(
            request.all_token_ids
        ) >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        stop_reason: str | int | None = None,
        output: EngineCoreOutput | None = None,
    ) -> None:
        """End ``request`` in the scheduler and emit its final output (with the rest of its text, and every
        token it holds: for a final_only request, everything it produced)."""
        self.scheduler.finish_request(request, reason)
        self._holding.pop(request.request_id, None)
        if request.final_only or request.held_output is not None:
            output = _complete(request)
        elif output is None:
            output = EngineCoreOutput(
                request.request_id, [], num_cached_tokens=max(request.num_cached_tokens, 0)
            )
        output.new_text = request.detokenizer.flush_final()
        output.finish_reason = reason
        output.stop_reason = stop_reason
        self.pending.append(output)

    def fail(self, request: Request, error: BaseException) -> None:
        """End a request the engine cannot go on with (its grammar did not compile): its caller gets ``error``."""
        logger.warning("request %s failed: %s", request.request_id, error)
        self.finish(request, FinishReason.ABORT)
        kind = "TypeError" if isinstance(error, TypeError) else "ValueError"
        self.pending[-1].error = RequestError(kind, str(error))

    # ---- status changes -----------------------------------------------------------------------------
    def report_status(self, changes: dict[str, WireStatus]) -> None:
        """Status changes of requests that produced no token this step get an output of their own."""
        for request_id, status in changes.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.pending.append(_stamp(EngineCoreOutput(request_id, []), request, status))


def _grammar_takes(request: Request, token_id: int) -> bool:
    """Whether the structured output takes the sampled token, and the token controls allowed it (the sampler
    draws some token from a row its masks left empty: the grammar may take it, but it is banned)."""
    assert request.grammar is not None
    if not request.grammar.ready_matcher.accept(token_id):
        return False
    params = request.sampling_params
    if not (params.allowed_token_ids or request.bad_words):
        return True
    ids, longest = request.all_token_ids, max((len(word) for word in request.bad_words or ()), default=0)
    output = ids[max(request.num_prompt_tokens, len(ids) - longest) : -1]
    return not is_banned(params, request.bad_words, output, token_id)


def _no_token_left(request: Request, token_id: int) -> str:
    """Why the request gets no token: its structured output and token controls together left none."""
    message = no_token_left(request.sampling_params, request.detokenizer.text)
    return message or f"token {token_id} was sampled although the structured output does not allow it"


def status_changes(started: list[Request], preempted: list[Request]) -> dict[str, WireStatus]:
    """The requests the scheduler started (or resumed) and preempted this step, by id; stamps when each request
    was first scheduled."""
    now = time.time()
    for request in started:
        request.first_scheduled_time = request.first_scheduled_time or now
    changes = {request.request_id: WireStatus.RUNNING for request in started}
    changes.update({request.request_id: WireStatus.PREEMPTED for request in preempted})
    return changes


def _stamp(output: EngineCoreOutput, request: Request, status: WireStatus) -> EngineCoreOutput:
    output.status = status
    output.first_scheduled_time = request.first_scheduled_time
    output.num_preemptions = request.num_preemptions
    return output


def _logprob_rows(sampled: SamplerOutput, row: int, width: int) -> tuple[torch.Tensor, ...]:
    """Row ``row`` of the step's logprobs, its first ``width`` columns (copies: the step's tensors are big)."""
    assert sampled.logprob_values is not None and sampled.logprob_token_ids is not None
    assert sampled.logprob_ranks is not None
    return tuple(
        column[row : row + 1, :width].clone()
        for column in (sampled.logprob_values, sampled.logprob_token_ids, sampled.logprob_ranks)
    )


def _complete(request: Request) -> EngineCoreOutput:
    """The tokens ``request`` held, taken as one output about to be sent: its logprob rows joined, the engine's
    timing."""
    output = request.held_output or EngineCoreOutput(request.request_id, [])
    request.held_output = None
    if request.output_logprobs:
        joined = (torch.cat(column) for column in zip(*request.output_logprobs))
        output.logprob_values, output.logprob_token_ids, output.logprob_ranks = joined
        request.output_logprobs = []
    output.num_cached_tokens = max(request.num_cached_tokens, 0)
    output.first_scheduled_time = request.first_scheduled_time
    output.num_preemptions = request.num_preemptions
    _count_proposals(output, request)
    return output


def _count_proposals(output: EngineCoreOutput, request: Request) -> None:
    """Speculative decoding's counts so far (proposed, accepted, forced), on a request that has any."""
    if request.num_draft_tokens or request.num_forced_tokens:
        output.num_draft_tokens = request.num_draft_tokens
        output.num_accepted_tokens = request.num_accepted_tokens
        output.num_forced_tokens = request.num_forced_tokens


def _attach_prompt_logprobs(output: EngineCoreOutput, request: Request, num_logprobs: int) -> None:
    """The prompt is done: send its logprobs once, with the first token (none for a one-token prompt)."""
    parts = request.prompt_logprobs or []
    if parts:
        values, ids, ranks = (torch.cat(column) for column in zip(*parts))
    else:
        width = num_logprobs + 1
        values, ids, ranks = torch.empty(0, width), torch.empty(0, width, dtype=torch.long), None
    output.prompt_logprob_values, output.prompt_logprob_token_ids = values, ids
    output.prompt_logprob_ranks = ranks
    request.prompt_logprobs = None
