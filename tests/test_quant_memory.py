"""The memory of weights kept as stored: the GGUF file mapped read-only and computed on in place, so an engine's
weights cost the file's pages, and engine processes on one machine (data-parallel ranks, restarts) share them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from enginekit import Engine, SamplingParams
from enginekit.model.formats.source import default_model_file

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/<pid>/smaps"
)


def file_mapping(pid: int, path: Path) -> dict[str, int]:
    """The kB fields of /proc/<pid>/smaps (Rss, Shared_Clean, Private_Dirty, ...) summed over the mappings of
    ``path``."""
    totals: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: address perms offset dev inode [path]
            inside = len(fields) >= 6 and os.path.realpath(fields[5]) == str(path)
        elif inside and fields[0].endswith(":") and len(fields) == 3 and fields[2] == "kB":
            totals[fields[0][:-1]] = totals.get(fields[0][:-1], 0) + int(fields[1])
    return totals


def test_data_parallel_ranks_share_the_pages_of_the_file():
    path = Path(os.path.realpath(default_model_file()))
    size_kb = path.stat().st_size // 1024
    with Engine(mode="mp", data_parallel_size=2, quantization="gguf") as engine:
        engine.generate(["Hello", "Bonjour", "Hola", "Ciao"], SamplingParams(max_tokens=4, ignore_eos=True))
        mappings = [file_mapping(pid, path) for pid in engine.client.engine_pids]
    for mapping in mappings:
        # the tied LM head reads the whole token embedding at every step: nearly all of the file is resident
        assert mapping["Rss"] > 0.8 * size_kb, mapping
        assert mapping["Private_Dirty"] == 0 and mapping["Private_Clean"] < 0.05 * size_kb, (
            mapping
        )  # never copied
        assert mapping["Shared_Clean"] > 0.95 * mapping["Rss"], mapping  # the same pages in both ranks
