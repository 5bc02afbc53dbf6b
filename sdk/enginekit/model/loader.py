"""Load a model: what it is (``ModelSpec``: config, tokenizer, chat template), then its weights into our model.

Three formats: the built-in tiny model, a Hugging Face folder (``config.json``, ``*.safetensors``,
``tokenizer.json``), and a GGUF file. A GGUF file's quantized matrices are kept as the file stores them where a
kernel computes with them (``quantization``, see ``stored_tensor_names``): the file is mapped read-only and the
model's stored weights are views of it (q/k/v, whose rows must be reordered and joined, are copied), so every
process that loads the file shares its pages. Otherwise (``quantization="none"``, CUDA, another dtype than
float32) it is dequantized once, fused into our layout in the engine's dtype, and stored in the weight cache;
later loads and every restart map that entry instead of reading the file again (``model/formats/weight_cache.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.architectures import by_name
from enginekit.model.builtin import BUILTIN_CONFIG, builtin_weights
from enginekit.model.config import ModelConfig
from enginekit.model.decoder import Decoder, layer_ops
from enginekit.model.formats import weight_cache
from enginekit.model.formats.gguf import StoredTensor, read_gguf_config, read_gguf_weights, weight_types
from enginekit.model.formats.gguf_header import GGUFHeader, gguf_error, read_gguf_header
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.formats.hf import read_hf_config, read_hf_weights
from enginekit.model.formats.source import ModelSource, resolve_model
from enginekit.model.kernels.native import native_quant_gemm
from enginekit.model.kernels.quant_gemm import NATIVE_TYPES
from enginekit.model.layers.embedding import Embedding
from enginekit.model.layers.linear import Linear, linear_kernel
from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight
from enginekit.model.layers.rotary import partial_rotary_order
from enginekit.model.text.chat_template import ChatTemplate, chat_template_from_folder, end_of_turn_token_ids
from enginekit.model.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger("enginekit.model")

LM_HEAD_EXACT_TOP = 64  # logits computed again from the unquantized input (QuantizedWeight.exact_top)
LAYOUT_VERSION = "fused-1"  # bump when the cached layout of the weights changes
_W = TypeVar(
    "_W", torch.Tensor, torch.Tensor | StoredTensor
)  # a checkpoint's tensors: float, or some kept as stored
Quantization = Literal["auto", "gguf", "none"]
# GGUF tensors whose products are fused into one (their rows joined in this order): q/k/v and gate/up.
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


@dataclass(frozen=True)
class ModelSpec:
    """What the front end and the engine both need to know about a model: read once per process."""

    name: str | None  # as the user gave it
    source: ModelSource
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None = None
    end_of_turn_token_ids: tuple[int, ...] = ()
    revision: str | None = None  # of a Hugging Face repo id, as the user gave it

    @property
    def source_key(self) -> tuple[str | None, str | None]:
        """The model and revision as given: the same key, the same spec."""
        return self.name, self.revision


def load_model_spec(model: str | None, revision: str | None = None) -> ModelSpec:
    """Read a model's architecture numbers, tokenizer and chat template (not its weights)."""
    source = resolve_model(model, revision)
    if source.format == "builtin":
        return ModelSpec(model, source, BUILTIN_CONFIG, ByteTokenizer(), revision=revision)
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
    return ModelSpec(model, source, config, tokenizer, template, end_of_turn, revision)


def load_model(
    spec: ModelSpec,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    quantization: Quantization = "auto",
) -> Decoder:
    """Build the model on ``device`` in ``dtype`` with its weights (seeded random ones for the built-in model).

    ``quantization`` applies to GGUF files (see ``stored_tensor_names``): ``"auto"`` keeps the quantized
    matrices as stored where a kernel computes with them, ``"gguf"`` requires it, ``"none"`` dequantizes all.
    """
    config, source = spec.config, spec.source
    with torch.device("meta"):
        module = Decoder(config)
    stored: dict[str, StoredWeight | QuantizedWeight] = {}
    if source.format == "gguf":
        assert source.path is not None
        header = read_gguf_header(source.path)
        keep = stored_tensor_names(header, config, device, dtype, quantization)
        if keep:  # no weight cache: the stored tensors are the file's own pages, the rest is small
            weights = read_gguf_weights(header, config, dtype, keep=keep)
            state = _fuse(_checked(weights, config, header), config)
            stored = {
                name: weight
                for name, weight in state.items()
                if isinstance(weight, (StoredWeight, QuantizedWeight))
            }
            for name in stored:
                del state[name]
        else:
            state = weight_cache.load_or_build(
                source.path,
                key_parts={"dtype": str(dtype).removeprefix("torch."), "layout": LAYOUT_VERSION},
                build=lambda: cast(  # nothing kept as stored: every entry is a float tensor
                    dict[str, torch.Tensor],
                    _fuse(_checked(read_gguf_weights(header, config, dtype), config, header), config),
                ),
            )
    else:
        if source.format == "builtin":
            weights = builtin_weights(config, seed)
        else:
            assert source.path is not None
            weights = read_hf_weights(source.path)
        state = _fuse(_checked(weights, config, source.path), config)
    module.load_state_dict(state, strict=False, assign=True)
    _use_stored(module, stored, config)
    if config.tie_word_embeddings and module.embed_tokens.weight is not None:
        module.lm_head.weight = module.embed_tokens.weight
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    kernel_name, kernel = linear_kernel(device, dtype)
    count = module.use_linear_kernel(kernel)
    native = module.use_layer_ops(layer_ops(config, device, dtype))
    logger.info(
        "model loaded on %s in %s; its %d projections run %s%s; norms and attention: %s",
        device,
        dtype,
        count,
        kernel_name,
        _describe_stored(stored),
        "native layer operations" if native else "torch",
    )
    return module


def stored_tensor_names(
    header: GGUFHeader,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantization: Quantization,
) -> frozenset[str]:
    """The GGUF tensors to keep as the file stores them; the others are dequantized at load to ``dtype``.

    - ``"none"``: none.
    - ``"auto"``: on CPU in float32 with the native kernels (``enginekit.model.kernels.native``), every matrix of
      a type they compute with (``NATIVE_TYPES``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16);
      F32 matrices stay float32 as they are. A matrix of another type is dequantized, and so are the others of
      its fused group (q/k/v, gate/up: one product each); the log says which and why (warning). On CUDA, in
      another dtype, or without the native kernels: none (logged at info level).
    - ``"gguf"``: like ``"auto"``, but a matrix that cannot be kept is an ``EngineStartupError`` naming it, its
      type and the file, and so is a device or dtype other than CPU float32. Without the native kernels the
      products run their portable form (gguf-py's dequantization on every call: the file's memory, but slow;
      logged as a warning).

    Raises
    ------
    EngineStartupError
        A tensor is missing, misshapen or of a type ``gguf`` cannot read (every mode), or ``"gguf"`` cannot
        keep a matrix as stored.
    """
    if quantization not in ("auto", "gguf", "none"):
        raise ValueError(f"quantization must be 'auto', 'gguf' or 'none', got {quantization!r}")
    infos = weight_types(header, config)
    if quantization == "none":
        return frozenset()
    matrices = {
        name: info for name, info in infos.items() if len(info.shape) == 2 and info.quant_type.name != "F32"
    }
    if not matrices:
        return frozenset()
    if device.type != "cpu" or dtype != torch.float32:
        if quantization == "gguf":
            raise gguf_error(
                header.path,
                f"quantization='gguf' computes with the weights as stored on CPU in float32 only; this engine "
                f"runs on {device.type} in {str(dtype).removeprefix('torch.')} (use 'auto' or 'none' to "
                "dequantize them at load)",
            )
        logger.info(
            "GGUF weights dequantized at load to %s: no kernel computes with them as stored on %s",
            str(dtype).removeprefix("torch."),
            device,
        )
        return frozenset()
    native = native_quant_gemm()
    if native is None and quantization == "auto":
        logger.info("GGUF weights dequantized at load: the native kernels cannot be used here (logged above)")
        return frozenset()
    lacking = {name: info for name, info in matrices.items() if info.quant_type not in NATIVE_TYPES}
    if lacking and quantization == "gguf":
        name, info = next(iter(lacking.items()))
        more = f" (and {len(lacking) - 1} more tensors)" if len(lacking) > 1 else ""
        raise gguf_error(
            header.path,
            f"tensor {name} is stored as {info.quant_type.name}, which no kernel computes with as stored{more}; "
            f"quantization='gguf' needs one of {', '.join(sorted(t.name for t in NATIVE_TYPES))} "
            "(use 'auto' to dequantize it at load)",
        )
    if native is None:
        logger.warning(
            "quantization='gguf' without the native kernels (the log above says why): the products run their "
            "portable form, which dequantizes every weight on every step (slow)"
        )
    keep = set(matrices) - set(lacking)
    dragged = set()
    for i in range(config.num_layers):
        for group in FUSED_GROUPS:
            names = [f"blk.{i}.{part}.weight" for part in group]
            if any(name not in keep for name in names):
                dragged |= keep.intersection(names)
    if lacking:
        by_type = defaultdict(list)
        for name, info in lacking.items():
            by_type[info.quant_type.name].append(name)
        listed = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(by_type.items()))
        logger.warning(
            "GGUF file %s: %d tensors dequantized at load to float32, of types no kernel computes with as "
            "stored (%s)%s",
            header.path,
            len(lacking),
            listed,
            f"; with them, {len(dragged)} tensors fused with them into one product ({', '.join(sorted(dragged))})"
            if dragged
            else "",
        )
    return frozenset(keep - dragged)


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


def _checked(weights: dict[str, _W], config: ModelConfig, origin: object) -> dict[str, _W]:
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


def _fuse(
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
    rotation of every path (torch, the native kernels, the fused layer) is the partial one (``layers/rotary.py``)."""
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


def _use_stored(
    module: Decoder, stored: dict[str, StoredWeight | QuantizedWeight], config: ModelConfig
) -> None:
    """Hand each layer its weight kept as stored (the tied LM head: the embedding's rows)."""
    for name, weight in stored.items():
        layer = module.get_submodule(name.removesuffix(".weight"))
        if isinstance(layer, Embedding):
            assert isinstance(weight, StoredWeight)
            layer.use_stored(weight)
        else:
            assert isinstance(layer, Linear) and isinstance(weight, QuantizedWeight)
            if name == "lm_head.weight":  # see QuantizedWeight
                weight = QuantizedWeight(weight.parts, exact_top=LM_HEAD_EXACT_TOP)
            layer.use_stored(weight)
    embedding = stored.get("embed_tokens.weight")
    if config.tie_word_embeddings and isinstance(embedding, StoredWeight):
        module.lm_head.use_stored(QuantizedWeight([embedding], exact_top=LM_HEAD_EXACT_TOP))


def _describe_stored(stored: dict[str, StoredWeight | QuantizedWeight]) -> str:
    if not stored:
        return ""
    kinds = sorted({part.quant_type.name for weight in stored.values() for part in _parts(weight)})
    mapped = sum(part.blocks.numel() for weight in stored.values() for part in _parts(weight))
    return (
        f" ({len(stored)} weights kept as stored in the file, {', '.join(kinds)}: {mapped / 2**20:.0f} MiB)"
    )


def _parts(weight: StoredWeight | QuantizedWeight) -> tuple[StoredWeight, ...]:
    return (weight,) if isinstance(weight, StoredWeight) else weight.parts
