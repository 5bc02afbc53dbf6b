"""OutputProcessor: deltas build the cumulative output; finished and failed requests wake their waiters once."""

import pytest
import torch

from enginekit.output_processor import OutputProcessor, RequestState
from enginekit.wire.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, RequestError


def batch(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs))


def tracked(processor: OutputProcessor, request_id: str = "r", logprobs: bool = False) -> RequestState:
    state = RequestState(request_id, "prompt", [1, 2], logprobs)
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


def test_logprob_tensors_become_one_dict_per_token():
    processor = OutputProcessor()
    state = tracked(processor, logprobs=True)
    values = torch.tensor([[-0.1, -0.1, -2.0]])
    ids = torch.tensor([[5, 5, 9]])
    processor.process(batch(EngineCoreOutput("r", [5], logprob_values=values, logprob_token_ids=ids)))
    assert state.output.outputs[0].logprobs == [{5: pytest.approx(-0.1), 9: -2.0}]


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
