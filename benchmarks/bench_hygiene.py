"""What the front-end process holds after many restarts, per mode (``enginekit.diagnostics``)."""

from __future__ import annotations

import time
from typing import Any

from .common import greedy, log, make_engine, session
from .figures import rate, summary, target
from .stats import markdown_table

MODES = ("inproc", "mp", "async", "mp, data_parallel_size=2", "mp, tensor_parallel_size=2")
_MIB = 2**20


def run_hygiene_bench(quick: bool) -> dict[str, Any]:
    from enginekit.diagnostics import snapshot, wait_until_clean

    restarts, dp_restarts = (5, 5) if quick else (30, 10)
    spec = session().model("builtin")
    rows, targets = [], []
    for variant in MODES:
        mode, _, option = variant.partition(", ")
        options = {option.split("=")[0]: 2} if option else {}
        count = dp_restarts if option else restarts
        log(f"hygiene: {variant}, {count} restarts")
        warm = make_engine(spec, mode, **options)
        _serve(warm)
        warm.shutdown()
        time.sleep(0.5)  # let the warm-up engine's threads and process finish exiting
        baseline = snapshot()
        engine = make_engine(spec, mode, **options)
        times, rss, workers = [], [], []  # workers: tensor-parallel workers' pids (the engine's children)
        try:
            _serve(engine)
            workers += _workers(engine)
            for _ in range(count):
                t0 = time.perf_counter()
                engine.restart()
                times.append(time.perf_counter() - t0)
                _serve(engine)
                workers += _workers(engine)
                rss.append(snapshot(collect=False).rss_bytes)
        finally:
            engine.shutdown()
        diff = wait_until_clean(baseline, timeout=15)
        leaks = diff.leaks()
        left = [pid for pid in workers if _alive(pid)]
        if left:
            leaks = [*leaks, f"{len(left)} tensor-parallel workers left: {left}"]
        rows.append(
            {
                "variant": variant,
                "restarts": count,
                "restart_s": summary(times),
                "rss_last_mib": rss[-1] / _MIB,
                "rss_mib_per_restart": _slope(rss) / _MIB,
                "rss_after_shutdown_mib": diff.rss_bytes / _MIB,
                "threads": diff.threads,
                "fds": diff.fds,
                "children": diff.children,
                "gc_frozen": diff.gc_freeze_count,
                "tensors": diff.tensors,
                "leaks": list(leaks),
            }
        )
        targets.append(
            target(
                f"hygiene, {variant}: leaks found by diagnostics after {count} restarts",
                0,
                len(leaks),
                at_least=False,
                unit="",
                digits=0,
            )
        )
    return {"rows": rows, "targets": targets}


def render_hygiene_bench(figures: dict[str, Any]) -> str:
    rows = [
        [
            r["variant"],
            r["restarts"],
            rate({k: v * 1e3 if k != "n" else v for k, v in r["restart_s"].items()}, 0),
            f"{r['rss_last_mib']:.0f}",
            f"{r['rss_mib_per_restart']:+.2f}",
            f"{r['rss_after_shutdown_mib']:+.1f}",
            f"{r['threads']:+d}",
            f"{r['fds']:+d}",
            f"{r['children']:+d}",
            f"{r['gc_frozen']:+d}",
            f"{r['tensors']:+d}",
            "clean" if not r["leaks"] else "; ".join(r["leaks"]),
        ]
        for r in figures["rows"]
    ]
    return (
        "Per mode: a warm-up engine first (modules, kernels and the shared launcher load once per process), then "
        "`enginekit.diagnostics.snapshot()` is the baseline, an engine starts and `engine.restart()` runs again "
        "and again, each restart followed by a small `generate`; after `shutdown()`, `wait_until_clean` gives the "
        "engine 15 s to be back at the baseline. RSS per restart is the least-squares slope over the restarts; "
        "the other columns are differences against the baseline after shutdown and must be zero. With "
        "`tensor_parallel_size=2` the workers are the engine process's children, not this process's: their pids, "
        "collected after every restart, must all be gone too (else the verdict names them).\n\n"
        + markdown_table(
            [
                "mode",
                "restarts",
                "restart ms",
                "RSS MiB at the end",
                "RSS MiB per restart",
                "RSS MiB after shutdown",
                "threads",
                "fds",
                "children",
                "gc frozen",
                "tensors",
                "verdict",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "r", "r", "r", "r", "l"],
        )
    )


def _serve(engine: Any) -> None:
    prompts = [{"prompt_token_ids": [10 + i, 20, 30, 40]} for i in range(4)]
    outputs = engine.generate(prompts, greedy(8), progress=False)
    if sum(len(o.outputs[0].token_ids) for o in outputs) != 32:
        raise RuntimeError("a restarted engine did not generate the expected tokens")


def _workers(engine: Any) -> list[int]:
    """The tensor-parallel workers of each rank (grandchildren of this process: diagnostics counts children)."""
    if engine.config.tensor_parallel_size == 1 or engine.mode == "inproc":
        return []
    answers = engine.call_utility("debug_process")
    answers = answers if isinstance(answers, list) else [answers]
    return [pid for answer in answers for pid in answer["tensor_parallel_workers"]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _slope(values: list[int]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    var = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / var
