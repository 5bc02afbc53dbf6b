"""ModelConfig: the architecture numbers of a Llama-family checkpoint, whatever format it came in."""

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
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
