"""A damaged GGUF file stops ``Engine`` with ``EngineStartupError`` naming the file, the tensor and its type, with
every ``quantization`` setting and in every mode (the header is read before any weight reaches native code)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

import gguf_files as files
from enginekit import Engine
from enginekit.errors import EngineStartupError
from gguf_files import Q

TENSOR = "blk.0.ffn_up.weight"


@pytest.fixture(scope="module")
def good_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad_files") / "good.gguf"
    files.write_tiny_gguf(path, weight_type=Q.Q5_K)
    return path


def unknown_type(good: Path, folder: Path) -> tuple[Path, str]:
    offset = files.tensor_type_offset(good, TENSOR)
    return files.patched_copy(
        good, folder / "type.gguf", offset, struct.pack("<I", 99)
    ), f"{TENSOR} .*type id 99"


def misfit_shape(good: Path, folder: Path) -> tuple[Path, str]:
    offset = (
        files.tensor_type_offset(good, TENSOR) - 16
    )  # its first dimension, before the second and the type
    (width,) = struct.unpack("<Q", good.read_bytes()[offset : offset + 8])
    path = files.patched_copy(good, folder / "shape.gguf", offset, struct.pack("<Q", width + 1))
    return path, rf"{TENSOR} \(Q5_K\) has rows of {width + 1} values, not a whole number of Q5_K blocks"


def truncated(good: Path, folder: Path) -> tuple[Path, str]:
    path = files.truncated_copy(good, folder / "cut.gguf", good.stat().st_size - 1000)
    return path, r"truncated: tensor \S+ \(\w+\)"


@pytest.mark.parametrize("damage", [unknown_type, misfit_shape, truncated])
@pytest.mark.parametrize("quantization", ["auto", "gguf", "none"])
@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_a_damaged_file_names_the_tensor_its_type_and_the_file(
    good_file, tmp_path, damage, quantization, mode
):
    path, problem = damage(good_file, tmp_path)
    with pytest.raises(EngineStartupError, match=rf"(?s){re.escape(str(path))}.*{problem}"):
        Engine(str(path), mode=mode, quantization=quantization, max_model_len=64)
