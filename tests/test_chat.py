"""frontend/chat.py through the facade: what a conversation may hold, and the errors for what it may not."""

import pytest

from enginekit import Engine, SamplingParams

# SmolLM2-135M-Instruct's own template: roles pass through, content is concatenated as a string.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template in OpenAI's format: it reads the parts of a message's content itself.
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:{% for part in message['content'] %}"
    "[{{ part['text'] }}]{% endfor %}\n{% endfor %}"
)
# A template that handles a role of its own.
NARRATOR_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'narrator' %}* {% endif %}{{ m['content'] }}\n{% endfor %}"
)
SHORT = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def engine():
    with Engine("builtin", mode="inproc", num_kv_blocks=128) as engine:
        yield engine


def chat(engine, messages, template=SMOL_TEMPLATE):
    return engine.chat(messages, SHORT, chat_template=template)


def test_an_empty_conversation_is_refused(engine):
    with pytest.raises(ValueError, match=r"the conversation is empty: give at least one message"):
        chat(engine, [])
    with pytest.raises(ValueError, match=r"the conversation is empty"):
        chat(engine, [[{"role": "user", "content": "hi"}], []])


def test_role_content_pairs_are_messages(engine):
    as_pairs = chat(engine, [("system", "Be brief."), ("user", "hi")])[0]
    as_dicts = chat(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])[
        0
    ]
    assert (
        as_pairs.prompt == as_dicts.prompt and as_pairs.outputs[0].token_ids == as_dicts.outputs[0].token_ids
    )
    assert as_pairs.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_a_message_of_another_shape_names_the_two_accepted_ones(engine):
    with pytest.raises(
        TypeError, match=r"message 1 is a str; a message is a dict .* or a \(role, content\) pair"
    ):
        chat(engine, [{"role": "user", "content": "hi"}, "hello"])


def test_a_role_the_template_does_not_know_is_refused(engine):
    with pytest.raises(
        ValueError, match=r"message 0 has role 'wizard', which the chat template .* does not know"
    ):
        chat(engine, [{"role": "wizard", "content": "hi"}])
    # A role the template names is known to it.
    out = chat(engine, [{"role": "narrator", "content": "Night falls."}], NARRATOR_TEMPLATE)[0]
    assert out.prompt == "* Night falls.\n"


def test_text_parts_are_joined_for_a_template_that_reads_a_string(engine):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = chat(engine, [{"role": "user", "content": parts}])[0]
    as_text = chat(engine, [{"role": "user", "content": "Hello\nthere"}])[0]
    assert as_parts.prompt == as_text.prompt
    assert as_parts.messages == [{"role": "user", "content": parts}]  # the output keeps what was given


def test_a_template_that_reads_parts_gets_them(engine):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert (
        chat(engine, [{"role": "user", "content": parts}], PARTS_TEMPLATE)[0].prompt == "user:[Hello][there]"
    )


def test_a_part_that_is_not_text_is_refused_clearly(engine):
    image = {"type": "image_url", "image_url": {"url": "http://example.invalid/cat.png"}}
    with pytest.raises(
        ValueError, match=r"message 0 has a content part of type 'image_url'; .* read text only"
    ):
        chat(engine, [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])


def test_every_chat_call_takes_the_same_options_and_names_a_misspelt_one(engine):
    messages = [("user", "hi")]
    with pytest.raises(TypeError, match=r"chat\(\) got an unexpected option 'chat_templat'; did you mean"):
        engine.chat(messages, SHORT, chat_templat=SMOL_TEMPLATE)
    with pytest.raises(TypeError, match=r"stream_chat\(\) got an unexpected option 'viewer'"):
        engine.stream_chat(messages, SHORT, viewer=True)  # a stream shows itself: no viewer
    streamed = list(engine.stream_chat(messages, SHORT, chat_template=SMOL_TEMPLATE, request_id="mine"))
    assert streamed[-1].request_id == "mine" and streamed[-1].finished
