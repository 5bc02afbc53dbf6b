"""A GGUF file's tensors (llama.cpp's format) in Hugging Face layout: which a config reads (``weight_types``), and
each either dequantized with ``gguf.quants.dequantize``, one at a time, so the peak memory is the output plus one
float32 tensor, or kept as the file stores it (``StoredTensor``: a uint8 view of the file mapped read-only, no
copy). The config comes from :mod:`enginekit.model.formats.gguf`, the header from
:mod:`enginekit.model.formats.gguf_header`.
"""

from __future__ import annotations

import functools
import warnings
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from enginekit.model.architectures import by_name
from enginekit.model.config import ModelConfig
from enginekit.model.formats.gguf_header import GGUFHeader, GGUFTensorInfo, gguf_error, read_gguf_header


class StoredTensor(NamedTuple):
    """A GGUF tensor kept as the file stores it: its rows of blocks, viewed in the read-only map of the file."""

    name: str  # its GGUF name
    blocks: torch.Tensor  # uint8 [rows, row_bytes], a view of the file's bytes (read-only: never write to it)
    quant_type: GGMLQuantizationType
    shape: tuple[int, ...]  # [rows, in_features] as the values, torch order
    offset: int  # of its first byte in the file
    rotary_heads: int  # its rows carry llama.cpp's rotary permutation over this many heads (0: none)


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
        tensor = dequantize_tensor(header, data, info)
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


def dequantize_tensor(header: GGUFHeader, data: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    """The tensor ``info`` of the file mapped as ``data``, dequantized to float32 (any type ``gguf`` reads)."""
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
