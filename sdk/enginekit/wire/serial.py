"""msgpack encoding of the wire messages, with tensors carried as separate zero-copy frames.

A tensor field is encoded inline as ``[dtype, shape, frame_index]``; its bytes travel as frame
``frame_index`` of the same multipart message. Decoding is typed (msgspec Structs), so a malformed message
fails validation instead of producing surprising objects. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any, BinaryIO, TypeVar

import msgspec
import torch

__all__ = ["MsgpackDecoder", "MsgpackEncoder", "read_frame", "write_frame"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
MAX_TENSOR_DIMS = 8
_LENGTH_BYTES = 8
T = TypeVar("T")
_frombuffer_lock = threading.Lock()


class MsgpackEncoder:
    """Encode a Struct into ``[main, *tensor_frames]``; one encoder per socket, reused.

    NOTE: the tensor frames of the message being encoded are collected on the encoder itself, so one
    encoding must finish before the next starts: ``encode`` holds a lock, and several threads may share it.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Any] | None = None
        self._lock = threading.Lock()

    def encode(self, obj: Any) -> list[Any]:
        with self._lock:
            self._frames = [b""]
            try:
                self._frames[0] = self._encoder.encode(obj)
                return self._frames
            finally:
                self._frames = None

    def encode_into(self, obj: Any, buffer: bytearray) -> list[Any]:
        """Like ``encode`` but writes the main frame into a reusable buffer."""
        with self._lock:
            self._frames = [buffer]
            try:
                self._encoder.encode_into(obj, buffer)
                return self._frames
            finally:
                self._frames = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            assert self._frames is not None
            tensor = obj.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            dtype = _DTYPE_NAMES.get(tensor.dtype)
            if dtype is None:
                raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}")
            index = len(self._frames)
            # NOTE: the numpy view keeps the tensor alive until zmq has sent the frame (copy=False).
            self._frames.append(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")
            return [dtype, list(tensor.shape), index]
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


class MsgpackDecoder:
    """Typed decoder for one message type; tensors are rebuilt over the received frames without a copy, or
    copied out of them with ``copy_tensors=True``.

    NOTE: the front end copies: its tensors (logprobs) reach the user, who may write into them (a received
    frame is read-only memory) and drops them anywhere. A tensor over a zmq frame frees the frame when it dies,
    and pyzmq runs signal handlers there: a Ctrl-C landing in that destructor would be dropped.
    """

    def __init__(self, message_type: Any, *, copy_tensors: bool = False) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)
        self._copy_tensors = copy_tensors
        self._frames: Sequence[Any] = ()
        self._lock = threading.Lock()

    def decode(self, frames: Sequence[Any]) -> Any:
        """``frames[0]`` is the msgpack body, the rest are tensor buffers."""
        with self._lock:
            self._frames = frames
            try:
                return self._decoder.decode(_buffer(frames[0]))
            finally:
                self._frames = ()

    def _dec_hook(self, expected: type, obj: Any) -> Any:
        if expected is not torch.Tensor:
            raise TypeError(f"unexpected type {expected!r}")
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("a tensor must be encoded as [dtype, shape, frame]")
        dtype_name, shape, index = obj
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {dtype_name!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_TENSOR_DIMS
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ValueError(f"bad tensor shape {shape!r}")
        if not isinstance(index, int) or not 0 < index < len(self._frames):
            raise ValueError(f"tensor frame {index!r} is missing")
        buffer = _buffer(self._frames[index])
        numel = 1
        for dim in shape:
            numel *= dim
        expected_bytes = numel * torch.empty((), dtype=dtype).element_size()
        if len(buffer) != expected_bytes:
            raise ValueError(f"tensor frame has {len(buffer)} bytes, expected {expected_bytes}")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        # NOTE: received frames are read-only; torch warns about that, and we never write into them.
        with _frombuffer_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(buffer, dtype=dtype).view(shape)
        return tensor.clone() if self._copy_tensors else tensor


def write_frame(fd: int, message: Any) -> None:
    """Write one message to a pipe as ``[8-byte little-endian length][msgpack body]``."""
    payload = msgspec.msgpack.encode(message)
    data = memoryview(len(payload).to_bytes(_LENGTH_BYTES, "little") + payload)
    while data:
        data = data[os.write(fd, data) :]


def read_frame(stream: BinaryIO, message_type: type[T]) -> T:
    """Read one ``write_frame`` message from a binary stream; ``EOFError`` if it ends early."""
    header = stream.read(_LENGTH_BYTES)
    if len(header) != _LENGTH_BYTES:
        raise EOFError("the stream ended before a message")
    size = int.from_bytes(header, "little")
    payload = stream.read(size)
    if len(payload) != size:
        raise EOFError(f"the stream ended {size - len(payload)} bytes into a message")
    return msgspec.msgpack.decode(payload, type=message_type)


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame
