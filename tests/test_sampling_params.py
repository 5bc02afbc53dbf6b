"""SamplingParams: every bad value fails at construction with a message that names the option and the fix."""

import numpy
import pytest

from enginekit import SamplingParams

BAD_VALUES = [
    # (options, exception, message)
    ({"max_tokens": 0}, ValueError, r"SamplingParams.max_tokens must be at least 1 or None, got 0"),
    ({"max_tokens": True}, TypeError, r"SamplingParams.max_tokens must be an integer, got True \(bool\)"),
    ({"max_tokens": 2.5}, TypeError, r"SamplingParams.max_tokens must be an integer, got 2.5 \(float\)"),
    # What crosses to an engine process must fit msgpack's integers: refused here, in every mode alike.
    ({"max_tokens": 2**64}, ValueError, r"SamplingParams.max_tokens must fit in a signed 64-bit integer"),
    ({"top_k": 2**64}, ValueError, r"SamplingParams.top_k must fit in a signed 64-bit integer"),
    ({"stop_token_ids": [2**64]}, ValueError, r"SamplingParams.stop_token_ids must fit in a signed 64-bit"),
    (
        {"repetition_penalty": float("nan")},
        ValueError,
        r"repetition_penalty must be a finite number, got nan",
    ),
    (
        {"repetition_penalty": float("inf")},
        ValueError,
        r"repetition_penalty must be a finite number, got inf",
    ),
    ({"temperature": float("nan")}, ValueError, r"SamplingParams.temperature must be a finite number"),
    ({"temperature": -0.5}, ValueError, r"SamplingParams.temperature must be in \[0, 100\], got -0.5"),
    ({"temperature": True}, TypeError, r"SamplingParams.temperature must be a number, got True \(bool\)"),
    ({"temperature": "hot"}, TypeError, r"SamplingParams.temperature must be a number, got 'hot' \(str\)"),
    ({"top_p": 0.0}, ValueError, r"SamplingParams.top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, ValueError, r"SamplingParams.top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -1}, ValueError, r"SamplingParams.top_k must be 0 \(disabled\) or positive, got -1"),
    ({"top_k": 2.0}, TypeError, r"SamplingParams.top_k must be an integer, got 2.0 \(float\)"),
    ({"seed": -3}, ValueError, r"SamplingParams.seed must be in \[0, 2\*\*63\), got -3"),
    ({"seed": "42"}, TypeError, r"SamplingParams.seed must be an integer, got '42' \(str\)"),
    ({"stop": ["ok", ""]}, ValueError, r"SamplingParams.stop must hold non-empty strings"),
    ({"stop": 5}, TypeError, r"SamplingParams.stop must be a string or a list of strings, got 5 \(int\)"),
    ({"stop": ["a", 1]}, TypeError, r"SamplingParams.stop must be a string or a list of strings"),
    ({"stop_token_ids": [-1]}, ValueError, r"SamplingParams.stop_token_ids must hold non-negative integers"),
    ({"stop_token_ids": 5}, TypeError, r"SamplingParams.stop_token_ids must be a list of integers, got 5"),
    ({"stop_token_ids": [1.0]}, TypeError, r"SamplingParams.stop_token_ids must be a list of integers"),
    ({"ignore_eos": "no"}, TypeError, r"SamplingParams.ignore_eos must be True or False, got 'no' \(str\)"),
    ({"logprobs": 50}, ValueError, r"SamplingParams.logprobs must be in \[0, 20\], got 50"),
    (
        {"min_tokens": 9, "max_tokens": 4},
        ValueError,
        r"SamplingParams.min_tokens must be in \[0, max_tokens=4\]",
    ),
    (
        {"temprature": 0},
        TypeError,
        r"SamplingParams got an unknown option 'temprature'; did you mean 'temperature'\?",
    ),
    (
        {"frobnicate": 1},
        TypeError,
        r"SamplingParams got an unknown option 'frobnicate'\. Its options are: max_tokens",
    ),
]


@pytest.mark.parametrize(("options", "exception", "message"), BAD_VALUES)
def test_bad_values_fail_clearly(options, exception, message):
    with pytest.raises(exception, match=message):
        SamplingParams(**options)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError, match=r"SamplingParams takes keyword options only"):
        SamplingParams(32)


def test_numpy_numbers_are_accepted_as_plain_numbers():
    params = SamplingParams(max_tokens=numpy.int64(5), temperature=numpy.float32(0.5), top_k=numpy.int32(3))
    assert (type(params.max_tokens), type(params.temperature), type(params.top_k)) == (int, float, int)
    assert (params.max_tokens, params.temperature, params.top_k) == (5, 0.5, 3)


def test_integers_are_accepted_where_numbers_are_expected():
    params = SamplingParams(temperature=1, top_p=1)
    assert type(params.temperature) is float and type(params.top_p) is float


def test_stop_accepts_a_single_string_or_a_list():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_none_is_no_stops_and_no_bad_words_as_in_vllm():
    # vLLM's defaults: code that passes its request's fields on (``stop=request.stop``) gives None
    params = SamplingParams(stop=None, stop_token_ids=None, bad_words=None)
    assert (params.stop, params.stop_token_ids, params.bad_words) == ((), (), ())
    assert params == SamplingParams()


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().is_greedy


def test_max_tokens_none_means_up_to_the_context():
    params = SamplingParams(max_tokens=None, min_tokens=5)
    assert params.max_tokens is None and params.min_tokens == 5
