"""Prompt preparation: every accepted form becomes one checked engine request; bad ones raise before sending."""

import pytest
import torch

from enginekit import StructuredOutputsParams
from enginekit.core.validation import RequestLimits
from enginekit.frontend.prompts import RequestBuilder, normalize_params, normalize_prompts, prepare_request
from enginekit.model.loader import load_model_spec
from enginekit.model.text.tokenizer import ByteTokenizer
from enginekit.sampling_params import SamplingParams

TOKENIZER = ByteTokenizer()
LIMITS = RequestLimits(vocab_size=259, hidden_size=8, max_model_len=32)
PARAMS = SamplingParams()


def prepare(prompt):
    return prepare_request(prompt, PARAMS, "r", TOKENIZER, LIMITS, 1.0)


def test_single_prompts_and_lists_normalize_to_a_list():
    assert normalize_prompts("hi") == ["hi"]
    assert normalize_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert normalize_prompts(["a", [1, 2], {"prompt": "b"}]) == ["a", [1, 2], {"prompt": "b"}]
    with pytest.raises(ValueError, match="prompts is empty"):
        normalize_prompts([])
    with pytest.raises(TypeError, match=r"prompts must be a string, .* not int"):
        normalize_prompts(5)


def test_one_params_for_all_or_one_each():
    assert normalize_params(None, 2) == [SamplingParams()] * 2
    assert normalize_params(PARAMS, 3) == [PARAMS] * 3
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        normalize_params([PARAMS], 2)
    with pytest.raises(TypeError, match="params must be SamplingParams or a list of them, not dict"):
        normalize_params({"max_tokens": 3}, 1)


def test_every_prompt_form_gives_the_same_request():
    text, ids = prepare("Hi")[0], TOKENIZER.encode("Hi")
    assert text.prompt_token_ids == ids and prepare("Hi")[1] == "Hi"
    assert prepare(ids)[0].prompt_token_ids == ids and prepare(ids)[1] is None
    assert prepare({"prompt": "Hi"})[0].prompt_token_ids == ids
    assert prepare({"prompt_token_ids": ids})[0].prompt_token_ids == ids
    assert prepare(torch.tensor(ids).tolist())[0].prompt_token_ids == ids


def test_token_ids_may_carry_the_text_they_stand_for():
    request, text = prepare({"prompt_token_ids": [5, 6], "prompt": "the text"})
    assert request.prompt_token_ids == [5, 6] and text == "the text"


def test_prompt_embeds_are_copied_and_stand_for_placeholder_tokens():
    embeds = torch.ones(3, 8)
    request, _ = prepare({"prompt_embeds": embeds})
    assert request.prompt_token_ids == [0, 0, 0]
    embeds.zero_()
    assert torch.equal(request.prompt_embeds, torch.ones(3, 8))


@pytest.mark.parametrize(
    ("prompt", "exception", "message"),
    [
        ("", ValueError, "prompt is an empty string"),
        ({"prompt": 3}, TypeError, "a text prompt must be a string, not int"),
        (
            {"prompt_token_ids": [1], "prompt_embeds": torch.ones(1, 8)},
            ValueError,
            "a dict prompt needs exactly one of",
        ),
        ([1, True], TypeError, r"token ids must be integers, got True \(bool\)"),
        ([1, 1.5], TypeError, r"token ids must be integers, got 1.5 \(float\)"),
        ([300], ValueError, r"token id 300 is outside the vocabulary \(size 259\)"),
        ([1] * 32, ValueError, "prompt is 32 tokens long; the longest allowed is 31"),
        (
            {"prompt_embeds": torch.ones(3)},
            ValueError,
            r"prompt_embeds must be a \[num_tokens, 8\] tensor, got \[3\]",
        ),
        (
            {"prompt_embeds": [[1.0] * 8]},
            ValueError,
            r"prompt_embeds must be a \[num_tokens, 8\] tensor, got list",
        ),
        (
            {"prompt_embeds": torch.ones(2, 8, dtype=torch.long)},
            ValueError,
            "must hold floating-point values",
        ),
        (
            {"prompt_embeds": torch.ones(2, 7)},
            ValueError,
            r"prompt_embeds must be a \[2, 8\] tensor, got \[2, 7\]",
        ),
        (3.5, TypeError, "a prompt must be a string, a token-id list or a dict, not float"),
    ],
)
def test_bad_prompts_raise_before_anything_is_sent(prompt, exception, message):
    with pytest.raises(exception, match=message):
        prepare(prompt)


def test_an_error_in_a_batch_names_the_prompt_and_its_constraint():
    builder = RequestBuilder(load_model_spec("builtin"), LIMITS)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt is an empty string$"):
        builder.build(["fine", "", "fine"], PARAMS)
    constrained = SamplingParams(
        logit_bias={300: 1.0}, structured_outputs=StructuredOutputsParams(choice=["a"])
    )
    with pytest.raises(
        ValueError, match=r"^prompts\[2\] \(choice='\[\"a\"\]'\): SamplingParams.logit_bias holds"
    ):
        builder.build(["fine", "fine", "biased"], [PARAMS, PARAMS, constrained])
    with pytest.raises(ValueError, match=r"^prompt is an empty string$"):  # a single prompt: no index
        builder.build("", PARAMS)
