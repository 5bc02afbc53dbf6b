"""A peft LoRA folder read and checked against a model: ``inspect_adapter`` (the config and the tensors' shapes
alone, cheap enough for the front end to run before it sends a request) and ``load_adapter`` (the weights, in the
layout the slots take: ``LoRAWeights``).

What enginekit applies: ``lora_A`` / ``lora_B`` of the q/k/v/o and gate/up/down projections of the decoder's layers,
with peft's scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` per module, so a
``rank_pattern`` works). Everything else a peft config can ask for changes the model in another way and is refused
by name, as are ``.bin`` weights (a pickle, never loaded here). Every message names the adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from enginekit.lora_request import LoRARequest
from enginekit.model.architectures import by_name
from enginekit.model.config import ModelConfig
from enginekit.model.layers.rotary import partial_rotary_order
from enginekit.model.lora.weights import PROJECTIONS, LoRAWeights, module_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"

SECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
MODULES = tuple(module for parts in PROJECTIONS.values() for module in parts)
# peft config fields that change the model in ways other than a plain LoRA product, with their neutral values
_REFUSED_FIELDS: dict[str, Any] = {
    "modules_to_save": None,
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "alpha_pattern": {},
    "trainable_token_indices": None,
    "layer_replication": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "megatron_config": None,
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?"
    r"layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter's checked config and the shapes of its tensors: ``modules[(layer, module)] = r``."""

    request: LoRARequest
    folder: Path
    scale_base: float  # lora_alpha
    rslora: bool
    modules: dict[tuple[int, str], int]
    keys: dict[tuple[int, str], tuple[str, str]]  # (layer, module) -> (lora_A key, lora_B key)

    @property
    def rank(self) -> int:
        """The largest ``r`` of its modules."""
        return max(self.modules.values())

    def scale(self, r: int) -> float:
        return self.scale_base / (math.sqrt(r) if self.rslora else r)


def supported_modules(config: ModelConfig) -> tuple[str, ...]:
    """The modules an adapter of this model may target: a checkpoint that stores q/k/v and gate/up fused (Phi-3)
    has only o and down among them."""
    if by_name(config.architecture).fused_checkpoint:
        return ("o_proj", "down_proj")
    return MODULES


def inspect_adapter(request: LoRARequest, config: ModelConfig, max_rank: int) -> AdapterInfo:
    """Check the adapter's folder, config and tensor shapes against ``config`` (no weight is read); raise
    ``ValueError`` naming the adapter and the problem."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"{where}: not found; a peft adapter is a folder holding {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(what PeftModel.save_pretrained writes)"
        )
    peft_config = _read_config(folder, where)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise ValueError(
                f"{where}: holds {PICKLED_WEIGHTS_FILE}, a pickle, which enginekit never loads; save it as "
                f"safetensors: PeftModel.from_pretrained(base, folder).save_pretrained(folder, "
                "safe_serialization=True)"
            )
        raise ValueError(f"{where}: has no {WEIGHTS_FILE}")
    allowed = supported_modules(config)
    _check_targets(peft_config.get("target_modules"), allowed, where, config)
    shapes = _tensor_shapes(weights, where)
    modules, keys = _modules(shapes, config, allowed, max_rank, where)
    alpha = peft_config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha must be a positive number, got {alpha!r}")
    return AdapterInfo(request, folder, float(alpha), bool(peft_config.get("use_rslora")), modules, keys)


def load_adapter(request: LoRARequest, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """The adapter's weights in the slots' layout (``LoRAWeights``), checked as ``inspect_adapter`` checks them."""
    from safetensors import SafetensorError, safe_open

    info = inspect_adapter(request, config, max_rank)
    rank, shapes = info.rank, module_shapes(config)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    try:
        with safe_open(info.folder / WEIGHTS_FILE, "pt") as file:
            for (layer, module), r in sorted(info.modules.items()):
                projection, part = _projection_of(module)
                parts = PROJECTIONS[projection]
                if projection not in layers[layer]:
                    width, out = shapes[parts[0]][1], sum(shapes[p][0] for p in parts)
                    layers[layer][projection] = (
                        torch.zeros(len(parts) * rank, width),
                        torch.zeros(out, rank),
                    )
                a, b = layers[layer][projection]
                key_a, key_b = info.keys[(layer, module)]
                start = sum(shapes[p][0] for p in parts[:part])
                a[part * rank : part * rank + r] = file.get_tensor(key_a).float()
                b[start : start + shapes[module][0], :r] = file.get_tensor(key_b).float() * info.scale(r)
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} ({request.lora_path}): cannot read {WEIGHTS_FILE}: {error}"
        ) from None
    if config.rotary_dims != config.head_dim:
        _reorder_for_partial_rotary(layers, config)
    for layer in layers:
        for a, b in layer.values():
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} ({request.lora_path}): its weights hold nan or inf"
                )
    return LoRAWeights(request.lora_name, rank, layers)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{where}: has no {CONFIG_FILE} (a peft adapter folder holds it)")
    try:
        peft_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: cannot read {CONFIG_FILE}: {error}") from None
    if not isinstance(peft_config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    kind = peft_config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{where}: is a {kind} adapter; enginekit applies LORA adapters only")
    for name, neutral in _REFUSED_FIELDS.items():
        value = peft_config.get(name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"{where}: sets {name}={value!r}, which enginekit does not apply (it applies the LoRA product "
                "of the attention and MLP projections only); train the adapter without it"
            )
    return peft_config


def _check_targets(targets: Any, allowed: tuple[str, ...], where: str, config: ModelConfig) -> None:
    """``target_modules`` given as names: each one's last component among ``allowed`` (a pattern string, or
    ``"all-linear"``, is checked through the tensors the adapter holds)."""
    if not isinstance(targets, (list, tuple)):
        return
    wrong = sorted({str(t) for t in targets if str(t).rpartition(".")[2] not in allowed})
    if wrong:
        raise ValueError(
            f"{where}: targets {', '.join(map(repr, wrong))}; enginekit applies adapters to "
            f"{', '.join(allowed)} of {config.architecture} models"
        )


def _tensor_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as file:
            return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{where}: cannot read {WEIGHTS_FILE}: {error}") from None


def _modules(
    shapes: dict[str, tuple[int, ...]],
    config: ModelConfig,
    allowed: tuple[str, ...],
    max_rank: int,
    where: str,
) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], tuple[str, str]]]:
    """Each (layer, module)'s ``r`` and keys, every tensor's name and shape checked against the model."""
    found: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"{where}: holds {key}, which enginekit cannot apply (it applies lora_A and lora_B of the "
                f"decoder layers' {', '.join(allowed)})"
            )
        layer, section, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in allowed or module not in SECTIONS.get(section, ()):
            raise ValueError(
                f"{where}: targets {section}.{module}; enginekit applies adapters to {', '.join(allowed)} of "
                f"{config.architecture} models"
            )
        if layer >= config.num_layers:
            raise ValueError(
                f"{where}: has weights for layer {layer}, but the model has {config.num_layers} layers: was it "
                "trained for another base model?"
            )
        found.setdefault((layer, module), {})[which] = (key, shape)
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    expected = module_shapes(config)
    modules, keys = {}, {}
    for (layer, module), pair in sorted(found.items()):
        name = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(
                f"{where}: {name} has lora_{next(iter(pair))} without lora_{'B' if 'A' in pair else 'A'}"
            )
        (key_a, shape_a), (key_b, shape_b) = pair["A"], pair["B"]
        out_features, in_features = expected[module]
        r = shape_a[0] if len(shape_a) == 2 else -1
        if len(shape_a) != 2 or len(shape_b) != 2 or shape_b[1] != r:
            raise ValueError(
                f"{where}: {name} has lora_A {list(shape_a)} and lora_B {list(shape_b)}, not [r, in] and [out, r]"
            )
        if shape_a[1] != in_features or shape_b[0] != out_features:
            raise ValueError(
                f"{where}: {name} maps {shape_a[1]} features to {shape_b[0]}, but this model's {module} maps "
                f"{in_features} to {out_features}: the adapter was trained for another base model"
            )
        if r > max_rank:
            raise ValueError(
                f"{where}: {name} has rank {r}, above max_lora_rank={max_rank}; start the engine with "
                f"max_lora_rank={r} or more"
            )
        modules[(layer, module)] = r
        keys[(layer, module)] = (key_a, key_b)
    return modules, keys


def _projection_of(module: str) -> tuple[str, int]:
    for projection, parts in PROJECTIONS.items():
        if module in parts:
            return projection, parts.index(module)
    raise AssertionError(module)


def _reorder_for_partial_rotary(
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], config: ModelConfig
) -> None:
    """q and k's output rows in the order the loader puts the checkpoint's (``checkpoint.py``), so the adapter's
    product lands where the base layer's does."""
    order = partial_rotary_order(config.rotary_dims, config.head_dim)
    heads = config.num_heads + config.num_kv_heads
    qk_rows = (torch.arange(heads)[:, None] * config.head_dim + order[None, :]).reshape(-1)
    v_rows = torch.arange(heads * config.head_dim, (heads + config.num_kv_heads) * config.head_dim)
    rows = torch.cat((qk_rows, v_rows))
    for layer in layers:
        if "self_attn.qkv_proj" in layer:
            a, b = layer["self_attn.qkv_proj"]
            layer["self_attn.qkv_proj"] = (a, b.index_select(0, rows))
