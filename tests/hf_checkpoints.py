"""Tiny random decoder checkpoints in Hugging Face layout, for enginekit tests.

``build_checkpoint`` writes a folder that looks like a real Hugging Face model repository
(``config.json``, ``generation_config.json``, ``model.safetensors`` or sharded
``model-0000X-of-0000Y.safetensors`` + ``model.safetensors.index.json``, ``tokenizer.json``,
``tokenizer_config.json``) holding a small, randomly initialised Llama, Qwen2 or Mistral model.
Everything is generated locally and deterministically from ``seed``; no hub access is needed.

``hf_greedy`` is the reference: it loads the folder with transformers and decodes greedily, one
prompt at a time, without stopping at EOS.

The weights are not transformers' default init. Tiny random models with the default init have
nearly flat next-token distributions, so greedy argmax can flip on float rounding differences
between two correct implementations. Here the LM head is scaled so logits have a standard
deviation of about ``LOGIT_STD`` (16), the projections use ``init_std`` (default 0.1), the norm
weights are random in [0.5, 1.5] and, where the architecture has them (Qwen2 q/k/v), biases are
non-zero. With the default sizes the top-1 / top-2 logit margin over greedy continuations has a
median of about 4 logits and a 5th percentile of about 0.2-0.4, while RMSNorm keeps activations
bounded (no inf/nan).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import torch

Arch = Literal["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3", "gemma3-mm"]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
TOKENIZER_VOCAB_TARGET = 384
DEFAULT_INIT_STD = 0.1
EMBED_STD = 1.0
LOGIT_STD = 16.0
BIAS_STD = 0.5
TIED_OUT_PROJ_GAIN = 3.0
DEFAULT_ROPE_THETA = {
    "llama": 500000.0,
    "qwen2": 1000000.0,
    "mistral": 1000000.0,
    "gemma2": 10000.0,
    "gemma3": 1000000.0,  # the global layers'; the sliding ones 10000 (GEMMA3_LOCAL_THETA)
    "gemma3-mm": 1000000.0,
    "qwen3": 1000000.0,
    "phi3": 10000.0,
}
GEMMA3_LOCAL_THETA = 10000.0
SHARD_SIZE = "100KB"

CORPUS = """\
The engine reads a prompt, splits it into tokens and runs the model one step at a time.
Each step produces a score for every token in the vocabulary, and the sampler picks the next one.
Greedy decoding always picks the token with the highest score, so the same prompt gives the same
answer every time. Sampling draws from the distribution instead, which makes the output vary.
A key value cache keeps the attention keys and values of earlier tokens, so that each new step only
has to process one token. Paged caches split that memory into fixed size blocks, and a scheduler
decides which requests run together in a batch. Continuous batching lets new requests join while
older ones are still running, and finished requests leave without waiting for the rest.
The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat near the open window.
In the morning the market was busy with people buying bread, fruit, fish and fresh vegetables.
Rivers run down from the mountains to the sea, and the rain falls again on the high hills.
She opened the book, read the first page twice, and then wrote a short note in the margin.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text, together with dates and prices.
Questions end with a question mark? Lists use commas; quotes use "double" or 'single' marks.
The weather today is cold and windy, but tomorrow should be sunny and a little warmer.
Students learn reading, writing, history, science and mathematics at school every week.
The train left the station at nine o'clock and arrived in the city just before noon.
Good software is tested often, measured carefully, and changed in small, simple steps.
"""


def _set_offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def _quiet():
    """No progress bars and no warnings from transformers while saving/loading."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_TARGET):
    """Train a small byte-level BPE tokenizer on the built-in corpus.

    ``<s>`` and ``</s>`` get ids 0 and 1. No post-processor adds them automatically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines()
    tok.train_from_iterator(lines * 4, trainer=trainer, length=len(lines) * 4)
    return tok


def _make_config(
    arch: Arch,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    tie_word_embeddings: bool,
    init_std: float,
    bos_id: int,
    eos_id: int,
    rope_parameters: dict | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    partial_rotary_factor: float = 1.0,
):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", **(rope_parameters or {}), "rope_theta": float(rope_theta)},
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if arch == "qwen2":
        if sliding_window:  # the second layer on slides (max_window_layers=1), as transformers picks them
            return Qwen2Config(
                **common, use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1
            )
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim or hidden_size // num_heads, use_sliding_window=False)
    if arch == "phi3":
        from transformers import Phi3Config

        original = (rope_parameters or {}).get("original_max_position_embeddings", max_position_embeddings)
        return Phi3Config(
            **common,
            sliding_window=sliding_window,
            original_max_position_embeddings=original,
            partial_rotary_factor=partial_rotary_factor,
            pad_token_id=eos_id,
        )
    if arch == "gemma2":  # soft-capping low enough to bite at these sizes; even layers slide
        from transformers import Gemma2Config

        return Gemma2Config(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=sliding_window or 4096,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            pad_token_id=eos_id,
        )
    if arch in (
        "gemma3",
        "gemma3-mm",
    ):  # every sixth layer global (as released), the sliding ones with their own
        # rope base; gemma3-mm: Gemma3ForConditionalGeneration, the same text model with a one-layer vision tower
        from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

        options: dict[str, Any] = dict(common)
        rope = options.pop("rope_parameters")
        text = Gemma3TextConfig(
            **options,
            head_dim=head_dim or hidden_size // num_heads,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=sliding_window or 4096,
            layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)],
            rope_parameters={
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA},
            },
            pad_token_id=eos_id,
        )
        if arch == "gemma3":
            return text
        vision = SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    raise ValueError(f"unknown arch {arch!r}; expected 'llama', 'qwen2' or 'mistral'")


def _model_class(arch: Arch):
    from transformers import (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        LlamaForCausalLM,
        MistralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "mistral": MistralForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "gemma3": Gemma3ForCausalLM,
        "gemma3-mm": Gemma3ForConditionalGeneration,
    }
    return classes[arch]


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, init_std: float, tied: bool) -> None:
    """Overwrite every parameter from a private generator (independent of transformers' init).

    Projections get ``N(0, init_std)``, biases ``N(0, 0.5)``, norm weights ``U(0.5, 1.5)`` and the
    LM head ``N(0, LOGIT_STD / sqrt(hidden_size))`` so logits have a standard deviation of about
    ``LOGIT_STD``. Untied embeddings are ``N(0, 1)``. With tied embeddings the table doubles as
    the LM head; to keep the model from just repeating its input token, the residual output
    projections (``o_proj``, ``down_proj``) are scaled up and the final norm weights get random
    signs.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    head_std = LOGIT_STD / hidden**0.5
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        name = name.replace("model.language_model.", "model.")  # a vision-language model's text model
        shape = param.shape
        if name.endswith("norm.weight"):
            value = 0.5 + torch.rand(shape, generator=gen)
            if tied and name == "model.norm.weight":
                value = value * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(shape, generator=gen) * (head_std if tied else EMBED_STD)
        elif name == "lm_head.weight":
            value = torch.randn(shape, generator=gen) * head_std
        elif name.endswith(".bias"):
            value = torch.randn(shape, generator=gen) * BIAS_STD
        else:
            value = torch.randn(shape, generator=gen) * init_std
            if tied and name.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * TIED_OUT_PROJ_GAIN
        param.copy_(value.to(param.dtype))


def build_checkpoint(
    path: Path,
    arch: Arch = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float | None = None,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    seed: int = 0,
    init_std: float = DEFAULT_INIT_STD,
    rope_parameters: dict | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    partial_rotary_factor: float = 1.0,
) -> Path:
    """Write a tiny random ``arch`` checkpoint in Hugging Face layout into ``path``; return it.

    ``vocab_size`` defaults to the tokenizer's size and must not be smaller than it.
    ``rope_theta`` defaults to a non-default value per arch (llama 5e5, qwen2 1e6, mistral 1e6).
    ``sharded=True`` splits the weights into several ``model-0000X-of-0000Y.safetensors`` files
    with a ``model.safetensors.index.json``. ``rope_parameters`` adds a rope type and its numbers
    (``{"rope_type": "llama3", "factor": 8.0, ...}``); ``head_dim`` sets qwen3's head size apart from
    hidden/heads; ``partial_rotary_factor`` rotates that part of each phi3 head; ``sliding_window`` gives mistral and phi3 that window on every layer, qwen2 on the layers
    from the second on.
    """
    _set_offline()
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    tok_vocab = tok.get_vocab_size()
    bos_id = tok.token_to_id(BOS_TOKEN)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if vocab_size is None:
        vocab_size = tok_vocab
    if vocab_size < tok_vocab:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tok_vocab}")
    if rope_theta is None:
        rope_theta = DEFAULT_ROPE_THETA[arch]

    config = _make_config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        init_std=init_std,
        bos_id=bos_id,
        eos_id=eos_id,
        rope_parameters=rope_parameters,
        head_dim=head_dim,
        sliding_window=sliding_window,
        partial_rotary_factor=partial_rotary_factor,
    )
    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(torch.float32).eval()
    _init_weights(model, seed, init_std, tied=tie_word_embeddings)
    if tie_word_embeddings:
        model.tie_weights()

    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    save_kwargs: dict = {"safe_serialization": True}
    if sharded:
        save_kwargs["max_shard_size"] = SHARD_SIZE
    with _quiet():
        model.save_pretrained(path, **save_kwargs)
    if sharded and not (path / "model.safetensors.index.json").exists():
        raise RuntimeError("sharded save produced no index; the model is too small to shard")

    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return path


def weight_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder (or ``[path]`` for a single file)."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(path.glob("*.safetensors"))


def corrupt_safetensors(path: Path, mode: Literal["truncate", "garbage"] = "truncate") -> None:
    """Damage the weights file(s) of a checkpoint folder (or a single ``.safetensors`` file).

    ``truncate`` keeps the valid header but cuts off most of the tensor data; ``garbage`` replaces
    the whole file with deterministic random bytes (an absurd header length).
    """
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no .safetensors files under {path}")
    gen = torch.Generator().manual_seed(1234)
    for f in files:
        data = f.read_bytes()
        if mode == "truncate":
            header_len = int.from_bytes(data[:8], "little")
            keep = 8 + header_len + max(0, (len(data) - 8 - header_len) // 4)
            f.write_bytes(data[:keep])
        elif mode == "garbage":
            noise = torch.randint(0, 256, (max(64, len(data) // 8),), generator=gen)
            f.write_bytes(b"\xff" * 8 + bytes(noise.to(torch.uint8).tolist()))
        else:
            raise ValueError(f"unknown mode {mode!r}")


def _load_hf_model(path: Path):
    _set_offline()
    from transformers import AutoModelForCausalLM

    with _quiet():
        kwargs = {"dtype": torch.float32, "local_files_only": True}
        architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
        if architectures == ["Gemma3ForConditionalGeneration"]:  # by name: the reference is that class
            from transformers import Gemma3ForConditionalGeneration

            model = Gemma3ForConditionalGeneration.from_pretrained(Path(path), **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(Path(path), **kwargs)
    return model.eval()


@torch.no_grad()
def hf_greedy(
    path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    repetition_penalty: float = 1.0,
    logits_processor: Any = None,
) -> list[list[int]]:
    """Greedy reference decode with transformers: new tokens only, EOS never stops generation.

    Each prompt runs on its own (batch size 1, no padding). EOS is treated like any other token:
    it can be generated, and decoding continues past it, so every result has exactly
    ``max_new_tokens`` tokens and equals plain argmax decoding (of the processed logits, with a
    ``repetition_penalty`` or extra ``logits_processor``).
    """
    from transformers import GenerationConfig

    if any(not p for p in prompts):
        raise ValueError("hf_greedy needs non-empty prompts")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    model = _load_hf_model(path)
    pad_id = model.config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    gen_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id if pad_id is not None else 0,
        bos_token_id=model.config.bos_token_id,
        repetition_penalty=repetition_penalty,
    )
    # generate() fills unset fields from model.generation_config; use ours there too so the
    # checkpoint's eos_token_id cannot come back and stop generation early.
    model.generation_config = gen_config
    results: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        mask = torch.ones_like(ids)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=gen_config,
            logits_processor=logits_processor,
        )
        new = out[0, ids.shape[1] :].tolist()
        if len(new) != max_new_tokens:
            raise RuntimeError(f"generate returned {len(new)} tokens, expected {max_new_tokens}")
        results.append(new)
    return results


@torch.no_grad()
def hf_greedy_with_margins(
    path: Path, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Plain argmax loop without a KV cache (full recompute each step), returning tokens and the
    top-1 minus top-2 logit margin at every generated position."""
    model = _load_hf_model(path)
    tokens: list[list[int]] = []
    margins: list[list[float]] = []
    for prompt in prompts:
        seq = list(prompt)
        new: list[int] = []
        gaps: list[float] = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            top = torch.topk(logits, 2)
            gaps.append(float(top.values[0] - top.values[1]))
            nxt = int(top.indices[0])
            new.append(nxt)
            seq.append(nxt)
        tokens.append(new)
        margins.append(gaps)
    return tokens, margins


@torch.no_grad()
def hf_prompt_logprobs(path: Path, prompt: list[int]) -> list[float]:
    """Reference prompt logprobs: for each prompt token after the first, its log-probability given the ones
    before it (one full forward pass)."""
    model = _load_hf_model(path)
    logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist()
