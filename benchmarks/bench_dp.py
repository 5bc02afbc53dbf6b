"""Data parallelism: two engine processes behind one front end, against one engine with all the threads (the
choice a user makes) and against one engine with one thread (per thread)."""

from __future__ import annotations

from typing import Any

from .common import (
    engines_up,
    equal_workload,
    interleave,
    log,
    paired_ratio,
    rate_runners,
    session,
    usable_cores,
)
from .figures import rate, ratio, summary, target
from .stats import markdown_table

ALL = "N=1, all threads"
ONE = "N=1, 1 thread"
TWO = "N=2, 1 thread each"
# (model, what N=2 / N=1 with all threads must reach, what N=2 / N=1 with one thread must reach)
TARGETS = {"builtin": (1.2, 1.6), "smollm2": (1.0, None)}


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(builtin=((64,), (16, 16), 2), smollm2=((32,), (16, 8), 1))
    # NOTE: 128 tokens: a built-in round of 64 requests then lasts about a second, long enough that a
    # scheduling hiccup of the VM does not decide a round's ratio.
    return dict(builtin=((64, 128), (32, 128), 4), smollm2=((64,), (32, 16), 2))


def run_dp_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    cores = usable_cores()
    size = sizes(quick)
    variants = {
        ALL: {"mode": "mp", "num_threads": cores},
        ONE: {"mode": "mp", "num_threads": 1},
        TWO: {"mode": "mp", "data_parallel_size": 2, "num_threads": 1},
    }
    models, targets = {}, []
    for key in ("builtin", "smollm2"):
        spec = ctx.model(key)
        concurrency_list, (prompt_len, output_len), repeats = size[key]
        with engines_up(
            spec, variants, equal_workload(max(concurrency_list), prompt_len, output_len)
        ) as engines:
            rows = three_way_measure(
                engines,
                spec,
                concurrency_list,
                (prompt_len, output_len),
                repeats,
                (ALL, ONE, TWO),
                f"dp: {key}",
            )
        goal_all, goal_one = TARGETS[key]
        for row in rows:
            targets.append(
                target(
                    f"data parallel, {key}, {row['concurrency']} concurrent: N=2 / N=1 with all threads",
                    goal_all,
                    row["against_all"],
                    headline=True,
                )
            )
            if goal_one is not None:
                targets.append(
                    target(
                        f"data parallel, {key}, {row['concurrency']} concurrent: N=2 / N=1 with 1 thread (per thread)",
                        goal_one,
                        row["against_one"],
                    )
                )
        models[key] = {
            "label": spec.label,
            "lengths": [prompt_len, output_len],
            "repeats": repeats,
            "rows": rows,
        }
    return {"cores": cores, "models": models, "targets": targets}


def three_way_measure(
    engines: dict[str, Any],
    spec: Any,
    concurrency_list: tuple[int, ...],
    lengths: tuple[int, int],
    repeats: int,
    names: tuple[str, str, str],
    tag: str,
) -> list[dict[str, Any]]:
    """The three engines run alternately at each concurrency: their tokens/s, and the third against the first
    (``against_all``) and the second (``against_one``), round by round."""
    first, second, third = names
    rows = []
    for concurrency in concurrency_list:
        log(f"{tag} x{concurrency}")
        batch = equal_workload(concurrency, *lengths)
        samples = interleave(rate_runners(engines, spec, batch), repeats=repeats, warmup=1)
        rows.append(
            {
                "concurrency": concurrency,
                "rates": {name: summary(values) for name, values in samples.items()},
                "against_all": summary(paired_ratio(samples[third], samples[first])),
                "against_one": summary(paired_ratio(samples[third], samples[second])),
            }
        )
    return rows


def three_way_rows(rows: list[dict[str, Any]], names: tuple[str, str, str]) -> list[list[Any]]:
    """A table row per concurrency: the three variants' tokens/s, then the third against the first and the second."""
    return [
        [
            row["concurrency"],
            *(rate(row["rates"][name], 0) for name in names),
            ratio(row["against_all"]),
            ratio(row["against_one"]),
        ]
        for row in rows
    ]


def render_dp_bench(figures: dict[str, Any]) -> str:
    parts = [
        f'`Engine(..., mode="mp")` three ways, all up at once and run alternately: one engine with all '
        f"{figures['cores']} threads (what a user runs without data parallelism), one engine with one thread, and "
        "`data_parallel_size=2` with one thread per rank (each rank gets half the requests). *N* requests "
        "submitted at once through `generate`. *N=2 / N=1 with all threads* is the comparison a user makes; "
        "*with 1 thread* compares equal threads per engine.\n"
    ]
    for model in figures["models"].values():
        rows = three_way_rows(model["rows"], (ALL, ONE, TWO))
        parts.append(
            f"**{model['label']}**: {model['lengths'][0]}-token prompts, {model['lengths'][1]} tokens each, "
            f"{model['repeats']} rounds; tokens/s.\n\n"
            + markdown_table(
                ["concurrent", f"{ALL}", f"{ONE}", f"{TWO}", "N=2 / N=1 all threads", "N=2 / N=1 1 thread"],
                rows,
                ["r", "r", "r", "r", "r", "r"],
            )
        )
    return "\n".join(parts)
