"""The padded, static-buffer decode path that CUDA graphs replay, run eagerly on CPU.

What a GPU adds (capture and replay) cannot run here; everything around it can: the padded shapes, the
scratch slot of the padding rows, the static buffers refilled in place, and the fallback to the eager path.
"""

import random

import pytest
import torch

from enginekit import Engine, SamplingParams
from enginekit.model.batch import SequenceChunk
from enginekit.model.decode_graph import batch_sizes, block_buckets
from hf_checkpoints import build_checkpoint

BLOCK = 4
MAX_SEQS = 12


def test_padded_shapes():
    assert batch_sizes(128) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128)
    assert batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100)
    assert batch_sizes(12) == (1, 2, 4, 8, 12)
    assert batch_sizes(3) == (1, 2, 3)
    assert batch_sizes(1) == (1,)
    assert block_buckets(1) == (1,)
    assert block_buckets(4) == (1, 2, 4)
    assert block_buckets(33) == (1, 2, 4, 8, 16, 32, 33)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A grouped-query model (4 heads, 2 KV heads), unlike the built-in one."""
    return str(build_checkpoint(tmp_path_factory.mktemp("graph-llama"), "llama"))


@pytest.fixture(scope="module", params=["builtin", "llama"])
def engines(request, tiny_llama):
    model = "builtin" if request.param == "builtin" else tiny_llama
    options = dict(
        mode="inproc", block_size=BLOCK, num_kv_blocks=256, max_num_seqs=MAX_SEQS, max_model_len=128
    )
    with Engine(model, **options) as eager, Engine(model, cuda_graphs=True, **options) as graphed:
        yield eager, graphed


def prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    # Lengths on both sides of block and bucket boundaries, so contexts cross 1, 2, 4, 8 and 16 blocks.
    return [
        {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]}
        for _ in range(count)
    ]


def token_ids(outputs) -> list[list[int]]:
    return [list(sample.token_ids) for output in outputs for sample in output.outputs]


@pytest.mark.parametrize("count", [1, 3, 5, 12])
def test_greedy_tokens_equal_the_eager_path(engines, count):
    eager, graphed = engines
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batch = prompts(count, seed=count)
    assert token_ids(graphed.generate(batch, params, progress=False)) == token_ids(
        eager.generate(batch, params, progress=False)
    )
    graphs = graphed.client.core.runner.decode_graphs
    used = set(graphs.steps)
    # Padded batches (5 -> 8, 3 -> 4) and several context buckets were used.
    assert {size for size, _ in used} <= set(batch_sizes(MAX_SEQS))
    assert len({blocks for _, blocks in used}) >= 2


def test_seeded_sampling_and_logprobs_equal_the_eager_path(engines):
    eager, graphed = engines
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=7, logprobs=2, n=2)
    batch = prompts(6, seed=99)
    expected = eager.generate(batch, params, progress=False)
    actual = graphed.generate(batch, params, progress=False)
    assert token_ids(actual) == token_ids(expected)
    for got, want in zip(actual, expected):
        for sample, reference in zip(got.outputs, want.outputs):
            for step, ref_step in zip(sample.logprobs, reference.logprobs):
                assert step.keys() == ref_step.keys()
                for token, logprob in step.items():
                    assert logprob.logprob == pytest.approx(ref_step[token].logprob, abs=1e-4)


def test_padding_rows_write_only_the_scratch_block(engines):
    eager, graphed = engines
    runner, core = graphed.client.core.runner, graphed.client.core
    num_blocks, slots = core.num_kv_blocks, core.num_kv_blocks * BLOCK
    assert runner.kv_caches[0].shape[1] == slots + BLOCK  # one block past the pool
    assert runner.decode_graphs.pad_slot == slots
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch = prompts(5, seed=5)  # 5 sequences decode padded to 8
    graphed.generate(batch, params, progress=False)
    eager.generate(batch, params, progress=False)
    # The cache blocks of real sequences hold the same keys and values as the eager engine's.
    used = core.kv_cache.pool.num_used_blocks * BLOCK
    eager_runner = eager.client.core.runner
    for graphed_cache, eager_cache in zip(runner.kv_caches, eager_runner.kv_caches):
        torch.testing.assert_close(graphed_cache[:, :used], eager_cache[:, :used], rtol=1e-4, atol=1e-5)
        assert graphed_cache[:, slots:].abs().sum() > 0  # the padding rows wrote their scratch slot
    assert all(block.block_id < num_blocks for block in core.kv_cache.pool.blocks)


def test_steps_that_are_not_pure_decodes_run_eagerly(engines):
    _eager, graphed = engines
    graphs = graphed.client.core.runner.decode_graphs
    graphs.steps.clear()
    # One token out: only the prefill step runs; it never takes the padded path.
    graphed.generate(prompts(3, seed=1), SamplingParams(max_tokens=1, temperature=0), progress=False)
    assert graphs.steps == {}
    decode = SequenceChunk([5], start=7, block_table=[0, 1], sampling_params=SamplingParams())
    assert graphs.accepts([decode])
    assert not graphs.accepts(
        [decode, SequenceChunk([5, 6], start=0, block_table=[2], sampling_params=SamplingParams())]
    )
    assert not graphs.accepts(
        [SequenceChunk([5], start=3, block_table=[0])]
    )  # a prompt chunk that does not sample
    assert not graphs.accepts([decode] * (MAX_SEQS + 1))
    assert not graphs.accepts([])
    embeds = SequenceChunk(
        [5], start=0, block_table=[0], sampling_params=SamplingParams(), prompt_embeds=torch.ones(1, 8)
    )
    assert not graphs.accepts([embeds])


def test_prompt_logprobs_and_prefix_hits_mix_with_padded_decodes(engines):
    eager, graphed = engines
    shared = list(range(10, 30))
    batch = [{"prompt_token_ids": [*shared, i]} for i in range(7)]
    params = SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1, ignore_eos=True)
    got, want = graphed.generate(batch, params, progress=False), eager.generate(batch, params, progress=False)
    assert token_ids(got) == token_ids(want)


def test_shapes_prepared_at_start_write_no_cache_block_and_stop_at_the_budget(engines):
    """``capture_at_start`` (what the engine runs on CUDA as it starts): every shape's padded step runs on padding
    rows only, so the cache's blocks keep what they hold; the shortest contexts come first, each from the largest
    batch; the budget ends it; then real steps refill the static buffers and give the eager engine's tokens."""
    eager, graphed = engines
    runner, core = graphed.client.core.runner, graphed.client.core
    graphs, slots = runner.decode_graphs, core.num_kv_blocks * BLOCK
    graphed.generate(prompts(4, seed=11), SamplingParams(max_tokens=6, temperature=0), progress=False)
    cached = [cache[:, :slots].clone() for cache in runner.kv_caches]
    graphs.steps.clear()
    ticks = iter(range(1000))
    count = graphs.capture_at_start(7.5, clock=lambda: float(next(ticks)))  # one tick a shape: 7 of them
    largest_first = tuple(reversed(graphs.batch_sizes))
    assert count == 7 and list(graphs.steps) == [(size, 1) for size in largest_first[:5]] + [
        (size, 2) for size in largest_first[:2]
    ]
    for step in graphs.steps.values():
        step()  # on CUDA the capture's warm-up runs it: the padded forward on what the buffers hold now
    for cache, before in zip(runner.kv_caches, cached):
        assert torch.equal(cache[:, :slots], before)
    assert graphs.capture_at_start(1000.0) == len(graphs.batch_sizes) * len(graphs.block_buckets)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    batch = prompts(5, seed=12)
    assert token_ids(graphed.generate(batch, params, progress=False)) == token_ids(
        eager.generate(batch, params, progress=False)
    )


def test_the_capture_budget_is_checked():
    with pytest.raises(ValueError, match="cuda_graph_capture_s must be zero or a positive number"):
        Engine("builtin", mode="inproc", cuda_graphs=True, cuda_graph_capture_s=-1)
    with pytest.raises(ValueError, match="cuda_graph_capture_s"):
        Engine("builtin", mode="inproc", cuda_graphs=True, cuda_graph_capture_s=float("nan"))


def test_penalties_token_controls_and_structured_outputs_equal_the_eager_path(engines):
    # the sampler runs on the graph's logits: every sampling option of a decode step works on the padded path
    from enginekit import StructuredOutputsParams

    eager, graphed = engines
    batch = prompts(4, seed=11)
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=16, temperature=0, logit_bias={7: 4.0}, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.8, seed=3, allowed_token_ids=list(range(40, 90))),
        SamplingParams(
            max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(regex="[0-9]{4,12}")
        ),
    ]
    graphs = graphed.client.core.runner.decode_graphs
    graphs.steps.clear()
    expected = eager.generate(batch, params, progress=False)
    actual = graphed.generate(batch, params, progress=False)
    assert token_ids(actual) == token_ids(expected)
    assert graphs.steps  # the decodes took the padded path
    assert all(40 <= t < 90 for t in actual[2].outputs[0].token_ids)
    assert actual[3].outputs[0].text.isdigit() and 4 <= len(actual[3].outputs[0].text) <= 12
