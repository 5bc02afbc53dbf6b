"""The fused decoder layer of weights kept as stored (``stored_layer.c``, ``DecoderLayer.fuse``): the same numbers
to the bit as the layer's pieces called one by one, on the architectures it runs (a q/k/v bias, a sliding window,
Phi-3's fused tensors), left out where the layer is not the plain one; and its boundary refuses bad input. A Phi-3
file's fused tensors are kept as stored and score its greedy tokens as the file dequantized does."""

from __future__ import annotations

import random

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from enginekit import Engine, SamplingParams
from enginekit.client.inproc import InprocClient
from enginekit.model.decoder import Decoder, DecoderLayer
from enginekit.model.formats.gguf import read_gguf_config
from enginekit.model.formats.gguf_header import read_gguf_header
from enginekit.model.kernels.native import native_layer_ops, native_library
from enginekit.model.kernels.quant_gemm import random_blocks, row_bytes
from enginekit.model.layers.linear import Linear
from enginekit.model.layers.quant_linear import StoredWeight
from enginekit.model.stored import stored_tensor_names
from hf_checkpoints import build_checkpoint

pytestmark = pytest.mark.skipif(
    native_library() is None, reason="the native library cannot be built or loaded here"
)


def _model(engine: Engine) -> Decoder:
    assert isinstance(engine.client, InprocClient)
    return engine.client.core.runner.model


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
        ("phi3", {"sliding_window": 8}, True),  # q/k/v and gate/up each one tensor in the file
        ("phi3", {"partial_rotary_factor": 0.75}, True),  # Phi-4-mini: q/k rows reordered at load
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
        model = _model(engine)
        assert model.fused_layers == (len(model.layers) if fused else 0)
        with_fused = _generate(engine, batch)
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.fused = None
        assert _generate(engine, batch) == with_fused


# test_quant_quality's bounds on a token's log-likelihood as stored against the file dequantized
LIMIT_NATS, WORST_NATS = 0.03, 0.5


def _engine(path, quantization: str, chunk: int = 32) -> Engine:
    return Engine(
        str(path),
        mode="inproc",
        quantization=quantization,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )


def _scores(engine: Engine, sequences: list[list[int]], start: list[int]) -> list[float]:
    """Each sequence's log-likelihood of its tokens from ``start`` on."""
    outputs = engine.generate(
        [{"prompt_token_ids": ids} for ids in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    scores = []
    for out, ids, first in zip(outputs, sequences, start):
        assert out.prompt_logprobs is not None
        for i in range(first, len(ids)):
            candidates = out.prompt_logprobs[i]
            assert candidates is not None
            scores.append(candidates[ids[i]].logprob)
    return scores


def _stored_part(model: Decoder, name: str) -> StoredWeight:
    """The one part of the weight kept as stored of the linear layer ``name``."""
    linear = model.get_submodule(name)
    assert isinstance(linear, Linear) and linear.stored is not None
    (part,) = linear.stored.parts
    return part


@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
@pytest.mark.parametrize("options", [{}, {"partial_rotary_factor": 0.75}], ids=["phi3", "phi4-mini"])
def test_a_phi3_file_keeps_its_fused_tensors_as_stored(tmp_path, weight_type, options):
    """Phi-3 stores q/k/v as one tensor (``attn_qkv``) and gate/up as one (``ffn_up``, gate rows first, as our
    ``gate_up_proj``): ``"auto"`` keeps both as stored, ``ffn_up`` as the file's own bytes (``attn_qkv`` too, but
    for Phi-4-mini, whose q/k rows are reordered: a copy of whole rows), and its layers run fused. The greedy
    tokens of the file dequantized (``"none"``) score as they score there, within test_quant_quality's bounds (a
    product of the wrong rows moves them by whole nats); comparing the tokens themselves would fail at a near tie,
    which the int8 and bf16 inputs can round either way."""
    from hf_to_gguf import write_gguf_from_hf

    path = write_gguf_from_hf(
        build_checkpoint(tmp_path / "phi3", "phi3", **options), tmp_path / "m.gguf", weight_type
    )
    header = read_gguf_header(path)
    config = read_gguf_config(header)
    keep = stored_tensor_names(header, config, torch.device("cpu"), torch.float32, "auto")
    fused = {f"blk.{i}.{name}.weight" for i in range(config.num_layers) for name in ("attn_qkv", "ffn_up")}
    assert fused <= keep
    rng = random.Random(0)
    batch = [[rng.randrange(3, 200) for _ in range(length)] for length in (1, 7, 33)]
    with _engine(path, "none") as engine:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        sequences = [
            ids + out.outputs[0].token_ids for ids, out in zip(batch, engine.generate(batch, params))
        ]
        start = [len(ids) for ids in batch]
        expected = _scores(engine, sequences, start)
    with _engine(path, "auto", chunk=4) as engine:  # chunks of 4 rows: the decode steps' kernels
        model = _model(engine)
        file_start = _stored_part(model, "layers.0.mlp.down_proj").blocks.untyped_storage().data_ptr()
        for i in range(config.num_layers):
            qkv = _stored_part(model, f"layers.{i}.self_attn.qkv_proj")
            gate_up = _stored_part(model, f"layers.{i}.mlp.gate_up_proj")
            assert qkv.quant_type == gate_up.quant_type == weight_type
            assert gate_up.blocks.data_ptr() == file_start + header.tensors[f"blk.{i}.ffn_up.weight"].offset
            qkv_in_file = (
                qkv.blocks.data_ptr() == file_start + header.tensors[f"blk.{i}.attn_qkv.weight"].offset
            )
            assert qkv_in_file == (config.rotary_dims == config.head_dim)
        assert model.fused_layers == len(model.layers)
        got = _scores(engine, sequences, start)
    deviations = [abs(a - b) for a, b in zip(got, expected)]
    mean = sum(deviations) / len(deviations)
    assert mean <= LIMIT_NATS and max(deviations) < WORST_NATS, f"mean {mean:.4f}, max {max(deviations):.4f}"


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
    assert ops is not None
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
    refuses("no such path", path=99)
    refuses("path must be from", path=2**31)
    with pytest.raises(TypeError, match="float32"):
        ops.stored_layer(hidden.double(), **arguments)
    with pytest.raises(ValueError, match="contiguous"):
        ops.stored_layer(hidden.t().contiguous().t(), **arguments)
