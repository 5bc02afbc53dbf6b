"""Each family's chat template (tests/chat_templates.py) renders as transformers' apply_chat_template does, and a
template that rejects a conversation gives its own message, in every mode."""

from __future__ import annotations

import asyncio
import json

import pytest

from chat_templates import FAMILIES, GEMMA_2, MISTRAL, NO_SYSTEM_ROLE
from enginekit import Engine, SamplingParams
from enginekit.model.text.chat_template import ChatTemplate
from hf_checkpoints import build_checkpoint
from test_chat_template import CONVERSATIONS, reference_render

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
THINKING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
]
DATE = {"date_string": "26 Jul 2024"}  # Llama 3's template prints today's date otherwise


def render_both(family: str, conversation, add_generation_prompt: bool = True, **kwargs) -> tuple[str, str]:
    source, bos, eos = FAMILIES[family]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render(
        conversation, add_generation_prompt=add_generation_prompt, **DATE, **kwargs
    )
    theirs = reference_render(
        source, conversation, add_generation_prompt=add_generation_prompt, bos=bos, eos=eos, **DATE, **kwargs
    )
    return ours, theirs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_each_family_renders_as_transformers(family, name, add_generation_prompt):
    conversation = CONVERSATIONS[name]
    if family in NO_SYSTEM_ROLE and conversation[0]["role"] == "system":  # both refuse it, with its message
        source, bos, eos = FAMILIES[family]
        with pytest.raises(Exception, match=NO_SYSTEM_ROLE[family]):
            reference_render(
                source, conversation, add_generation_prompt=add_generation_prompt, bos=bos, eos=eos
            )
        with pytest.raises(ValueError, match=NO_SYSTEM_ROLE[family]):
            ChatTemplate(source, bos_token=bos, eos_token=eos).render(conversation)
        return
    ours, theirs = render_both(family, conversation, add_generation_prompt)
    assert ours == theirs


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3", "mistral"])
def test_tools_render_as_transformers(family):
    ours, theirs = render_both(family, CONVERSATIONS["with system"], tools=TOOLS)
    assert ours == theirs
    assert "get_weather" in ours


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_thinking_renders_as_transformers(enable_thinking):
    ours, theirs = render_both("qwen3", THINKING, enable_thinking=enable_thinking)
    assert ours == theirs
    assert ("<think>\n\n</think>" in ours) is not enable_thinking


@pytest.mark.parametrize(
    ("family", "conversation", "message"),
    [
        (
            "mistral",
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "After the optional system message, conversation roles must alternate user/assistant",
        ),
        (
            "llama3",
            [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"function": {"name": "f", "arguments": {}}},
                        {"function": {"name": "g", "arguments": {}}},
                    ],
                },
            ],
            "This model only supports single tool-calls at once!",
        ),
    ],
)
def test_a_rejected_conversation_carries_the_templates_message(family, conversation, message):
    source, bos, eos = FAMILIES[family]
    with pytest.raises(ValueError, match=message):
        ChatTemplate(source, bos_token=bos, eos_token=eos).render(conversation)


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory):
    """A tiny Mistral checkpoint whose tokenizer_config.json carries Mistral's template."""
    path = build_checkpoint(tmp_path_factory.mktemp("mistral") / "m", "mistral")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": MISTRAL}))
    return path


@pytest.mark.parametrize("mode", ["inproc", "mp", "async"])
def test_the_templates_own_message_in_every_mode(mistral_folder, mode):
    good = CONVERSATIONS["multi-turn"]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    alternate = r"chat template from .*tokenizer_config.json.* failed: After the optional system message, conversation"
    with Engine(str(mistral_folder), mode=mode, num_kv_blocks=32, max_model_len=128) as engine:
        out = engine.chat(good, params)[0]
        assert out.prompt == reference_render(
            MISTRAL, good, add_generation_prompt=True, bos="<s>", eos="</s>"
        )
        with pytest.raises(ValueError, match=alternate):
            engine.chat(bad, params)
        with pytest.raises(ValueError, match=alternate):
            list(engine.stream_chat(bad, params))
        if mode == "async":

            async def achat():
                with pytest.raises(ValueError, match=alternate):
                    await engine.achat(bad, params)

            asyncio.run(achat())
        assert engine.chat(good, params)[0].prompt == out.prompt  # the engine still serves


def test_chat_passes_template_variables(tmp_path):
    from chat_templates import QWEN_3

    with Engine("builtin", mode="inproc", num_kv_blocks=64) as engine:
        params = SamplingParams(max_tokens=2, temperature=0)
        out = engine.chat(
            THINKING,
            params,
            chat_template=QWEN_3,
            chat_template_kwargs={"enable_thinking": False, "tools": TOOLS},
        )[0]
        expected = reference_render(
            QWEN_3,
            THINKING,
            add_generation_prompt=True,
            bos=None,
            eos=None,
            enable_thinking=False,
            tools=TOOLS,
        )
        assert out.prompt == expected and out.prompt.endswith("<think>\n\n</think>\n\n")
        with pytest.raises(TypeError, match="chat_template_kwargs must be a dict of template variables"):
            engine.chat(THINKING, params, chat_template=QWEN_3, chat_template_kwargs=["enable_thinking"])


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """A tiny Gemma 2 checkpoint whose tokenizer_config.json carries Gemma 2's template."""
    path = build_checkpoint(tmp_path_factory.mktemp("gemma2") / "g", "gemma2", sliding_window=8)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": GEMMA_2}))
    return path


@pytest.mark.parametrize("mode", ["inproc", "mp", "async"])
def test_gemmas_refusal_of_a_system_message_in_every_mode(gemma_folder, mode):
    with_system = CONVERSATIONS["with system"]
    params = SamplingParams(max_tokens=2, temperature=0)
    refused = r"chat template from .*tokenizer_config.json.* failed: System role not supported"
    with Engine(str(gemma_folder), mode=mode, num_kv_blocks=32, max_model_len=128) as engine:
        with pytest.raises(ValueError, match=refused):
            engine.chat(with_system, params)
        with pytest.raises(ValueError, match=refused):
            list(engine.stream_chat(with_system, params))
        if mode == "async":

            async def achat():
                with pytest.raises(ValueError, match=refused):
                    await engine.achat(with_system, params)

            asyncio.run(achat())
        out = engine.chat(CONVERSATIONS["one user turn"], params)[0]  # the engine still serves
        assert out.prompt == reference_render(
            GEMMA_2, CONVERSATIONS["one user turn"], add_generation_prompt=True, bos="<s>", eos="</s>"
        )


def test_an_image_for_gemma3s_template_is_refused():
    """Gemma 3's template writes <start_of_image> for an image part; the engine reads text only, so the part is
    refused before the template sees it (a Gemma3ForConditionalGeneration folder loads as its text model)."""
    from chat_templates import GEMMA_3

    image = {"type": "image", "url": "http://example.invalid/cat.png"}
    with Engine("builtin", mode="inproc", num_kv_blocks=64) as engine:
        params = SamplingParams(max_tokens=2, temperature=0)
        with pytest.raises(ValueError, match=r"content part of type 'image'; .* read text only"):
            engine.chat(
                [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
                params,
                chat_template=GEMMA_3,
            )
        text_only = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
        assert engine.chat(text_only, params, chat_template=GEMMA_3)[0].prompt.endswith(
            "Hi!<end_of_turn>\n<start_of_turn>model\n"
        )
