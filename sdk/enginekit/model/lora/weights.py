"""An adapter's weights in the layout of the slots (``LoRAWeights``), and as one flat tensor (``pack`` /
``unpack``: how rank 0 hands them to the other tensor-parallel ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from enginekit.model.config import ModelConfig

# our fused projections (``Decoder`` module names within a layer) and the checkpoint modules that are their parts
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class LoRAWeights:
    """An adapter's weights in the slots' layout, for the whole model (not a tensor-parallel rank's slice).

    ``layers[i][projection] = (A, B)`` for each of our fused projections the adapter touches in layer ``i``:
    ``A`` ``[parts x rank, in_features]`` (part p's rows at ``p * rank``), ``B`` ``[out_features, rank]`` (part p's
    output rows multiply part p's rows of ``A``; the scaling folded in), float32, zero where a part is untouched or
    its ``r`` is below ``rank``."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self._pairs())

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (A, B), layer by layer, in ``PROJECTIONS``' order."""
        return [
            layer[projection] for layer in self.layers for projection in PROJECTIONS if projection in layer
        ]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each checkpoint module an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (q_size, hidden),
        "k_proj": (kv_size, hidden),
        "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def pack(weights: LoRAWeights) -> torch.Tensor:
    """One float32 tensor: a 0/1 flag per (layer, projection), then the ``A`` and ``B`` of each flagged one."""
    flags = [float(projection in layer) for layer in weights.layers for projection in PROJECTIONS]
    pieces = [torch.tensor(flags)]
    for a, b in weights._pairs():
        pieces += [a.reshape(-1).float(), b.reshape(-1).float()]
    return torch.cat(pieces)


def unpack(flat: torch.Tensor, name: str, rank: int, config: ModelConfig) -> LoRAWeights:
    """``pack``'s inverse, for a model of ``config`` and an adapter of ``rank``."""
    shapes = module_shapes(config)
    num_flags = config.num_layers * len(PROJECTIONS)
    flags, offset = flat[:num_flags].tolist(), num_flags
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for index in range(config.num_layers):
        layer = {}
        for number, (projection, parts) in enumerate(PROJECTIONS.items()):
            if not flags[index * len(PROJECTIONS) + number]:
                continue
            a_shape = (len(parts) * rank, shapes[parts[0]][1])
            b_shape = (sum(shapes[part][0] for part in parts), rank)
            a = flat[offset : offset + a_shape[0] * a_shape[1]].view(a_shape)
            offset += a.numel()
            b = flat[offset : offset + b_shape[0] * b_shape[1]].view(b_shape)
            offset += b.numel()
            layer[projection] = (a, b)
        layers.append(layer)
    assert offset == flat.numel(), "a packed adapter of another shape"
    return LoRAWeights(name, rank, layers)
