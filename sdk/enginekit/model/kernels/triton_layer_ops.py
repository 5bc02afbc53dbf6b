"""A decoder layer's small operations in Triton, one launch each where torch takes several:

- :func:`rope_write_cache`: q and k rotated, the rotated k and the v written to their cache slots (torch: four
  ops for the rotation, two ``index_copy_``);
- :func:`rms_norm`, :func:`residual_norm`: an RMS norm; a residual add with an RMS norm after it, before it (of
  the added output), or both: Gemma's sandwich norms (torch: eight ops per norm in half precision, one per add);
- :func:`gated_activation`: SiLU (or GeLU-tanh) of the gate times the up half (torch: two).

Each computes in float32 and rounds where the torch code rounds in its dtype (a norm's output before the weight,
each sum), so the two paths agree to the dtype's rounding. Triton compiles each kernel once per process for each
dtype and shape constant (``tl.constexpr``) it meets (see docs/architecture.md).
"""

# pyright: reportArgumentType=false, reportCallIssue=false
# (triton types a kernel's tl.constexpr parameters as tl.constexpr and its launch options, num_warps, not at all:
# a launch passes plain numbers for both, as Triton's own examples do)
from __future__ import annotations

import torch
import triton
import triton.language as tl

# a constexpr: a jitted function reads no other global (the interpreter would, the compiler refuses)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh through exp2 of a value never above 0 (nothing overflows): (1 - e^-2|x|) / (1 + e^-2|x|), signed."""
    decay = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    magnitude = (1.0 - decay) / (1.0 + decay)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def sigmoid(x):
    """1 / (1 + e^-x) through exp2 of a value never above 0 (nothing overflows)."""
    decay = tl.exp2(tl.abs(x) * -LOG2E)
    return tl.where(x < 0, decay, 1.0) / (1.0 + decay)


@triton.jit
def _rotate(row_ptr, heads, dims, partner, mask, cos, sin, HEAD_DIM: tl.constexpr):
    """``x * cos + x[partner] * signed_sin`` of the heads ``heads`` of one token's row (see ``rotary.rotate``)."""
    x = tl.load(row_ptr + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    rolled = tl.load(row_ptr + heads[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0)
    return x * cos[None, :] + rolled.to(tl.float32) * sin[None, :]


@triton.jit
def _rope_write_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qkv_stride,
    cos_stride,
    sin_stride,
    cache_stride_slot,
    cache_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    partner = tl.where(dims < HEAD_DIM // 2, dims + HEAD_DIM // 2, dims - HEAD_DIM // 2)
    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=dim_valid, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=dim_valid, other=0.0).to(tl.float32)
    row = qkv_ptr + token * qkv_stride
    heads = tl.arange(0, HEADS_PAD)
    q_mask = (heads < NUM_HEADS)[:, None] & dim_valid[None, :]
    q = _rotate(row, heads, dims, partner, q_mask, cos, sin, HEAD_DIM)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(q_out, q.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & dim_valid[None, :]
        k = _rotate(row + NUM_HEADS * HEAD_DIM, kv_heads, dims, partner, kv_mask, cos, sin, HEAD_DIM)
        v_row = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
        v = tl.load(v_row + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=kv_mask, other=0.0)
        where = slot * cache_stride_slot + kv_heads[:, None] * cache_stride_head + dims[None, :]
        tl.store(k_cache_ptr + where, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + where, v, mask=kv_mask)


def rope_write_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The rotated q heads of ``qkv`` ``[T, (heads + 2 kv_heads) * D]`` (each row contiguous) as a new
    ``[T, heads, D]``; writes the rotated k and the v heads into ``kv_cache`` ``[2, slots, KVH, D]`` at ``slots``
    (int64; a negative slot writes nothing). ``cos`` and ``signed_sin``: ``[T, 1, D]`` (``RotaryEmbedding``'s)."""
    tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
    _require(
        qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim,
        f"qkv must be [tokens, (heads + 2 kv_heads) * head_dim] with contiguous rows, got {tuple(qkv.shape)}",
    )
    _require(
        cos.shape == signed_sin.shape == (tokens, 1, head_dim)
        and cos.stride(-1) == signed_sin.stride(-1) == 1,
        f"cos and signed_sin must be [tokens, 1, head_dim], got {tuple(cos.shape)} and {tuple(signed_sin.shape)}",
    )
    _require(
        slots.shape == (tokens,) and slots.dtype == torch.int64,
        f"slots must be [tokens] int64, got {tuple(slots.shape)} {slots.dtype}",
    )
    _require(
        kv_cache.dim() == 4 and kv_cache.shape[2] == num_kv_heads and kv_cache.stride(-1) == 1,
        f"kv_cache must be [2, slots, {num_kv_heads}, head_dim], got {tuple(kv_cache.shape)}",
    )
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _rope_write_cache_kernel[(tokens,)](
            qkv,
            cos,
            signed_sin,
            slots,
            q,
            kv_cache[0],
            kv_cache[1],
            qkv.stride(0),
            cos.stride(0),
            signed_sin.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            DIM_PAD=triton.next_power_of_2(head_dim),
        )
    return q


@triton.jit
def _rms_norm(x, weight_ptr, cols, valid, eps, HIDDEN: tl.constexpr, dtype: tl.constexpr):
    """``weight * rms_norm(x)`` rounded as the torch code rounds: the normed values to ``dtype`` before the
    weight, the product after (float32 rounds nothing)."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return (normed.to(dtype).to(tl.float32) * weight).to(dtype).to(tl.float32)


@triton.jit
def _residual_norm_kernel(
    x_ptr,
    residual_ptr,
    x_weight_ptr,
    weight_ptr,
    sum_ptr,
    out_ptr,
    eps,
    x_stride,
    residual_stride,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    NORM_X: tl.constexpr,
    ADD: tl.constexpr,
    NORM_SUM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
    if NORM_X:
        h = _rms_norm(h, x_weight_ptr, cols, valid, eps, HIDDEN, dtype)
    if ADD:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=valid, other=0.0)
        h = (residual.to(tl.float32) + h).to(dtype).to(tl.float32)
        if NORM_SUM:  # else the sum is the output, stored below
            tl.store(sum_ptr + row * HIDDEN + cols, h.to(dtype), mask=valid)
    if NORM_SUM:
        h = _rms_norm(h, weight_ptr, cols, valid, eps, HIDDEN, dtype)
    tl.store(out_ptr + row * HIDDEN + cols, h.to(dtype), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * weight`` of ``x`` ``[T, hidden]`` (rows contiguous), as a new tensor."""
    return _residual_norm(x, None, eps, None, weight)[1]


def residual_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    eps: float,
    *,
    x_weight: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, out)`` of ``x`` and ``residual`` ``[T, hidden]`` (rows contiguous) in one launch, new tensors:

    - ``sum = residual + x``, or ``residual + rms_norm(x) * x_weight`` with ``x_weight``;
    - ``out = rms_norm(sum) * weight``, or ``sum`` itself without ``weight``.

    A pre-norm layer's add and next norm: ``weight``. Gemma's sandwich norms: ``x_weight`` (the norm of the
    attention's or the MLP's output), and the next norm's ``weight`` after the attention's."""
    return _residual_norm(x, residual, eps, x_weight, weight)


def _residual_norm(x, residual, eps, x_weight, weight) -> tuple[torch.Tensor, torch.Tensor]:
    _require(
        x.dim() == 2 and x.stride(1) == 1,
        f"x must be [tokens, hidden] with contiguous rows, got {tuple(x.shape)}",
    )
    rows, hidden = x.shape
    for name, tensor in (("x_weight", x_weight), ("weight", weight)):
        _require(tensor is None or tensor.shape == (hidden,), f"{name} must be [{hidden}]")
    _require(
        residual is None or (residual.shape == x.shape and residual.stride(1) == 1),
        f"residual must be [{rows}, {hidden}] with contiguous rows, like x",
    )
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None and weight is not None else out
    if rows:
        _residual_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,  # never read without ADD
            x_weight if x_weight is not None else out,  # never read without NORM_X
            weight if weight is not None else out,
            total,
            out,
            eps,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            NORM_X=x_weight is not None,
            ADD=residual is not None,
            NORM_SUM=weight is not None,
            num_warps=_warps(hidden),
        )
    return total, out


@triton.jit
def _gated_activation_kernel(
    x_ptr, out_ptr, x_stride, INTER: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + INTER + cols, mask=valid, other=0.0).to(tl.float32)
    if GELU_TANH:
        activated = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        activated = gate * sigmoid(gate)
    # rounded as torch rounds: the activation in place in the dtype, then the product
    tl.store(out_ptr + row * INTER + cols, (activated.to(dtype).to(tl.float32) * up).to(dtype), mask=valid)


def gated_activation(gate_up: torch.Tensor, *, gelu_tanh: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (``gelu(gate, approximate="tanh") * up`` with ``gelu_tanh``) of ``[gate | up]``
    ``[T, 2 * inter]`` (rows contiguous), as a new ``[T, inter]``."""
    _require(
        gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0,
        f"gate_up must be [tokens, 2 * inter] with contiguous rows, got {tuple(gate_up.shape)}",
    )
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _gated_activation_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), INTER=inter, BLOCK=block, GELU_TANH=gelu_tanh
        )
    return out


def _warps(hidden: int) -> int:
    """Warps for one row of ``hidden`` values: about 256 values per warp, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(hidden) // 256))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
