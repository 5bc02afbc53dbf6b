"""The default real model, SmolLM2-135M-Instruct (a Q4_1 GGUF from the registry wheel), against transformers.

transformers loads the same GGUF file (dequantized to float32) once per test session; its greedy tokens are the
reference. Plain and chat-formatted prompts, 32 tokens each, in every mode.
"""

from __future__ import annotations

import pytest

from enginekit import Engine, SamplingParams
from enginekit.model.formats.source import default_model_file

MODES = ["inproc", "mp", "async"]
NUM_TOKENS = 32
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "Photosynthesis is the process by which",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is a prime number."},
        {"role": "user", "content": "Name another one."},
    ],
]
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="session")
def reference():
    """transformers' tokenizer and greedy continuations of every prompt (token ids in, token ids out)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(text) for text in PLAIN]
    prompts += [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CONVERSATIONS
    ]
    prompts[len(PLAIN) :] = [
        tokenizer.encode(text, add_special_tokens=False) for text in prompts[len(PLAIN) :]
    ]
    continuations = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                # NOTE: explicit: the chat prompts hold <|im_end|>, which is also the pad token, and without a
                # mask generate would take those positions for padding and mask them out.
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
            continuations.append(out[0, len(ids) :].tolist())
    return {"tokenizer": tokenizer, "prompts": prompts, "continuations": continuations}


@pytest.fixture(scope="module", params=MODES)
def engine(request):
    # quantization="none": the file dequantized to float32, as transformers loads it (the weights as stored are
    # compared with this in test_quantized.py).
    with Engine(mode=request.param, max_model_len=1024, quantization="none") as engine:
        yield engine


def test_greedy_tokens_equal_transformers_in_every_mode(engine, reference):
    outputs = engine.generate(reference["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference["continuations"]


def test_text_prompts_tokenize_as_transformers_does(engine, reference):
    ours = engine.get_tokenizer()
    assert [ours.encode(text) for text in PLAIN] == reference["prompts"][: len(PLAIN)]


def test_chat_renders_as_transformers_and_answers(engine, reference):
    chat_prompts = reference["prompts"][len(PLAIN) :]
    outputs = engine.chat(CONVERSATIONS, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == chat_prompts
    assert [o.outputs[0].token_ids for o in outputs] == reference["continuations"][len(PLAIN) :]


def test_chat_stops_at_the_end_of_the_turn(engine):
    out = engine.chat(CONVERSATIONS[0], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 2  # <|im_end|>: kept in the ids, not in the text


def test_streaming_and_async_chat(engine):
    import asyncio

    conversation = CONVERSATIONS[0]
    expected = engine.chat(conversation, SamplingParams(max_tokens=16, temperature=0))[0].text
    chunks = list(engine.stream_chat(conversation, SamplingParams(max_tokens=16, temperature=0)))
    assert chunks[-1].finished and chunks[-1].text == expected

    async def both():
        outs = await engine.achat(conversation, SamplingParams(max_tokens=16, temperature=0))
        chunks = [
            c async for c in engine.astream_chat(conversation, SamplingParams(max_tokens=16, temperature=0))
        ]
        return outs[0].text, chunks[-1].text

    assert asyncio.run(both()) == (expected, expected)


def test_chat_answers_with_the_weights_as_stored():
    # The LM head's largest logits are computed again from its unquantized input (QuantizedWeight.exact_top):
    # with the int8 input alone this model (and llama.cpp on the same file) answers "L'Étoile, la Cité, ...".
    with Engine(mode="inproc", quantization="gguf") as engine:
        assert engine.client.core.runner.model.lm_head.stored.exact_top
        outputs = engine.chat(CONVERSATIONS[:1], SamplingParams(max_tokens=64, temperature=0))
    assert outputs[0].text == "The capital of France is Paris."


def test_the_fused_layers_give_the_pieces_tokens_and_logprobs():
    # Every layer of the default model runs in one native call (stored_layer.c); called piece by piece it gives
    # the same numbers. No prefix cache: both runs compute every prompt token in the same steps.
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    prompts = ["Tell me a story about a cat", "What is the capital of France?", "1 2 3 4 5"]
    with Engine(mode="inproc", quantization="gguf", enable_prefix_caching=False) as engine:
        model = engine.client.core.runner.model
        assert model.fused_layers == len(model.layers)
        fused = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)]
        for layer in model.layers:
            layer.fused = None
        pieces = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)]
    assert fused == pieces
