"""ModelConfig: the architecture numbers and options of a checkpoint, whatever format it came in."""

from __future__ import annotations

import msgspec


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_local_theta: float = (
        0.0  # the sliding layers' own rope base (Gemma 3); 0: rope_theta for every layer
    )
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # per-head RMS norms of q and k (``self_attn.q_norm``, ``self_attn.k_norm``)
    rope_type: str = "default"  # one of ``architectures.ROPE_TYPES``
    # the rope type's numbers as transformers names them (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim)
    rope_parameters: dict[str, float] = {}
    # the leading dims of each head that rotate (partial rotary, Phi-4-mini: 0.75 of them; neox pairs within
    # them), the rest pass through; 0: every dim. The loader reorders each head's q/k rows so that the rotation
    # is a full-width one whose pass-through pairs have frequency 0 (``layers/rotary.py``, ``partial_rotary_order``)
    rotary_dim: int = 0
    # per-frequency divisors of the inverse frequencies (a GGUF's ``rope_freqs.weight``), rotary dims / 2 of them
    rope_freq_factors: tuple[float, ...] = ()
    # longrope's per-frequency factors, rotary dims / 2 each: the short ones within original_max_position_embeddings
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    hidden_act: str = "silu"  # the MLP's activation, one of ``architectures.ACTIVATIONS``
    norm_plus_one: bool = False  # see ``Architecture``: the loader adds the 1 to the stored norm weights
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    attention_scale: float = (
        0.0  # the attention scores' scale (Gemma: query_pre_attn_scalar ** -0.5); 0: head_dim ** -0.5
    )
    attn_logit_softcap: float = 0.0  # scaled scores capped at c * tanh(s / c); 0: not capped
    final_logit_softcap: float = 0.0  # the same for the logits
    # each layer's sliding attention window (0: full attention), one per layer; empty: every layer attends fully
    layer_windows: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head rotate (``rotary_dim``, or all ``head_dim``)."""
        return self.rotary_dim or self.head_dim

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding attention window: it attends to the last this many tokens (0: to all)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def long_rope_from(self) -> int | None:
        """``longrope``: the sequence length past which the long factors apply (its original context), else None."""
        if self.rope_type != "longrope":
            return None
        return int(self.rope_parameters["original_max_position_embeddings"])
