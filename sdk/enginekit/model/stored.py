"""Which of a GGUF file's tensors the model keeps as the file stores them (``stored_tensor_names``, by the
``quantization`` switch), and handing those weights to their layers (``use_stored``)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Literal

import torch

from enginekit.model.architectures import by_name
from enginekit.model.config import ModelConfig
from enginekit.model.decoder import Decoder
from enginekit.model.formats.gguf_header import GGUFHeader, gguf_error
from enginekit.model.formats.gguf_weights import weight_types
from enginekit.model.kernels.native import native_quant_gemm
from enginekit.model.kernels.quant_gemm import NATIVE_TYPES
from enginekit.model.layers.embedding import Embedding
from enginekit.model.layers.linear import Linear
from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight

logger = logging.getLogger("enginekit.model")

LM_HEAD_EXACT_TOP = 64  # logits computed again from the unquantized input (QuantizedWeight.exact_top)
Quantization = Literal["auto", "gguf", "none"]
# GGUF tensors whose products are fused into one (their rows joined in this order): q/k/v and gate/up. A file of an
# architecture that stores each group as one tensor (``Architecture.fused_checkpoint``, Phi-3: ``attn_qkv``, and
# ``ffn_up`` holding the gate rows, then the up rows) has none: that tensor is kept or dequantized whole.
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def stored_tensor_names(
    header: GGUFHeader,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantization: Quantization,
) -> frozenset[str]:
    """The GGUF tensors to keep as the file stores them; the others are dequantized at load to ``dtype``.

    - ``"none"``: none.
    - ``"auto"``: on CPU in float32 with the native kernels (``enginekit.model.kernels.native``), every matrix of
      a type they compute with (``NATIVE_TYPES``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16);
      F32 matrices stay float32 as they are. A matrix of another type is dequantized, and so are the others of
      its fused group (q/k/v, gate/up: one product each); the log says which and why (warning). On CUDA, in
      another dtype, or without the native kernels: none (logged at info level).
    - ``"gguf"``: like ``"auto"``, but a matrix that cannot be kept is an ``EngineStartupError`` naming it, its
      type and the file, and so is a device or dtype other than CPU float32. Without the native kernels the
      products run their portable form (gguf-py's dequantization on every call: the file's memory, but slow;
      logged as a warning).

    Raises
    ------
    EngineStartupError
        A tensor is missing, misshapen or of a type ``gguf`` cannot read (every mode), or ``"gguf"`` cannot
        keep a matrix as stored.
    """
    if quantization not in ("auto", "gguf", "none"):
        raise ValueError(f"quantization must be 'auto', 'gguf' or 'none', got {quantization!r}")
    infos = weight_types(header, config)
    if quantization == "none":
        return frozenset()
    matrices = {
        name: info for name, info in infos.items() if len(info.shape) == 2 and info.quant_type.name != "F32"
    }
    if not matrices:
        return frozenset()
    if device.type != "cpu" or dtype != torch.float32:
        if quantization == "gguf":
            raise gguf_error(
                header.path,
                f"quantization='gguf' computes with the weights as stored on CPU in float32 only; this engine "
                f"runs on {device.type} in {str(dtype).removeprefix('torch.')} (use 'auto' or 'none' to "
                "dequantize them at load)",
            )
        logger.info(
            "GGUF weights dequantized at load to %s: no kernel computes with them as stored on %s",
            str(dtype).removeprefix("torch."),
            device,
        )
        return frozenset()
    native = native_quant_gemm()
    if native is None and quantization == "auto":
        logger.info("GGUF weights dequantized at load: the native kernels cannot be used here (logged above)")
        return frozenset()
    lacking = {name: info for name, info in matrices.items() if info.quant_type not in NATIVE_TYPES}
    if lacking and quantization == "gguf":
        name, info = next(iter(lacking.items()))
        more = f" (and {len(lacking) - 1} more tensors)" if len(lacking) > 1 else ""
        raise gguf_error(
            header.path,
            f"tensor {name} is stored as {info.quant_type.name}, which no kernel computes with as stored{more}; "
            f"quantization='gguf' needs one of {', '.join(sorted(t.name for t in NATIVE_TYPES))} "
            "(use 'auto' to dequantize it at load)",
        )
    if native is None:
        logger.warning(
            "quantization='gguf' without the native kernels (the log above says why): the products run their "
            "portable form, which dequantizes every weight on every step (slow)"
        )
    keep = set(matrices) - set(lacking)
    dragged = set()
    groups = () if by_name(config.architecture).fused_checkpoint else FUSED_GROUPS
    for i in range(config.num_layers):
        for group in groups:
            names = [f"blk.{i}.{part}.weight" for part in group]
            if any(name not in keep for name in names):
                dragged |= keep.intersection(names)
    if lacking:
        by_type = defaultdict(list)
        for name, info in lacking.items():
            by_type[info.quant_type.name].append(name)
        listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(by_type.items()))
        logger.warning(
            "GGUF file %s: %d tensors dequantized at load to float32, of types no kernel computes with as "
            "stored (%s)%s",
            header.path,
            len(lacking),
            listed,
            f"; with them, {len(dragged)} tensors fused with them into one product ({', '.join(sorted(dragged))})"
            if dragged
            else "",
        )
    return frozenset(keep - dragged)


def use_stored(
    module: Decoder,
    stored: dict[str, StoredWeight | QuantizedWeight],
    config: ModelConfig,
    *,
    batch_invariant: bool = False,
) -> None:
    """Hand each layer its weight kept as stored (the tied LM head: the embedding's rows); ``batch_invariant``:
    products whose rows do not depend on each other (``QuantizedWeight``)."""
    for name, weight in stored.items():
        layer = module.get_submodule(name.removesuffix(".weight"))
        if isinstance(layer, Embedding):
            assert isinstance(weight, StoredWeight)
            layer.use_stored(weight)
        else:
            assert isinstance(layer, Linear) and isinstance(weight, QuantizedWeight)
            exact_top = LM_HEAD_EXACT_TOP if name == "lm_head.weight" else 0  # see QuantizedWeight
            if exact_top or batch_invariant:
                weight = QuantizedWeight(
                    weight.parts, weight.gemm, exact_top=exact_top, batch_invariant=batch_invariant
                )
            layer.use_stored(weight)
    embedding = stored.get("embed_tokens.weight")
    if config.tie_word_embeddings and isinstance(embedding, StoredWeight):
        module.lm_head.use_stored(
            QuantizedWeight([embedding], exact_top=LM_HEAD_EXACT_TOP, batch_invariant=batch_invariant)
        )


def describe_stored(stored: dict[str, StoredWeight | QuantizedWeight]) -> str:
    if not stored:
        return ""
    kinds = sorted({part.quant_type.name for weight in stored.values() for part in _parts(weight)})
    mapped = sum(part.blocks.numel() for weight in stored.values() for part in _parts(weight))
    return (
        f" ({len(stored)} weights kept as stored in the file, {', '.join(kinds)}: {mapped / 2**20:.0f} MiB)"
    )


def _parts(weight: StoredWeight | QuantizedWeight) -> tuple[StoredWeight, ...]:
    return (weight,) if isinstance(weight, StoredWeight) else weight.parts
