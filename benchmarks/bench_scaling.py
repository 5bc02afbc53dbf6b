"""Section 6: time per decode step against batch size and context length, on the engine core directly."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .common import Context, ModelSpec, greedy
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Scaling: decode step time against batch size and context length"
BLOCK_SIZE = 16
PREFILL_BUDGET = 2048  # the engine's default max_num_batched_tokens


class DecodeBench:
    """An ``EngineCore`` with a KV cache large enough for every cell; brings a batch to steady decode.

    Each cell adds ``batch`` requests with distinct random prompts of ``context`` tokens, steps until all of
    them are running and every one needs exactly one new token (pure decode), then hands out timed steps.
    """

    def __init__(self, spec: ModelSpec, max_tokens_in_flight: int, max_context: int, seed: int = 0) -> None:
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


def run(ctx: Context, report: SectionReport) -> None:
    batches = ctx.pick((1, 8, 32, 128), (1, 2, 4, 8, 16, 32, 64, 128))
    contexts = ctx.pick((128, 1024, 4096), (128, 512, 1024, 2048, 4096))
    context_batches = ctx.pick((1, 8), (1, 8, 32))
    cap = ctx.pick(8192, 32768)  # prefilling long contexts dominates this section's runtime
    steps = ctx.pick(8, 20)
    report.method = f"""
Drives `EngineCore` directly in this process ({ctx.threads} torch threads, no front end): *B* requests with
distinct random prompts of *context* tokens are prefilled, then {steps} pure decode steps (each produces
one token for each of the *B* requests) are timed one by one with `core.step()`: scheduling, input
preparation, the forward pass, sampling and output bookkeeping. Batch sizes {", ".join(map(str, batches))}
at context 128; contexts {", ".join(map(str, contexts))} at batch {", ".join(map(str, context_batches))}
(cells with more than {cap:,} tokens in flight are skipped). The built-in model has 4096 positions, so its
longest context is cut to leave room for the decode steps (the column shows the context measured).
"""
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
                ctx.log(f"scaling: {spec.key} batch {batch} context {context}")
                actual[(batch, context)] = bench.actual_context(batch, context, steps)
                results[(batch, context)] = measure(bench, batch, context, steps)
        finally:
            bench.close()
        base = results[(1, 128)].median
        rows = [
            [
                b,
                fmt(results[(b, 128)], "", 2),
                f"{results[(b, 128)].median * 1e3 / b:.0f}",
                f"{results[(b, 128)].median / base:.2f}x",
            ]
            for b in batches
        ]
        report.table(
            f"{spec.label}: decode step time against batch size (context 128)",
            ["batch", "ms per step", "us per token", "step / batch-1 step"],
            rows,
            ["r", "l", "r", "r"],
        )
        rows = []
        for context in contexts:
            row: list[Any] = [_context_label(context, [actual.get((b, context)) for b in context_batches])]
            for b in context_batches:
                summary = results.get((b, context))
                row.append("skipped" if summary is None else fmt(summary, "", 2))
            rows.append(row)
        report.table(
            f"{spec.label}: decode step time (ms) against context length",
            ["context"] + [f"batch {b}" for b in context_batches],
            rows,
            ["r"] + ["l"] * len(context_batches),
        )
        report.findings.append(_fit_line(spec, results, batches, contexts, context_batches))
    report.limits = """
A decode step has a fixed cost that does not depend on the batch (Python in the scheduler and runner,
building index tensors, about 15 torch ops per layer each paying dispatch overhead, and one attention call
per layer) and a per-sequence cost (the projections' extra rows, the output bookkeeping and
detokenization per request). On these tiny models the fixed cost dominates up to tens of sequences, which is
why a larger batch is nearly free per token. Context length enters through paged attention: each step
gathers every sequence's whole context from the cache (one index per block, still a copy) before
`scaled_dot_product_attention`, so the per-step cost grows linearly with batch x context, and with mixed
lengths every sequence is padded to the longest.

What would move it: attention that reads the paged cache in place (no gather copy; a fused kernel), decode
metadata (slot tables) kept on the engine and updated incrementally instead of rebuilt from Python lists
every step, and fewer Python-level ops per layer (fused QKV + rotary, CUDA graphs / torch.compile on GPU).
"""


def _context_label(context: int, actual: Sequence[int | None]) -> str:
    measured = {a for a in actual if a is not None}
    if measured and measured != {context}:
        return f"{context} (measured {', '.join(map(str, sorted(measured)))})"
    return str(context)


def _fit_line(
    spec: ModelSpec,
    results: dict[tuple[int, int], Summary],
    batches: Sequence[int],
    contexts: Sequence[int],
    context_batches: Sequence[int],
) -> str:
    """Least-squares lines: step ms against batch (context 128), and against context at the largest batch."""
    fixed, per_sequence = _line([(b, results[(b, 128)].median) for b in batches])
    batch = max(b for b in context_batches if any((b, c) in results for c in contexts if c != 128))
    points = [(c, results[(batch, c)].median) for c in contexts if (batch, c) in results]
    _, per_context = _line(points)
    return (
        f"{spec.key}: step time ~= {fixed:.2f} ms + {per_sequence * 1e3:.0f} us per sequence (context 128); "
        f"at batch {batch} each extra 1k tokens of context adds {per_context * 1e3:.2f} ms per step "
        f"({per_context * 1e6 / batch:.0f} us per sequence)."
    )


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    return mean_y - slope * mean_x, slope
