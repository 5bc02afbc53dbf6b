"""Random peft LoRA adapters for the tiny checkpoints of ``hf_checkpoints``, and their merged reference.

``build_adapter`` writes a peft folder (``adapter_config.json``, ``adapter_model.safetensors``) for a checkpoint
folder, with ``init_lora_weights=False`` so that ``B`` is not zero, and ``B`` rescaled so that the adapter's product
is about ``strength`` times the size of the base projection's output: large enough to change the greedy tokens,
small enough to leave the logit margins of the tiny models as they are. ``merge_adapter`` writes the reference:
``PeftModel.merge_and_unload()`` of the base and the adapter, saved as a checkpoint folder for ``hf_greedy``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hf_checkpoints import _load_hf_model, _quiet

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


@torch.no_grad()
def build_adapter(
    base: Path,
    path: Path,
    *,
    targets: list[str] | str = ALL,
    r: int = 8,
    alpha: float = 16,
    seed: int = 0,
    strength: float = 0.5,
    **options,
) -> Path:
    """Write a random LoRA adapter of checkpoint ``base`` into ``path`` (``options``: more ``LoraConfig`` fields,
    e.g. ``use_rslora``, ``rank_pattern``, ``layers_to_transform``)."""
    from peft import LoraConfig, get_peft_model

    model = _load_hf_model(base)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0, **options
    )
    with _quiet():  # peft calls transformers' deprecated is_gradient_checkpointing
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    for module in peft_model.modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
            base_std = module.base_layer.weight.std() * module.base_layer.weight.shape[1] ** 0.5
            scale = module.scaling["default"]
            b.copy_(
                torch.randn(b.shape, generator=generator) * strength * base_std / (scale * a.shape[0] ** 0.5)
            )
    with _quiet():
        peft_model.save_pretrained(path)
    return Path(path)


@torch.no_grad()
def merge_adapter(base: Path, adapter: Path, path: Path) -> Path:
    """The base checkpoint with the adapter merged in (``merge_and_unload``), saved as a checkpoint folder."""
    from peft import PeftModel

    model = _load_hf_model(base)
    with _quiet():
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(base) / name).exists():
            shutil.copy(Path(base) / name, Path(path) / name)
    return Path(path)
