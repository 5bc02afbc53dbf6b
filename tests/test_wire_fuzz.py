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
from enginekit.wire.messages import (
    AbortRequest,
    EngineCoreRequest,
    EngineRequest,
    ShutdownRequest,
    UtilityRequest,
    WakeupRequest,
    engine_identity,
)
from enginekit.wire.serial import MsgpackDecoder, MsgpackEncoder
from process_support import HANG_GUARD_S

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PROBE_PROMPT = "still serving?"
PROBE_PARAMS = SamplingParams(max_tokens=6, temperature=0)
VALID_TAGS = {"add", "abort", "utility", "shutdown", "wakeup"}
DECODER = MsgpackDecoder(EngineRequest)
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

    def wait_for(self, *needles: str, count: int, timeout: float = HANG_GUARD_S) -> int:
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
            client.sockets.input.send_multipart([engine_identity(0), *frames])

    def attack(self, messages: list[list[bytes]], *, rejected: int | None = None) -> None:
        """Send hostile messages, then check the engine logged each one and still serves correctly.

        An ADD that cannot be decoded but names its request id is rejected (answered with an error under
        that id); anything else is dropped.
        """
        if rejected is None:
            assert all(classify(frames) != "accepted" for frames in messages)
            rejected = sum(classify(frames) == "rejected" for frames in messages)
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
    engine = Engine("builtin", mode="mp")
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


def classify(frames: list[bytes]) -> str:
    """What the engine does with a message: "accepted", "rejected" (an undecodable ADD with an id), "dropped"."""
    try:
        DECODER.decode(frames)
        return "accepted"
    except Exception:
        pass
    try:
        raw = msgspec.msgpack.decode(frames[0])
    except Exception:
        return "dropped"
    if isinstance(raw, list) and len(raw) >= 2 and raw[0] == "add" and isinstance(raw[1], str):
        return "rejected"
    return "dropped"


def valid_messages() -> dict[str, list[bytes]]:
    params = SamplingParams(max_tokens=3, temperature=0.5, stop=("x",), seed=3)
    encoder = MsgpackEncoder()
    return {
        "add": encoder.encode(EngineCoreRequest("fuzz", [1, 2, 3], params, 1.0)),
        "abort": encoder.encode(AbortRequest(["fuzz"])),
        "utility": encoder.encode(UtilityRequest(999_999, "ping", [])),
        "shutdown": encoder.encode(ShutdownRequest(0.0)),
        "wakeup": encoder.encode(WakeupRequest()),
    }


VALID = {tag: [bytes(f) for f in frames] for tag, frames in valid_messages().items()}
INT64 = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
msgpack_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
messages_of = lambda message: st.lists(message, min_size=1, max_size=4)  # noqa: E731


@st.composite
def random_bytes(draw):
    return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))


@st.composite
def truncated_msgpack(draw):
    body = draw(st.sampled_from([message[0] for message in VALID.values()]))
    return [body[: draw(st.integers(0, len(body) - 1))]]


@st.composite
def unknown_tag(draw):
    fields = msgspec.msgpack.decode(draw(st.sampled_from(list(VALID.values())))[0])
    fields[0] = draw(msgpack_values.filter(lambda tag: not (isinstance(tag, str) and tag in VALID_TAGS)))
    return [msgspec.msgpack.encode(fields)]


@st.composite
def wrong_field_types(draw):
    tag = draw(st.sampled_from(["add", "utility", "shutdown", "abort"]))
    fields = msgspec.msgpack.decode(VALID[tag][0])
    path = [draw(st.integers(1, len(fields)))]  # one past the end appends an extra field
    target = fields
    if (
        path[0] < len(fields)
        and isinstance(fields[path[0]], list)
        and fields[path[0]]
        and draw(st.booleans())
    ):
        target = fields[path[0]]  # a nested field (sampling params, token ids, request ids)
        path.append(draw(st.integers(0, len(target) - 1)))
    value = draw(msgspec_values_not_like(target[path[-1]] if path[-1] < len(target) else None))
    if path[-1] < len(target):
        target[path[-1]] = value
    else:
        target.append(value)
    return [msgspec.msgpack.encode(fields)]


def msgspec_values_not_like(original):
    return msgpack_values.filter(lambda value: type(value) is not type(original))


@st.composite
def bad_tensor_fields(draw):
    dtype = draw(st.sampled_from(["float32", "int64", "bool"]) | st.text(max_size=10) | INT64)
    shape = draw(st.lists(st.integers(-4, 2**64 - 1), max_size=10) | st.just([[2], [3]]) | INT64 | st.none())
    index = draw(st.integers(-2, 5) | st.text(max_size=2) | st.none())
    extra = draw(st.lists(st.binary(max_size=48), max_size=3))
    tensor = draw(st.sampled_from([[dtype, shape, index], [dtype, shape], "tensor", 7]))
    fields = [*msgspec.msgpack.decode(VALID["add"][0])[:5], tensor]  # prompt_embeds is the 6th field
    return [msgspec.msgpack.encode(fields), *extra]


def hostile(strategy):
    """Lists of messages the engine cannot accept as they are (it must drop or reject each)."""
    return messages_of(strategy).filter(lambda messages: all(classify(m) != "accepted" for m in messages))


@FUZZ
@given(messages=hostile(random_bytes()))
def test_random_bytes(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=hostile(truncated_msgpack()))
def test_truncated_msgpack(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=hostile(unknown_tag()))
def test_unknown_message_tags(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=hostile(wrong_field_types()))
def test_wrong_field_types(target, messages):
    target.attack(messages)


@FUZZ
@given(messages=hostile(bad_tensor_fields()))
def test_malformed_tensor_fields(target, messages):
    target.attack(messages)


def test_internal_messages_are_refused_from_the_socket(target):
    # ExecutorFailed would stop the engine and InvalidRequest answer for another id, if the socket could send
    # them; they exist only inside the engine process.
    target.attack(
        [
            [msgspec.msgpack.encode(["executor_failed", "from a rogue"])],
            [msgspec.msgpack.encode(["invalid", "x", ["ValueError", "no"]])],
        ]
    )


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
    messages = [[bytes(f) for f in encoder.encode(r)] for r in requests]
    target.attack(messages, rejected=len(messages))


def test_adds_that_cannot_be_decoded_are_answered_under_their_id(target):
    # Bad sampling values, as the facade would refuse them: the engine refuses them under the request's id.
    fields = msgspec.msgpack.decode(VALID["add"][0])
    messages = []
    for index, value in (
        (3, 2.0),
        (1, True),
        (7, "no"),
        (0, True),
    ):  # top_k, temperature, ignore_eos, max_tokens
        bad = [*fields[:3], list(fields[3]), *fields[4:]]
        bad[3][index] = value
        bad[1] = f"bad-params-{index}"
        messages.append([msgspec.msgpack.encode(bad)])
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
    embeds = [msgspec.msgpack.encode(["add", "p", [0], [], 0.0, ["float32", [1], 1]]), payload]
    messages = [[payload], [payload, payload], embeds]
    messages += [[msgspec.msgpack.encode([tag, payload])] for tag in sorted(VALID_TAGS)]
    target.attack(messages)
    assert not marker.exists()
    # The payload is armed: unpickling it here does create its marker.
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Touch(control)))
    assert control.exists()


def test_oversized_frames(target):
    huge = os.urandom(32 * 2**20)
    claims_4g_items = b"\xdd\xff\xff\xff\xff"  # a msgpack array header announcing 2**32 - 1 elements
    target.attack(
        [
            [huge],
            [b"\xdd\xff\xff\xff\xff"],
            [b"\x9f" + claims_4g_items * 8],
            [msgspec.msgpack.encode(["add", "big", [1], [], 0.0, ["float32", [2**31, 2**31], 1]]), huge],
            [huge[:1024], *([b"x"] * 10_000)],
        ]
    )


def test_a_request_running_during_the_attacks_is_unaffected(target):
    target.bystander.join(120)
    assert not target.bystander.is_alive()
    completion = target.bystander_output.outputs[0]
    assert completion.finish_reason == "length"
    assert completion.token_ids == target.bystander_expected
