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
SPIN = "300000"  # the launcher's default (libgomp's own): spin some milliseconds at a barrier, then sleep
SHORT_SPIN = "10000"  # the previous default: about 0.3 ms here

# (label, mode, torch threads (None: the engine's default), environment for the engine process, engine options)
VARIANTS: tuple[tuple[str, str, int | None, dict[str, str], dict[str, Any]], ...] = (
    ("mp default (all cores, long spin, adaptive threads)", "mp", None, {}, {}),
    (
        "mp all cores, short spin, adaptive threads (the previous default)",
        "mp",
        None,
        {"GOMP_SPINCOUNT": SHORT_SPIN},
        {},
    ),
    ("mp all cores, long spin, fixed threads", "mp", None, {}, {"adaptive_threads": False}),
    ("mp 1 thread", "mp", 1, {}, {}),
    ("inproc all cores (this process: spinning)", "inproc", 0, {}, {}),
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
{repeats} interleaved rounds, in five setups: a background engine (mp) as it starts by default (up to
{cores} torch threads, as many as other processes leave cores free, checked four times a second; OpenMP
workers that spin at a barrier, `GOMP_SPINCOUNT={SPIN}` in its environment, some milliseconds, then sleep); the
previous default, the same with a short spin (`GOMP_SPINCOUNT={SHORT_SPIN}`); the default with its threads
fixed (`adaptive_threads=False`); a background engine with 1 torch thread; and an in-process engine on
all cores (this process's OpenMP runtime, which spins: the policy is read once, when torch loads). *Loaded*
runs the same rounds beside one other process spinning on one core (`python -c "while True: pass"`), as a
notebook user's laptop running anything else. Ratios are against the default mp setup, per round.
"""
    if cores == 1:
        report.findings.append("This machine has one core: there is no thread count to choose.")
        return
    workload = equal_workload(max(concurrency_list), prompt_len, output_len)
    engines: dict[str, Any] = {}
    samples: dict[tuple[str, int, str], list[float]] = {}
    try:
        for label, mode, threads, environ, options in VARIANTS:
            with _environ(environ):
                engines[label] = make_engine(
                    spec,
                    mode,
                    num_threads=cores if threads == 0 else threads,
                    num_kv_blocks=kv_blocks_for(workload),
                    **options,
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
    report.limits = """
An OpenMP parallel region ends at a barrier: every worker must arrive before the op returns. A passive
worker sleeps there and is woken by a futex at the next op: tens of microseconds on this VM, at each of the
hundreds of ops in a step. A spinning worker is ready at once, but holds its core while it waits, so beside
another busy process the worker that a barrier waits for is often the descheduled one, and every op waits a
scheduler tick for it. One torch thread has no barriers at all, and is the fastest beside a busy process,
but leaves half the machine idle on a quiet one.

The default combines them: workers spin some milliseconds (long enough to span every gap between one op and the
next, the Python between two steps included, then they sleep, so an idle engine leaves its cores), and the
engine process counts, four times a second,
the CPU other processes took on its cores (`/proc/stat` less its own time) and runs as many threads as they
leave free (`core/threads.py`). A user's `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or `KMP_BLOCKTIME` wins (the
launcher reads the environment when it imports torch), and `adaptive_threads=False` fixes the thread count.
An in-process engine cannot change the policy of an OpenMP runtime that is already loaded; a notebook user
on a busy laptop can set `OMP_WAIT_POLICY=PASSIVE` before importing torch, or run the engine in the
background. The governor reacts within about half a second of work (two readings that agree; waits for
requests are taken out of its window), so a busy process
that starts mid-request costs that long. Pinning threads to cores was not tried: on a machine shared with
other work it makes a descheduled worker wait for its own core instead of any free one.

The previous default spun about 0.3 ms (`GOMP_SPINCOUNT=10000`). A step of the real model has gaps longer than
that between its parallel regions, so a worker fell asleep inside steps and paid a futex wake-up, hundreds of
microseconds on this VM after a longer sleep, at the next op. Beside a busy process the spin length does not
matter: the governor has dropped to one thread, which never waits at a barrier.
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
