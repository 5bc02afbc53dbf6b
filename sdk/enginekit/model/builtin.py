"""The built-in tiny model: a Llama-shaped config, seeded random weights, the byte-level tokenizer; no files."""

from __future__ import annotations

import string

import torch

from enginekit.model.config import ModelConfig
from enginekit.model.text.tokenizer import ByteTokenizer

BUILTIN_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    eos_token_ids=(ByteTokenizer.eos_token_id,),
    bos_token_id=ByteTokenizer.bos_token_id,
)


def builtin_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights in checkpoint layout, scaled so that greedy output is confident and printable."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for name, rows, cols in (
            ("self_attn.q_proj", q_size, hidden),
            ("self_attn.k_proj", kv_size, hidden),
            ("self_attn.v_proj", kv_size, hidden),
            ("self_attn.o_proj", hidden, q_size),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.down_proj", hidden, inter),
        ):
            weights[f"{prefix}{name}.weight"] = normal(rows, cols, std=cols**-0.5)
        weights[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    # Only printable characters get an output embedding; the rest (and EOS) sit at logit 0 and never win a
    # greedy step, so the demo prints readable text to max_tokens.
    lm_head = normal(config.vocab_size, hidden, std=3.0 * hidden**-0.5)
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    for char in string.ascii_letters + string.digits + string.punctuation + " \n":
        printable[ord(char) + ByteTokenizer.NUM_SPECIAL] = True
    weights["lm_head.weight"] = lm_head * printable[:, None]
    return weights
