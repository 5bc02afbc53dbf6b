import pytest

from enginekit import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer of at least 1, got 0"),
        ({"temperature": -0.5}, r"temperature must be in \[0, 100\], got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, r"top_k must be 0 \(disabled\) or positive, got -1"),
        ({"seed": -3}, r"seed must be in \[0, 2\*\*63\), got -3"),
        ({"stop": ["ok", ""]}, r"stop must hold non-empty strings"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must hold non-negative integers"),
        ({"logprobs": 50}, r"logprobs must be in \[0, 20\], got 50"),
        ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens must be in \[0, max_tokens=4\], got 9"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string_or_a_list():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().is_greedy
