"""The fused decoder layer of weights kept as stored (``stored_layer.c``, ``DecoderLayer.fuse``): the same numbers
to the bit as the layer's pieces called one by one, on the architectures it runs (a q/k/v bias, a sliding window),
left out where the layer is not the plain one; and its boundary refuses bad input."""

from __future__ import annotations

import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from enginekit import Engine, SamplingParams
from enginekit.model.kernels.native import native_layer_ops, native_library
from enginekit.model.kernels.quant_gemm import random_blocks, row_bytes
from hf_checkpoints import build_checkpoint

pytestmark = pytest.mark.skipif(
    native_library() is None, reason="the native library cannot be built or loaded here"
)


def _generate(engine: Engine, batch: list[list[int]]):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in batch], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize(
    ("arch", "options", "fused"),
    [
        ("llama", {}, True),
        ("qwen2", {}, True),  # q/k/v bias
        ("mistral", {"sliding_window": 8}, True),  # a window on every layer
        ("qwen3", {}, False),  # q/k norms: not the plain layer
    ],
)
def test_fused_layers_give_the_pieces_numbers_to_the_bit(tmp_path, arch, options, fused):
    from hf_to_gguf import write_gguf_from_hf

    path = write_gguf_from_hf(build_checkpoint(tmp_path / arch, arch, **options), tmp_path / "m.gguf", Q.Q8_0)
    rng = random.Random(0)
    batch = [[rng.randrange(3, 200) for _ in range(length)] for length in (1, 5, 21, 40)]
    with Engine(
        str(path),
        mode="inproc",
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,  # both runs compute every prompt token, in the same steps
    ) as engine:
        model = engine.client.core.runner.model
        assert model.fused_layers == (len(model.layers) if fused else 0)
        with_fused = _generate(engine, batch)
        for layer in model.layers:
            layer.fused = None
        assert _generate(engine, batch) == with_fused


def _layer_inputs(rows: int = 2, size: int = 64, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    inter, block_size = 96, 4
    n_qkv = (heads + 2 * kv_heads) * dim
    weights = {
        "w_qkv": random_blocks(Q.Q8_0, n_qkv, size, gen),
        "w_o": random_blocks(Q.Q4_0, size, heads * dim, gen),
        "w_gate_up": random_blocks(Q.Q4_1, 2 * inter, size, gen),
        "w_down": random_blocks(Q.Q8_0, size, inter, gen),
    }
    types = {"t_qkv": Q.Q8_0, "t_o": Q.Q4_0, "t_gate_up": Q.Q4_1, "t_down": Q.Q8_0}
    arguments = {
        **weights,
        **{name: int(qtype) for name, qtype in types.items()},
        "norm1": torch.rand(size, generator=gen),
        "norm2": torch.rand(size, generator=gen),
        "eps": 1e-5,
        "b_qkv": None,
        "inter": inter,
        "heads": heads,
        "scale": dim**-0.5,
        "window": 0,
        "softcap": 0.0,
        "cos": torch.rand(rows, 1, dim, generator=gen),
        "signed_sin": torch.rand(rows, 1, dim, generator=gen),
        "slots": torch.tensor([2, 9]),
        "kv_cache": torch.zeros(2, 6 * block_size, kv_heads, dim),
        "block_tables": torch.tensor([[0, 1, 2], [3, 4, 5]]),
        "table_rows": None,
        "context_lens": torch.tensor([3, 10]),
        "block_size": block_size,
    }
    return torch.randn(rows, size, generator=gen), arguments


def test_the_fused_layer_refuses_bad_tables_weights_and_tensors() -> None:
    ops = native_layer_ops()
    hidden, arguments = _layer_inputs()
    ops.stored_layer(hidden.clone(), **arguments)

    def refuses(match: str, error: type[Exception] = ValueError, **changes) -> None:
        before = hidden.clone()
        with pytest.raises(error, match=match):
            ops.stored_layer(before, **(arguments | changes))
        assert torch.equal(before, hidden)  # nothing written

    refuses("slot", slots=torch.tensor([2, 24]))
    refuses("block id", block_tables=torch.tensor([[0, 1, 2], [3, 4, 6]]))
    refuses("longer", context_lens=torch.tensor([3, 13]))
    refuses("negative", context_lens=torch.tensor([-1, 3]))
    refuses("table row", table_rows=torch.tensor([0, 2]))
    # a weight's type that does not match its rows' bytes (Q4_0 rows given as Q8_0): refused before any read
    refuses("blocks", t_o=int(Q.Q8_0))
    assert row_bytes(Q.Q8_0, 64) != row_bytes(Q.Q4_0, 64)
    refuses("no kernel", t_down=int(Q.Q2_K))
    refuses("w_gate_up", w_gate_up=arguments["w_gate_up"][:-1])
    with pytest.raises(TypeError, match="float32"):
        ops.stored_layer(hidden.double(), **arguments)
    with pytest.raises(ValueError, match="contiguous"):
        ops.stored_layer(hidden.t().contiguous().t(), **arguments)
