"""The sampler runs where the logits are, and a step copies back only its ids and the logprobs asked for.

The device is stood in for by torch's ``meta`` device, which has shapes but no values: any read of a value on the
host (``tolist``, ``item``, ``cpu``, a branch on a tensor) raises, and ``DeviceGuard`` fails any operation that mixes
a meta tensor with a host tensor of more than one value, as CUDA refuses it. The one way back to the host,
``transfer.to_host``, is replaced by a counting stand-in that hands back zeros of the right shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from enginekit import Engine, SamplingParams
from enginekit.model import transfer
from enginekit.model.batch import ScheduledBatch, SequenceChunk, TokenBitmask
from enginekit.model.sampler import Sampler
from hf_checkpoints import build_checkpoint

META = torch.device("meta")


class DeviceGuard(TorchFunctionMode):
    """Record every operation that mixes the device (meta) with host tensors holding more than one value."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if t.device.type == "meta" or t.numel() > 1}
        if len(devices) > 1:
            self.mixed.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """Replace ``transfer.to_host``: count the values asked for, hand back zeros on the host."""
    copied: list[int] = []

    def to_host(tensors, copy_stream=None):
        copied.append(sum(t.numel() for t in tensors))
        return transfer.HostCopy(tuple(torch.zeros(t.shape, dtype=t.dtype) for t in tensors))

    monkeypatch.setattr(transfer, "to_host", to_host)
    return copied


@pytest.fixture(scope="module")
def runner():
    with Engine("builtin", mode="inproc") as engine:
        yield engine.client.core.runner


def every_feature(vocab: int) -> ScheduledBatch:
    """A step that uses every sampling feature, and a prompt chunk whose logprobs are wanted."""
    history = ([5, 6, 7, 8, 9, 9], 3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=0.7, logit_bias={4: 3.0, 11: -2.0}, allowed_token_ids=[3, 4, 11, 12]),
        SamplingParams(temperature=0, bad_words=("xy",), min_tokens=4, stop_token_ids=[7]),
    ]
    chunks = [
        SequenceChunk([9], 5, [0], sampling_params=p, history=history if p.has_penalties else None)
        for p in params
    ]
    chunks[4].bad_words, chunks[4].history = [[8, 9], [13]], history
    chunks[4].banned_stop_ids = (7, 2)
    prompt = SequenceChunk([1, 2, 3, 4], 0, [1], prompt_logprobs=2, prompt_targets=[2, 3, 4])
    words = (vocab + 31) // 32
    bits = torch.full((2, words), -1, dtype=torch.int32)
    bits[1, 0] = 0b1010
    return ScheduledBatch([*chunks, prompt], 2, TokenBitmask([0, 4], bits))


@pytest.mark.parametrize("vocab", [300, 5000])
def test_every_feature_samples_on_the_device_and_copies_back_o_rows_times_k(
    runner, counted, monkeypatch, vocab
):
    monkeypatch.setattr(runner.sampler, "generator", lambda device: None)  # meta has no generators
    batch = every_feature(vocab)
    logits = torch.empty(5 + 3, vocab, device=META)  # 5 sampled rows, then the prompt chunk's 3 scored rows
    guard = DeviceGuard()
    with guard:
        output = runner._sample(batch, logits, {5: slice(5, 8)})
    assert guard.mixed == []
    assert len(output.token_ids) == 5 and output.logprob_values.shape == (5, 4)
    assert output.prompt_logprobs[5][0].shape == (3, 3)
    # the ids, 3 x 5 x (1 + 3) sampled logprobs and 3 x 3 x (1 + 2) prompt logprobs: never the vocabulary
    assert counted == [5 + 3 * 5 * 4 + 3 * 3 * 3]


def test_the_sampler_alone_reads_nothing_on_the_host_but_its_result(counted):
    sampler = Sampler(seed=0)
    logits = torch.empty(3, 1000, device=META)
    guard = DeviceGuard()
    with guard:
        out = sampler(logits, [SamplingParams(temperature=0, logprobs=2)] * 3, [None] * 3)
    assert guard.mixed == [] and counted == [3 + 3 * 3 * 3] and out.token_ids == [0, 0, 0]


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return [build_checkpoint(root / f"v{size}", "llama", vocab_size=size) for size in (400, 6000)]


def test_a_steps_host_copy_does_not_grow_with_the_vocabulary(vocabularies, counted):
    prompts = [{"prompt_token_ids": [3 + i, 40, 41, 42 + i]} for i in range(4)]
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(max_tokens=6, temperature=0.7, ignore_eos=True, logit_bias={50: 2.0}),
    ]
    per_model = []
    for path in vocabularies:
        counted.clear()
        with Engine(str(path), mode="inproc", num_kv_blocks=64) as engine:
            assert engine.client.core.model_config.vocab_size in (400, 6000)
            engine.generate(prompts, params, progress=False)
        per_model.append(list(counted))
    assert per_model[0] == per_model[1]
    # per step: 4 ids and 4 x 3 logprob rows of three tensors, and once the prompt's 3 rows x 2 of three tensors
    assert max(per_model[0]) <= 4 + 4 * 3 * 3 + 3 * 2 * 3 and len(per_model[0]) == 6
