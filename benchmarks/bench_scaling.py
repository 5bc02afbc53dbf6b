"""Time per decode step against batch size and context length, on the engine core directly."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .common import ModelSpec, greedy, log, session
from .figures import rate, summary
from .stats import Summary, markdown_table, summarize

BLOCK_SIZE = 16
PREFILL_BUDGET = 2048  # the engine's default max_num_batched_tokens


class DecodeBench:
    """An ``EngineCore`` with a KV cache large enough for every cell; brings a batch to steady decode.

    Each cell adds ``batch`` requests with distinct random prompts of ``context`` tokens, steps until all of
    them are running and every one needs exactly one new token (pure decode), then hands out timed steps.
    """

    def __init__(
        self, spec: ModelSpec, max_tokens_in_flight: int, max_context: int, seed: int = 0, **options: Any
    ) -> None:
        from enginekit import EngineConfig
        from enginekit.core.engine_core import EngineCore

        self.spec = spec
        self.rng = random.Random(seed)
        limit = spec.config.max_position_embeddings
        self.max_model_len = min(limit, max_context)
        num_blocks = max_tokens_in_flight // BLOCK_SIZE + 512
        config = EngineConfig.from_options(
            spec.engine_model,
            num_kv_blocks=num_blocks,
            max_model_len=self.max_model_len,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=PREFILL_BUDGET,
            **options,
        )
        self.core = EngineCore(config)
        self._ids = 0

    def actual_context(self, batch: int, context: int, steps: int) -> int:
        return min(context, self.max_model_len - headroom(batch, context, steps))

    @contextmanager
    def decoding(self, batch: int, context: int, steps: int) -> Iterator[Callable[[], float]]:
        """Within the block, each call of the yielded function runs one pure-decode step and returns its ms."""
        core = self.core
        context = self.actual_context(batch, context, steps)
        for _ in range(batch):
            self._ids += 1
            prompt = self.spec.random_prompt(context, self.rng)
            core.handle(_request(f"scaling-{self._ids}", prompt, greedy(self.max_model_len - context)))
        try:
            guard = 0
            while not self._steady(batch):
                core.step()
                guard += 1
                if guard > 10 * headroom(batch, context, steps):
                    raise RuntimeError(f"batch {batch} x context {context} never reached a steady decode")
            core.step()  # one warm decode step

            def step() -> float:
                if not self._steady(batch):
                    raise RuntimeError(
                        "the batch changed while measuring (a request finished or was preempted)"
                    )
                t0 = time.perf_counter()
                core.step()
                return (time.perf_counter() - t0) * 1e3

            yield step
        finally:
            core.abort_all()
            core.step()

    def _steady(self, batch: int) -> bool:
        scheduler = self.core.scheduler
        running = scheduler.running
        return (
            not scheduler.waiting
            and len(running) == batch
            and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        )

    def close(self) -> None:
        self.core.shutdown()


def headroom(batch: int, context: int, steps: int) -> int:
    """Tokens a request may grow by while the others prefill and while steps are measured."""
    return -(-batch * context // PREFILL_BUDGET) + steps + 16


def _request(request_id: str, prompt: list[int], params: Any) -> Any:
    from enginekit.wire.messages import EngineCoreRequest

    return EngineCoreRequest(request_id, prompt, params, time.time())


def measure(bench: DecodeBench, batch: int, context: int, steps: int) -> Summary:
    with bench.decoding(batch, context, steps) as step:
        return summarize(step() for _ in range(steps))


def run_scaling_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    batches = (1, 8, 32, 128) if quick else (1, 4, 16, 64, 128)
    contexts = (128, 1024, 4096) if quick else (128, 512, 1024, 2048, 4096)
    context_batches = (1, 8)
    cap = 8192 if quick else 16384  # prefilling long contexts dominates this section's runtime
    steps = 8 if quick else 16
    models = {}
    for spec in ctx.models():
        cells = [(b, 128) for b in batches]
        cells += [(b, c) for b in context_batches for c in contexts if c != 128 and b * c <= cap]
        in_flight = max(b * (c + headroom(b, c, steps)) for b, c in cells)
        longest = max(c + headroom(b, c, steps) for b, c in cells)
        bench = DecodeBench(spec, in_flight, longest)
        results: dict[tuple[int, int], Summary] = {}
        actual: dict[tuple[int, int], int] = {}
        try:
            for batch, context in cells:
                log(f"scaling: {spec.key} batch {batch} context {context}")
                actual[(batch, context)] = bench.actual_context(batch, context, steps)
                results[(batch, context)] = measure(bench, batch, context, steps)
        finally:
            bench.close()
        fixed, per_sequence = _line([(b, results[(b, 128)].median) for b in batches])
        batch = max(b for b in context_batches if any((b, c) in results for c in contexts if c != 128))
        _, per_context = _line([(c, results[(batch, c)].median) for c in contexts if (batch, c) in results])
        models[spec.key] = {
            "label": spec.label,
            "cells": [
                {"batch": b, "context": c, "measured_context": actual[(b, c)], "ms": summary(results[(b, c)])}
                for b, c in cells
            ],
            "fit": {
                "fixed_ms": fixed,
                "per_sequence_ms": per_sequence,
                "context_batch": batch,
                "per_1k_context_ms": per_context * 1e3,
            },
        }
    return {
        "threads": ctx.threads,
        "steps": steps,
        "batches": list(batches),
        "contexts": list(contexts),
        "context_batches": list(context_batches),
        "cap": cap,
        "models": models,
        "targets": [],
    }


def render_scaling_bench(figures: dict[str, Any]) -> str:
    parts = [
        f"`EngineCore` driven directly in this process ({figures['threads']} threads, no front end): *B* requests "
        f"with random prompts of *context* tokens are prefilled, then {figures['steps']} pure decode steps are "
        "timed one by one (`core.step()`: scheduling, inputs, forward, sampling, outputs). Cells with more than "
        f"{figures['cap']:,} tokens in flight are skipped; the built-in model's longest context is cut to fit its "
        "positions (the measured context is in brackets where it differs).\n"
    ]
    for model in figures["models"].values():
        cells = {(c["batch"], c["context"]): c for c in model["cells"]}
        base = cells[(1, 128)]["ms"]["median"]
        rows = [
            [
                b,
                rate(cells[(b, 128)]["ms"], 2),
                f"{cells[(b, 128)]['ms']['median'] * 1e3 / b:.0f}",
                f"{cells[(b, 128)]['ms']['median'] / base:.2f}x",
            ]
            for b in figures["batches"]
        ]
        parts.append(
            f"**{model['label']}**, context 128\n\n"
            + markdown_table(
                ["batch", "ms per step", "µs per token", "step / batch-1 step"], rows, ["r", "r", "r", "r"]
            )
        )
        rows = []
        for context in figures["contexts"]:
            row: list[Any] = [context]
            for b in figures["context_batches"]:
                cell = cells.get((b, context))
                if cell is None:
                    row.append("skipped")
                else:
                    measured = "" if cell["measured_context"] == context else f" [{cell['measured_context']}]"
                    row.append(rate(cell["ms"], 2) + measured)
            rows.append(row)
        parts.append(
            markdown_table(
                ["context", *(f"batch {b}, ms" for b in figures["context_batches"])],
                rows,
                ["r"] + ["r"] * len(figures["context_batches"]),
            )
        )
        fit = model["fit"]
        parts.append(
            f"A least-squares line: a step takes {fit['fixed_ms']:.2f} ms + {fit['per_sequence_ms'] * 1e3:.0f} µs per "
            f"sequence at context 128; at batch {fit['context_batch']}, each 1k tokens of context adds "
            f"{fit['per_1k_context_ms']:.2f} ms per step.\n"
        )
    return "\n".join(parts)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    return mean_y - slope * mean_x, slope
