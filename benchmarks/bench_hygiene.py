"""Section 8: what the front-end process holds after many restarts, per mode (``enginekit.diagnostics``)."""

from __future__ import annotations

import time
from typing import Any

from .common import Context, greedy, make_engine
from .report import SectionReport
from .stats import fmt, summarize

TITLE = "Restart hygiene"
MODES = ("inproc", "mp", "async", "mp, data_parallel_size=2")
_MIB = 2**20


def run(ctx: Context, report: SectionReport) -> None:
    from enginekit.diagnostics import snapshot, wait_until_clean

    restarts = ctx.pick(5, 50)
    dp_restarts = ctx.pick(5, 20)
    spec = ctx.model("builtin")
    report.method = f"""
Per mode: one warm-up cycle (start, generate, shut down) loads what any first engine loads once (modules,
torch kernels, in mp/async the shared launcher process); then `enginekit.diagnostics.snapshot()` is the
baseline, an engine starts, and `engine.restart()` runs {restarts} times, each followed by a small
`generate` (4 prompts x 8 tokens) so that every restarted engine really served requests. After
`engine.shutdown()`, `wait_until_clean(baseline, timeout=15)` polls until the process is back to the
baseline or the time is up, and the remaining difference is reported. RSS growth per restart is the
least-squares slope of the front end's RSS (while running) over the restarts. The front end is this
process; in mp and async modes each engine process is new and its exit is checked as a child process.
"""
    rows = []
    one_time = []
    for variant in MODES:
        mode, _, dp = variant.partition(", ")
        options = {"data_parallel_size": 2} if dp else {}
        count = dp_restarts if dp else restarts
        ctx.log(f"hygiene: {variant}, {count} restarts")
        before_any = snapshot()
        warm = make_engine(spec, mode, **options)
        _serve(warm)
        warm.shutdown()
        time.sleep(0.5)  # let the warm-up engine's threads and process finish exiting
        baseline = snapshot()
        engine = make_engine(spec, mode, **options)
        times, rss = [], []
        try:
            _serve(engine)
            first_rss = snapshot(collect=False).rss_bytes
            for _ in range(count):
                t0 = time.perf_counter()
                engine.restart()
                times.append(time.perf_counter() - t0)
                _serve(engine)
                rss.append(snapshot(collect=False).rss_bytes)
        finally:
            engine.shutdown()
        diff = wait_until_clean(baseline, timeout=15)
        leaks = diff.leaks()
        slope = _slope(rss) / _MIB
        rows.append(
            [
                variant,
                count,
                fmt(summarize(times).scaled(1e3), "ms", 0),
                f"{first_rss / _MIB:.0f}",
                f"{rss[-1] / _MIB:.0f}",
                f"{slope:+.2f}",
                f"{diff.rss_bytes / _MIB:+.1f}",
                f"{diff.threads:+d}",
                f"{diff.fds:+d}",
                f"{diff.children:+d}",
                f"{diff.gc_freeze_count:+d}",
                f"{diff.tensors:+d}",
                "clean" if not leaks else "; ".join(leaks),
            ]
        )
        first = before_any.diff(baseline)
        one_time.append(
            f"{variant}: the first engine of the process leaves {first.rss_bytes / _MIB:+.0f} MiB RSS, "
            f"{first.threads:+d} threads, {first.fds:+d} fds, {first.children:+d} child processes "
            "(one-time, before the baseline)"
        )
    report.table(
        "Front-end process after the restarts (RSS in MiB; differences are after shutdown against the baseline)",
        [
            "mode",
            "restarts",
            "restart time",
            "RSS after first start",
            "RSS after the last restart",
            "RSS MiB per restart",
            "RSS after shutdown",
            "threads",
            "fds",
            "children",
            "gc frozen",
            "tensors",
            "verdict (diagnostics.leaks)",
        ],
        rows,
        ["l", "r", "l", "r", "r", "r", "r", "r", "r", "r", "r", "r", "l"],
    )
    report.findings.extend(one_time)
    report.limits = """
RSS after shutdown is what the allocator keeps, not necessarily a leak: glibc's malloc and torch's CPU
allocator keep freed memory for reuse, so the figure to watch is the growth per restart, which should be
zero within noise. Threads, fds, child processes, frozen gc objects and tensors must come back exactly.
The first engine of a process loads modules and, in mp and async modes, starts the shared launcher
process (one child that stays for the life of the front end); those are one-time costs, reported apart.

What would move it: nothing needs to if the per-restart growth is zero; where it is not, the snapshot's
thread names and the diff's new child pids name the culprit.
"""


def _serve(engine: Any) -> None:
    prompts = [{"prompt_token_ids": [10 + i, 20, 30, 40]} for i in range(4)]
    outputs = engine.generate(prompts, greedy(8), progress=False)
    if sum(len(o.outputs[0].token_ids) for o in outputs) != 32:
        raise RuntimeError("a restarted engine did not generate the expected tokens")


def _slope(values: list[int]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    var = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / var
