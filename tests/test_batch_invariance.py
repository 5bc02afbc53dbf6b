"""``batch_invariant=True``: a greedy request gives the same tokens and logprobs alone and inside batches of other
sizes and kinds (constrained requests, a long prompt prefilled in chunks beside its decodes, sixteen at once), on
the default GGUF model with its weights as stored (``quantization="auto"``) and on a float32 checkpoint, in-process
and in a background process.

Without the option a step's row count picks the kernels (the int8 or bf16 product, the skinny GEMM or oneDNN,
native attention or SDPA), and the probe's logprobs move in their last bits from one batch to the next (its tokens
too, at a near tie: on the default model at its sixth token beside two constrained requests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from enginekit import Engine, EngineConfig, SamplingParams, StructuredOutputsParams
from enginekit.model.kernels.native import native_layer_ops
from hf_checkpoints import build_checkpoint

pytestmark = pytest.mark.skipif(native_layer_ops() is None, reason="needs the native kernels")

PROBE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CONSTRAINED = SamplingParams(
    max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{8,40}")
)
# a step of at most this many tokens: the long prompt is prefilled in chunks, beside the other requests' decodes
STEP_TOKENS = 256


def _batches(long_prompt: list[int], short: list[list[int]], probe: list[int]) -> dict[str, tuple]:
    """Each batch the probe goes into: its prompts, their parameters, and the probe's place among them."""
    return {
        "alone": ([probe], [PROBE], 0),
        "beside two constrained requests": ([*short[:2], probe], [CONSTRAINED, CONSTRAINED, PROBE], 2),
        "sixteen at once": ([*short[:15], probe], [SHORT] * 15 + [PROBE], 15),
        # the long prompt's chunks take the first steps' budget: the probe's prefill waits, then runs beside them
        "after a long prompt": ([long_prompt, *short[:3], probe], [SHORT] * 4 + [PROBE], 4),
        # the probe decodes while the long prompt's chunks are prefilled (past 512 tokens: SDPA without the option)
        "before a long prompt": ([probe, *short[3:6], long_prompt], [PROBE] + [SHORT] * 4, 0),
    }


def _probe_outputs(engine: Engine, prompts: list, params: list, place: int) -> tuple[list[int], list[tuple]]:
    """The probe's tokens and its logprobs (each step's top tokens with their values, exactly)."""
    output = engine.generate(prompts, params, progress=False)[place].outputs[0]
    logprobs = [tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in output.logprobs or []]
    return output.token_ids, logprobs


def _check(engine: Engine, long_prompt: list[int], short: list[list[int]], probe: list[int]) -> None:
    runs = {
        name: _probe_outputs(engine, *batch) for name, batch in _batches(long_prompt, short, probe).items()
    }
    alone = runs.pop("alone")
    assert len(alone[0]) == PROBE.max_tokens and len(alone[1]) == PROBE.max_tokens
    differing = [name for name, outputs in runs.items() if outputs != alone]
    assert differing == [], f"the probe's tokens or logprobs changed {', '.join(differing)}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("invariant")
    return {
        # weights of 2**19 elements (oneDNN's threshold), and room for a prompt past 512 tokens (SDPA's)
        "llama": build_checkpoint(
            folder / "llama",
            "llama",
            hidden_size=512,
            intermediate_size=1024,
            num_heads=8,
            num_kv_heads=2,
            max_position_embeddings=2048,
        ),
        # GeLU-tanh over 200 features (torch's vector loop leaves a tail), soft-capped scores and logits
        "gemma2": build_checkpoint(
            folder / "gemma2",
            "gemma2",
            hidden_size=256,
            intermediate_size=200,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=2048,
        ),
    }


@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_the_default_model_as_stored_gives_a_request_the_same_tokens_in_any_batch(mode: str) -> None:
    with Engine(
        mode=mode, batch_invariant=True, max_num_batched_tokens=STEP_TOKENS, max_model_len=2048
    ) as engine:
        encode = engine.get_tokenizer().encode
        probe = encode("Tell me a short story about a robot who learns to paint.")
        short = [encode(f"Question {i}: what is {i} plus {i + 3}? Answer:") for i in range(15)]
        long_prompt = encode(
            " ".join(f"Line {i} of a long document about rivers and mountains." for i in range(60))
        )
        assert len(long_prompt) > 512
        _check(engine, long_prompt, short, probe)


@pytest.mark.parametrize(("arch", "mode"), [("llama", "inproc"), ("llama", "mp"), ("gemma2", "inproc")])
def test_a_float32_checkpoint_gives_a_request_the_same_tokens_in_any_batch(
    checkpoints: dict[str, Path], arch: str, mode: str
) -> None:
    with Engine(
        str(checkpoints[arch]),
        mode=mode,
        batch_invariant=True,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=2048,
    ) as engine:
        vocab = engine.get_tokenizer().vocab_size
        probe = [(7 * i + 3) % vocab for i in range(20)]
        short = [[(13 * i + j) % vocab for j in range(5 + i)] for i in range(15)]
        long_prompt = [(31 * i + 11) % vocab for i in range(700)]
        _check(engine, long_prompt, short, probe)


def test_the_option_is_refused_where_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="batch_invariant=True runs on CPU in float32 only"):
        EngineConfig(batch_invariant=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU in float32 only"):
        EngineConfig(batch_invariant=True, device="cuda")
    with pytest.raises(ValueError, match="at most two tensor-parallel ranks"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=3)
