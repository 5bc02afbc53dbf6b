"""Build the model: from a local Hugging Face folder, or the built-in tiny model."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.config import ModelConfig
from enginekit.model.llama import LlamaForCausalLM
from enginekit.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

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


@dataclass(frozen=True)
class ModelSpec:
    """What both the front end and the engine need to know about a model: read once per process."""

    name: str | None  # the folder or file, or None for the built-in model
    config: ModelConfig
    tokenizer: Tokenizer


def load_model_spec(model: str | None) -> ModelSpec:
    """Read a model's architecture numbers and tokenizer (not its weights)."""
    if model is None:
        return ModelSpec(None, BUILTIN_CONFIG, ByteTokenizer())
    folder = Path(model)
    if not folder.is_dir():
        raise EngineStartupError(f"model folder {model!r} does not exist", phase="model load")
    config = ModelConfig.from_folder(folder)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    tokenizer = load_tokenizer(folder, bos_token_id=config.bos_token_id, eos_token_id=eos)
    return ModelSpec(model, config, tokenizer)


def load_model(
    spec: ModelSpec, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> LlamaForCausalLM:
    """Build the model on ``device`` with its weights (seeded random ones for the built-in model)."""
    config = spec.config
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    weights = (
        _builtin_weights(config, seed) if spec.name is None else _read_checkpoint(Path(spec.name), config)
    )
    state = _fuse(weights, config)
    missing = set(module.state_dict()) - set(state)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise EngineStartupError(
            f"checkpoint {spec.name} lacks weights: {', '.join(sorted(missing)[:5])}",
            phase="model load",
        )
    module.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.embed_tokens.weight
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _read_checkpoint(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise EngineStartupError(f"model folder {folder} has no *.safetensors weights", phase="model load")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(folder / name))
        except (SafetensorError, OSError, ValueError) as error:
            raise EngineStartupError(
                f"cannot read weights file {folder / name}: {error}", phase="model load"
            ) from error
    return weights


def _fuse(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map checkpoint names onto ours, concatenating q/k/v and gate/up into one matmul each."""
    get = weights.get
    state = {
        "embed_tokens.weight": get("model.embed_tokens.weight"),
        "norm.weight": get("model.norm.weight"),
    }
    if "lm_head.weight" in weights:
        state["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = [get(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
        mlp = [get(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
        state[f"{dst}self_attn.qkv_proj.weight"] = _cat(attn)
        if config.attention_bias:
            state[f"{dst}self_attn.qkv_proj.bias"] = _cat(
                [get(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]
            )
        state[f"{dst}self_attn.o_proj.weight"] = get(f"{src}self_attn.o_proj.weight")
        state[f"{dst}mlp.gate_up_proj.weight"] = _cat(mlp)
        state[f"{dst}mlp.down_proj.weight"] = get(f"{src}mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{dst}{norm}.weight"] = get(f"{src}{norm}.weight")
    return {name: tensor for name, tensor in state.items() if tensor is not None}


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts, dim=0)


def _builtin_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
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
