"""enginekit.model.formats.weight_cache and weight_cache_entry: build once, then map; damaged entries are rebuilt."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import gguf_files as files
from enginekit.errors import EngineStartupError
from enginekit.model.formats import weight_cache, weight_cache_entry
from enginekit.model.formats.gguf import read_gguf_config
from enginekit.model.formats.gguf_weights import read_gguf_weights

KEY = {"dtype": "float32", "layout": "test-1"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ENGINEKIT_CACHE", str(root))
    return root


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(b"source weights")
    return path


class Builder:
    """A build function that counts its calls; ~1.8 MiB of tensors, so the data spans several chunks."""

    def __init__(self, seed: int = 0) -> None:
        self.calls = 0
        self.seed = seed

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        generator = torch.Generator().manual_seed(self.seed)
        return {
            "embed.weight": torch.randn(640, 512, generator=generator),
            "layer.0.weight": torch.randn(512, 512, generator=generator).to(torch.bfloat16),
            "norm.weight": torch.rand(512, generator=generator),
        }


def entry_of(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return entry


def assert_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    assert all(
        left[name].dtype == right[name].dtype and torch.equal(left[name], right[name]) for name in left
    )


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds this tensor's memory, from /proc/self/maps."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def test_the_second_load_maps_the_entry_without_building(cache, source):
    build = Builder()
    first = weight_cache.load_or_build(source, key_parts=KEY, build=build)
    second = weight_cache.load_or_build(source, key_parts=KEY, build=build)
    assert build.calls == 1
    assert_equal(first, build())
    assert_equal(second, first)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_mapped_tensors_live_in_the_cache_file(cache, source):
    weight_cache.load_or_build(source, key_parts=KEY, build=Builder())
    tensors = weight_cache.load_or_build(source, key_parts=KEY, build=Builder())
    weights_file = str(entry_of(cache) / weight_cache_entry.WEIGHTS_FILE)
    assert {mapped_file(tensor) for tensor in tensors.values()} == {weights_file}


def anonymous_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_mapping_a_large_entry_does_not_copy_it(cache, source):
    size = 64 << 20

    def build():
        return {"big": torch.ones(size // 4)}

    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    before = anonymous_rss_bytes()
    tensors = weight_cache.load_or_build(source, key_parts=KEY, build=build)
    assert float(tensors["big"].sum()) == size // 4  # touch every page
    assert anonymous_rss_bytes() - before < size // 4


def test_engine_kit_cache_is_respected(cache, source):
    assert weight_cache.cache_dir() == cache
    weight_cache.load_or_build(source, key_parts=KEY, build=Builder())
    entry = entry_of(cache)
    assert entry.name.startswith("model-")
    assert {p.name for p in entry.iterdir()} == {
        weight_cache_entry.WEIGHTS_FILE,
        weight_cache_entry.MANIFEST_FILE,
    }


def test_the_default_cache_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("ENGINEKIT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert weight_cache.cache_dir() == tmp_path / ".cache" / "enginekit"


def test_other_key_parts_or_a_changed_source_get_their_own_entry(cache, source):
    build = Builder()
    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    weight_cache.load_or_build(source, key_parts=KEY | {"dtype": "bfloat16"}, build=build)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000_000))
    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    assert build.calls == 3
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 3


def truncate(weights: Path) -> None:
    os.truncate(weights, weights.stat().st_size - 100)


def flip_data_bytes(weights: Path) -> None:
    """Overwrite bytes in the middle of the data with an ordinary write: the mtime changes, so every chunk is checked.

    The mtime is also moved on explicitly: a write within the same clock tick as the build would keep it.
    """
    stat = weights.stat()
    with open(weights, "r+b") as file:
        file.seek(stat.st_size // 2)
        data = file.read(16)
        file.seek(-16, os.SEEK_CUR)
        file.write(bytes(b ^ 0xFF for b in data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def flip_first_chunk_keeping_mtime(weights: Path) -> None:
    """Silent damage (mtime restored): caught by the chunks every load samples, the first among them."""
    stat = weights.stat()
    header_bytes = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as file:
        file.seek(header_bytes + 1000)
        file.write(b"\x00\x11\x22\x33")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def garbage_header(weights: Path) -> None:
    with open(weights, "r+b") as file:
        file.seek(8)
        file.write(b"#not json at all")


def swap_tensor_set(weights: Path) -> None:
    """A valid safetensors file of other tensors, exactly as large, in place of the entry's."""
    from safetensors.torch import save_file

    size = weights.stat().st_size
    save_file({"other": torch.zeros(1)}, str(weights))
    with open(weights, "ab") as file:
        file.truncate(size)


DAMAGES = {
    "truncated": lambda entry: truncate(entry / weight_cache_entry.WEIGHTS_FILE),
    "flipped data": lambda entry: flip_data_bytes(entry / weight_cache_entry.WEIGHTS_FILE),
    "silent flip": lambda entry: flip_first_chunk_keeping_mtime(entry / weight_cache_entry.WEIGHTS_FILE),
    "garbage header": lambda entry: garbage_header(entry / weight_cache_entry.WEIGHTS_FILE),
    "wrong tensor set": lambda entry: swap_tensor_set(entry / weight_cache_entry.WEIGHTS_FILE),
    "missing manifest": lambda entry: (entry / weight_cache_entry.MANIFEST_FILE).unlink(),
    "manifest of garbage": lambda entry: (entry / weight_cache_entry.MANIFEST_FILE).write_text("{"),
    "missing weights": lambda entry: (entry / weight_cache_entry.WEIGHTS_FILE).unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_logged_removed_and_rebuilt(cache, source, caplog, damage):
    build = Builder()
    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    DAMAGES[damage](entry_of(cache))
    with caplog.at_level(logging.WARNING, logger="enginekit.weight_cache"):
        rebuilt = weight_cache.load_or_build(source, key_parts=KEY, build=build)
    assert build.calls == 2
    assert_equal(rebuilt, build())
    assert any(r.levelno == logging.WARNING and "damaged" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert_equal(weight_cache.load_or_build(source, key_parts=KEY, build=build), rebuilt)
    assert build.calls == 3  # the call above, for comparing; the load itself built nothing
    assert not caplog.records


def test_a_write_to_a_chunk_no_load_samples_is_still_caught(cache, source, caplog, monkeypatch):
    """Sampling only the first and last of 40 chunks; the changed mtime makes the load check all of them."""
    monkeypatch.setattr(weight_cache_entry, "NUM_SAMPLED_CHUNKS", 0)

    def build():
        return {"big": torch.arange(10 << 20, dtype=torch.float32)}

    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    flip_data_bytes(entry_of(cache) / weight_cache_entry.WEIGHTS_FILE)
    calls = []
    with caplog.at_level(logging.WARNING, logger="enginekit.weight_cache"):
        tensors = weight_cache.load_or_build(source, key_parts=KEY, build=lambda: calls.append(1) or build())
    assert calls == [1]
    assert "data checksum mismatch" in caplog.text
    assert torch.equal(tensors["big"], build()["big"])


def test_a_copied_entry_is_fully_checked_once_then_trusted(cache, source):
    """A new inode (e.g. the cache copied elsewhere) makes the next load check every chunk and renew the stamp."""
    build = Builder()
    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    weights = entry_of(cache) / weight_cache_entry.WEIGHTS_FILE
    copy = weights.with_name("copy")
    copy.write_bytes(weights.read_bytes())
    os.replace(copy, weights)
    weight_cache.load_or_build(source, key_parts=KEY, build=build)
    manifest = json.loads((entry_of(cache) / weight_cache_entry.MANIFEST_FILE).read_text())
    assert build.calls == 1
    assert manifest["stamp"] == [weights.stat().st_mtime_ns, weights.stat().st_ino]


def test_two_concurrent_builders_leave_one_valid_entry(cache, source):
    barrier = threading.Barrier(2)
    results, builders = [None, None], [Builder(), Builder()]

    def run(index: int) -> None:
        def build():
            barrier.wait(timeout=30)  # both are building before either publishes
            return builders[index]()

        results[index] = weight_cache.load_or_build(source, key_parts=KEY, build=build)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [b.calls for b in builders] == [1, 1]
    assert_equal(results[0], results[1])
    assert [p.name for p in cache.iterdir()] == [entry_of(cache).name]  # no temporary folders left
    again = Builder()
    assert_equal(weight_cache.load_or_build(source, key_parts=KEY, build=again), results[0])
    assert again.calls == 0


def test_an_unwritable_cache_logs_and_returns_the_built_tensors(tmp_path, monkeypatch, source, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("ENGINEKIT_CACHE", str(blocker / "cache"))
    build = Builder()
    with caplog.at_level(logging.WARNING, logger="enginekit.weight_cache"):
        tensors = weight_cache.load_or_build(source, key_parts=KEY, build=build)
    assert_equal(tensors, build())
    assert "cannot write weight cache entry" in caplog.text


def test_clear_cache_removes_only_entries(cache, source):
    weight_cache.load_or_build(source, key_parts=KEY, build=Builder())
    (cache / "notes.txt").write_text("mine")
    assert weight_cache.clear_cache() == 1
    assert [p.name for p in cache.iterdir()] == ["notes.txt"]


def test_a_missing_source_is_a_startup_error(cache, tmp_path):
    with pytest.raises(EngineStartupError, match=r"cannot read .*absent\.gguf"):
        weight_cache.load_or_build(tmp_path / "absent.gguf", key_parts=KEY, build=Builder())


def test_key_parts_must_be_strings(cache, source):
    with pytest.raises(TypeError, match="key_parts maps strings to strings"):
        weight_cache.load_or_build(source, key_parts={"dtype": torch.float32}, build=Builder())


def test_gguf_weights_round_trip_through_the_cache(cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    files.write_tiny_gguf(path, weight_type=files.Q.Q4_K)
    config = read_gguf_config(path)
    direct = read_gguf_weights(path, config, torch.bfloat16)
    for _ in range(2):
        cached = weight_cache.load_or_build(
            path,
            key_parts={"dtype": "bfloat16"},
            build=lambda: read_gguf_weights(path, config, torch.bfloat16),
        )
        assert_equal(cached, direct)


def build_entry(tmp_path, name: str) -> Path:
    """An entry for a source file of its own; returns the source file."""
    source = tmp_path / f"{name}.bin"
    source.write_bytes(name.encode())
    weight_cache.load_or_build(source, key_parts=KEY, build=Builder())
    return source


def entry_names(cache: Path) -> set[str]:
    return {entry.path.name.split("-")[0] for entry in weight_cache.list_entries()}


def test_the_cache_stays_under_its_size_bound_evicting_the_least_recently_used(cache, tmp_path, monkeypatch):
    first = build_entry(tmp_path, "first")
    one_entry = weight_cache.list_entries()[0].num_bytes
    monkeypatch.setenv("ENGINEKIT_CACHE_MAX_BYTES", str(one_entry * 5 // 2))  # room for two
    build_entry(tmp_path, "second")
    weight_cache.load_or_build(first, key_parts=KEY, build=Builder())  # used again: now the most recent
    build_entry(tmp_path, "third")
    assert entry_names(cache) == {"first", "third"}
    assert sum(entry.num_bytes for entry in weight_cache.list_entries()) <= one_entry * 5 // 2


def test_entries_unused_for_longer_than_the_age_bound_are_removed(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINEKIT_CACHE_MAX_AGE_DAYS", "7")
    old = build_entry(tmp_path, "old")
    entry = next(e.path for e in weight_cache.list_entries())
    eight_days_ago = time.time() - 8 * 86400
    os.utime(entry, (eight_days_ago, eight_days_ago))
    build_entry(tmp_path, "new")
    assert entry_names(cache) == {"new"}
    assert old.exists()  # the source is never touched


def test_a_bad_bound_in_the_environment_is_refused_by_name(cache, monkeypatch):
    monkeypatch.setenv("ENGINEKIT_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="ENGINEKIT_CACHE_MAX_BYTES must be a size in bytes"):
        weight_cache.cache_limits()
    monkeypatch.setenv("ENGINEKIT_CACHE_MAX_BYTES", "1.5G")
    assert weight_cache.cache_limits()[0] == 3 << 29


def test_the_cache_command_lists_prunes_and_clears(cache, tmp_path):
    build_entry(tmp_path, "alpha")
    build_entry(tmp_path, "beta")

    def command(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "enginekit.cli", "cache", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    listing = command("list")
    assert "2 entries" in listing and "alpha-" in listing and "beta-" in listing
    assert "ENGINEKIT_CACHE_MAX_BYTES" in listing
    one_entry = weight_cache.list_entries()[0].num_bytes
    assert "removed 1 entries" in command("prune", "--max-bytes", str(one_entry * 3 // 2))
    assert len(weight_cache.list_entries()) == 1
    assert "removed 1 entries" in command("clear")
    assert weight_cache.list_entries() == []
