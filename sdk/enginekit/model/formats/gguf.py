"""A GGUF model's config (llama.cpp's format): the architecture, sizes, rope, windows and soft-capping read from
its metadata as llama.cpp reads them. Its tensors are read by :mod:`enginekit.model.formats.gguf_weights`, the
header parsed by :mod:`enginekit.model.formats.gguf_header`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from enginekit.model.architectures import ARCHITECTURES, Architecture, by_gguf_name
from enginekit.model.config import ModelConfig
from enginekit.model.formats.gguf_header import GGUFHeader, gguf_error, read_gguf_header
from enginekit.model.formats.gguf_weights import dequantize_tensor

# ``general.architecture`` values we read (llama.cpp's converter writes Mistral checkpoints as ``llama``)
SUPPORTED_ARCHITECTURES = tuple(name for a in ARCHITECTURES for name in a.gguf_names)
# ``{arch}.rope.scaling.type`` values and the rope type each stands for (``architectures.ROPE_TYPES``)
_GGUF_ROPE_SCALING = {"none": "default", "linear": "linear", "yarn": "yarn"}


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
        freq_factors = tuple(float(x) for x in dequantize_tensor(header, data, info).tolist())
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
        factors.append(tuple(float(x) for x in dequantize_tensor(header, data, info).tolist()))
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
