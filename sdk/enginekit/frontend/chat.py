"""Chat: conversations rendered with the model's chat template and answered like prompts, as vLLM's ``LLM.chat``.

``ChatMixin`` gives ``Engine`` its chat methods — ``chat``, ``achat``, ``stream_chat``, ``astream_chat`` — each the
conversation-rendering front of its ``generate`` counterpart. The rendered text is tokenized without adding special
tokens (the template writes them), generation stops at the template's end-of-turn token, and each output keeps
its conversation (``RequestOutput.messages``, which the live viewer shows as turns).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from enginekit.frontend.prompts import normalize_params, vllm_names
from enginekit.model.loader import ModelSpec
from enginekit.model.text.chat_template import ChatTemplate
from enginekit.outputs import RequestOutput
from enginekit.sampling_params import SamplingParams

if TYPE_CHECKING:
    from enginekit.frontend.output_processor import RequestState
    from enginekit.frontend.output_router import OutputRouter

Params = SamplingParams | list[SamplingParams] | None


class ChatMixin:
    """The chat methods of ``Engine``; see the module docstring."""

    if TYPE_CHECKING:  # what the host, Engine, provides
        _spec: ModelSpec | None
        _router: OutputRouter
        _submit: Callable[..., list[RequestState]]
        _generate: Callable[..., list[RequestOutput]]
        _agenerate: Callable[..., Coroutine[Any, Any, list[RequestOutput]]]

    @vllm_names
    def chat(
        self,
        messages: Any,
        sampling_params: Params = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        viewer: Any = None,
        request_id: str | list[str] | None = None,
    ) -> list[RequestOutput]:
        """Answer a conversation (``[{"role": ..., "content": ...}, ...]``) or a list of them, like vLLM's ``LLM.chat``.

        The model's chat template renders each (or ``chat_template``, Jinja source); generation stops at the
        template's end-of-turn token. Raises ``ValueError`` if the model has no template and none is given.
        Other arguments as for ``generate``.
        """
        prompts, params, conversations = self._chat_inputs(
            messages, sampling_params, chat_template, add_generation_prompt
        )
        return self._generate(prompts, params, use_tqdm, viewer, request_id, conversations)

    @vllm_names
    def achat(
        self,
        messages: Any,
        sampling_params: Params = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        viewer: Any = None,
        request_id: str | list[str] | None = None,
    ) -> Coroutine[Any, Any, list[RequestOutput]]:
        """``chat`` for asyncio, as ``agenerate`` is to ``generate``: submits now, returns a coroutine to await."""
        prompts, params, conversations = self._chat_inputs(
            messages, sampling_params, chat_template, add_generation_prompt
        )
        return self._agenerate(prompts, params, use_tqdm, viewer, request_id, conversations)

    @vllm_names
    def stream_chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Stream the answer to one conversation, as ``stream`` does for a prompt."""
        prompts, params, conversations = self._chat_inputs(
            messages, sampling_params, chat_template, add_generation_prompt
        )
        return self._router.stream(*self._submit(prompts, params, "stream_chat", request_id, conversations))

    @vllm_names
    def astream_chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Async ``stream_chat``, as ``astream`` is to ``stream``."""
        prompts, params, conversations = self._chat_inputs(
            messages, sampling_params, chat_template, add_generation_prompt
        )
        return self._router.stream_async(
            *self._submit(prompts, params, "astream_chat", request_id, conversations)
        )

    def _chat_inputs(
        self, messages: Any, params: Any, chat_template: str | None, add_generation_prompt: bool
    ) -> tuple[list[dict[str, Any]], list[SamplingParams], list[list[dict[str, Any]]]]:
        spec = self._spec
        assert spec is not None  # the engine read it before it started
        template = _template(spec, chat_template)
        conversations = messages if _is_batch(messages) else [messages]
        prompts = []
        for conversation in conversations:
            text = template.render(conversation, add_generation_prompt=add_generation_prompt)
            # NOTE: the template writes the special tokens itself (a BOS too, if the model wants one).
            ids = spec.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        params = _stop_at_end_of_turn(spec, normalize_params(params, len(prompts)))
        return prompts, params, [[dict(message) for message in c] for c in conversations]


def _template(spec: ModelSpec, source: str | None) -> ChatTemplate:
    if source is not None:
        return ChatTemplate(source, bos_token=None, eos_token=None, origin="the chat_template argument")
    if spec.chat_template is None:
        raise ValueError(
            f"model {spec.source.name!r} has no chat template; pass chat_template='...' (Jinja source), "
            "or build the prompt yourself and call generate"
        )
    return spec.chat_template


def _stop_at_end_of_turn(spec: ModelSpec, params: list[SamplingParams]) -> list[SamplingParams]:
    """Stop at the template's end-of-turn token too, where it is not already an end-of-sequence token."""
    extra = tuple(i for i in spec.end_of_turn_token_ids if i not in spec.config.eos_token_ids)
    if not extra:
        return params
    return [
        p if p.ignore_eos else msgspec.structs.replace(p, stop_token_ids=p.stop_token_ids + extra)
        for p in params
    ]


def _is_batch(conversations: Any) -> bool:
    """A list of conversations (lists of messages), rather than one conversation."""
    return (
        isinstance(conversations, (list, tuple))
        and bool(conversations)
        and isinstance(conversations[0], (list, tuple))
    )
