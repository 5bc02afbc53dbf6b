"""Write a GGUF file from a Hugging Face checkpoint folder the way llama.cpp's converter (``convert_hf_to_gguf.py``)
lays one out, for the tests: the same weights in both formats, so the engine's tokens from the GGUF can be compared
with transformers' tokens from the folder.

What the converter does per architecture, as data (``FAMILIES``): the ``general.architecture`` it writes (Mistral
checkpoints become ``llama`` files), whether it interleaves the two rotary halves of each q/k head (``llama``), and
the metadata keys. Rope scaling: ``linear`` and ``yarn`` as ``{arch}.rope.scaling.*`` keys, ``llama3`` as the
tensor ``rope_freqs.weight`` (one divisor per frequency). Vectors are stored as F32, matrices in ``weight_type``.
Phi-3 (``phi3``): its fused ``attn_qkv`` and ``ffn_up`` (gate and up rows), and ``longrope`` as the tensors
``rope_factors_short.weight`` / ``rope_factors_long.weight`` with ``rope.scaling.attn_factor`` and
``original_context_length``. Gemma 2 (``gemma2``): norms stored as (1 + weight), its sandwich norms as
``post_attention_norm``, ``ffn_norm`` (before the MLP) and ``post_ffw_norm``, no ``output.weight`` (the head is the
embedding), and the ``attn_logit_softcapping``, ``final_logit_softcapping`` and ``attention.sliding_window`` keys.
Gemma 3 (``gemma3``): also q/k norms, ``rope.freq_base_swa`` (the sliding layers' base) and the final
soft-capping when set; ``Gemma3ForConditionalGeneration`` as its text model alone.
The tokenizer (the byte-level BPE of ``hf_checkpoints``) goes in as ``gpt2`` tokens
and merges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

Q = GGMLQuantizationType


class Family(NamedTuple):
    gguf_arch: str  # general.architecture
    permute_qk: bool  # llama.cpp's rotary order of q/k rows
    renames: tuple[tuple[str, str], ...] = ()  # applied before RENAMES
    norm_plus_one: bool = False  # norms stored as (1 + weight), and the head always tied (Gemma)


# Gemma 2: its four norms per layer; ffn_norm is the one before the MLP
GEMMA_NORMS = (
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
)


FAMILIES = {
    "LlamaForCausalLM": Family("llama", True),
    "MistralForCausalLM": Family("llama", True),
    "Qwen2ForCausalLM": Family("qwen2", False),
    "Qwen3ForCausalLM": Family("qwen3", False),
    "Phi3ForCausalLM": Family("phi3", False),
    "Gemma2ForCausalLM": Family("gemma2", False, GEMMA_NORMS, norm_plus_one=True),
    "Gemma3ForCausalLM": Family("gemma3", False, GEMMA_NORMS, norm_plus_one=True),
    # its text model: the converter reads text_config over the outer config, drops the vision tower and projector
    # (another file, the mmproj, holds them) and the language_model. prefix
    "Gemma3ForConditionalGeneration": Family("gemma3", False, GEMMA_NORMS, norm_plus_one=True),
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.", ""),
)
RENAMES = (
    ("model.embed_tokens.", "token_embd."),
    ("model.norm.", "output_norm."),
    ("lm_head.", "output."),
    ("model.layers.", "blk."),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.qkv_proj", "attn_qkv"),  # Phi-3's fused projections
    ("mlp.gate_up_proj", "ffn_up"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
)


def gguf_tensor_name(hf_name: str, family: Family) -> str:
    for old, new in family.renames + RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def interleave_rotary_halves(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a Llama q/k projection's rows: each head's two rotary halves interleaved."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
    )


def llama3_freq_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """The ``llama3`` rope scaling as one divisor of each inverse frequency (``rope_freqs.weight``)."""
    base = rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_gguf_from_hf(folder: Path, path: Path, weight_type: GGMLQuantizationType = Q.F32) -> Path:
    """Convert the checkpoint ``folder`` (``hf_checkpoints.build_checkpoint``) into the GGUF file ``path``."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    family = FAMILIES[config["architectures"][0]]
    config = {**config, **config.get("text_config", {})}
    arch = family.gguf_arch
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope_by_layer_type = config.get("rope_parameters") or {}
    rope = rope_by_layer_type.get("full_attention", rope_by_layer_type)  # Gemma 3: the global layers'
    writer = GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if arch != "gemma2":  # Gemma2Model writes its own keys, no rope base (llama.cpp reads 10000)
        writer.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in rope_by_layer_type:  # the sliding layers' base, as TextModel writes it
        writer.add_float32(
            f"{arch}.rope.freq_base_swa", rope_by_layer_type["sliding_attention"]["rope_theta"]
        )
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family.permute_qk or arch == "phi3":  # Phi-4-mini: the rotated part of each head
        partial = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get(
            "partial_rotary_factor", 1.0
        )
        writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // heads)
    if arch == "phi3":  # longrope: the factors are tensors, the rest these keys
        writer.add_uint32(f"{arch}.attention.sliding_window", config.get("sliding_window") or 0)
        original = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
    else:
        _add_rope_scaling(writer, arch, rope)
    if arch == "gemma2":  # its soft-capping, always
        writer.add_float32(f"{arch}.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    if arch == "gemma3" and config.get("final_logit_softcapping"):  # only when set
        writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    # the window (llama.cpp spreads it over the layers in Gemma's pattern); Gemma 3 without one when every
    # layer attends fully (sliding_window_pattern 1)
    if arch == "gemma2" or (arch == "gemma3" and config.get("sliding_window_pattern") != 1):
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    _add_tokenizer(writer, folder, config)

    weights = load_file(folder / "model.safetensors")
    if config.get("tie_word_embeddings") or family.norm_plus_one:
        weights.pop("lm_head.weight", None)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_freq_divisors(rope, head_dim))
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", attn_factor if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for hf_name, tensor in weights.items():
        if hf_name.startswith(VISION_PREFIXES):
            continue
        for old, new in TEXT_PREFIXES:
            if hf_name.startswith(old):
                hf_name = new + hf_name[len(old) :]
                break
        name = gguf_tensor_name(hf_name, family)
        if family.permute_qk and (".attn_q." in name or ".attn_k." in name):
            tensor = interleave_rotary_halves(tensor, heads if ".attn_q." in name else kv_heads)
        if family.norm_plus_one and name.endswith("norm.weight"):
            tensor = tensor + 1
        values = tensor.float().numpy()
        quant_type = Q.F32 if values.ndim == 1 else weight_type
        data = quantize(values, quant_type)
        writer.add_tensor(name, data, raw_dtype=quant_type if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_rope_scaling(writer: GGUFWriter, arch: str, rope: dict) -> None:
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    elif kind == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        writer.add_uint32(
            f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"]
        )
        for key, name in (
            ("attention_factor", "yarn_attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if rope.get(key) is not None:
                writer.add_float32(f"{arch}.rope.scaling.{name}", rope[key])
    elif kind not in ("default", "llama3"):  # llama3: the tensor rope_freqs.weight
        raise ValueError(f"this converter does not write rope type {kind!r}")


def _add_tokenizer(writer: GGUFWriter, folder: Path, config: dict) -> None:
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = {config["bos_token_id"], config["eos_token_id"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
