"""Quality of the weights as stored: on real text, each token's log-likelihood with the GGUF file's quantized
tensors computed as stored (``quantization="gguf"``) against the same file dequantized to float32
(``quantization="none"``). At up to 16 rows a step (decode, and prefill in small chunks) the block types' products
take their input quantized to int8 blocks; above that they run in float32 on dequantized panels; on CPUs with
AVX-512 BF16, from 6 rows on (a prefill included) input and weight are rounded to bf16 instead. Both are scored:
the prompt in one step, and in chunks of 8 tokens (the decode kernels). A wrong kernel (a scale, a nibble order, a minimum) moves these
by whole nats; the quantization of the activations alone moves them by a few hundredths at most."""

from __future__ import annotations

import pytest

from enginekit import Engine, SamplingParams

TEXT = (
    "The city of Paris is the capital of France and its largest city. It lies on the river Seine, in the north of "
    "the country, at the heart of the Ile-de-France region. Since the seventeenth century Paris has been one of "
    "the major centres of finance, diplomacy, commerce, fashion, science and the arts in Europe. The city is known "
    "for its museums and architectural landmarks: the Louvre received more than eight million visitors last year, "
    "making it the most visited art museum in the world. The Eiffel Tower, built for the World's Fair of 1889, was "
    "at first criticised by some of the leading artists and intellectuals of the time, and is now a global icon."
)
LIMIT_NATS = 0.03  # the target: mean absolute difference per token (the int8 kernels: about 0.017)


def token_logprobs(quantization: str, chunk: int = 2048) -> tuple[list[int], list[float]]:
    with Engine(
        mode="inproc", quantization=quantization, max_model_len=512, max_num_batched_tokens=chunk
    ) as engine:
        if quantization == "gguf":  # the projections really are kept as stored
            assert engine.client.core.runner.model.lm_head.stored is not None
        prompt = engine.tokenizer.encode(TEXT)
        scored = engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return prompt, [scored.prompt_logprobs[i][token].logprob for i, token in enumerate(prompt) if i > 0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[float]]:
    return token_logprobs("none")


def deviation(reference, chunk: int) -> tuple[float, float]:
    tokens, expected = reference
    prompt, got = token_logprobs("gguf", chunk)
    assert prompt == tokens and len(got) == len(expected) > 100
    assert sum(expected) / len(expected) > -4.0  # the text is scored as text: the reference finds it likely
    deviations = [abs(a - b) for a, b in zip(got, expected)]
    return sum(deviations) / len(deviations), max(deviations)


def test_log_likelihood_as_stored_in_one_step_stays_within_three_hundredths_of_a_nat(reference):
    mean, worst = deviation(reference, 2048)
    assert mean <= LIMIT_NATS and worst < 0.5, f"mean |d log p| {mean:.4f}, max {worst:.4f} nats"


def test_log_likelihood_through_the_int8_kernels_stays_within_three_hundredths_of_a_nat(reference):
    mean, worst = deviation(reference, 8)
    assert 0 < mean <= LIMIT_NATS, f"mean |d log p| {mean:.4f} nats"  # > 0: the int8 kernels ran
    assert worst < 0.5  # no single token far off (a kernel wrong on some rows would show here)
