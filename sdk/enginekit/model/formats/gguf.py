"""A GGUF model (llama.cpp's format): its config from the metadata, its weights in Hugging Face layout.

Each tensor is either dequantized with ``gguf.quants.dequantize``, one at a time, so the peak memory is the output
plus one float32 tensor, or kept as the file stores it (``StoredTensor``: a uint8 view of the file mapped
read-only, no copy). The header itself is parsed by :mod:`enginekit.model.formats.gguf_header`.
"""

from __future__ import annotations

import functools
import warnings
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from enginekit.model.architectures import ARCHITECTURES, Architecture, by_gguf_name, by_name
from enginekit.model.config import ModelConfig
from enginekit.model.formats.gguf_header import GGUFHeader, GGUFTensorInfo, gguf_error, read_gguf_header

# ``general.architecture`` values we read (llama.cpp's converter writes Mistral checkpoints as ``llama``)
SUPPORTED_ARCHITECTURES = tuple(name for a in ARCHITECTURES for name in a.gguf_names)
# ``{arch}.rope.scaling.type`` values and the rope type each stands for (``architectures.ROPE_TYPES``)
_GGUF_ROPE_SCALING = {"none": "default", "linear": "linear", "yarn": "yarn"}


class StoredTensor(NamedTuple):
    """A GGUF tensor kept as the file stores it: its rows of blocks, viewed in the read-only map of the file."""

    name: str  # its GGUF name
    blocks: torch.Tensor  # uint8 [rows, row_bytes], a view of the file's bytes (read-only: never write to it)
    quant_type: GGMLQuantizationType
    shape: tuple[int, ...]  # [rows, in_features] as the values, torch order
    offset: int  # of its first byte in the file
    rotary_heads: int  # its rows carry llama.cpp's rotary permutation over this many heads (0: none)


def read_gguf_config(source: Path | GGUFHeader) -> ModelConfig:
    """The architecture numbers of a GGUF model, from its metadata.

    Parameters
    ----------
    source
        The ``.gguf`` file (or its parsed header); ``general.architecture`` must be in ``SUPPORTED_ARCHITECTURES``.

    Raises
    ------
    EngineStartupError
        The file is unreadable, of an unsupported architecture or rope scaling, or lacks a metadata key.
    """
    header = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    meta = header.metadata
    arch = _required(header, "general.architecture")
    spec = by_gguf_name(arch)
    if spec is None:
        raise gguf_error(
            header.path,
            f"unsupported architecture {arch!r}; supported: "
            + ", ".join(
                f"{name} (Llama and Mistral files)" if name == "llama" else name
                for name in SUPPORTED_ARCHITECTURES
            ),
        )
    num_heads = _required_int(header, f"{arch}.attention.head_count")
    hidden_size = _required_int(header, f"{arch}.embedding_length")
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden_size // num_heads  # as llama.cpp reads it
    value_dim = meta.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise gguf_error(
            header.path, f"unsupported value heads of {value_dim} dims for key heads of {head_dim}"
        )
    rotary_dims = _rotary_dims(header, arch, spec, head_dim)
    rope_type, rope_parameters, freq_factors, short_factors, long_factors = _rope(header, arch, rotary_dims)
    max_positions = _required_int(header, f"{arch}.context_length")
    num_layers = _required_int(header, f"{arch}.block_count")
    layer_windows = _layer_windows(header, arch, spec, num_layers)
    eos_ids = (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
    attention_scale = 0.0  # see Architecture.gguf_hidden_scale_layers
    if spec.gguf_hidden_scale_layers and num_layers == spec.gguf_hidden_scale_layers:
        attention_scale = (hidden_size // num_heads) ** -0.5
    rope_theta = _float32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    local_theta = _local_rope_theta(header, arch, spec, rope_theta, rope_type) if layer_windows else 0.0
    return ModelConfig(
        architecture=spec.name,
        vocab_size=_vocab_size(header, arch),
        hidden_size=hidden_size,
        intermediate_size=_required_int(header, f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        layer_windows=layer_windows,
        hidden_act=spec.gguf_activation,
        norm_plus_one=spec.norm_plus_one,
        sandwich_norms=spec.sandwich_norms,
        scale_embeddings=spec.scale_embeddings,
        attention_scale=attention_scale,
        attn_logit_softcap=_float32(
            meta.get(f"{arch}.attn_logit_softcapping", spec.gguf_default_attn_softcap)
        ),
        final_logit_softcap=_float32(
            meta.get(f"{arch}.final_logit_softcapping", spec.gguf_default_final_softcap)
        ),
        num_heads=num_heads,
        num_kv_heads=_required_int(header, f"{arch}.attention.head_count_kv", default=num_heads),
        head_dim=head_dim,
        rms_norm_eps=_float32(_required(header, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rotary_dim=rotary_dims if rotary_dims != head_dim else 0,
        rope_local_theta=local_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias=spec.attention_bias or "blk.0.attn_q.bias" in header.tensors,
        qk_norm=spec.qk_norm,
        rope_type=rope_type,
        rope_parameters=rope_parameters,
        rope_freq_factors=freq_factors,
        rope_short_factors=short_factors,
        rope_long_factors=long_factors,
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
    )


def read_gguf_weights(
    source: Path | GGUFHeader,
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    keep: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor | StoredTensor]:
    """Dequantize a GGUF model's weights into Hugging Face checkpoint names and shapes (some kept as stored).

    Parameters
    ----------
    source
        The ``.gguf`` file, or its parsed header.
    config
        Its config, from :func:`read_gguf_config`; it says which tensors to expect and their shapes.
    dtype
        The dtype of the returned tensors.
    keep
        GGUF names of the tensors to keep as stored: each comes back as a ``StoredTensor`` (a view of the file
        mapped read-only, its rows still in llama.cpp's rotary order where ``rotary_heads`` says so).

    Returns
    -------
    dict[str, torch.Tensor | StoredTensor]
        ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ... ``lm_head.weight``
        (absent when tied), with llama.cpp's rotary permutation of q and k undone where the architecture's
        converter applies it (``Architecture.gguf_rotary_permuted``: ``llama``).

    Raises
    ------
    EngineStartupError
        A tensor is missing, of the wrong shape, or stored in a type ``gguf`` cannot dequantize; every tensor
        is checked before any is dequantized.
    """
    header = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    plan = _weight_plan(config)
    _check_tensors(header, plan)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    file_bytes = _file_bytes(data) if keep else None
    weights: dict[str, torch.Tensor | StoredTensor] = {}
    permuted = by_name(config.architecture).gguf_rotary_permuted
    for gguf_name, hf_name, _, rotary_heads in plan:
        info = header.tensors[gguf_name]
        heads = rotary_heads if permuted else 0
        if gguf_name in keep:
            assert file_bytes is not None
            rows = _stored_rows(file_bytes, info)
            _check_finite(header, info, _stored_floats_finite(data, info))
            weights[hf_name] = StoredTensor(gguf_name, rows, info.quant_type, info.shape, info.offset, heads)
            continue
        tensor = _dequantize(header, data, info)
        _check_finite(header, info, _finite_sum(tensor.numpy()))
        if heads:
            tensor = _undo_rotary_permutation(tensor, heads)
        if config.norm_plus_one and gguf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms with the 1 added; a checkpoint, without
            tensor = tensor - 1
        weights[hf_name] = tensor.to(dtype)
    return weights


@functools.cache
def dequantizable_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types the installed ``gguf`` package can dequantize, found by trying one zero block of each."""
    found = set()
    for quant_type, (_, type_size) in GGML_QUANT_SIZES.items():
        try:
            with np.errstate(all="ignore"):
                dequantize(np.zeros((1, type_size), dtype=np.uint8), quant_type)
        except NotImplementedError:
            continue
        found.add(quant_type)
    return frozenset(found)


def _layer_windows(header: GGUFHeader, arch: str, spec: Architecture, num_layers: int) -> tuple[int, ...]:
    """Each layer's window as llama.cpp spreads ``{arch}.attention.sliding_window`` over the layers (absent: the
    architecture's default; 0: none): ``{arch}.attention.sliding_window_pattern`` as one flag per layer or as a
    period n (of every n layers the first n - 1 slide; 0: all), else the architecture's period."""
    meta = header.metadata
    window = int(meta.get(f"{arch}.attention.sliding_window", spec.gguf_default_window) or 0)
    if not window:
        return ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", spec.gguf_window_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise gguf_error(
                header.path,
                f"metadata key {arch}.attention.sliding_window_pattern is {pattern!r}, expected one flag per "
                f"layer ({num_layers}) or one period",
            )
        return tuple(window if slides else 0 for slides in pattern)
    if not isinstance(pattern, int) or isinstance(pattern, bool):
        raise gguf_error(
            header.path,
            f"metadata key {arch}.attention.sliding_window_pattern is {pattern!r}, expected a period",
        )
    return tuple(window if not pattern or i % pattern < pattern - 1 else 0 for i in range(num_layers))


def _local_rope_theta(
    header: GGUFHeader, arch: str, spec: Architecture, rope_theta: float, rope_type: str
) -> float:
    """The sliding layers' rope base (``ModelConfig.rope_local_theta``; 0: the global layers' tables):
    ``{arch}.rope.freq_base_swa``, else the architecture's default (Gemma 3: 10000, unscaled)."""
    base = header.metadata.get(f"{arch}.rope.freq_base_swa")
    if base is None:
        return spec.gguf_local_rope_base
    base = _float32(base)
    if spec.gguf_local_rope_base:
        return base
    if base == rope_theta:
        return 0.0
    if rope_type != "default":  # llama.cpp scales these layers as the others; our local tables are unscaled
        raise gguf_error(
            header.path,
            f"unsupported: {arch}.rope.freq_base_swa with rope scaling {rope_type!r} on the sliding layers; "
            "supported: a sliding-layer base without scaling",
        )
    return base


def _required(header: GGUFHeader, key: str) -> Any:
    if key not in header.metadata:
        raise gguf_error(header.path, f"missing metadata key {key!r}")
    return header.metadata[key]


def _required_int(header: GGUFHeader, key: str, default: int | None = None) -> int:
    value = header.metadata.get(key, default) if default is not None else _required(header, key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise gguf_error(header.path, f"metadata key {key!r} is {value!r}, expected one integer")
    return value


def _float32(value: float) -> float:
    """The shortest decimal that reads back as this float32 (``1e-05``, not ``9.999999747378752e-06``)."""
    return float(str(np.float32(value)))


def _vocab_size(header: GGUFHeader, arch: str) -> int:
    """The embedding's rows (llama.cpp's Gemma 3 converter drops the rows past the tokenizer's), else the
    ``{arch}.vocab_size`` key or the token list's length."""
    embedding = header.tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        return embedding.shape[0]
    size = header.metadata.get(f"{arch}.vocab_size")
    if size is None and isinstance(header.metadata.get("tokenizer.ggml.tokens"), list):
        size = len(header.metadata["tokenizer.ggml.tokens"])
    if size is None:
        raise gguf_error(
            header.path, f"missing metadata key {arch}.vocab_size (and no tokenizer.ggml.tokens)"
        )
    return size


_Factors = tuple[float, ...]


def _rope(
    header: GGUFHeader, arch: str, head_dim: int
) -> tuple[str, dict[str, float], _Factors, _Factors, _Factors]:
    """The rope type, its numbers as transformers names them, the per-frequency divisors and longrope's short and
    long factors, from what llama.cpp's converter writes: ``{arch}.rope.scaling.*`` for linear and YaRN scaling,
    the tensor ``rope_freqs.weight`` (Llama 3's ``llama3`` scaling, one divisor per frequency), and Phi-3's
    ``rope_factors_short.weight`` / ``rope_factors_long.weight`` with ``{arch}.rope.scaling.attn_factor`` and
    ``original_context_length`` (``longrope``)."""
    meta = header.metadata
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    if "rope_factors_long.weight" in header.tensors:
        return _longrope(header, arch, head_dim, data)
    prefix = f"{arch}.rope.scaling."
    scaling = meta.get(prefix + "type", "none")
    factor = meta.get(prefix + "factor", meta.get(f"{arch}.rope.scale_linear"))
    if scaling == "linear" and factor in (None, 0.0, 1.0):
        scaling = "none"  # llama.cpp reads a factor of 0 or 1 as no scaling
    if scaling not in _GGUF_ROPE_SCALING:
        raise gguf_error(
            header.path,
            f"unsupported rope scaling {scaling!r}; supported: {', '.join(_GGUF_ROPE_SCALING)} "
            "(and per-frequency factors in rope_freqs.weight)",
        )
    rope_type = _GGUF_ROPE_SCALING[scaling]
    params: dict[str, float] = {}
    if rope_type != "default":
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise gguf_error(header.path, f"rope scaling {scaling!r} needs the metadata key {prefix}factor")
        params["factor"] = _float32(factor)
    if rope_type == "yarn":
        original = _required_int(header, prefix + "original_context_length")
        params["original_max_position_embeddings"] = float(original)
        for key, name in (
            ("yarn_attn_factor", "attention_factor"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            if isinstance(meta.get(prefix + key), (int, float)):
                params[name] = _float32(meta[prefix + key])
        for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            if meta.get(prefix + key, neutral) != neutral:
                raise gguf_error(header.path, f"unsupported YaRN option {prefix}{key} = {meta[prefix + key]}")
    freq_factors: tuple[float, ...] = ()
    info = header.tensors.get("rope_freqs.weight")
    if info is not None:
        if info.shape != (head_dim // 2,):
            raise gguf_error(
                header.path,
                f"tensor rope_freqs.weight has shape {list(info.shape)}, the config needs [{head_dim // 2}]",
            )
        freq_factors = tuple(float(x) for x in _dequantize(header, data, info).tolist())
    return rope_type, params, freq_factors, (), ()


def _longrope(
    header: GGUFHeader, arch: str, head_dim: int, data: np.memmap
) -> tuple[str, dict[str, float], _Factors, _Factors, _Factors]:
    factors = []
    for name in ("rope_factors_short.weight", "rope_factors_long.weight"):
        info = header.tensors.get(name)
        if info is None or info.shape != (head_dim // 2,):
            shape = "missing" if info is None else f"of shape {list(info.shape)}"
            raise gguf_error(
                header.path, f"longrope needs the tensor {name} of [{head_dim // 2}]; it is {shape}"
            )
        factors.append(tuple(float(x) for x in _dequantize(header, data, info).tolist()))
    original = _required_int(header, f"{arch}.rope.scaling.original_context_length")
    params = {
        "original_max_position_embeddings": float(original),
        "factor": _required_int(header, f"{arch}.context_length") / original,
    }
    attn_factor = header.metadata.get(f"{arch}.rope.scaling.attn_factor")
    if isinstance(attn_factor, (int, float)):
        params["attention_factor"] = float(attn_factor)
    return "longrope", params, (), factors[0], factors[1]


def _rotary_dims(header: GGUFHeader, arch: str, spec: Architecture, head_dim: int) -> int:
    """``{arch}.rope.dimension_count``: the leading dims of each head that rotate (llama.cpp's neox rotation pairs
    them as transformers does), the rest passed through; below the head size only where the architecture's
    reference does that (``Architecture.partial_rotary``)."""
    dims = header.metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if dims == head_dim:
        return head_dim
    if not spec.partial_rotary or not isinstance(dims, int) or not 0 < dims < head_dim or dims % 2:
        supported = ", ".join(a.gguf_names[0] for a in ARCHITECTURES if a.partial_rotary and a.gguf_names)
        raise gguf_error(
            header.path,
            f"unsupported partial rotary embedding ({dims} of {head_dim} dims) for {arch}; supported: every dim, "
            f"or an even part of each head on {supported}",
        )
    return dims


_Plan = list[tuple[str, str, tuple[int, ...], int]]


def _weight_plan(config: ModelConfig) -> _Plan:
    """(GGUF name, Hugging Face name, Hugging Face shape, heads of a rotary permutation or 0) per tensor."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    plan = [
        ("token_embd.weight", "model.embed_tokens.weight", (config.vocab_size, hidden), 0),
        ("output_norm.weight", "model.norm.weight", (hidden,), 0),
    ]
    if not config.tie_word_embeddings:
        plan.append(("output.weight", "lm_head.weight", (config.vocab_size, hidden), 0))
    layer = [
        ("attn_norm.weight", "input_layernorm.weight", (hidden,), 0),
        ("ffn_norm.weight", "post_attention_layernorm.weight", (hidden,), 0),
        ("attn_q.weight", "self_attn.q_proj.weight", (q_size, hidden), config.num_heads),
        ("attn_k.weight", "self_attn.k_proj.weight", (kv_size, hidden), config.num_kv_heads),
        ("attn_v.weight", "self_attn.v_proj.weight", (kv_size, hidden), 0),
        ("attn_output.weight", "self_attn.o_proj.weight", (hidden, q_size), 0),
        ("ffn_gate.weight", "mlp.gate_proj.weight", (inter, hidden), 0),
        ("ffn_up.weight", "mlp.up_proj.weight", (inter, hidden), 0),
        ("ffn_down.weight", "mlp.down_proj.weight", (hidden, inter), 0),
    ]
    if by_name(config.architecture).fused_checkpoint:  # Phi-3: q/k/v and gate/up stored fused
        fused = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"}
        layer = [entry for entry in layer if entry[0] not in fused]
        layer += [
            ("attn_qkv.weight", "self_attn.qkv_proj.weight", (q_size + 2 * kv_size, hidden), 0),
            ("ffn_up.weight", "mlp.gate_up_proj.weight", (2 * inter, hidden), 0),
        ]
    # Gemma: ffn_norm is the norm before the MLP, the one after attention has its own
    if config.sandwich_norms:
        layer = [entry for entry in layer if entry[0] != "ffn_norm.weight"]
        layer += [
            ("post_attention_norm.weight", "post_attention_layernorm.weight", (hidden,), 0),
            ("ffn_norm.weight", "pre_feedforward_layernorm.weight", (hidden,), 0),
            ("post_ffw_norm.weight", "post_feedforward_layernorm.weight", (hidden,), 0),
        ]
    if config.qk_norm:
        layer += [
            ("attn_q_norm.weight", "self_attn.q_norm.weight", (config.head_dim,), 0),
            ("attn_k_norm.weight", "self_attn.k_norm.weight", (config.head_dim,), 0),
        ]
    if config.attention_bias:
        layer += [
            ("attn_q.bias", "self_attn.q_proj.bias", (q_size,), config.num_heads),
            ("attn_k.bias", "self_attn.k_proj.bias", (kv_size,), config.num_kv_heads),
            ("attn_v.bias", "self_attn.v_proj.bias", (kv_size,), 0),
        ]
    for i in range(config.num_layers):
        plan += [(f"blk.{i}.{g}", f"model.layers.{i}.{h}", shape, heads) for g, h, shape, heads in layer]
    return plan


def _check_tensors(header: GGUFHeader, plan: _Plan) -> None:
    for gguf_name, _, shape, _ in plan:
        info = header.tensors.get(gguf_name)
        if info is None:
            raise gguf_error(header.path, f"missing tensor {gguf_name}")
        if info.shape != shape:
            raise gguf_error(
                header.path,
                f"tensor {gguf_name} has shape {list(info.shape)}, the config needs {list(shape)}",
            )
        if info.quant_type not in dequantizable_types():
            supported = ", ".join(sorted(t.name for t in dequantizable_types()))
            raise gguf_error(
                header.path,
                f"tensor {gguf_name} is stored as {info.quant_type.name}, which cannot be dequantized; "
                f"supported types: {supported}",
            )


def weight_types(source: Path | GGUFHeader, config: ModelConfig) -> dict[str, GGUFTensorInfo]:
    """The tensors a model of this config reads from the file, by GGUF name, checked (present, of the right shape
    and a type ``gguf`` can read) as :func:`read_gguf_weights` checks them."""
    header = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    plan = _weight_plan(config)
    _check_tensors(header, plan)
    return {gguf_name: header.tensors[gguf_name] for gguf_name, *_ in plan}


def _file_bytes(data: np.memmap) -> torch.Tensor:
    """The whole read-only map as one uint8 tensor (one storage: views of neighbouring tensors can be joined)."""
    with warnings.catch_warnings():  # torch warns that the array is read-only: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _stored_rows(file_bytes: torch.Tensor, info: GGUFTensorInfo) -> torch.Tensor:
    """The tensor's bytes as uint8 ``[rows, row_bytes]``: a view of the read-only map, nothing copied."""
    rows = prod(info.shape[:-1])
    return file_bytes[info.offset : info.offset + info.num_bytes].view(rows, info.num_bytes // rows)


# Where the float16 numbers of one block of each type kept as stored lie (byte offsets): its scales and minimums.
# The rest of a block holds small integers, which cannot be NaN; a damaged file shows in these (1 in 32 random
# float16 values is NaN or inf), so checking them costs a read of a few bytes per block, not a dequantization.
_BLOCK_FLOATS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def _stored_floats_finite(data: np.ndarray, info: GGUFTensorInfo) -> bool | None:
    """Whether the floating-point numbers of a tensor kept as stored (every value of F16/BF16/F32, the scales
    of a quantized type) are all finite, read in place; ``None`` for a type this does not know."""
    count = prod(info.shape)
    if info.quant_type is GGMLQuantizationType.BF16:  # numpy has no bfloat16: torch views the same bytes
        raw = torch.from_numpy(np.ndarray((count,), np.uint16, data, info.offset).copy())
        return _finite_sum(raw.view(torch.bfloat16).float().numpy())
    if info.quant_type in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        dtype = np.float16 if info.quant_type is GGMLQuantizationType.F16 else np.float32
        return _finite_sum(np.ndarray((count,), dtype, data, info.offset))
    offsets = _BLOCK_FLOATS.get(info.quant_type)
    if offsets is None:
        return None
    block_bytes = GGML_QUANT_SIZES[info.quant_type][1]
    num_blocks = info.num_bytes // block_bytes
    return all(  # a strided view of the file: one float16 every block_bytes, nothing copied
        _finite_sum(np.ndarray((num_blocks,), np.float16, data, info.offset + at, (block_bytes,)))
        for at in offsets
    )


def _finite_sum(values: np.ndarray) -> bool:
    # NOTE: one NaN or inf makes the sum NaN or inf: a single pass with no mask as large as the tensor. numpy's,
    # not torch's: torch's threaded reductions were far slower on a loaded machine (docs/benchmarks.md, section 6).
    with np.errstate(all="ignore"):
        return bool(np.isfinite(values.sum(dtype=np.float32)))


def _check_finite(header: GGUFHeader, info: GGUFTensorInfo, finite: bool | None) -> None:
    """A damaged file (gguf has no checksum) shows as NaN or inf where a model has none: refuse it at load."""
    if finite is False:
        raise gguf_error(
            header.path,
            f"tensor {info.name} holds NaN or inf values: the file is damaged (download it again)",
        )


def _dequantize(header: GGUFHeader, data: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    raw = data[info.offset : info.offset + info.num_bytes].reshape(
        -1, info.num_bytes // prod(info.shape[:-1])
    )
    try:
        with np.errstate(all="ignore"):  # a damaged scale (inf * 0): _check_finite names the tensor
            values = dequantize(raw, info.quant_type)
    except Exception as error:
        raise gguf_error(header.path, f"cannot dequantize tensor {info.name}: {error}") from error
    values = np.asarray(values, dtype=np.float32)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only file map
        values = values.copy()
    return torch.from_numpy(values).reshape(info.shape)


def _undo_rotary_permutation(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the two rotary halves of each head's rows; put them back in halves."""
    rows = tensor.shape[0]
    pairs = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return pairs.transpose(1, 2).reshape(tensor.shape).contiguous()
