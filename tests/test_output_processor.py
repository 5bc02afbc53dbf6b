"""OutputProcessor: deltas build the cumulative output; finished and failed requests wake their waiters once."""

import pytest
import torch

from enginekit.frontend.output_processor import OutputProcessor, RequestState
from enginekit.outputs import Logprob
from enginekit.sampling_params import RequestOutputKind, SamplingParams
from enginekit.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    RequestError,
    RequestStatus,
)


def batch(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs))


def tracked(processor: OutputProcessor, request_id: str = "r", **options) -> RequestState:
    params = SamplingParams(**options)
    engine_ids = [f"{i}_{request_id}" for i in range(params.n)] if params.n > 1 else None
    state = RequestState(
        request_id, "prompt", [1, 2], params, engine_ids=engine_ids, decode=lambda t: f"<{t}>"
    )
    processor.add(state)
    return state


def test_deltas_accumulate_into_the_cumulative_output():
    processor = OutputProcessor()
    state = tracked(processor)
    processor.process(batch(EngineCoreOutput("r", [5], "he")))
    processor.process(batch(EngineCoreOutput("r", [6], "llo", FinishReason.LENGTH, num_cached_tokens=16)))
    out = state.output
    assert out.outputs[0].token_ids == [5, 6] and out.text == "hello"
    assert out.finished and out.outputs[0].finish_reason == "length" and out.num_cached_tokens == 16
    assert state.version == 2 and "r" not in processor.states


def test_logprob_tensors_become_one_dict_of_logprob_objects_per_token():
    processor = OutputProcessor()
    state = tracked(processor, logprobs=1)
    values = torch.tensor([[-0.1, -0.1, -2.0]])
    ids = torch.tensor([[5, 5, 9]])
    ranks = torch.tensor([[3, 3, 1]])
    delta = EngineCoreOutput("r", [5], logprob_values=values, logprob_token_ids=ids, logprob_ranks=ranks)
    processor.process(batch(delta))
    [row] = state.output.outputs[0].logprobs
    assert list(row) == [5, 9]
    assert row[5] == Logprob(pytest.approx(-0.1), 3, "<5>") and row[9] == Logprob(-2.0, 1, "<9>")


def test_prompt_logprobs_start_with_none_for_the_first_token():
    processor = OutputProcessor()
    state = tracked(processor, prompt_logprobs=0)
    delta = EngineCoreOutput(
        "r", [], prompt_logprob_values=torch.tensor([[-1.5]]), prompt_logprob_token_ids=torch.tensor([[2]]),
        prompt_logprob_ranks=torch.tensor([[4]]),
    )  # fmt: skip
    processor.process(batch(delta))
    assert state.output.prompt_logprobs == [None, {2: Logprob(-1.5, 4, "<2>")}]


def test_n_samples_fill_their_own_completions_and_finish_together():
    processor = OutputProcessor()
    state = tracked(processor, n=2)
    assert processor.engine_ids(["r"]) == ["0_r", "1_r"]
    processor.process(batch(EngineCoreOutput("1_r", [7], "b", FinishReason.LENGTH)))
    assert not state.finished and [c.text for c in state.output.outputs] == ["", "b"]
    processor.process(batch(EngineCoreOutput("0_r", [6], "a", FinishReason.STOP, stop_reason=6)))
    out = state.output
    assert state.finished and out.finished and [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert processor.states == {} and processor._samples == {}


def test_forget_returns_only_the_unfinished_samples():
    processor = OutputProcessor()
    state = tracked(processor, n=3)
    processor.process(batch(EngineCoreOutput("1_r", [7], "b", FinishReason.LENGTH)))
    assert processor.forget([state]) == ["0_r", "2_r"]


def test_a_reused_id_never_gets_the_aborted_requests_last_outputs():
    """An aborted request's outputs still on their way when a new request takes its id belong to no one: the new
    request gets only its own (the engine applies the abort before the new request, so they all come first)."""
    processor = OutputProcessor()
    old = tracked(processor, "busy")
    processor.process(batch(EngineCoreOutput("busy", [5], "a")))
    assert processor.forget([old]) == ["busy"]  # left early: the caller aborts it
    new = tracked(processor, "busy")
    processor.process(
        batch(
            EngineCoreOutput("busy", [6], "b"),  # sent before the engine saw the abort
            EngineCoreOutput("busy", [], finish_reason=FinishReason.ABORT),  # the abort's final output
            EngineCoreOutput("busy", [9], "z", FinishReason.LENGTH),  # the new request's
        )
    )
    assert new.output.outputs[0].token_ids == [9] and new.output.finished
    assert new.output.outputs[0].finish_reason == "length" and old.output.outputs[0].token_ids == [5]
    assert processor._ending == set()


def test_speculative_counts_sum_over_the_samples():
    processor = OutputProcessor()
    state = tracked(processor, n=2)
    processor.process(batch(EngineCoreOutput("0_r", [5], num_draft_tokens=4, num_accepted_tokens=3)))
    processor.process(batch(EngineCoreOutput("1_r", [6], num_draft_tokens=2, num_forced_tokens=5)))
    processor.process(batch(EngineCoreOutput("0_r", [7], num_draft_tokens=8, num_accepted_tokens=6)))
    metrics = state.output.metrics
    assert metrics is not None
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens, metrics.num_forced_tokens) == (10, 6, 5)
    assert metrics.acceptance_rate == 0.6


def test_status_and_metrics_follow_the_engine_events():
    processor = OutputProcessor()
    state = tracked(processor)
    out = state.output
    assert out.status == "waiting" and out.metrics.arrival_time > 0
    processor.process(
        batch(EngineCoreOutput("r", [], status=RequestStatus.RUNNING, first_scheduled_time=5.0))
    )
    assert out.status == "running" and out.metrics.first_scheduled_time == 5.0
    processor.process(batch(EngineCoreOutput("r", [], status=RequestStatus.PREEMPTED, num_preemptions=1)))
    assert out.status == "preempted" and out.metrics.num_preemptions == 1
    processor.process(batch(EngineCoreOutput("r", [3], "x")))
    assert out.status == "running" and out.metrics.first_token_time is not None
    processor.process(batch(EngineCoreOutput("r", [4], "y", FinishReason.LENGTH)))
    assert out.status == "finished" and out.metrics.finished_time >= out.metrics.first_token_time


def test_delta_snapshots_yield_only_what_is_new():
    processor = OutputProcessor()
    state = tracked(processor, output_kind=RequestOutputKind.DELTA)
    processor.process(batch(EngineCoreOutput("r", [5], "he")))
    first = state.snapshot()
    processor.process(batch(EngineCoreOutput("r", [6], "llo")))
    second = state.snapshot()
    assert (first.outputs[0].text, first.outputs[0].token_ids) == ("he", [5])
    assert (second.outputs[0].text, second.outputs[0].token_ids) == ("llo", [6])
    assert state.output.text == "hello"  # the state itself stays cumulative


def test_an_error_output_fails_the_request_with_its_exception():
    processor = OutputProcessor()
    state = tracked(processor)
    error = RequestError("TypeError", "SamplingParams.top_k must be an integer")
    processor.process(batch(EngineCoreOutput("r", [], finish_reason=FinishReason.ABORT, error=error)))
    assert state.finished and isinstance(state.error, TypeError) and not state.output.finished
    assert str(state.error) == "SamplingParams.top_k must be an integer"


def test_unknown_ids_are_ignored_and_listeners_are_called_per_update():
    processor = OutputProcessor()
    state = tracked(processor)
    calls = []
    state.listener = lambda: calls.append(state.version)
    processor.process(batch(EngineCoreOutput("other", [1]), EngineCoreOutput("r", [2])))
    assert calls == [1]


def test_fail_all_and_forget():
    processor = OutputProcessor()
    a, b = tracked(processor, "a"), tracked(processor, "b")
    assert processor.forget([a]) == ["a"] and list(processor.states) == ["b"]
    boom = RuntimeError("gone")
    processor.fail_all(boom)
    assert b.error is boom and b.finished and processor.states == {}
    assert a.error is None  # forgotten requests are not the processor's any more


def test_a_snapshot_does_not_change_with_later_deltas():
    processor = OutputProcessor()
    state = tracked(processor)
    processor.process(batch(EngineCoreOutput("r", [5], "a")))
    snapshot = state.snapshot()
    processor.process(batch(EngineCoreOutput("r", [6], "b")))
    assert snapshot.text == "a" and snapshot.outputs[0].token_ids == [5]
