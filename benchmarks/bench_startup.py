"""Time to a ready engine and to restart it, next to ``python -c "import torch"``."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from .baselines import import_time
from .common import Context, ModelSpec, interleave, log, make_engine, paired_ratio, session
from .figures import rate, ratio, summary, target
from .stats import markdown_table

TARGET = 0.5  # a restart against `python -c "import torch"`

# Runs in a fresh interpreter: the time from Engine(...) to ready, as a notebook's first engine sees it.
_FIRST_START = r"""
import sys, time
from enginekit import Engine
model = sys.argv[1] or None
t0 = time.perf_counter()
engine = Engine(model, mode="mp")
print(time.perf_counter() - t0)
engine.shutdown()
"""


def run_startup_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    repeats = 1 if quick else 4
    runners: dict[str, Any] = {
        "torch": lambda: import_time("torch", repeats=1, warmup=0).median,
        "enginekit": lambda: import_time("enginekit.runtime.engine_main", repeats=1, warmup=0).median,
    }
    specs = _models(ctx)
    engines = {}
    try:
        for spec in specs:
            engines[spec.key] = make_engine(spec, "mp")
            runners[f"first-{spec.key}"] = lambda s=spec: _first_start(s)
            runners[f"start-{spec.key}"] = lambda s=spec: _timed_start(s, "mp")
            runners[f"restart-{spec.key}"] = lambda e=engines[spec.key]: _timed(e.restart)
            runners[f"inproc-{spec.key}"] = lambda s=spec: _timed_start(s, "inproc")
        log(f"startup: {len(runners)} variants x {repeats}")
        samples = interleave(runners, repeats=repeats, warmup=1)
    finally:
        for engine in engines.values():
            engine.shutdown()
    torch_s = samples["torch"]
    times = {name: summary(values) for name, values in samples.items()}
    ratios = {name: summary(paired_ratio(values, torch_s)) for name, values in samples.items()}
    targets = [
        target(f"{spec.key}: restart / `import torch`", TARGET, ratios[f"restart-{spec.key}"], at_least=False)
        for spec in specs
    ]
    return {
        "repeats": repeats,
        "models": {spec.key: _short(spec) for spec in specs},
        "seconds": times,
        "against_torch": ratios,
        "targets": targets,
    }


def render_startup_bench(figures: dict[str, Any]) -> str:
    seconds, ratios = figures["seconds"], figures["against_torch"]

    def row(label: str, key: str) -> list[str]:
        return [
            label,
            rate({k: v * 1e3 if k != "n" else v for k, v in seconds[key].items()}, 0),
            ratio(ratios[key]),
        ]

    rows = [
        row('`python -c "import torch"`', "torch"),
        row('`python -c "import enginekit.runtime.engine_main"`', "enginekit"),
    ]
    for key, name in figures["models"].items():
        rows += [
            row(f'first `Engine({name}, mode="mp")` in a fresh process', f"first-{key}"),
            row(f'`Engine({name}, mode="mp")`', f"start-{key}"),
            row(f"`engine.restart()` ({name}, mp)", f"restart-{key}"),
            row(f'`Engine({name}, mode="inproc")`', f"inproc-{key}"),
        ]
    return (
        '`Engine(..., mode="mp")` returns once the engine process has reported READY (model loaded, KV cache '
        "allocated). *restart* is `engine.restart()` on a running engine. *first start* runs in a fresh "
        "interpreter (enginekit and torch imported, the timer around `Engine(...)` only): a new notebook's first "
        f"engine. All variants alternate, {figures['repeats']} rounds after a warm-up round; the reference is "
        '`python -c "import torch"` with the same interpreter.\n\n'
        + markdown_table(["what", "ms", "/ import torch"], rows, ["l", "r", "r"])
    )


def _models(ctx: Context) -> list[ModelSpec]:
    """The tiny models, and the default real model (its restart maps the weight cache: 540 MB in float32)."""
    return [*ctx.models(), ctx.model("smollm2")]


def _short(spec: ModelSpec) -> str:
    return {"builtin": '"builtin"', "smollm2": '"smollm2-135m-instruct"'}.get(spec.key, "llama_dir")


def _timed(action: Any) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def _timed_start(spec: ModelSpec, mode: str, **options: Any) -> float:
    t0 = time.perf_counter()
    engine = make_engine(spec, mode, **options)
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    return elapsed


def _first_start(spec: ModelSpec) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_START, spec.engine_model],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"first start failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return float(result.stdout.strip().splitlines()[-1])
