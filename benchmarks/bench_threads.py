"""Section: torch threads and OpenMP wait policy in both modes, on a quiet machine and beside a busy process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from .common import (
    equal_workload,
    interleave,
    kv_blocks_for,
    log,
    make_engine,
    paired_ratio,
    rate_runners,
    session,
    usable_cores,
)
from .figures import median, rate, summary, target
from .stats import markdown_table

SPIN = "300000"  # the launcher's default (libgomp's own): spin some milliseconds at a barrier, then sleep
SHORT_SPIN = "10000"  # the previous default: about 0.3 ms here

# (label, mode, torch threads (None: the engine's default; 0: every core), environment for the engine process,
# engine options). In-process engines run in this process, whose OpenMP wait policy was fixed when it imported
# torch (libgomp's: workers spin some milliseconds at a barrier, then sleep): a passive wait is measured in an
# engine process instead, the same engine core with OMP_WAIT_POLICY=PASSIVE.
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
    (
        "mp all cores, passive wait, fixed threads",
        "mp",
        None,
        {"OMP_WAIT_POLICY": "PASSIVE"},
        {"adaptive_threads": False},
    ),
    ("mp 1 thread", "mp", 1, {}, {}),
    ("inproc default (all cores, adaptive threads)", "inproc", 0, {}, {}),
    (
        "inproc all cores, fixed threads (the previous default)",
        "inproc",
        0,
        {},
        {"adaptive_threads": False},
    ),
)
DEFAULTS = (VARIANTS[0][0], VARIANTS[5][0])  # what Engine() gives in each mode


def sizes(quick: bool) -> dict[str, Any]:
    # NOTE: no 32: spinning workers beside a busy process run at a tenth of the speed, minutes per round.
    if quick:
        return dict(concurrency=(8,), lengths=(16, 8), repeats=1)
    return dict(concurrency=(1, 8), lengths=(32, 16), repeats=2)


def run_threads_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    cores = usable_cores()
    size = sizes(quick)
    concurrency_list, (prompt_len, output_len), repeats = (
        size["concurrency"],
        size["lengths"],
        size["repeats"],
    )
    spec = ctx.model("smollm2")
    figures: dict[str, Any] = {
        "cores": cores,
        "lengths": [prompt_len, output_len],
        "repeats": repeats,
        "label": spec.label,
        "spin": SPIN,
        "short_spin": SHORT_SPIN,
        "rows": [],
        "targets": [],
    }
    if cores == 1:
        return figures
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
                    log(f"threads: {load} x{concurrency}")
                    batch = equal_workload(concurrency, prompt_len, output_len)
                    runners = rate_runners(engines, spec, batch, seed=concurrency, inproc_threads=cores)
                    for label, values in interleave(runners, repeats=repeats, warmup=1).items():
                        samples[(label, concurrency, load)] = values
    finally:
        for engine in engines.values():
            engine.shutdown()
    default = DEFAULTS[0]
    for load in ("quiet", "loaded"):
        for concurrency in concurrency_list:
            base = samples[(default, concurrency, load)]
            figures["rows"].append(
                {
                    "load": load,
                    "concurrency": concurrency,
                    "rates": {label: summary(samples[(label, concurrency, load)]) for label, *_ in VARIANTS},
                    "against_default": {
                        label: summary(paired_ratio(samples[(label, concurrency, load)], base))
                        for label, *_ in VARIANTS[1:]
                    },
                }
            )
    for row in figures["rows"]:
        if row["concurrency"] != max(concurrency_list):
            continue
        best = max(median(row["rates"][label]) for label, *_ in VARIANTS)
        for mode, label in zip(("mp", "inproc"), DEFAULTS):
            figures["targets"].append(
                target(
                    f"threads, {row['load']}, {row['concurrency']} concurrent: the default {mode} engine / the best setup",
                    0.9 if mode == "mp" else 0.8,
                    median(row["rates"][label]) / best,
                )
            )
    return figures


def render_threads_bench(figures: dict[str, Any]) -> str:
    if figures["cores"] == 1:
        return "This machine has one core: there is no thread count to choose.\n"
    prompt_len, output_len = figures["lengths"]
    parts = [
        f"{figures['label']}, *N* requests of {prompt_len}-token prompts and {output_len} tokens, "
        f"{figures['repeats']} interleaved rounds, {len(VARIANTS)} setups. The background engine (mp) as it starts by "
        f"default: up to {figures['cores']} threads, as many as other processes leave free, OpenMP workers that spin "
        f"at a barrier (`GOMP_SPINCOUNT={figures['spin']}`) then sleep; the same with the previous short spin "
        f"(`GOMP_SPINCOUNT={figures['short_spin']}`); with its threads fixed (`adaptive_threads=False`); fixed and "
        "waiting passively (`OMP_WAIT_POLICY=PASSIVE`: workers sleep at once, woken by a futex); with 1 thread. The "
        "in-process engine (inproc) on all cores as it starts by default (the same governor, applied inside each step; "
        "this process's workers spin, libgomp's default, fixed once torch has loaded) and with its threads fixed (the "
        "previous default: an in-process engine cannot wait passively unless `OMP_WAIT_POLICY` was set before torch "
        "loaded, which the mp row shows). *Loaded* runs the same rounds beside one process spinning on one core "
        '(`python -c "while True: pass"`). tokens/s, and against the default background engine.\n'
    ]
    # One row per setup, one column per load and concurrency: the two modes' defaults and the alternatives read
    # down a column.
    columns = [(row["load"], row["concurrency"]) for row in figures["rows"]]
    by_column = {(row["load"], row["concurrency"]): row for row in figures["rows"]}
    rows = []
    for label, *_ in VARIANTS:
        cells: list[Any] = [label]
        for column in columns:
            row = by_column[column]
            against = row["against_default"].get(label)
            ratio = "" if against is None else f"; {median(against):.2f}x"
            cells.append(f"{rate(row['rates'][label], 1)}{ratio}")
        rows.append(cells)
    headers = ["setup", *(f"{load}, {concurrency} concurrent" for load, concurrency in columns)]
    parts.append(markdown_table(headers, rows, ["l"] * len(headers)))
    return "\n".join(parts)


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
