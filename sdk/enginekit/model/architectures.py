"""Architectures as data: what sets each supported decoder apart from the plain Llama one.

One decoder (``model/decoder.py``) runs every architecture here; an ``Architecture`` names the options it turns on.
Adding an architecture whose pieces already exist is one entry in ``ARCHITECTURES``; a new piece (a norm, an
activation, an attention option) is a field here, a flag in ``ModelConfig`` and its code in ``layers/``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Architecture(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # our name, and ``ModelConfig.architecture``
    hf_classes: tuple[str, ...]  # Hugging Face ``architectures`` entries
    gguf_names: tuple[str, ...] = ()  # GGUF ``general.architecture`` values
    attention_bias: bool = False  # q/k/v projections carry biases (always, whatever the config says)
    qk_norm: bool = False  # an RMS norm over each head of q and of k, before the rotary embedding
    sliding_window: str = "none"  # "none"; "always": ``sliding_window`` applies when set; "flag": only with
    # ``use_sliding_window``
    gguf_rotary_permuted: bool = False  # llama.cpp's converter interleaves the rotary halves of q/k rows
    # the checkpoint stores q/k/v as one ``self_attn.qkv_proj`` and gate/up as one ``mlp.gate_up_proj`` (in the
    # decoder's own order: q, k, v rows; gate rows, then up rows); in GGUF ``attn_qkv`` and ``ffn_up``
    fused_checkpoint: bool = False
    # its reference rotates only the first partial_rotary_factor of each head's dims (neox pairs within them) and
    # passes the rest through (Phi-4-mini); in GGUF {arch}.rope.dimension_count below the head size
    partial_rotary: bool = False
    # Gemma's pieces: every RMS norm scales by (1 + weight) (a Hugging Face checkpoint stores the offset from 1);
    # norms also after attention (``post_attention_layernorm``) and around the MLP (``pre_feedforward_layernorm``,
    # ``post_feedforward_layernorm``), each output normed before its residual add; embeddings times sqrt(hidden)
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    # Hugging Face: the vision-language classes whose ``text_config`` and language-model weights are this decoder
    # (their vision tower and projector are not read); what the config classes fill in for keys a config.json
    # leaves out (released multimodal configs list few); and, when a config lists no ``layer_types``, the
    # sliding pattern its class derives (of every n layers the last attends fully; ``sliding_window_pattern``
    # overrides n; 0: the window on every layer)
    hf_multimodal_classes: tuple[str, ...] = ()
    hf_defaults: tuple[tuple[str, Any], ...] = ()
    hf_window_pattern: int = 0
    # What a GGUF file may leave unsaid, and llama.cpp's defaults for it: the MLP activation; the sliding-window
    # pattern when {arch}.attention.sliding_window_pattern is absent (of every n layers the first n - 1 slide, the
    # last attends to everything; 0: the window, if any, on every layer); the window when
    # {arch}.attention.sliding_window is absent (0: none); the soft-capping when its key is absent
    gguf_activation: str = "silu"
    gguf_window_pattern: int = 0
    gguf_default_window: int = 0
    gguf_default_attn_softcap: float = 0.0
    gguf_default_final_softcap: float = 0.0
    # Gemma in llama.cpp: scores scaled by head_dim ** -0.5, save the model of this many layers (the 27B), scaled
    # by (hidden / heads) ** -0.5 (its query_pre_attn_scalar, which the file does not carry); 0: head_dim ** -0.5
    gguf_hidden_scale_layers: int = 0
    # the sliding layers' rope base when {arch}.rope.freq_base_swa is absent (0: the global layers' base), and
    # whether they rotate without the rope scaling (Gemma 3: the linear scaling is the global layers' alone)
    gguf_local_rope_base: float = 0.0


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="llama", hf_classes=("LlamaForCausalLM",), gguf_names=("llama",), gguf_rotary_permuted=True
    ),
    Architecture(name="mistral", hf_classes=("MistralForCausalLM",), sliding_window="always"),
    Architecture(
        name="qwen2",
        hf_classes=("Qwen2ForCausalLM",),
        gguf_names=("qwen2",),
        attention_bias=True,
        sliding_window="flag",
    ),
    # Gemma 2: GeLU-tanh MLP, attention-logit and final-logit soft-capping, query_pre_attn_scalar and the
    # sliding/global layer_types come from its config.json
    Architecture(
        name="gemma2",
        hf_classes=("Gemma2ForCausalLM",),
        gguf_names=("gemma2",),
        sliding_window="always",
        norm_plus_one=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hf_window_pattern=2,
        gguf_activation="gelu_pytorch_tanh",
        gguf_window_pattern=2,
        gguf_default_window=4096,
        gguf_default_attn_softcap=50.0,
        gguf_default_final_softcap=30.0,
        gguf_hidden_scale_layers=46,
    ),
    # Gemma 3 (text): Gemma 2's pieces with q/k norms, no soft-capping, and the sliding layers' own rope base
    Architecture(
        name="gemma3",
        hf_classes=("Gemma3ForCausalLM",),
        hf_multimodal_classes=("Gemma3ForConditionalGeneration",),
        gguf_names=("gemma3",),
        sliding_window="always",
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hf_defaults=(
            ("vocab_size", 262208),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("hidden_activation", "gelu_pytorch_tanh"),
            ("max_position_embeddings", 131072),
            ("rms_norm_eps", 1e-6),
            ("rope_theta", 1000000.0),
            ("rope_local_base_freq", 10000.0),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 4096),
            ("tie_word_embeddings", True),
        ),
        hf_window_pattern=6,
        gguf_activation="gelu_pytorch_tanh",
        gguf_window_pattern=6,
        gguf_hidden_scale_layers=62,
        gguf_local_rope_base=10000.0,
    ),
    Architecture(name="qwen3", hf_classes=("Qwen3ForCausalLM",), gguf_names=("qwen3",), qk_norm=True),
    Architecture(
        name="phi3",
        hf_classes=("Phi3ForCausalLM",),
        gguf_names=("phi3",),
        sliding_window="always",
        fused_checkpoint=True,
        partial_rotary=True,
    ),
)

# The rope types whose tables we compute (``layers/rotary.py``), as transformers names them.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# The MLP activations, as transformers names them (``hidden_act``; Gemma's ``hidden_activation``).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def by_hf_class(classes: list[str]) -> Architecture | None:
    return next(
        (a for c in classes for a in ARCHITECTURES if c in a.hf_classes + a.hf_multimodal_classes), None
    )


def by_gguf_name(name: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES if name in a.gguf_names), None)


def by_name(name: str) -> Architecture:
    return next(a for a in ARCHITECTURES if a.name == name)
