"""Load a model: what it is (``ModelSpec``: config, tokenizer, chat template), then its weights into our model.

Three formats: the built-in tiny model, a Hugging Face folder (``config.json``, ``*.safetensors``,
``tokenizer.json``), and a GGUF file. A GGUF file is dequantized once, fused into our layout in the engine's
dtype, and stored in the weight cache; later loads and every restart map that entry instead of reading the
file again (``model/formats/weight_cache.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.builtin import BUILTIN_CONFIG, builtin_weights
from enginekit.model.config import ModelConfig
from enginekit.model.decoder import Decoder, layer_ops
from enginekit.model.formats import weight_cache
from enginekit.model.formats.gguf import read_gguf_config, read_gguf_weights
from enginekit.model.formats.gguf_header import GGUFHeader, read_gguf_header
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.formats.hf import read_hf_config, read_hf_weights
from enginekit.model.formats.source import ModelSource, resolve_model
from enginekit.model.layers.linear import linear_kernel
from enginekit.model.text.chat_template import ChatTemplate, chat_template_from_folder, end_of_turn_token_ids
from enginekit.model.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger("enginekit.model")

LAYOUT_VERSION = "fused-1"  # bump when the cached layout of the weights changes


@dataclass(frozen=True)
class ModelSpec:
    """What the front end and the engine both need to know about a model: read once per process."""

    name: str | None  # as the user gave it
    source: ModelSource
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None = None
    end_of_turn_token_ids: tuple[int, ...] = ()


def load_model_spec(model: str | None) -> ModelSpec:
    """Read a model's architecture numbers, tokenizer and chat template (not its weights)."""
    source = resolve_model(model)
    if source.format == "builtin":
        return ModelSpec(model, source, BUILTIN_CONFIG, ByteTokenizer())
    assert source.path is not None
    if source.format == "gguf":
        header = read_gguf_header(source.path)
        config = read_gguf_config(header)
        backend, info = tokenizer_from_gguf(header)
        tokenizer = HFTokenizer(backend, bos_token_id=info.bos_token_id, eos_token_id=info.eos_token_id)
        template = None
        if info.chat_template:
            origin = f"{source.path} (tokenizer.chat_template)"
            template = ChatTemplate(
                info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, origin=origin
            )
    else:
        config = read_hf_config(source.path)
        eos = config.eos_token_ids[0] if config.eos_token_ids else None
        tokenizer = load_tokenizer(source.path, bos_token_id=config.bos_token_id, eos_token_id=eos)
        template = chat_template_from_folder(source.path)
    end_of_turn = end_of_turn_token_ids(template, tokenizer.backend) if template is not None else ()
    return ModelSpec(model, source, config, tokenizer, template, end_of_turn)


def load_model(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Decoder:
    """Build the model on ``device`` in ``dtype`` with its weights (seeded random ones for the built-in model)."""
    config, source = spec.config, spec.source
    with torch.device("meta"):
        module = Decoder(config)
    if source.format == "gguf":
        assert source.path is not None
        header = read_gguf_header(source.path)
        state = weight_cache.load_or_build(
            source.path,
            key_parts={"dtype": str(dtype).removeprefix("torch."), "layout": LAYOUT_VERSION},
            build=lambda: _fuse(_checked(read_gguf_weights(header, config, dtype), config, header), config),
        )
    else:
        weights = (
            builtin_weights(config, seed) if source.format == "builtin" else read_hf_weights(source.path)
        )
        state = _fuse(_checked(weights, config, source.path), config)
    module.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.embed_tokens.weight
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    kernel_name, kernel = linear_kernel(device, dtype)
    count = module.use_linear_kernel(kernel)
    native = module.use_layer_ops(layer_ops(config, device, dtype))
    logger.info(
        "model loaded on %s in %s; its %d projections run %s; norms and attention: %s",
        device,
        dtype,
        count,
        kernel_name,
        "native layer operations" if native else "torch",
    )
    return module


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
    if config.attention_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_size,),
            "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.bias": (kv_size,),
        }
    if config.qk_norm:
        layer |= {
            "self_attn.q_norm.weight": (config.head_dim,),
            "self_attn.k_norm.weight": (config.head_dim,),
        }
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _checked(
    weights: dict[str, torch.Tensor], config: ModelConfig, origin: object
) -> dict[str, torch.Tensor]:
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


def _fuse(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map checkpoint names onto ours, concatenating q/k/v and gate/up into one matmul each."""
    state = {
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    if "lm_head.weight" in weights:
        state["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[f"{dst}self_attn.qkv_proj.weight"] = torch.cat(
            [weights[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"]
        )
        if config.attention_bias:
            state[f"{dst}self_attn.qkv_proj.bias"] = torch.cat(
                [weights[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"]
            )
        state[f"{dst}self_attn.o_proj.weight"] = weights[f"{src}self_attn.o_proj.weight"]
        state[f"{dst}mlp.gate_up_proj.weight"] = torch.cat(
            [weights[f"{src}mlp.{p}_proj.weight"] for p in ("gate", "up")]
        )
        state[f"{dst}mlp.down_proj.weight"] = weights[f"{src}mlp.down_proj.weight"]
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if config.qk_norm else []
        for norm in norms:
            state[f"{dst}{norm}.weight"] = weights[f"{src}{norm}.weight"]
    return {name: tensor.contiguous() for name, tensor in state.items()}
