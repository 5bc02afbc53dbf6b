"""A Hugging Face checkpoint folder: its config (``config.json``) and its weights (``*.safetensors``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.architectures import ACTIVATIONS, ARCHITECTURES, ROPE_TYPES, Architecture, by_hf_class
from enginekit.model.config import ModelConfig

logger = logging.getLogger("enginekit.model")

SUPPORTED_ARCHITECTURES = {c: a.name for a in ARCHITECTURES for c in a.hf_classes + a.hf_multimodal_classes}
# the keys each rope type needs, besides rope_theta
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "factor"),
}
_ROPE_OPTIONAL = (
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)


def read_hf_config(folder: Path) -> ModelConfig:
    """The architecture numbers of a Hugging Face checkpoint folder, from its ``config.json``."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise EngineStartupError(
            f"model folder {folder} has no config.json; expected a Hugging Face checkpoint folder",
            phase="model load",
        )
    raw = _read_json(config_path)
    required = _Required(raw, config_path)
    architectures = raw.get("architectures") or []
    spec = by_hf_class(architectures)
    if spec is None:
        raise EngineStartupError(
            f"unsupported architecture {architectures or raw.get('model_type')!r} in {config_path}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
            phase="model load",
        )
    arch = spec.name
    if any(c in spec.hf_multimodal_classes for c in architectures):
        raw = _text_config(raw, config_path)
    raw = dict(spec.hf_defaults) | raw
    required = _Required(raw, config_path)
    num_heads = required.int("num_attention_heads")
    hidden_size = required.int("hidden_size")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    max_positions = raw.get("max_position_embeddings", 2048)
    rotary_dim = _rotary_dim(raw, spec, head_dim, config_path)
    rope_theta, rope_type, rope_parameters, short_factors, long_factors = _rope(
        raw, config_path, rotary_dim or head_dim, max_positions
    )
    num_layers = required.int("num_hidden_layers")
    # Gemma names its activation hidden_activation (and keeps a hidden_act it does not use)
    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if hidden_act not in ACTIVATIONS:
        raise EngineStartupError(
            f"unsupported activation {hidden_act!r} in {config_path}; supported: {', '.join(ACTIVATIONS)}",
            phase="model load",
        )
    query_scalar = raw.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=arch,
        vocab_size=required.int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=required.int("intermediate_size"),
        num_layers=num_layers,
        layer_windows=_layer_windows(raw, spec, num_layers, config_path),
        hidden_act=hidden_act,
        norm_plus_one=spec.norm_plus_one,
        sandwich_norms=spec.sandwich_norms,
        scale_embeddings=spec.scale_embeddings,
        attention_scale=float(query_scalar) ** -0.5 if query_scalar else 0.0,
        attn_logit_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rotary_dim=rotary_dim,
        rope_local_theta=_local_rope_theta(raw, config_path),
        max_position_embeddings=max_positions,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=spec.attention_bias or bool(raw.get("attention_bias", False)),
        qk_norm=spec.qk_norm,
        rope_type=rope_type,
        rope_parameters=rope_parameters,
        rope_short_factors=short_factors,
        rope_long_factors=long_factors,
        eos_token_ids=_eos_ids(folder, raw),
        bos_token_id=raw.get("bos_token_id"),
    )


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_windows(raw: dict, spec: Architecture, num_layers: int, config_path: Path) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers chooses them: ``layer_types`` when the
    config lists them, else every layer (``sliding_window="always"``) or, with ``use_sliding_window``, the
    layers from ``max_window_layers`` on (``"flag"``). Empty: no layer slides."""
    window = raw.get("sliding_window") or 0
    if spec.sliding_window == "none" or not window:
        return ()
    if spec.sliding_window == "flag" and not raw.get("use_sliding_window"):
        return ()
    types = raw.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown or len(types) != num_layers:
            raise EngineStartupError(
                f"unsupported layer_types {unknown or types!r} in {config_path}: one per layer, "
                f"each of {', '.join(LAYER_TYPES)}",
                phase="model load",
            )
        return tuple(window if kind == "sliding_attention" else 0 for kind in types)
    pattern = raw.get("sliding_window_pattern", spec.hf_window_pattern)
    if (
        spec.hf_window_pattern and isinstance(pattern, int) and pattern > 0
    ):  # Gemma: the last of every n global
        return tuple(window if (layer + 1) % pattern else 0 for layer in range(num_layers))
    first = raw.get("max_window_layers", 0) if spec.sliding_window == "flag" else 0
    return tuple(window if layer >= first else 0 for layer in range(num_layers))


def _text_config(raw: dict, config_path: Path) -> dict:
    """A vision-language config's text model: its ``text_config``, with the token ids and the tied head from the
    outer config where the text one leaves them out."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise EngineStartupError(
            f"{config_path} names {raw.get('architectures')} but has no text_config", phase="model load"
        )
    outer = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in raw}
    return outer | text


# Where vision-language checkpoints keep their language model, by how transformers saved them (the hub's
# originals: language_model.model.*; transformers 4.52 and later in memory: model.language_model.*), and the
# prefixes of what the text model does not read (the vision tower, the projector)
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_UNUSED_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


def _text_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor (a plain decoder's names unchanged); None: not read."""
    if name.startswith(_UNUSED_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint folder's ``*.safetensors`` files that the decoder reads, by name;
    a vision-language checkpoint's language model under the plain decoder's names, its vision tower and
    projector left unread (logged at INFO)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise EngineStartupError(f"cannot read {index}: {error!r}", phase="model load") from None
    if files is None:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise EngineStartupError(f"model folder {folder} has no *.safetensors weights", phase="model load")
    weights: dict[str, torch.Tensor] = {}
    unused = 0
    for name in files:
        try:
            with safe_open(folder / name, "pt") as file:
                for key in file.keys():  # noqa: SIM118 (a safetensors file is not a mapping)
                    text_name = _text_name(key)
                    if text_name is None:
                        unused += 1
                        continue
                    weights[text_name] = file.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as error:
            raise EngineStartupError(
                f"cannot read weights file {folder / name}: {error}", phase="model load"
            ) from error
    if unused:
        logger.info(
            "%s: %d tensors of the vision tower and projector are not used (the engine reads text only)",
            folder,
            unused,
        )
    return weights


class _Required:
    """Reads the keys a config must have; a missing or non-integer one names the file and the key."""

    def __init__(self, raw: dict, path: Path) -> None:
        self.raw, self.path = raw, path

    def int(self, key: str) -> int:
        value = self.raw.get(key)
        if value is None:
            raise EngineStartupError(f"{self.path} lacks the key {key!r}", phase="model load")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise EngineStartupError(
                f"{self.path}: {key!r} must be a positive integer, got {value!r}", phase="model load"
            )
        return value


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EngineStartupError(f"cannot read {path}: {error}", phase="model load") from None
    if not isinstance(raw, dict):
        raise EngineStartupError(f"{path} is not a JSON object", phase="model load")
    return raw


def _rope(
    raw: dict, path: Path, head_dim: int, max_positions: int
) -> tuple[float, str, dict[str, float], tuple[float, ...], tuple[float, ...]]:
    """rope_theta, the rope type and its numbers, from ``rope_parameters`` (transformers 5) or ``rope_scaling``,
    and longrope's short and long factors."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if isinstance(
        params.get("full_attention"), dict
    ):  # one rope per layer type (Gemma 3): the global layers'
        params = params["full_attention"]
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # the early Phi-3 configs' name
    if rope_type not in ROPE_TYPES:
        raise EngineStartupError(
            f"unsupported rope type {rope_type!r} in {path}; supported: {', '.join(ROPE_TYPES)}",
            phase="model load",
        )
    if "original_max_position_embeddings" not in params and "original_max_position_embeddings" in raw:
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()
    if rope_type == "longrope":
        short_factors = _factors(params, "short_factor", head_dim, path)
        long_factors = _factors(params, "long_factor", head_dim, path)
        if params.get("factor") is None and isinstance(params.get("original_max_position_embeddings"), int):
            # as transformers: the factor that stretched the original context to max_position_embeddings
            params["factor"] = max_positions / params["original_max_position_embeddings"]
    missing = [key for key in _ROPE_KEYS[rope_type] if not isinstance(params.get(key), (int, float))]
    if missing:
        raise EngineStartupError(
            f"{path}: rope type {rope_type!r} needs {', '.join(missing)} in rope_parameters",
            phase="model load",
        )
    numbers = {
        key: float(params[key])
        for key in (*_ROPE_KEYS[rope_type], *_ROPE_OPTIONAL)
        if isinstance(params.get(key), (int, float)) and params.get(key) is not None
    }
    return float(theta), rope_type, numbers, short_factors, long_factors


def _rotary_dim(raw: dict, spec: Architecture, head_dim: int, path: Path) -> int:
    """The leading dims of each head that rotate, as transformers counts them (``int(head_dim *
    partial_rotary_factor)``); 0: all of them. Only where the architecture's reference rotates part of a head."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    factor = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return 0
    dims = int(head_dim * factor) if isinstance(factor, (int, float)) else 0
    if not spec.partial_rotary or not 0 < dims < head_dim or dims % 2:
        supported = ", ".join(a.name for a in ARCHITECTURES if a.partial_rotary)
        raise EngineStartupError(
            f"unsupported partial rotary embedding in {path} (partial_rotary_factor {factor!r} for "
            f"{spec.name}); supported: 1.0, or an even part of each head on {supported}",
            phase="model load",
        )
    return dims


def _local_rope_theta(raw: dict, path: Path) -> float:
    """The sliding layers' rope base where it differs from the global one (Gemma 3: ``rope_parameters``
    ``sliding_attention``, or ``rope_local_base_freq``); 0: none of its own."""
    local = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise EngineStartupError(
                f"unsupported rope type {local['rope_type']!r} for the sliding layers in {path}; supported: default",
                phase="model load",
            )
        return float(local.get("rope_theta", 10000.0))
    return float(raw.get("rope_local_base_freq") or 0.0)


def _factors(params: dict, key: str, head_dim: int, path: Path) -> tuple[float, ...]:
    values = params.get(key)
    if not isinstance(values, list) or len(values) != head_dim // 2:
        raise EngineStartupError(
            f"{path}: rope type 'longrope' needs {key} as a list of {head_dim // 2} numbers (rotary dims / 2), "
            f"got {values!r}",
            phase="model load",
        )
    return tuple(float(v) for v in values)


def _eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        eos = _read_json(generation_config).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
