"""LoRARequest: which LoRA adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import msgspec

__all__ = ["LoRARequest"]


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """A LoRA adapter for a request: a peft folder (``adapter_config.json`` and ``adapter_model.safetensors``).

    Parameters
    ----------
    lora_name
        A name for the adapter, used in messages and shown in ``RequestOutput.lora_request``.
    lora_int_id
        A positive integer that identifies the adapter in the engine (``remove_lora``, ``pin_lora`` and
        ``list_loras`` use it). Requests with the same id run the same adapter, loaded once.
    lora_path
        The adapter's folder, as peft's ``save_pretrained`` writes it.

    Examples
    --------
    >>> from enginekit import Engine, LoRARequest
    >>> engine = Engine("path/to/base", enable_lora=True)  # doctest: +SKIP
    >>> engine.generate("Hi", lora_request=LoRARequest("pirate", 1, "adapters/pirate"))  # doctest: +SKIP
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"LoRARequest.lora_int_id must be a positive integer (it identifies adapter {self.lora_name!r} "
                f"in the engine), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise TypeError(
                f"LoRARequest.lora_path of adapter {self.lora_name!r} must be the adapter's folder as a string "
                f"(str(path) for a Path), got {self.lora_path!r}"
            )

    @property
    def adapter_id(self) -> int:
        """``lora_int_id`` (vLLM's alias)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """``lora_name`` (vLLM's alias)."""
        return self.lora_name

    @property
    def path(self) -> str:
        """``lora_path`` (vLLM's alias)."""
        return self.lora_path
