"""A checkpoint's tensors into our model's state: the names and shapes a config needs (``checkpoint_shapes``), the
check that they are all there (``checked``), and the map onto our layout (``fuse``): q/k/v and gate/up joined into
one product each, tensors kept as the GGUF file stores them joined into one ``QuantizedWeight`` (a view of the file
where they lie back to back)."""

from __future__ import annotations

import itertools
from typing import TypeVar

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.architectures import by_name
from enginekit.model.config import ModelConfig
from enginekit.model.formats.gguf_header import GGUFHeader
from enginekit.model.formats.gguf_weights import StoredTensor
from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight
from enginekit.model.layers.rotary import partial_rotary_order

_W = TypeVar(
    "_W", torch.Tensor, torch.Tensor | StoredTensor
)  # a checkpoint's tensors: float, or some kept as stored


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by its Hugging Face name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if _fused_checkpoint(config):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            del layer[f"{name}.weight"]
        layer |= {
            "self_attn.qkv_proj.weight": (q_size + 2 * kv_size, hidden),
            "mlp.gate_up_proj.weight": (2 * inter, hidden),
        }
    if config.attention_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_size,),
            "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.bias": (kv_size,),
        }
    if config.sandwich_norms:
        layer |= {
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,),
        }
    if config.qk_norm:
        layer |= {
            "self_attn.q_norm.weight": (config.head_dim,),
            "self_attn.k_norm.weight": (config.head_dim,),
        }
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def checked(weights: dict[str, _W], config: ModelConfig, origin: object) -> dict[str, _W]:
    """Refuse missing or misshapen weights, naming them as the checkpoint does."""
    where = origin.path if isinstance(origin, GGUFHeader) else origin
    expected = checkpoint_shapes(config)
    missing = [name for name in expected if name not in weights]
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied head anyway
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineStartupError(
            f"checkpoint {where} lacks weights: {', '.join(missing[:5])}{more}", phase="model load"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise EngineStartupError(
                f"checkpoint {where}: weight {name} has shape {list(weights[name].shape)}, the config needs "
                f"{list(shape)}",
                phase="model load",
            )
    return weights


def fuse(
    weights: dict[str, torch.Tensor] | dict[str, torch.Tensor | StoredTensor], config: ModelConfig
) -> dict[str, torch.Tensor | StoredWeight | QuantizedWeight]:
    """Map checkpoint names onto ours, concatenating q/k/v and gate/up into one matmul each (``_join``); a
    weight kept as stored becomes a ``StoredWeight`` (the embedding) or a ``QuantizedWeight`` (a projection)."""
    state = {
        "embed_tokens.weight": _join([weights["model.embed_tokens.weight"]], embedding=True),
        "norm.weight": weights["model.norm.weight"],
    }
    if "lm_head.weight" in weights:
        state["lm_head.weight"] = _join([weights["lm_head.weight"]])
    fused = _fused_checkpoint(config)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        if fused:  # already one product each
            state[f"{dst}self_attn.qkv_proj.weight"] = _join([weights[f"{src}self_attn.qkv_proj.weight"]])
            state[f"{dst}mlp.gate_up_proj.weight"] = _join([weights[f"{src}mlp.gate_up_proj.weight"]])
        else:
            state[f"{dst}self_attn.qkv_proj.weight"] = _join(
                [weights[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"]
            )
            state[f"{dst}mlp.gate_up_proj.weight"] = _join(
                [weights[f"{src}mlp.{p}_proj.weight"] for p in ("gate", "up")]
            )
        if config.attention_bias:
            state[f"{dst}self_attn.qkv_proj.bias"] = _join(
                [weights[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"]
            )
        state[f"{dst}self_attn.o_proj.weight"] = _join([weights[f"{src}self_attn.o_proj.weight"]])
        state[f"{dst}mlp.down_proj.weight"] = _join([weights[f"{src}mlp.down_proj.weight"]])
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if config.qk_norm else []
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if config.sandwich_norms else []
        for norm in norms:
            state[f"{dst}{norm}.weight"] = weights[f"{src}{norm}.weight"]
    if config.rotary_dims != config.head_dim:  # partial rotary: each head's q/k dims in the order it needs
        _reorder_for_partial_rotary(state, config)
    if config.norm_plus_one:  # stored as the offset from 1 (see Architecture.norm_plus_one)
        for name in [name for name in state if name.endswith("norm.weight")]:
            state[name] = state[name] + 1
    return {
        name: tensor.contiguous() if isinstance(tensor, torch.Tensor) else tensor
        for name, tensor in state.items()
    }


def _reorder_for_partial_rotary(state: dict, config: ModelConfig) -> None:
    """Each head's q and k rows (and biases, and q/k norm weights) in ``partial_rotary_order``, so the full-width
    rotation of every path (torch, the native kernels) is the partial one (``layers/rotary.py``). The order stays
    within each head: a split by heads (tensor parallel) keeps it."""
    order = partial_rotary_order(config.rotary_dims, config.head_dim)
    heads = config.num_heads + config.num_kv_heads
    qk_rows = (torch.arange(heads)[:, None] * config.head_dim + order[None, :]).reshape(-1)
    v_rows = torch.arange(heads * config.head_dim, (heads + config.num_kv_heads) * config.head_dim)
    rows = torch.cat((qk_rows, v_rows))
    for i in range(config.num_layers):
        for name in (f"layers.{i}.self_attn.qkv_proj.weight", f"layers.{i}.self_attn.qkv_proj.bias"):
            if name in state:
                state[name] = _rows_in_order(state[name], rows)
        for name in (f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"):
            if name in state:
                state[name] = state[name][order]


def _rows_in_order(weight, rows: torch.Tensor):
    """The weight's rows ``rows`` (a permutation that keeps each part's rows within it): float rows indexed,
    stored rows copied whole (each row's blocks are its own)."""
    if isinstance(weight, torch.Tensor):
        return weight.index_select(0, rows)
    parts, start = [], 0
    for part in weight.parts:
        local = rows[start : start + part.out_features] - start
        parts.append(part._replace(blocks=part.blocks.index_select(0, local)))
        start += part.out_features
    return QuantizedWeight(parts, exact_top=weight.exact_top)


def _fused_checkpoint(config: ModelConfig) -> bool:
    return by_name(config.architecture).fused_checkpoint


def _join(parts: list, *, embedding: bool = False):
    """The rows of ``parts`` one after another: float tensors concatenated, stored tensors as one
    ``QuantizedWeight`` (a ``StoredWeight`` for the ``embedding``).

    Stored parts of one type form one product: a view of the file where they lie there back to back in this
    order, else a copy of their rows (llama.cpp's rotary permutation of q and k undone on the way), since one
    product of the joined rows costs less than one per part (docs/benchmarks.md). Parts
    of different types stay separate products. (``stored_tensor_names`` keeps a fused group whole: all stored,
    or all float.)"""
    if all(isinstance(part, torch.Tensor) for part in parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    assert all(isinstance(part, StoredTensor) for part in parts), "a fused group is either float or stored"
    runs: list[list[StoredTensor]] = []
    for part in parts:
        if runs and runs[-1][0].quant_type == part.quant_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [_stored_run(run) for run in runs]
    if embedding:
        assert len(joined) == 1
        return joined[0]
    return QuantizedWeight(joined)


def _stored_run(run: list[StoredTensor]) -> StoredWeight:
    first = run[0]
    rows = sum(part.blocks.shape[0] for part in run)
    adjacent = all(
        later.offset == earlier.offset + earlier.blocks.numel() for earlier, later in itertools.pairwise(run)
    )
    if adjacent and not any(part.rotary_heads for part in run):
        blocks = first.blocks
        if len(run) > 1:  # one view over the stretch of the file the parts fill
            blocks = torch.empty(0, dtype=torch.uint8).set_(
                blocks.untyped_storage(),  # pyright: ignore[reportCallIssue]  # torch's stubs lack this overload
                blocks.storage_offset(),
                (rows, blocks.shape[1]),
            )
    else:
        blocks = torch.cat([_undo_row_permutation(part.blocks, part.rotary_heads) for part in run])
    return StoredWeight(blocks, first.quant_type, rows, first.shape[-1])


def _undo_row_permutation(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary order of q/k rows undone on stored rows (each row's bytes move whole)."""
    if not heads:
        return rows
    count = rows.shape[0]
    return rows.reshape(heads, count // heads // 2, 2, rows.shape[1]).transpose(1, 2).reshape(rows.shape)
