"""Rotary position embedding: the cos and sin tables, and the rotation."""

from __future__ import annotations

import math

import torch
from torch import nn

from enginekit.model.config import ModelConfig


class RotaryEmbedding(nn.Module):
    """cos and sin tables for every position, computed once the way the reference implementation does; the sin
    table's first half is stored negated (see ``rotate``).

    ``longrope`` has two tables one after the other, the short factors' then the long factors'; ``rows`` says
    which row each token reads."""

    cos: torch.Tensor  # buffers, [max_positions (twice for longrope), D]
    signed_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.max_positions = config.max_position_embeddings
        self.long_from = config.long_rope_from  # longrope: the original length (see ``rows``)
        with torch.device("cpu"):  # NOTE: real tables even when the model is built on the meta device
            inv_freq, attention_factor = inverse_frequencies(config)
            cos, sin = _rotary_tables(inv_freq, self.max_positions, attention_factor)
            if self.long_from is not None:
                long_cos, long_sin = _rotary_tables(
                    inverse_frequencies(config, long=True)[0], self.max_positions, attention_factor
                )
                cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
            if config.rotary_dims != head_dim:
                cos, sin = _pass_through(cos, sin, config.rotary_dims, head_dim)
            signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def rows(self, start: int, end: int, long: bool) -> range:
        """The table rows of positions ``[start, end)``: the positions, or with ``longrope`` for a ``long``
        sequence (one past ``long_from`` tokens; see ``core/scheduler.py``) the long factors' rows."""
        offset = self.max_positions if long and self.long_from is not None else 0
        return range(start + offset, end + offset)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of these positions, ``[T, 1, D]``; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[T, heads, D]``: the reference's ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x2, x1)``, written as ``roll(x) * signed_sin`` with ``roll(x) = cat(x2, x1)`` and
    the sign in the table. Bitwise the same values in two fewer ops."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def inverse_frequencies(config: ModelConfig, *, long: bool = False) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies of ``config.rope_type`` and the factor on cos and sin, computed in the
    order and dtypes transformers uses (``modeling_rope_utils``), so the tables are bitwise the same.

    ``dynamic`` (NTK) changes the base only for sequences past ``max_position_embeddings``, which no sequence
    here reaches (``max_model_len`` is at most that): its frequencies are the default ones, as in transformers
    within that length. ``longrope``: the short factors' frequencies, or with ``long`` the long factors'."""
    dim, base, params = config.rotary_dims, config.rope_theta, config.rope_parameters
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    attention_factor = 1.0
    if config.rope_type == "longrope":
        factors = config.rope_long_factors if long else config.rope_short_factors
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
        factor = params["factor"]
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            original = params["original_max_position_embeddings"]
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    elif config.rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif config.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif config.rope_type == "yarn":
        inv_freq, attention_factor = _yarn(dim, base, params, config.max_position_embeddings)
    elif config.rope_type not in ("default", "dynamic"):
        raise ValueError(f"unknown rope type {config.rope_type!r}")
    if config.rope_freq_factors:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, attention_factor


def _llama3(inv_freq: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict[str, float], max_positions: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rotary_tables(
    inv_freq: torch.Tensor, max_positions: int, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _pass_through(
    cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial rotary as a full-width rotation: the tables of ``rotary_dims`` widened to ``head_dim``, each half
    followed by the pass-through dims' cos 1 and sin 0 (exactly: the attention factor does not touch them). With
    each head's q/k rows in ``partial_rotary_order``, the pairs (i, i + head_dim / 2) are the reference's
    (i, i + rotary_dims / 2) for i below rotary_dims / 2, and pass-through dims paired with each other, unchanged."""
    half, rest = rotary_dims // 2, (head_dim - rotary_dims) // 2
    ones, zeros = torch.ones(cos.shape[0], rest), torch.zeros(sin.shape[0], rest)
    widen = lambda table, fill: torch.cat((table[:, :half], fill, table[:, half:], fill), dim=-1)  # noqa: E731
    return widen(cos, ones), widen(sin, zeros)


def partial_rotary_order(rotary_dims: int, head_dim: int) -> torch.Tensor:
    """Where each dim of a head comes from, so that a partial rotary (the first ``rotary_dims`` dims in neox
    pairs (i, i + rotary_dims / 2), the rest passed through) is the full-width rotation of ``_pass_through``:
    the rotated dims' first half, the passed dims' first half, the rotated dims' second half, the passed dims'
    second half. q and k reordered alike keep every score q . k; v and the output are untouched."""
    half, rest = rotary_dims // 2, (head_dim - rotary_dims) // 2
    return torch.cat(
        (
            torch.arange(0, half),
            torch.arange(rotary_dims, rotary_dims + rest),
            torch.arange(half, rotary_dims),
            torch.arange(rotary_dims + rest, head_dim),
        )
    )
