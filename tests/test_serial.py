"""msgpack wire encoding: typed, tensors as separate frames, zero-copy on receipt."""

import msgspec
import numpy
import pytest
import torch
import zmq

from enginekit import SamplingParams
from enginekit.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder


def roundtrip(obj, message_type):
    frames = MsgpackEncoder().encode(obj)
    return MsgpackDecoder(message_type).decode([bytes(memoryview(f)) for f in frames]), frames


def test_request_with_prompt_embeds_travels_as_a_separate_frame():
    embeds = torch.randn(5, 8)
    request = EngineCoreRequest("r1", [0] * 5, SamplingParams(max_tokens=3, stop=("x",)), 1.5, embeds)
    decoded, frames = roundtrip(request, EngineCoreRequest)
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == embeds.numel() * 4
    assert torch.equal(decoded.prompt_embeds, embeds)
    assert decoded.sampling_params == request.sampling_params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_tensor_dtypes_roundtrip(dtype):
    values = torch.randn(2, 3).to(dtype)
    output = EngineCoreOutputs([EngineCoreOutput("r", [1], logprob_values=values)])
    decoded, _ = roundtrip(output, EngineCoreOutputs)
    assert decoded.outputs[0].logprob_values.dtype == dtype
    assert torch.equal(decoded.outputs[0].logprob_values, values)


def test_outputs_roundtrip_with_finish_reason():
    output = EngineCoreOutputs([EngineCoreOutput("r", [4, 5], "hi", FinishReason.STOP, "END")])
    decoded, frames = roundtrip(output, EngineCoreOutputs)
    assert len(frames) == 1
    assert decoded.outputs[0].finish_reason is FinishReason.STOP and decoded.outputs[0].stop_reason == "END"


def received_over_zmq(frames):
    """Send ``frames`` over an in-process zmq pair; the frames as received (``copy=False``), still alive."""
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://serial-test")
        sender.connect("inproc://serial-test")
        sender.send_multipart(frames, copy=False)
        return receiver.recv_multipart(copy=False)
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_received_tensor_is_not_copied():
    embeds = torch.randn(64, 32)
    received = received_over_zmq(
        MsgpackEncoder().encode(EngineCoreRequest("r", [0] * 64, SamplingParams(), 0.0, embeds))
    )
    decoded = MsgpackDecoder(EngineCoreRequest).decode(received)
    frame_address = numpy.frombuffer(received[1].buffer, dtype=numpy.uint8).ctypes.data
    assert decoded.prompt_embeds.data_ptr() == frame_address  # a view of the received frame
    assert torch.equal(decoded.prompt_embeds, embeds)


def test_a_copying_decoder_gives_tensors_of_their_own():
    # The front end's decoder: its tensors reach the user, who may write into them and drop them anywhere.
    values = torch.randn(4, 3)
    received = received_over_zmq(
        MsgpackEncoder().encode(EngineCoreOutputs([EngineCoreOutput("r", [1], logprob_values=values)]))
    )
    decoded = MsgpackDecoder(EngineCoreOutputs, copy_tensors=True).decode(received).outputs[0].logprob_values
    frame = numpy.frombuffer(received[1].buffer, dtype=numpy.uint8)
    assert decoded.data_ptr() != frame.ctypes.data and torch.equal(decoded, values)
    decoded.add_(1.0)  # its own memory: the frame keeps the bytes it received
    assert torch.equal(torch.frombuffer(bytearray(frame.tobytes()), dtype=torch.float32).view(4, 3), values)


@pytest.mark.parametrize(
    "tensor_field",
    [
        ["float32", [2, 2], 5],  # missing frame
        ["complex64", [2], 1],  # unknown dtype
        ["float32", [3, 3], 1],  # wrong byte count
        ["float32", [-1], 1],  # bad shape
        "not a tensor",
    ],
)
def test_malformed_tensor_fields_fail_validation(tensor_field):
    body = msgspec.msgpack.encode(["r", [0], [], 0.0, tensor_field])
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        MsgpackDecoder(EngineCoreRequest).decode([body, b"\0" * 16])


def test_unknown_objects_are_never_encoded():
    with pytest.raises(TypeError, match="cannot encode object on the wire"):
        MsgpackEncoder().encode(EngineCoreOutputs([EngineCoreOutput("r", [1], stop_reason=object())]))
