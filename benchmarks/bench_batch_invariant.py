"""What ``batch_invariant=True`` costs: the default model's tokens/s with the option off and on, side by side (two
background engines up at once, their runs alternating), at 1 and 16 concurrent requests, and for one long prompt
(prefill: the invariant path attends every query natively, where SDPA takes chunks past 512 tokens).

Run alone: ``python -m benchmarks.bench_batch_invariant [--quick]`` (prints the section and its JSON); in
``make bench`` it is the ``invariant`` section. Ratios are on / off per round; absolute rates move with the
machine's load.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import (
    Workload,
    engines_up,
    equal_workload,
    interleave,
    load_average,
    log,
    paired_ratio,
    rate_runners,
    session,
)
from .figures import rate, ratio, summary
from .stats import markdown_table

VARIANTS = {"off": {"mode": "mp"}, "on": {"mode": "mp", "batch_invariant": True}}
# (name, workload): decode-bound at 1 and 16 concurrent, then one prefill of a long prompt
PROMPT_LEN, OUTPUT_LEN, LONG_PROMPT = 64, 64, 1536


def workloads(quick: bool) -> list[tuple[str, Workload]]:
    output = OUTPUT_LEN // 2 if quick else OUTPUT_LEN
    return [
        ("1 concurrent", equal_workload(1, PROMPT_LEN, output)),
        ("16 concurrent", equal_workload(16, PROMPT_LEN, output)),
        (f"one {LONG_PROMPT}-token prompt, 1 token", equal_workload(1, LONG_PROMPT, 1)),
    ]


def run_batch_invariant_bench(quick: bool) -> dict[str, Any]:
    ctx = session()
    spec = ctx.model("smollm2")
    repeats = 3 if quick else 7
    cases = workloads(quick)
    # KV blocks for the largest of them at once: 16 short requests or the long prompt
    largest = Workload("largest", (PROMPT_LEN,) * 16 + (LONG_PROMPT,), (OUTPUT_LEN,) * 17)
    rows = []
    with engines_up(
        spec, {name: dict(options, max_model_len=2048) for name, options in VARIANTS.items()}, largest
    ) as engines:
        for index, (name, workload) in enumerate(cases):
            log(f"invariant: {name}")
            runners = rate_runners(engines, spec, workload, seed=100 * index)
            samples = interleave(runners, repeats=repeats, warmup=1)
            # the prefill's rate counts its prompt's tokens (one token is generated per run)
            scale = workload.prompt_lens[0] if workload.output_lens == (1,) else 1
            rows.append(
                {
                    "case": name,
                    "unit": "prompt tokens/s" if scale > 1 else "tokens/s",
                    "rates": {
                        variant: summary([v * scale for v in values]) for variant, values in samples.items()
                    },
                    "on_over_off": summary(paired_ratio(samples["on"], samples["off"])),
                }
            )
    return {"threads": ctx.threads, "repeats": repeats, "load": load_average(), "rows": rows}


def render_batch_invariant_bench(figures: dict[str, Any]) -> str:
    table = markdown_table(
        ["workload", "unit", "off", "on", "on / off"],
        [
            [
                row["case"],
                row["unit"],
                rate(row["rates"]["off"]),
                rate(row["rates"]["on"]),
                ratio(row["on_over_off"]),
            ]
            for row in figures["rows"]
        ],
        ["l", "l", "r", "r", "r"],
    )
    return (
        "The default model (weights as stored) in two background engines up at once, `batch_invariant` off and "
        f"on, their runs alternating ({figures['repeats']} rounds after a warm-up; {PROMPT_LEN}-token prompts; "
        f"load average at the end: {figures['load']}). A ratio is the median of per-round ratios.\n\n" + table
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter outputs")
    args = parser.parse_args()
    result = run_batch_invariant_bench(args.quick)
    print(render_batch_invariant_bench(result))
    print(json.dumps(result, indent=1))
