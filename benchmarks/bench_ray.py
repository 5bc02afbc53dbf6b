"""Data-parallel ranks placed by Ray (``data_parallel_backend="ray"``) against the same ranks started locally: what
the placement costs at start and per token, and that a shutdown leaves nothing on the cluster.

The section starts a local Ray cluster of its own (``ray.init(num_cpus=cores)``), as a user's notebook would
before the engine starts, and shuts it down at the end. Both engines run ``data_parallel_size=2`` with one torch
thread per rank; their ranks talk to the front end over the same ZeroMQ sockets, so on one host the difference
is where a rank's process comes from (a Ray worker that imports torch, against a spawned child) and Ray's own
daemons beside them. Needs Ray (``pip install 'enginekit[ray]'``): without it the section is skipped.
"""

from __future__ import annotations

import time
from typing import Any

import ray  # the section is optional: without Ray this import fails and the page says it was skipped

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
from .figures import rate, ratio, summary
from .stats import markdown_table

LOCAL = "local ranks"
RAY = "Ray ranks"
JOIN_TIMEOUT_S = 180.0  # each actor imports torch in a fresh Ray worker


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(models=("builtin",), concurrency=32, lengths=(16, 16), repeats=1, starts=1)
    return dict(models=("builtin", "smollm2"), concurrency=64, lengths=(32, 64), repeats=3, starts=2)


def run_ray_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    size = sizes(quick)
    cores = usable_cores()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        models = {key: _measure(ctx.model(key), size) for key in size["models"]}
    finally:
        ray.shutdown()
    return {"cores": cores, "ray_version": ray.__version__, "models": models}


def _measure(spec: Any, size: dict[str, Any]) -> dict[str, Any]:
    prompt_len, output_len = size["lengths"]
    workload = equal_workload(size["concurrency"], prompt_len, output_len)
    options = {"data_parallel_size": 2, "num_threads": 1, "num_kv_blocks": kv_blocks_for(workload)}
    variants = {LOCAL: {}, RAY: {"data_parallel_backend": "ray", "startup_timeout": JOIN_TIMEOUT_S}}
    starts: dict[str, list[float]] = {name: [] for name in variants}
    for attempt in range(size["starts"]):  # a start, a shutdown, and what is left on the cluster after it
        for name, extra in variants.items():
            log(f"ray: {spec.key} start {attempt + 1}, {name}")
            begin = time.perf_counter()
            engine = make_engine(spec, "mp", **options, **extra)
            starts[name].append(time.perf_counter() - begin)
            engine.shutdown()
    left_after_starts = _leftovers()
    engines = {name: make_engine(spec, "mp", **options, **extra) for name, extra in variants.items()}
    try:
        log(f"ray: {spec.key} x{size['concurrency']}")
        samples = interleave(rate_runners(engines, spec, workload), repeats=size["repeats"], warmup=1)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {
        "label": spec.label,
        "concurrency": size["concurrency"],
        "lengths": [prompt_len, output_len],
        "repeats": size["repeats"],
        "start_s": {name: summary(values) for name, values in starts.items()},
        "rates": {name: summary(values) for name, values in samples.items()},
        "ray_over_local": summary(paired_ratio(samples[RAY], samples[LOCAL])),
        "left_after_starts": left_after_starts,
        "left_at_end": _leftovers(),
    }


def _leftovers(wait_s: float = 30.0) -> dict[str, int]:
    """Live actors and placement groups on the cluster (the GCS's tables), once they have had ``wait_s`` to go."""
    from ray._private.state import actors
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + wait_s
    while True:
        live = [a for a in actors().values() if a["State"] != "DEAD"]
        groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not (live or groups) or time.monotonic() > deadline:
            return {"actors": len(live), "placement_groups": len(groups)}
        time.sleep(0.2)


def render_ray_bench(figures: dict[str, Any]) -> str:
    parts = [
        f'`data_parallel_size=2`, one torch thread per rank, `mode="mp"`, on a local Ray {figures["ray_version"]} '
        f"cluster of {figures['cores']} CPUs that the section starts itself, against the same ranks started as "
        "local processes. Both engines up at once, run alternately. *Start* is `Engine(...)` until ready: a Ray "
        "rank is an actor in a fresh Ray worker, which imports torch and the engine, where a local rank is a "
        "spawned child doing the same. *Left* counts live actors and placement groups after every shutdown "
        "(0 and 0 is the requirement).\n"
    ]
    rows = []
    for model in figures["models"].values():
        rows.append(
            [
                model["label"],
                f"{model['concurrency']} x {model['lengths'][0]}+{model['lengths'][1]}",
                f"{model['start_s'][LOCAL]['median']:.1f} / {model['start_s'][RAY]['median']:.1f}",
                rate(model["rates"][LOCAL], 0),
                rate(model["rates"][RAY], 0),
                ratio(model["ray_over_local"]),
                "{actors} actors, {placement_groups} groups".format(**model["left_at_end"]),
            ]
        )
    parts.append(
        markdown_table(
            ["model", "requests", "start s (local / Ray)", "local tok/s", "Ray tok/s", "Ray / local", "left"],
            rows,
            ["l", "l", "r", "r", "r", "r", "l"],
        )
    )
    parts.append(
        "On one host a Ray rank computes exactly as a local one: its tokens and sockets are the same, so the "
        "per-token ratio should sit near 1, and any gap is Ray's daemons (GCS, raylet, workers' heartbeats) "
        "taking CPU from the ranks on these cores. The start costs Ray's actor placement and a fresh worker's "
        "imports. What Ray is for, ranks on other hosts, cannot be measured on this one machine.\n"
    )
    return "\n".join(parts)
