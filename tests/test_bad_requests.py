"""Every bad request fails with the same exception and message in every mode, by every path.

Through the facade it is refused before anything is sent. As a raw message — bypassing the facade's checks —
the engine core refuses it under its request id, and the caller waiting for that id gets the same exception
(in the background modes the message crosses the socket: sampling values the facade would never build are
written as msgpack by hand).
"""

import msgspec
import pytest
import torch

from enginekit import Engine, SamplingParams
from enginekit.frontend.output_processor import RequestState
from enginekit.wire.messages import EngineCoreRequest

MODES = ["inproc", "mp", "async"]
MAX_MODEL_LEN = 64
HIDDEN = 128  # the built-in model's
GREEDY = SamplingParams(max_tokens=4, temperature=0)
NAN_EMBEDS = torch.zeros(2, HIDDEN).index_fill_(0, torch.tensor([1]), float("nan"))
INF_EMBEDS = torch.zeros(2, HIDDEN).index_fill_(0, torch.tensor([0]), float("inf"))

# (case, facade prompt, raw prompt token ids, raw prompt embeds, exception, message)
BAD_PROMPTS = [
    (
        "out of vocabulary",
        [5, 10**6],
        [5, 10**6],
        None,
        ValueError,
        r"token id 1000000 is outside the vocabulary \(size 259\)",
    ),
    (
        "negative token id",
        [5, -1],
        [5, -1],
        None,
        ValueError,
        r"token ids must be non-negative integers, got -1",
    ),
    ("empty prompt", {"prompt_token_ids": []}, [], None, ValueError, r"^prompt has no tokens$"),
    (
        "prompt too long",
        [5] * MAX_MODEL_LEN,
        [5] * MAX_MODEL_LEN,
        None,
        ValueError,
        rf"prompt is {MAX_MODEL_LEN} tokens long; the longest allowed is {MAX_MODEL_LEN - 1}",
    ),
    (
        "prompt_embeds of the wrong width",
        {"prompt_embeds": torch.zeros(2, 7)},
        [0, 0],
        torch.zeros(2, 7),
        ValueError,
        rf"prompt_embeds must be a \[2, {HIDDEN}\] tensor, got \[2, 7\]",
    ),
    (
        "NaN prompt_embeds",
        {"prompt_embeds": NAN_EMBEDS},
        [0, 0],
        NAN_EMBEDS,
        ValueError,
        r"prompt_embeds must hold finite values; row 1 holds nan or inf",
    ),
    (
        "inf prompt_embeds",
        {"prompt_embeds": INF_EMBEDS},
        [0, 0],
        INF_EMBEDS,
        ValueError,
        r"prompt_embeds must hold finite values; row 0 holds nan or inf",
    ),
]

# (case, sampling option, bad value, exception, message): what SamplingParams itself raises.
BAD_SAMPLING = [
    ("float top_k", "top_k", 2.0, TypeError, r"SamplingParams.top_k must be an integer, got 2.0 \(float\)"),
    (
        "bool temperature",
        "temperature",
        True,
        TypeError,
        r"SamplingParams.temperature must be a number, got True",
    ),
    (
        "bool max_tokens",
        "max_tokens",
        True,
        TypeError,
        r"SamplingParams.max_tokens must be an integer, got True",
    ),
    (
        "string ignore_eos",
        "ignore_eos",
        "no",
        TypeError,
        r"SamplingParams.ignore_eos must be True or False, got 'no'",
    ),
    ("top_p out of range", "top_p", 1.5, ValueError, r"SamplingParams.top_p must be in \(0, 1\], got 1.5"),
]


@pytest.fixture(scope="module", params=MODES)
def engine(request):
    with Engine("builtin", mode=request.param, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64) as engine:
        yield engine


def wait_for_raw(engine, request_id: str) -> None:
    """Track ``request_id`` as the facade would and wait for its outcome (which raises its error)."""
    state = RequestState(request_id, None, [], SamplingParams())
    engine._router.track(state)
    engine._router.wait([state])


def send_raw_add(engine, fields: list) -> None:
    """Send an ADD written field by field (the facade could not build it) on the engine's input socket."""
    client = engine.client
    with client._send_lock:
        client.sockets.input.send_multipart([client._engine(None).identity, msgspec.msgpack.encode(fields)])


@pytest.mark.parametrize(("case", "prompt", "token_ids", "embeds", "exception", "message"), BAD_PROMPTS)
def test_a_bad_prompt_fails_the_same_way_through_the_facade(
    engine, case, prompt, token_ids, embeds, exception, message
):
    with pytest.raises(exception, match=message):
        engine.generate(prompt, GREEDY)
    assert engine.call_utility("get_request_ids") == []  # nothing was sent


@pytest.mark.parametrize(("case", "prompt", "token_ids", "embeds", "exception", "message"), BAD_PROMPTS)
def test_a_bad_prompt_fails_the_same_way_as_a_raw_message(
    engine, case, prompt, token_ids, embeds, exception, message
):
    request_id = f"raw {case}"
    engine.client.add_request(EngineCoreRequest(request_id, token_ids, GREEDY, 0.0, embeds))
    with pytest.raises(exception, match=message):
        wait_for_raw(engine, request_id)
    assert engine.generate("still serving", GREEDY)[0].finished


@pytest.mark.parametrize(("case", "option", "value", "exception", "message"), BAD_SAMPLING)
def test_bad_sampling_options_fail_the_same_way_by_every_path(
    engine, case, option, value, exception, message
):
    with pytest.raises(exception, match=message):
        SamplingParams(**{option: value})
    if engine.mode == "inproc":
        return  # no socket: a SamplingParams object is the only way in, and it cannot be built bad
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreRequest(f"raw {case}", [5, 6], GREEDY)))
    fields[3][SamplingParams.__struct_fields__.index(option)] = value
    send_raw_add(engine, fields)
    with pytest.raises(exception, match=message):
        wait_for_raw(engine, f"raw {case}")
    assert engine.generate("still serving", GREEDY)[0].finished


def test_an_add_the_engine_cannot_decode_is_answered_not_dropped(engine):
    if engine.mode == "inproc":
        pytest.skip("no socket in-process")
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreRequest("raw floats", [5, 6], GREEDY)))
    fields[2] = [5.5, 6.5]  # token ids that are not integers
    send_raw_add(engine, fields)
    with pytest.raises(ValueError, match=r"malformed request: Expected `int`, got `float`"):
        wait_for_raw(engine, "raw floats")
