"""Hostile frames on a real engine process's input socket are logged and dropped; the engine keeps serving.

The frames go through the front end's own input socket to a running engine process: random bytes, truncated
msgpack, unknown request types, wrong field types, malformed tensor fields, pickles and oversized frames. After
every batch a probe request must still produce exactly its reference tokens, a request that was running
meanwhile is unaffected, and every hostile message shows up in the engine's log as dropped (or, when it is
well formed but carries values the engine cannot serve, as a rejected request). Nothing is unpickled.
"""

import logging
import os
import pathlib
import pickle
import threading

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enginekit import Engine, SamplingParams
from enginekit.client.mp import ENGINE_IDENTITY
from enginekit.core.messages import EngineCoreRequest, RequestType, ShutdownRequest, UtilityRequest
from enginekit.core.serial import MsgpackDecoder, MsgpackEncoder

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PROBE_PROMPT = "still serving?"
PROBE_PARAMS = SamplingParams(max_tokens=6, temperature=0)
VALID_TYPES = {t.value for t in RequestType}
DECODERS = {
    RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
    RequestType.ABORT: MsgpackDecoder(list[str]),
    RequestType.UTILITY: MsgpackDecoder(UtilityRequest),
    RequestType.SHUTDOWN: MsgpackDecoder(ShutdownRequest),
}
HIDDEN_SIZE = 128  # the built-in model's


class EngineLog(logging.Handler):
    """Collects the engine process's log lines, which the front end forwards to its own logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def count(self, *needles: str) -> int:
        return sum(any(needle in line for needle in needles) for line in list(self.lines))

    def wait_for(self, *needles: str, count: int, timeout: float = 10.0) -> int:
        with self.changed:
            self.changed.wait_for(lambda: self.count(*needles) >= count, timeout)
        return self.count(*needles)


class Target:
    def __init__(self, engine: Engine, log: EngineLog) -> None:
        self.engine = engine
        self.log = log
        self.reference = self.probe()

    def probe(self) -> list[int]:
        return self.engine.generate(PROBE_PROMPT, PROBE_PARAMS)[0].outputs[0].token_ids

    def send(self, frames: list[bytes]) -> None:
        client = self.engine.client
        with client._send_lock:
            client.input_socket.send_multipart([ENGINE_IDENTITY, *frames])

    def attack(self, messages: list[list[bytes]], *, rejected: int = 0) -> None:
        """Send hostile messages, then check the engine logged each one and still serves correctly."""
        dropped_before = self.log.count("dropped a")
        rejected_before = self.log.count("rejected request")
        for frames in messages:
            self.send(frames)
        assert self.probe() == self.reference
        assert self.engine.client.process.is_alive()
        num_dropped = len(messages) - rejected
        dropped = self.log.wait_for("dropped a", count=dropped_before + num_dropped) - dropped_before
        assert dropped == num_dropped, self.log.lines[-5:]
        if rejected:
            seen = self.log.wait_for("rejected request", count=rejected_before + rejected) - rejected_before
            assert seen == rejected, self.log.lines[-5:]


BYSTANDER_PARAMS = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    log = EngineLog()
    logger = logging.getLogger("enginekit.engine_process")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)
    engine = Engine(mode="mp")
    try:
        target = Target(engine, log)
        # A long request runs while the fuzzers attack; the last test checks that nothing disturbed it.
        target.bystander_expected = engine.generate("bystander", BYSTANDER_PARAMS)[0].outputs[0].token_ids
        target.bystander = threading.Thread(
            target=lambda: setattr(
                target, "bystander_output", engine.generate("bystander", BYSTANDER_PARAMS)[0]
            )
        )
        target.bystander.start()
        yield target
        target.bystander.join(120)
    finally:
        engine.shutdown()
        logger.removeHandler(log)
        logger.setLevel(level)


def decodes(frames: list[bytes]) -> bool:
    """Whether the engine would accept this message as a request (the fuzzers send only ones it must drop)."""
    try:
        request_type = RequestType(frames[0])
    except ValueError:
        return False
    if request_type is RequestType.WAKEUP:
        return len(frames) == 1
    if request_type is RequestType.EXECUTOR_FAILED or len(frames) < 2:
        return False
    try:
        DECODERS[request_type].decode(frames[1:])
    except Exception:
        return False
    return True


def valid_messages() -> dict[RequestType, list[bytes]]:
    params = SamplingParams(max_tokens=3, temperature=0.5, stop=("x",), seed=3)
    encoder = MsgpackEncoder()
    return {
        RequestType.ADD: encoder.encode(EngineCoreRequest("fuzz", [1, 2, 3], params, 1.0)),
        RequestType.ABORT: encoder.encode(["fuzz"]),
        RequestType.UTILITY: encoder.encode(UtilityRequest(0, 999_999, "ping", [])),
        RequestType.SHUTDOWN: encoder.encode(ShutdownRequest(0.0)),
    }


VALID = {kind: [kind.value, *(bytes(f) for f in frames)] for kind, frames in valid_messages().items()}
INT64 = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
msgpack_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
request_types = st.sampled_from(sorted(VALID_TYPES))
messages_of = lambda message: st.lists(message, min_size=1, max_size=4)  # noqa: E731


@st.composite
def random_bytes(draw):
    first = draw(request_types | st.binary(max_size=4))
    return [first, *draw(st.lists(st.binary(max_size=64), max_size=3))]


@st.composite
def truncated_msgpack(draw):
    kind, body = draw(st.sampled_from([message[:2] for message in VALID.values()]))
    return [kind, body[: draw(st.integers(0, len(body) - 1))]]


@st.composite
def unknown_type(draw):
    kind = draw(st.binary(max_size=8).filter(lambda b: b not in VALID_TYPES))
    body = draw(st.sampled_from(list(VALID.values())))[1:]
    return [kind, *body]


@st.composite
def wrong_field_types(draw):
    kind = draw(st.sampled_from([RequestType.ADD, RequestType.UTILITY, RequestType.SHUTDOWN]))
    fields = msgspec.msgpack.decode(VALID[kind][1])
    path = [draw(st.integers(0, len(fields)))]  # one past the end appends an extra field
    target = fields
    if (
        path[0] < len(fields)
        and isinstance(fields[path[0]], list)
        and fields[path[0]]
        and draw(st.booleans())
    ):
        target = fields[path[0]]  # a nested field (sampling params, token ids)
        path.append(draw(st.integers(0, len(target) - 1)))
    value = draw(msgspec_values_not_like(target[path[-1]] if path[-1] < len(target) else None))
    if path[-1] < len(target):
        target[path[-1]] = value
    else:
        target.append(value)
    return [kind.value, msgspec.msgpack.encode(fields)]


def msgspec_values_not_like(original):
    return msgpack_values.filter(lambda value: type(value) is not type(original))


@st.composite
def bad_tensor_fields(draw):
    dtype = draw(st.sampled_from(["float32", "int64", "bool"]) | st.text(max_size=10) | INT64)
    shape = draw(st.lists(st.integers(-4, 2**64 - 1), max_size=10) | st.just([[2], [3]]) | INT64 | st.none())
    index = draw(st.integers(-2, 5) | st.text(max_size=2) | st.none())
    extra = draw(st.lists(st.binary(max_size=48), max_size=3))
    tensor = draw(st.sampled_from([[dtype, shape, index], [dtype, shape], "tensor", 7]))
    fields = [*msgspec.msgpack.decode(VALID[RequestType.ADD][1])[:4], tensor]  # prompt_embeds is 5th
    return [RequestType.ADD.value, msgspec.msgpack.encode(fields), *extra]


def dropped(strategy):
    return messages_of(strategy).filter(lambda messages: not any(decodes(m) for m in messages))


@FUZZ
@given(messages=dropped(random_bytes()))
def test_random_bytes(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=dropped(truncated_msgpack()))
def test_truncated_msgpack(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=dropped(unknown_type()))
def test_unknown_request_types(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=dropped(wrong_field_types()))
def test_wrong_field_types(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=dropped(bad_tensor_fields()))
def test_malformed_tensor_fields(target, messages):
    target.attack(messages)


def test_internal_request_types_are_refused_from_the_socket(target):
    # EXECUTOR_FAILED would stop the engine if the socket could send it; WAKEUP takes no body.
    target.attack([[RequestType.EXECUTOR_FAILED.value, b"\x90"], [RequestType.WAKEUP.value, b"\x90"]])


def test_well_typed_requests_the_engine_cannot_serve_are_rejected(target):
    params = SamplingParams(max_tokens=3)
    encoder = MsgpackEncoder()
    requests = [
        EngineCoreRequest("out-of-vocabulary", [10**9], params),
        EngineCoreRequest("negative-token", [-1], params),
        EngineCoreRequest("past-int64", [2**63 + 1], params),
        EngineCoreRequest("empty-prompt", [], params),
        EngineCoreRequest("too-long", [5] * 100_000, params),
        EngineCoreRequest("embeds-width", [0, 0], params, prompt_embeds=torch.zeros(2, 7)),
        EngineCoreRequest("embeds-rows", [0, 0, 0], params, prompt_embeds=torch.zeros(2, HIDDEN_SIZE)),
        EngineCoreRequest("embeds-flat", [0, 0], params, prompt_embeds=torch.zeros(2 * HIDDEN_SIZE)),
    ]
    messages = [[RequestType.ADD.value, *(bytes(f) for f in encoder.encode(r))] for r in requests]
    target.attack(messages, rejected=len(messages))


class Touch:
    """Unpickling this creates ``path``: proof that something was unpickled."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_pickle_payloads_are_never_unpickled(target, tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Touch(marker), protocol=pickle.HIGHEST_PROTOCOL)
    embeds = [
        RequestType.ADD.value,
        msgspec.msgpack.encode(["p", [0], [], 0.0, ["float32", [1], 1]]),
        payload,
    ]
    messages = [[kind, payload] for kind in sorted(VALID_TYPES - {RequestType.WAKEUP.value})]
    messages += [[payload], [payload, payload], embeds]
    target.attack(messages)
    assert not marker.exists()
    # The payload is armed: unpickling it here does create its marker.
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Touch(control)))
    assert control.exists()


def test_oversized_frames(target):
    huge = os.urandom(32 * 2**20)
    claims_4g_items = b"\xdd\xff\xff\xff\xff"  # a msgpack array header announcing 2**32 - 1 elements
    add = RequestType.ADD.value
    target.attack(
        [
            [add, huge],
            [RequestType.UTILITY.value, claims_4g_items],
            [add, b"\x9f" + claims_4g_items * 8],
            [add, msgspec.msgpack.encode(["big", [1], [], 0.0, ["float32", [2**31, 2**31], 1]]), huge],
            [huge[:1024], *([b"x"] * 10_000)],
        ]
    )


def test_a_request_running_during_the_attacks_is_unaffected(target):
    target.bystander.join(120)
    assert not target.bystander.is_alive()
    completion = target.bystander_output.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.token_ids == target.bystander_expected
