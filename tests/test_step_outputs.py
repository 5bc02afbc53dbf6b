"""StepOutputs: a sampled token's delta or final output, the stop checks in their order, status and refusals."""

import pytest
import torch

from enginekit.core.detokenizer import IncrementalDetokenizer
from enginekit.core.kv_cache import KVCacheManager
from enginekit.core.request import Request
from enginekit.core.scheduler import Scheduler
from enginekit.core.step_outputs import StepOutputs, status_changes
from enginekit.model.sampler import SamplerOutput
from enginekit.model.text.tokenizer import ByteTokenizer
from enginekit.sampling_params import SamplingParams
from enginekit.wire.messages import EngineCoreRequest, FinishReason, RequestStatus

EOS = ByteTokenizer.eos_token_id
PROMPT = [1, 5, 6, 7]


def token_of(char: str) -> int:
    return ord(char) + ByteTokenizer.NUM_SPECIAL


@pytest.fixture
def outputs() -> StepOutputs:
    scheduler = Scheduler(
        KVCacheManager(16, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64
    )
    return StepOutputs(scheduler, eos_token_ids=frozenset({EOS}), max_model_len=12)


def add(outputs: StepOutputs, request_id: str = "r", **params) -> Request:
    sampling = SamplingParams(**params)
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), PROMPT, sampling.stop)
    request = Request(EngineCoreRequest(request_id, PROMPT, sampling), detokenizer=detokenizer)
    outputs.scheduler.add_request(request)
    return request


def sample(outputs: StepOutputs, request: Request, *tokens: int) -> list:
    """Feed ``tokens`` one step each; return every output emitted."""
    for token in tokens:
        outputs.token(request, SamplerOutput([token]), 0, None)
    return outputs.take()


def test_a_token_that_does_not_stop_emits_its_delta_and_keeps_the_request(outputs):
    request = add(outputs, max_tokens=4)
    (delta,) = sample(outputs, request, token_of("h"))
    assert (delta.new_token_ids, delta.new_text, delta.finish_reason) == ([token_of("h")], "h", None)
    assert "r" in outputs.scheduler.requests and outputs.num_generated_tokens == 1
    assert outputs.take() == []


def test_max_tokens_ends_the_request_with_length_and_frees_it(outputs):
    request = add(outputs, max_tokens=2)
    *_, last = sample(outputs, request, token_of("h"), token_of("i"))
    assert (last.finish_reason, last.stop_reason, last.new_text) == (FinishReason.LENGTH, None, "i")
    assert "r" not in outputs.scheduler.requests


def test_max_model_len_ends_the_request_with_length(outputs):
    request = add(outputs, max_tokens=100)  # 4 prompt tokens: the 8th output token reaches 12
    emitted = sample(outputs, request, *[token_of("x")] * 8)
    assert [o.finish_reason for o in emitted] == [None] * 7 + [FinishReason.LENGTH]


def test_eos_stops_only_from_min_tokens_on_and_never_with_ignore_eos(outputs):
    early = add(outputs, "early", min_tokens=2, max_tokens=5)
    assert [o.finish_reason for o in sample(outputs, early, EOS, EOS)] == [None, FinishReason.STOP]
    ignored = add(outputs, "ignored", ignore_eos=True, max_tokens=3)
    assert [o.finish_reason for o in sample(outputs, ignored, EOS, EOS, EOS)] == [
        None,
        None,
        FinishReason.LENGTH,
    ]


def test_a_stop_token_ends_the_request_with_its_id_as_the_reason(outputs):
    request = add(outputs, stop_token_ids=[token_of("q")], max_tokens=5)
    (output,) = sample(outputs, request, token_of("q"))
    assert (output.finish_reason, output.stop_reason) == (FinishReason.STOP, token_of("q"))


def test_a_stop_string_wins_over_the_length_limit_and_is_cut_from_the_text(outputs):
    request = add(outputs, stop=["lo"], max_tokens=3)
    emitted = sample(outputs, request, token_of("h"), token_of("l"), token_of("o"))
    assert (emitted[-1].finish_reason, emitted[-1].stop_reason) == (FinishReason.STOP, "lo")
    assert "".join(o.new_text for o in emitted) == "h"


def test_an_abort_releases_the_request_and_sends_the_text_held_back(outputs):
    request = add(outputs, stop=["xyz"], max_tokens=5)
    (delta,) = sample(outputs, request, token_of("x"))  # "x" may start the stop string: held back
    assert delta.new_text == ""
    outputs.finish(request, FinishReason.ABORT)
    (final,) = outputs.take()
    assert (final.finish_reason, final.new_token_ids, final.new_text) == (FinishReason.ABORT, [], "x")
    assert "r" not in outputs.scheduler.requests


def test_a_status_change_rides_on_the_token_or_gets_its_own_output_while_the_request_lives(outputs):
    running, waiting = add(outputs, "running", max_tokens=4), add(outputs, "waiting")
    gone = add(outputs, "gone")
    changes = status_changes([running, waiting, gone], [])
    assert running.first_scheduled_time > 0
    outputs.token(running, SamplerOutput([token_of("a")]), 0, changes.pop("running"))
    outputs.finish(gone, FinishReason.ABORT)
    outputs.report_status(changes)
    emitted = {(o.request_id, o.status) for o in outputs.take()}
    assert ("running", RequestStatus.RUNNING) in emitted and ("waiting", RequestStatus.RUNNING) in emitted
    assert ("gone", RequestStatus.RUNNING) not in emitted


def test_status_changes_keep_the_first_scheduled_time_and_mark_preemptions(outputs):
    request = add(outputs)
    status_changes([request], [])
    first = request.first_scheduled_time
    assert status_changes([request], []) == {"r": RequestStatus.RUNNING}
    assert request.first_scheduled_time == first
    assert status_changes([], [request]) == {"r": RequestStatus.PREEMPTED}


@pytest.mark.parametrize(
    ("error", "kind"), [(TypeError("bad type"), "TypeError"), (ValueError("bad"), "ValueError")]
)
def test_a_refusal_carries_the_error_kind_its_caller_raises(outputs, error, kind):
    outputs.refuse("x", error)
    (output,) = outputs.take()
    assert (output.finish_reason, output.error.kind, output.error.message) == (
        FinishReason.ABORT,
        kind,
        str(error),
    )


# ---- final_only: one output when the request ends ------------------------------------------------------
def add_final_only(outputs: StepOutputs, request_id: str = "f", **params) -> Request:
    sampling = SamplingParams(**params)
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), PROMPT, sampling.stop)
    message = EngineCoreRequest(request_id, PROMPT, sampling, final_only=True)
    request = Request(message, detokenizer=detokenizer)
    outputs.scheduler.add_request(request)
    return request


def logprob_step(token: int, value: float) -> SamplerOutput:
    """A one-row step that asked for one logprob: the sampled token, then the top one."""
    return SamplerOutput(
        [token],
        torch.tensor([[value, value + 1]]),
        torch.tensor([[token, 0]]),
        torch.tensor([[2, 1]], dtype=torch.int32),
    )


def test_a_final_only_request_sends_its_start_then_one_output_with_everything_when_it_ends(outputs):
    request = add_final_only(outputs, max_tokens=3, logprobs=1)
    (started,) = status_changes([request], []).values()
    outputs.token(request, logprob_step(token_of("a"), 0), 0, started)
    (start,) = outputs.take()
    assert (start.new_token_ids, start.status, start.finish_reason) == ([], RequestStatus.RUNNING, None)
    outputs.token(request, logprob_step(token_of("b"), -1), 0, None)
    assert outputs.take() == []  # no delta while it runs
    outputs.token(request, logprob_step(token_of("c"), -2), 0, None)
    (final,) = outputs.take()
    assert (final.new_token_ids, final.new_text) == ([token_of(c) for c in "abc"], "abc")
    assert final.finish_reason is FinishReason.LENGTH
    assert final.logprob_values.tolist() == [[0, 1], [-1, 0], [-2, -1]]
    assert final.logprob_token_ids[:, 0].tolist() == final.new_token_ids
    assert 0 < final.first_scheduled_time <= final.first_token_time


def test_an_aborted_final_only_request_sends_what_it_produced(outputs):
    request = add_final_only(outputs, max_tokens=10, stop=["yz"])
    sample(outputs, request, token_of("h"), token_of("y"))
    status_changes([], [request])
    request.num_preemptions += 1
    outputs.finish(request, FinishReason.ABORT)
    (final,) = outputs.take()
    assert (final.finish_reason, final.new_token_ids) == (FinishReason.ABORT, [token_of("h"), token_of("y")])
    assert final.new_text == "hy" and final.num_preemptions == 1


def test_a_final_only_request_aborted_before_its_first_token_sends_an_empty_end(outputs):
    request = add_final_only(outputs)
    outputs.finish(request, FinishReason.ABORT)
    (final,) = outputs.take()
    assert (final.new_token_ids, final.new_text, final.first_token_time) == ([], "", 0.0)


# ---- stream_interval: a stream's tokens sent every N steps ----------------------------------------------
@pytest.fixture
def every_third() -> StepOutputs:
    scheduler = Scheduler(
        KVCacheManager(16, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64
    )
    return StepOutputs(scheduler, eos_token_ids=frozenset({EOS}), max_model_len=64, stream_interval=3)


def step(outputs: StepOutputs, request: Request, token: int, value: float = 0.0) -> list:
    """One forward step that samples ``token`` for ``request``; what the step hands back."""
    outputs.token(request, logprob_step(token, value), 0, None)
    outputs.end_step()
    return outputs.take()


def test_a_stream_gets_its_first_token_at_once_then_the_tokens_of_every_third_step_together(every_third):
    request = add(every_third, max_tokens=20, logprobs=1)
    sent = [step(every_third, request, token_of(c), -i) for i, c in enumerate("abcdefg")]
    assert [[o.new_token_ids for o in batch] for batch in sent] == [
        [[token_of("a")]],  # step 1: the first token, at once (time to first token)
        [],
        [[token_of("b"), token_of("c")]],  # step 3
        [],
        [],
        [[token_of(c) for c in "def"]],  # step 6
        [],
    ]
    texts = ["".join(o.new_text for o in batch) for batch in sent]
    assert texts == ["a", "", "bc", "", "", "def", ""]
    later = sent[5][0]
    assert later.logprob_values.tolist() == [[-3, -2], [-4, -3], [-5, -4]]
    assert later.logprob_token_ids[:, 0].tolist() == later.new_token_ids and later.first_token_time == 0.0
    assert later.finish_reason is None and "r" in every_third.scheduler.requests


def test_a_streams_end_and_its_abort_send_the_tokens_it_held_at_once(every_third):
    ending = add(every_third, "ends", max_tokens=4)
    aborted = add(every_third, "aborted", max_tokens=20)
    step(every_third, ending, token_of("a"))
    step(every_third, aborted, token_of("x"))
    step(every_third, ending, token_of("b"))  # step 3, a send step
    assert step(every_third, ending, token_of("c")) == []  # held
    (final,) = step(every_third, ending, token_of("d"))  # step 5: not a send step, but the request ends
    assert (final.new_token_ids, final.new_text) == ([token_of("c"), token_of("d")], "cd")
    assert final.finish_reason is FinishReason.LENGTH and "ends" not in every_third.scheduler.requests
    every_third.token(aborted, SamplerOutput([token_of("y")]), 0, None)
    every_third.finish(aborted, FinishReason.ABORT)
    (end,) = every_third.take()
    assert (end.new_token_ids, end.new_text, end.finish_reason) == ([token_of("y")], "y", FinishReason.ABORT)
    every_third.end_step()  # step 6, a send step: nothing is left to send
    assert every_third.take() == []


def test_a_final_only_request_is_not_sent_on_send_steps(every_third):
    request = add_final_only(every_third, max_tokens=5)
    assert [step(every_third, request, token_of(c)) for c in "abcd"] == [[], [], [], []]
    (final,) = step(every_third, request, token_of("e"))
    assert final.new_text == "abcde" and final.first_token_time > 0
