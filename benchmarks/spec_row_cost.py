"""What one more row costs a decode step on the default model: the figure behind speculative decoding's
``ROW_COST`` (``sdk/enginekit/core/speculative/plan.py``).

Run by hand (not part of ``run.py``): ``.venv/bin/python benchmarks/spec_row_cost.py [threads]``. One sequence with a
300-token context computes a chunk of 1 to 9 rows (a decode and its proposals), every row sampled, interleaved
over 25 rounds; prints each row count's median step time as a multiple of the one-row step's.
"""

from __future__ import annotations

import statistics
import sys
import time

from enginekit.config import EngineConfig
from enginekit.core.engine_core import EngineCore
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.sampling_params import SamplingParams

CONTEXT = 300
ROWS = (1, 2, 3, 5, 9)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    core = EngineCore(EngineConfig(num_threads=threads, num_kv_blocks=64))
    try:
        runner, params, blocks = core.runner, SamplingParams(temperature=0, max_tokens=8), list(range(32))
        prompt = SequenceChunk(list(range(100, 100 + CONTEXT)), 0, blocks, sampling_params=params, seq_id="s")
        runner.execute(ScheduledBatch([prompt], 32))

        def step(rows: int) -> float:
            chunk = SequenceChunk(
                [5] * rows,
                CONTEXT,
                blocks,
                sampling_params=params,
                seq_id="s",
                draft_token_ids=[5] * (rows - 1),
            )
            start = time.perf_counter()
            runner.execute(ScheduledBatch([chunk], 32))
            return time.perf_counter() - start

        times: dict[int, list[float]] = {rows: [] for rows in ROWS}
        for _ in range(25):
            for rows in ROWS:
                times[rows].append(step(rows))
        one = statistics.median(times[1])
        print(f"one-row step: {one * 1000:.1f} ms ({threads} threads)")
        for rows in ROWS[1:]:
            ratio = statistics.median(times[rows]) / one
            print(f"{rows} rows: {ratio:.2f}x the one-row step, {(ratio - 1) / (rows - 1):.2f} per extra row")
    finally:
        core.shutdown()


if __name__ == "__main__":
    main()
