"""Section: torch threads and OpenMP wait policy per mode, on a quiet machine and beside a busy process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from .common import (
    Context,
    engine_batch_runner,
    equal_workload,
    interleave,
    kv_blocks_for,
    make_engine,
    paired_ratio,
    usable_cores,
)
from .report import SectionReport
from .stats import Summary, fmt, summarize

TITLE = "Thread count and OpenMP wait policy per mode, quiet and loaded"
LIBGOMP_DEFAULT_SPIN = "300000"  # libgomp's own spin count when OMP_WAIT_POLICY is unset
SHORT_SPIN = "10000"  # a middle ground: spin a few microseconds at a barrier, then sleep

# (label, mode, torch threads (None: the engine's default), environment for the engine process)
VARIANTS: tuple[tuple[str, str, int | None, dict[str, str]], ...] = (
    ("mp default (all cores, passive)", "mp", None, {}),
    ("mp all cores, spinning", "mp", None, {"GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}),
    ("mp all cores, short spin", "mp", None, {"GOMP_SPINCOUNT": SHORT_SPIN}),
    ("mp 1 thread, passive", "mp", 1, {}),
    ("inproc all cores (this process: spinning)", "inproc", 0, {}),
)


def run(ctx: Context, report: SectionReport) -> None:
    cores = usable_cores()
    # NOTE: no 32: spinning workers beside a busy process run at a tenth of the speed, minutes per round.
    concurrency_list = (1, 8)
    prompt_len, output_len = ctx.pick((16, 8), (64, 16))
    repeats = ctx.pick(1, 3)
    spec = ctx.model("smollm2")
    report.method = f"""
SmolLM2-135M-Instruct (float32), *N* requests of {prompt_len}-token prompts and {output_len} greedy tokens,
{repeats} interleaved rounds, in five setups: a background engine (mp) as it starts by default (torch
threads on all {cores} usable cores, OpenMP workers waiting passively: `OMP_WAIT_POLICY=PASSIVE` in its
environment), the same with libgomp's default spinning wait (`GOMP_SPINCOUNT={LIBGOMP_DEFAULT_SPIN}`) and with
a short spin (`GOMP_SPINCOUNT={SHORT_SPIN}`), a background engine with 1 torch thread, and an in-process engine on all cores (this process's OpenMP runtime,
which spins: the policy is read once, when torch loads). *Loaded* runs the same rounds beside one other
process spinning on one core (`python -c "while True: pass"`), as a notebook user's laptop running
anything else. Ratios are against the default mp setup, per round.
"""
    if cores == 1:
        report.findings.append("This machine has one core: there is no thread count to choose.")
        return
    workload = equal_workload(max(concurrency_list), prompt_len, output_len)
    engines: dict[str, Any] = {}
    samples: dict[tuple[str, int, str], list[float]] = {}
    try:
        for label, mode, threads, environ in VARIANTS:
            with _environ(environ):
                engines[label] = make_engine(
                    spec,
                    mode,
                    num_threads=cores if threads == 0 else threads,
                    num_kv_blocks=kv_blocks_for(workload),
                )
        for load in ("quiet", "loaded"):
            with _busy_process() if load == "loaded" else contextlib.nullcontext():
                for concurrency in concurrency_list:
                    ctx.log(f"threads: {load} x{concurrency}")
                    batch = equal_workload(concurrency, prompt_len, output_len)
                    runners = {
                        label: _rate(
                            engine_batch_runner(
                                engine,
                                spec,
                                batch,
                                threads=cores if engine.mode == "inproc" else None,
                                seed=concurrency + i,
                            )
                        )
                        for i, (label, engine) in enumerate(engines.items())
                    }
                    for label, values in interleave(runners, repeats=repeats, warmup=1).items():
                        samples[(label, concurrency, load)] = values
    finally:
        for engine in engines.values():
            engine.shutdown()
    default = VARIANTS[0][0]
    ratios: dict[tuple[str, int, str], Summary] = {}
    for load in ("quiet", "loaded"):
        rows = []
        for concurrency in concurrency_list:
            row: list[Any] = [concurrency]
            for label, *_ in VARIANTS:
                values = samples[(label, concurrency, load)]
                cell = fmt(summarize(values), "", 1)
                if label != default:
                    ratio = paired_ratio(values, samples[(default, concurrency, load)])
                    ratios[(label, concurrency, load)] = ratio
                    cell += f"; {ratio.median:.2f}x"
                row.append(cell)
            rows.append(row)
        report.table(
            f"{spec.label}, {load}: tokens/s (and against the default background engine)",
            ["concurrent", *[label for label, *_ in VARIANTS]],
            rows,
            ["r"] + ["l"] * len(VARIANTS),
        )
    for label, *_ in VARIANTS[1:]:
        quiet = [ratios[(label, c, "quiet")].median for c in concurrency_list]
        loaded = [ratios[(label, c, "loaded")].median for c in concurrency_list]
        report.findings.append(
            f"{label} / default: quiet {', '.join(f'{r:.2f}x' for r in quiet)}, loaded "
            f"{', '.join(f'{r:.2f}x' for r in loaded)} (at {', '.join(map(str, concurrency_list))} concurrent)."
        )
    report.limits = f"""
An OpenMP parallel region ends at a barrier: every worker must arrive before the op returns. A spinning
worker holds its core while it waits, so on {cores} cores with anything else runnable (another process, or
in mp mode the engine's own IO threads and the front end) the thread that the barrier waits for is often
the one that was descheduled, and each of the hundreds of ops per step waits a scheduler tick for it. A
passive worker sleeps at the barrier and is woken by a futex: a few microseconds per op on a quiet machine,
and no collapse on a busy one. One torch thread avoids barriers altogether but leaves half the machine
idle on a quiet one.

Defaults chosen from these figures: a background engine takes every usable core (shared out between
data-parallel ranks) and passive waits, unless the user sets `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or
`KMP_BLOCKTIME` (the launcher reads the environment when it imports torch). An in-process engine cannot
change the policy of an OpenMP runtime that is already loaded; a notebook user on a busy laptop can set
`OMP_WAIT_POLICY=PASSIVE` before importing torch. The short spin is the middle ground that was tried: it
bounds how long a worker holds its core at a barrier; its rows show how much of spinning's quiet gain it
keeps and what it still costs beside a busy process, where a passive default does not collapse. Pinning threads to cores was not tried: on a machine
shared with other work it makes a descheduled worker wait for its own core instead of any free one.
"""


def _rate(runner: Any) -> Any:
    return lambda: runner().tokens_per_s


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _busy_process() -> Iterator[None]:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()
