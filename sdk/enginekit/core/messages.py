"""Every message between the front end and the engine core, as msgspec Structs.

In-process mode passes these objects directly; the background process sends them as msgpack (array-like,
defaults omitted) with tensors in separate zero-copy frames (see ``core/serial.py``).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import torch

from enginekit.sampling_params import SamplingParams


class RequestType(bytes, enum.Enum):
    """First frame of every front end -> engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    WAKEUP = b"\x03"  # NOTE: sent to wake a loop blocked on input_queue.get (e.g. from a signal handler)
    EXECUTOR_FAILED = b"\x04"
    SHUTDOWN = b"\x05"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    prompt_embeds: torch.Tensor | None = None
    client_index: int = 0


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    client_index: int
    call_id: int
    method_name: str
    args: list[Any]


class ShutdownRequest(msgspec.Struct, array_like=True, gc=False):
    timeout: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: a delta, not the cumulative output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # [num_new_tokens, k + 1] log-probabilities and token ids: the sampled token first, then the top k.
    logprob_values: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    utility_output: UtilityOutput | None = None
    timestamp: float = 0.0
    engine_index: int = 0


class ReadyMessage(msgspec.Struct, array_like=True, gc=False):
    """The engine process's handshake: sent once, after the model and KV cache are ready."""

    status: str
    max_model_len: int
    num_gpu_blocks: int
    kv_cache_size_tokens: int
    block_size: int
    pid: int
    device: str
    secret: bytes = b""


# NOTE: a single frame with this content means the engine process is dying; never a valid msgpack message
# that a real EngineCoreOutputs could encode to.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
