"""The options of the generate and chat calls, declared once, and the one check every call runs on them.

Each entry point of ``Engine`` takes its prompts (or messages) and ``sampling_params`` positionally and the rest
as keyword options, typed by one of these ``TypedDict``s (``**options: Unpack[GenerateOptions]``). ``takes``
checks the names a call got: vLLM's spelling and ours (``params`` for ``sampling_params``, ``progress`` for
``use_tqdm``) are both accepted, giving both is a ``TypeError``, and an unknown name is a ``TypeError`` naming
the closest valid one.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

T = TypeVar("T")


class StreamOptions(TypedDict, total=False):
    """The options of ``stream`` and ``astream``."""

    request_id: str | None  # your id for the request (one is made up otherwise)
    lora_request: Any  # a LoRARequest: the LoRA adapter the request runs with (enable_lora)


class GenerateOptions(TypedDict, total=False):
    """The options of ``generate``, ``agenerate`` and ``generate_background``."""

    use_tqdm: bool | None  # a progress bar (None: for 16 prompts or more); alias ``progress``
    viewer: Any  # True or a Viewer: watch the requests live
    request_id: str | list[str] | None  # your ids, one per prompt
    lora_request: Any  # a LoRARequest for every prompt, or a list with one (or None) per prompt (enable_lora)


class ChatOptions(TypedDict, total=False):
    """What chat adds: how the conversation is rendered."""

    chat_template: str | None  # Jinja source instead of the model's own template
    add_generation_prompt: bool  # end with the template's opening of the assistant's turn (default True)
    chat_template_kwargs: (
        dict[str, Any] | None
    )  # more template variables: tools, enable_thinking, date_string


class ChatGenerateOptions(GenerateOptions, ChatOptions, total=False):
    """The options of ``chat`` and ``achat``."""


class ChatStreamOptions(StreamOptions, ChatOptions, total=False):
    """The options of ``stream_chat`` and ``astream_chat``."""


ALIASES = {"params": "sampling_params", "progress": "use_tqdm"}


def takes(options_type: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Check a call's keyword options against ``options_type`` (and ``sampling_params``) before it runs."""
    valid = {"sampling_params", *options_type.__required_keys__, *options_type.__optional_keys__}

    def decorate(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def checked(self: Any, *args: Any, **options: Any) -> T:
            for alias, name in ALIASES.items():
                if alias in options:
                    if name in options or (name == "sampling_params" and len(args) > 1):
                        raise TypeError(f"{method.__name__}() got both {name!r} and its alias {alias!r}")
                    options[name] = options.pop(alias)
            for name in options:
                if name not in valid:
                    close = difflib.get_close_matches(name, sorted(valid | set(ALIASES)), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise TypeError(f"{method.__name__}() got an unexpected option {name!r}{hint}")
            return method(self, *args, **options)

        return checked

    return decorate
