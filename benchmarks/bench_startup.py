"""Section 5: time to a ready engine and to restart it, next to ``python -c "import torch"``."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from .baselines import import_time
from .common import Context, ModelSpec, interleave, make_engine, paired_ratio
from .report import SectionReport
from .stats import fmt, summarize

TITLE = "Startup and restart"
TARGET = 0.5

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


def run(ctx: Context, report: SectionReport) -> None:
    repeats = ctx.pick(2, 5)
    report.method = f"""
`Engine("builtin", mode="mp")` returns once the engine process has reported READY (model loaded, KV cache allocated),
so its wall time is the time to a usable engine. *restart* is `engine.restart()` on a running engine
(shutdown, then start). *first start* runs in a fresh interpreter (`python -c`, enginekit and torch already
imported there, timer around `Engine(...)` only): what the first engine of a new notebook kernel costs.
The reference is `python -c "import torch"` with the same interpreter. All variants alternate, {repeats}
rounds after one warm-up round; the ratio is the median of per-round ratios.
"""
    runners: dict[str, Any] = {
        "torch": lambda: import_time("torch", repeats=1, warmup=0).median,
        "enginekit": lambda: import_time("enginekit.runtime.engine_main", repeats=1, warmup=0).median,
    }
    engines = {}
    has_spawn = _has_option("start_method")
    try:
        for spec in _models(ctx):
            engines[spec.key] = make_engine(spec, "mp")
            runners[f"first-{spec.key}"] = lambda s=spec: _first_start(s)
            runners[f"start-{spec.key}"] = lambda s=spec: _timed_start(s, "mp")
            runners[f"restart-{spec.key}"] = lambda e=engines[spec.key]: _timed(e.restart)
            if has_spawn:
                runners[f"spawn-{spec.key}"] = lambda s=spec: _timed_start(s, "mp", start_method="spawn")
            runners[f"inproc-{spec.key}"] = lambda s=spec: _timed_start(s, "inproc")
        ctx.log(f"startup: {len(runners)} variants x {repeats}")
        samples = interleave(runners, repeats=repeats, warmup=1)
    finally:
        for engine in engines.values():
            engine.shutdown()
    torch_s = samples["torch"]
    rows = [
        ['`python -c "import torch"`', fmt(summarize(torch_s).scaled(1e3), "ms", 0), "1.00x"],
        _row('`python -c "import enginekit.runtime.engine_main"`', samples["enginekit"], torch_s),
    ]
    for spec in _models(ctx):
        name = _short(spec)
        rows.append(
            _row(
                f'first `Engine({name}, mode="mp")` in a fresh process', samples[f"first-{spec.key}"], torch_s
            )
        )
        rows.append(_row(f'`Engine({name}, mode="mp")`', samples[f"start-{spec.key}"], torch_s))
        if has_spawn:
            rows.append(
                _row(
                    f'`Engine({name}, mode="mp", start_method="spawn")`',
                    samples[f"spawn-{spec.key}"],
                    torch_s,
                )
            )
        rows.append(_row(f"`engine.restart()` ({name}, mp)", samples[f"restart-{spec.key}"], torch_s))
        rows.append(_row(f'`Engine({name}, mode="inproc")`', samples[f"inproc-{spec.key}"], torch_s))
        ratio = paired_ratio(samples[f"restart-{spec.key}"], torch_s)
        verdict = "met" if ratio.median <= TARGET else "NOT met"
        report.targets.append(
            f"{spec.key}: restart <= {TARGET}x `import torch`: measured {ratio.median:.2f}x "
            f"({summarize(samples[f'restart-{spec.key}']).median * 1e3:.0f} ms vs "
            f"{summarize(torch_s).median * 1e3:.0f} ms): {verdict}"
        )
    report.table(
        "Wall time to a ready engine",
        ["what", "time", "/ import torch (per-round spread)"],
        rows,
        ["l", "l", "l"],
    )
    report.limits = """
A spawned engine process pays for a fresh interpreter and `import torch` before it can load the model; the
launcher (the default start method where available) imports torch once per front-end process and forks
every later engine from it, so a start or restart pays only the fork, the model load (reading safetensors or
building the built-in weights), the KV-cache allocation and the READY handshake. The first engine of a
process still pays the launcher's own torch import. Model load grows with the checkpoint's size: a few
milliseconds for the tiny models; for the real model, mapping its dequantized weights from the weight cache
(the GGUF is dequantized once, at the first load ever) and the first touch of those pages.

What would move it: starting the launcher in the background as soon as enginekit is imported (so the first
engine finds it warm), and, for restart, keeping the loaded weights in the launcher (shared memory) so that a
restart with the same model skips the load.
"""


def _row(label: str, values: list[float], torch_s: list[float]) -> list[str]:
    ratio = paired_ratio(values, torch_s)
    return [
        label,
        fmt(summarize(values).scaled(1e3), "ms", 0),
        f"{ratio.median:.2f}x ({ratio.min:.2f}-{ratio.max:.2f})",
    ]


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


def _has_option(name: str) -> bool:
    from enginekit import EngineConfig

    return name in EngineConfig.__struct_fields__
