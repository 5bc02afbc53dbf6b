"""Load a model: what it is (``ModelSpec``: config, tokenizer, chat template), then its weights into our model.

Three formats: the built-in tiny model, a Hugging Face folder (``config.json``, ``*.safetensors``,
``tokenizer.json``), and a GGUF file. A GGUF file's quantized matrices are kept as the file stores them where a
kernel computes with them (``quantization``, see ``model/stored.py``): the file is mapped read-only and the
model's stored weights are views of it (q/k/v, whose rows must be reordered and joined, are copied), so every
process that loads the file shares its pages. Otherwise (``quantization="none"``, CUDA, another dtype than
float32) it is dequantized once, fused into our layout in the engine's dtype, and stored in the weight cache;
later loads and every restart map that entry instead of reading the file again (``model/formats/weight_cache.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from enginekit.errors import EngineStartupError
from enginekit.model.builtin import BUILTIN_CONFIG, builtin_weights
from enginekit.model.checkpoint import checked, fuse
from enginekit.model.config import ModelConfig
from enginekit.model.decoder import Decoder, layer_ops
from enginekit.model.formats import weight_cache
from enginekit.model.formats.gguf import read_gguf_config
from enginekit.model.formats.gguf_header import read_gguf_header
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.formats.gguf_weights import read_gguf_weights
from enginekit.model.formats.hf import read_hf_config, read_hf_weights
from enginekit.model.formats.source import ModelSource, resolve_model
from enginekit.model.kernels.library import native_kernels_status
from enginekit.model.kernels.native import native_layer_ops, native_skinny_gemm
from enginekit.model.layers.linear import linear_kernel
from enginekit.model.layers.parallel_linear import Collectives
from enginekit.model.layers.quant_linear import QuantizedWeight, StoredWeight
from enginekit.model.stored import Quantization, describe_stored, stored_tensor_names, use_stored
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
    comm: Collectives | None = None,
    batch_invariant: bool = False,
) -> Decoder:
    """Build the model on ``device`` in ``dtype`` with its weights (seeded random ones for the built-in model).

    ``quantization`` applies to GGUF files (see ``stored_tensor_names``): ``"auto"`` keeps the quantized
    matrices as stored where a kernel computes with them, ``"gguf"`` requires it, ``"none"`` dequantizes all.

    ``batch_invariant``: every row of a step computed as it would be alone (the engine option of that name): the
    invariant products (``invariant_linear``, ``QuantizedWeight``'s), and native attention for every query. On CPU
    in float32 with the native kernels only: elsewhere an ``EngineStartupError`` says why.

    ``comm``: this rank's tensor-parallel group; the model keeps this rank's slice of each split weight
    (``shard_state``), float weights only: a GGUF file is dequantized at load under ``"auto"`` (logged), and
    ``"gguf"`` is refused.
    """
    config, source = spec.config, spec.source
    if comm is not None:
        check_tensor_parallel(config, comm.size)
        if source.format == "gguf" and quantization != "none":
            if quantization == "gguf":
                raise EngineStartupError(
                    f"quantization='gguf' keeps a GGUF file's weights as stored, which tensor parallelism "
                    f"(tensor_parallel_size={comm.size}) cannot split yet: use quantization='auto' or 'none' "
                    "(float weights, each rank its slice), or tensor_parallel_size=1",
                    phase="model load",
                )
            logger.info(
                "GGUF weights dequantized at load to %s: tensor_parallel_size=%d splits float weights only",
                str(dtype).removeprefix("torch."),
                comm.size,
            )
            quantization = "none"
    if batch_invariant:
        check_batch_invariant(
            config, device, dtype, tensor_parallel_size=comm.size if comm is not None else 1
        )
    with torch.device("meta"):
        module = Decoder(config, comm)
    stored: dict[str, StoredWeight | QuantizedWeight] = {}
    if source.format == "gguf":
        assert source.path is not None
        header = read_gguf_header(source.path)
        keep = stored_tensor_names(header, config, device, dtype, quantization)
        if keep:  # no weight cache: the stored tensors are the file's own pages, the rest is small
            weights = read_gguf_weights(header, config, dtype, keep=keep)
            state = fuse(checked(weights, config, header), config)
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
                    fuse(checked(read_gguf_weights(header, config, dtype), config, header), config),
                ),
            )
    else:
        if source.format == "builtin":
            weights = builtin_weights(config, seed)
        else:
            assert source.path is not None
            weights = read_hf_weights(source.path)
        state = fuse(checked(weights, config, source.path), config)
    if comm is not None:
        state = shard_state(module, state)
    module.load_state_dict(state, strict=False, assign=True)
    use_stored(module, stored, config, batch_invariant=batch_invariant)
    if config.tie_word_embeddings and module.embed_tokens.weight is not None:
        module.lm_head.weight = module.embed_tokens.weight
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    kernel_name, kernel = linear_kernel(device, dtype, batch_invariant=batch_invariant)
    count = module.use_linear_kernel(kernel)
    module.batch_invariant = batch_invariant
    native = module.use_layer_ops(layer_ops(config, device, dtype, module.tensor_parallel_size))
    logger.info(
        "model loaded on %s in %s%s; its %d projections run %s%s; norms and attention: %s",
        device,
        dtype,
        f" (tensor-parallel rank {comm.rank} of {comm.size})" if comm is not None else "",
        count,
        kernel_name,
        describe_stored(stored),
        "native layer operations" if native else "torch",
    )
    return module


def check_batch_invariant(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, *, tensor_parallel_size: int
) -> None:
    """Refuse ``batch_invariant=True`` where a row's arithmetic would still depend on the batch, naming why."""
    why = None
    if device.type != "cpu" or dtype != torch.float32:
        why = f"it runs on CPU in float32 only, and this engine runs on {device} in {str(dtype).removeprefix('torch.')}"
    elif native_skinny_gemm() is None or native_layer_ops() is None:
        why = f"it needs the native kernels, and they cannot be used here ({native_kernels_status()})"
    elif layer_ops(config, device, dtype, tensor_parallel_size) is None:
        why = "it needs the native attention, and this model's attention shapes are past its limits"
    if why is not None:
        raise EngineStartupError(
            f"batch_invariant=True cannot hold here: {why}. Use batch_invariant=False.", phase="model load"
        )


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a model that ``size`` tensor-parallel ranks cannot split evenly, naming what and what would work."""
    counts = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "intermediate features": config.intermediate_size,
    }
    uneven = [f"{count} {what}" for what, count in counts.items() if count % size]
    if uneven:
        works = [n for n in range(1, max(counts.values()) + 1) if all(c % n == 0 for c in counts.values())]
        raise EngineStartupError(
            f"tensor_parallel_size={size} does not split this model's {', '.join(uneven)} evenly "
            f"(each rank holds an equal share); sizes that work: {', '.join(map(str, works))}",
            phase="model load",
        )


def shard_state(module: Decoder, state: dict) -> dict:
    """Each split weight of ``state`` replaced by this rank's slice (a copy: the full tensor is freed with
    ``state``'s reference to it); the others (norms) whole."""
    sharded = {}
    for name in list(state):
        owner = module.get_submodule(name.rpartition(".")[0])
        full = state.pop(name)
        shard = getattr(owner, "shard", None)
        sharded[name] = shard(name, full) if shard is not None else full
    return sharded
