"""Overlapped steps (``async_scheduling=True``) give what serial steps give: the same tokens, text, finish and stop
reasons, logprobs, structured outputs, preemptions and aborts, in every mode, on CPU too; and they really overlap:
a step is launched before the tokens of the step before it are applied, and its decodes read those tokens on the
device."""

from __future__ import annotations

import asyncio

import pytest

from enginekit import Engine, RequestOutputKind, SamplingParams, StructuredOutputsParams

MODES = ["inproc", "mp", "async"]
EOS = 2  # the built-in model's
PROMPTS = [f"prompt {i}: " + "the quick brown fox " * (i % 4) for i in range(12)]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=16, temperature=0.9, seed=5, n=2, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.4, frequency_penalty=0.5),
    SamplingParams(max_tokens=20, temperature=0, bad_words=["e", "th"], presence_penalty=1.0),
    # EOS pushed up: it ends these requests mid-batch, at different steps, after min_tokens
    SamplingParams(max_tokens=24, temperature=0, min_tokens=3, logit_bias={EOS: 6.0}),
    SamplingParams(max_tokens=24, temperature=0.7, seed=9, min_tokens=6, logit_bias={EOS: 4.0}),
    SamplingParams(max_tokens=24, temperature=0, stop=["o", "x "], include_stop_str_in_output=True),
    SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ord("C") + 3, ord("o") + 3]),
    SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(regex=r"[a-d]{2,7}")
    ),
    SamplingParams(
        max_tokens=30,
        temperature=0.8,
        seed=2,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    ),
    SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY),
]


def summary(outputs) -> list:
    return [
        [
            (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
                [{t: round(v.logprob, 3) for t, v in step.items()} for step in c.logprobs or []],
            )
            for c in o.outputs
        ]
        + [[e and {t: round(v.logprob, 3) for t, v in e.items()} for e in o.prompt_logprobs or []]]
        for o in outputs
    ]


def workload(engine) -> dict:
    streamed = list(engine.stream(PROMPTS[4], PARAMS[4]))
    return {
        "generate": summary(engine.generate(PROMPTS, PARAMS, progress=False)),
        "agenerate": summary(asyncio.run(engine.agenerate(PROMPTS[:6], PARAMS[:6], use_tqdm=False))),
        "stream": [*summary(streamed[-1:]), len(streamed) > 1],
    }


@pytest.fixture(scope="module")
def serial():
    with Engine("builtin", mode="inproc", async_scheduling=False) as engine:
        return workload(engine)


def test_the_workload_ends_requests_mid_batch_in_every_way(serial):
    reasons = {sample[2] for out in serial["generate"] for sample in out[:-1]}
    assert reasons == {"length", "stop"}
    eos_ended = serial["generate"][4][0]
    assert eos_ended[0][-1] == EOS and EOS not in eos_ended[0][:3] and len(eos_ended[0]) < 24
    assert serial["generate"][6][0][3] in ("o", "x ") and serial["generate"][7][0][3] is not None


@pytest.mark.parametrize("mode", MODES)
def test_overlapped_steps_give_the_serial_outputs(serial, mode):
    with Engine("builtin", mode=mode, async_scheduling=True) as engine:
        assert workload(engine) == serial


@pytest.mark.parametrize("overlap", [False, True])
def test_a_preempted_request_recomputes_to_the_same_output(overlap):
    prompts = [f"Request number {i} asks for a long answer" for i in range(6)]
    params = [
        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0.8, seed=4, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(
            max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{20,80}")
        ),
    ] * 2
    options = {"mode": "inproc", "async_scheduling": overlap}
    with Engine("builtin", num_kv_blocks=24, block_size=16, max_model_len=256, **options) as tight:
        squeezed = summary(tight.generate(prompts, params, progress=False))
        assert tight.get_stats()["num_preemptions"] > 0
    with Engine("builtin", mode="inproc", async_scheduling=False) as roomy:
        assert squeezed == summary(roomy.generate(prompts, params, progress=False))


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_ends_an_overlapped_request_and_frees_its_blocks(mode):
    with Engine("builtin", mode=mode, async_scheduling=True) as engine:
        params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
        stream = engine.stream("abort me", params, request_id="long")
        first = next(stream)
        assert first.outputs[0].token_ids
        engine.abort("long")
        last = list(stream)[-1]
        assert last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 2000
        stats = engine.call_utility("wait_idle")
        assert stats["num_running_requests"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        expected = engine.generate("abort me", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        got = last.outputs[0].token_ids[:8]
        assert expected[0].outputs[0].token_ids[: len(got)] == got


def test_a_step_is_launched_before_the_tokens_of_the_one_before_are_applied(monkeypatch):
    with Engine("builtin", mode="inproc", async_scheduling=True) as engine:
        core = engine.client.core
        events: list[str] = []
        forward_step, token = core.runner.forward_step, core.outputs.token

        def launched(batch):
            pending = [chunk.sampled_row for chunk in batch.chunks if chunk.sampled_row is not None]
            events.append(f"launch {len(pending)} pending")
            return forward_step(batch)

        def applied(request, sampled, row, status):
            events.append("token")
            return token(request, sampled, row, status)

        monkeypatch.setattr(core.runner, "forward_step", launched)
        monkeypatch.setattr(core.outputs, "token", applied)
        engine.generate("overlap", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    # the prefill, then each decode launched (its token read on the device) before the last token is applied;
    # the fourth token is the last (max_tokens): no step is launched for it
    assert events == [
        "launch 0 pending",
        "launch 1 pending",
        "token",
        "launch 1 pending",
        "token",
        "launch 1 pending",
        "token",
        "token",
    ]


def test_async_scheduling_is_off_by_default_on_cpu_and_refused_with_tensor_parallelism():
    with Engine("builtin", mode="inproc") as engine:
        assert engine.client.core.async_scheduling is False
    with pytest.raises(
        ValueError, match="async_scheduling=True cannot be used with tensor_parallel_size > 1"
    ):
        Engine("builtin", mode="mp", async_scheduling=True, tensor_parallel_size=2)
