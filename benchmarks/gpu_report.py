"""The GPU check's figures as markdown: the tables ``gpu_check`` prints, and the benchmark page's GPU section.

``page_section`` renders the latest GPU check of the 1B model on CUDA found in ``benchmarks/results/gpu/``, or
says that no GPU was lent; ``benchmarks/report.py`` appends it to the page.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .figures import goal_text, number, rate
from .stats import markdown_table

QUESTION = "What does the engine do on a GPU?"
TRANSFORMERS = "transformers generate"


def page_section(folder: Path, page_folder: Path) -> str:
    """The page's GPU section: the latest GPU check in ``folder`` (links relative to ``page_folder``)."""
    latest = latest_gpu_result(folder)
    if latest is None:
        return (
            f"## {QUESTION}\n\n"
            "No GPU was lent for this run: there is no GPU check of the 1B model in `benchmarks/results/gpu/`. "
            "[docs/gpu.md](gpu.md) says how to run `python -m benchmarks.gpu_check` on a GPU machine.\n"
        )
    path, result = latest
    return render_gpu_check(result, os.path.relpath(path, page_folder))


def latest_gpu_result(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest GPU check in ``folder`` that ran the 1B model on CUDA (unreadable files are left out)."""
    found = []
    for path in folder.glob("*.json"):
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cuda = str(result.get("device", "")).startswith("cuda")
        if result.get("kind") == "gpu_check" and cuda and not result.get("tiny"):
            found.append((result.get("date", ""), path, result))
    if not found:
        return None
    _, path, result = max(found, key=lambda item: item[0])
    return path, result


def render_gpu_check(result: dict[str, Any], json_link: str) -> str:
    """Every phase of one GPU check as markdown, from its JSON alone."""
    parts = [f"## {QUESTION}\n", _header(result, json_link)]
    for name, render in (
        ("limits", _limits),
        ("speed", _speed),
        ("parity", _parity),
        ("kernels", _kernels),
        ("hygiene", _hygiene),
        ("kv_sizing", _kv_sizing),
        ("tp", _tp),
    ):
        entry = result.get(name)
        if entry is None:
            continue
        if "error" in entry:
            parts.append(f"**The {name} phase failed:**\n\n```\n{entry['error'].strip()}\n```\n")
        elif "skipped" in entry:
            parts.append(f"{name}: not run ({entry['skipped']}).\n")
        else:
            parts.append(render(entry, result))
    parts.append(_targets(result.get("targets", [])))
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.get("phase_s", {}).items())
    parts.append(f"Time per phase: {phases}; {result.get('duration_s', 0) / 60:.1f} min in all.\n")
    return "\n".join(parts)


def _header(result: dict[str, Any], json_link: str) -> str:
    info, model = result["machine"], result["model"]
    where = info.get("gpu") or result["device"]
    dirty = " with uncommitted changes" if result.get("dirty") else ""
    return (
        f"`{result['command']}` on {result['date'][:16].replace('T', ' ')} UTC from commit {result['commit']}{dirty}, "
        f"on {where}{_memory(info)} ({info.get('cpu_cores')} CPU cores); Python {info.get('python')}, torch "
        f"{info.get('torch')}, CUDA {info.get('cuda') or 'none'}, transformers {info.get('transformers')}. The model: "
        f"{model['label']}, {model['num_params'] / 1e9:.2f} B parameters, {model['weight_bytes'] / 1e9:.2f} GB in "
        f"bfloat16, built in {model['build_s']:.0f} s. Every figure: [{json_link}]({json_link}).\n"
    )


def _memory(info: dict[str, Any]) -> str:
    return f" ({info['gpu_memory_gib']} GiB)" if info.get("gpu_memory_gib") else ""


def _limits(limits: dict[str, Any], result: dict[str, Any]) -> str:
    return (
        f"The chip, measured in the same run: {_significant(limits['bandwidth_gb_s'])} GB/s copy bandwidth (a "
        f"{limits['copy_gib']:g} GiB device copy, bytes read plus written) and {_significant(limits['bf16_tflop_s'])} "
        f"TFLOP/s in bfloat16 (a {limits['matmul_n']}-square `torch.matmul`).\n"
    )


def _significant(value: float) -> str:
    """At least three significant digits, thousands separated: ``4,312``, ``791.3``, ``0.0327``."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:,.1f}" if value >= 10 else f"{value:.3g}"


def _requests(batch: int | str) -> str:
    return f"{batch} request{'' if int(batch) == 1 else 's'}"


def _speed(speed: dict[str, Any], result: dict[str, Any]) -> str:
    sizes = speed["batch_sizes"]
    systems: dict[str, dict[int, dict[str, Any]]] = {}
    for row in speed["rows"]:
        systems.setdefault(row["system"], {})[row["batch"]] = row
    rows = []
    for system, by_batch in systems.items():
        cells = [system]
        for batch in sizes:
            row = by_batch.get(batch)
            if row is None:
                cells.append("n/a")
                continue
            text = rate(row["tokens_per_s"], 0)
            if row["new_tokens"] != speed["new_tokens"]:
                text += f" ({row['new_tokens']} new tokens)"
            cells.append(f"{text} · {_percent(row['bandwidth_share'])} · {_percent(row['arithmetic_share'])}")
        rows.append(cells)
    ceilings = speed["ceilings"]
    for key, label in (
        ("bandwidth_limit", "limit: every weight read once a step"),
        ("arithmetic_limit", "limit: 2 · params FLOP a token"),
        ("limit", "limit: both, one after the other"),
    ):
        rows.append([label, *(f"{ceilings[str(batch)][key]:,.0f}" for batch in sizes)])
    ratios = speed.get("mp_over_inproc", {})
    ratio_text = "; ".join(
        f"{kind}: " + ", ".join(f"{value:.2f}x at {batch}" for batch, value in by_batch.items())
        for kind, by_batch in ratios.items()
    )
    return (
        f"Output tokens/s of {', '.join(map(str, sizes))} requests at once ({speed['prompt_len']}-token prompts, "
        f"{speed['new_tokens']} new tokens each, greedy, EOS ignored; wall time of the call, prefill included; "
        f"bfloat16), then the share of the bandwidth limit · of the arithmetic limit. {speed['repeats']} timed "
        "round(s) after a warm-up at each size, the systems in rotating order. Engine options: "
        f"`{_options(speed['engine_options'])}`.\n\n"
        + markdown_table(
            ["system", *(_requests(batch) for batch in sizes)], rows, ["l", *("r" for _ in sizes)]
        )
        + (f"\nmp over inproc: {ratio_text}.\n" if ratio_text else "")
        + _staggered(speed.get("staggered", []))
    )


def _staggered(rows: list[dict[str, Any]]) -> str:
    """Steps with a prefill chunk against pure decode steps, per output token (``gpu_speed.measure_staggered``)."""
    if not rows:
        return ""
    batch = rows[0]["batch"]
    table = [
        [
            row["system"],
            *(
                f"{row[kind]['steps']} · {row[kind]['ms_per_step']:.2f} ms · {row[kind]['us_per_token']:.1f} µs"
                for kind in ("decode", "mixed")
            ),
            f"{row['ratio']:.2f}x",
        ]
        for row in rows
    ]
    return (
        f"\nStaggered arrivals: {3 * batch} requests, {batch} at a time, so that arriving prompts share steps with "
        "the running decodes; steps of at least half that many sequences: how many, time a step, time an output "
        "token; then the time a token of steps with a prefill chunk over that of pure decode steps.\n\n"
        + markdown_table(
            ["system", "pure decode steps", "steps with a prefill chunk", "ratio"],
            table,
            ["l", "r", "r", "r"],
        )
    )


def _kernels(kernels: dict[str, Any], result: dict[str, Any]) -> str:
    """The Triton path against the torch path (``gpu_kernels.py``)."""
    rows = []
    for path, row in kernels["paths"].items():
        start, launches, long = row["start"], row["launches"], row["long"]
        rows.append(
            [
                path,
                f"{start['cold']['engine_start_s'] + start['cold']['first_generate_s']:.1f} s · "
                f"{start['warm']['engine_start_s'] + start['warm']['first_generate_s']:.1f} s",
                f"{launches['per_decode_step']:.0f} · {launches['per_layer']:.1f}",
                f"{long['decode_tokens_per_s']:,.0f} tok/s · {long['median_step_ms']:.2f} ms · "
                f"{_percent(long['limit_share'])}",
            ]
        )
    first = next(iter(kernels["paths"].values()))
    long = first["long"]
    return (
        "The attention and layer kernels: the Triton path (the default on CUDA) against the torch path "
        "(`ENGINEKIT_TRITON_KERNELS=0`). Start: a fresh process's engine start and first 2-token generate, with an "
        "empty Triton cache · with the cache that left. Launches: "
        f"{first['launches']['counted']} of one eager decode step · per layer. Long contexts: "
        f"{long['requests']} requests of {long['prompt_len']}-token prompts and {long['new_tokens']} new tokens "
        "with graphs, the median pure decode step: tokens/s · time · share of what reading the weights and every "
        "request's KV cache once allows at the measured copy bandwidth.\n\n"
        + markdown_table(
            ["path", "start (cold · warm)", "launches (step · layer)", "long contexts"],
            rows,
            ["l", "r", "r", "r"],
        )
    )


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def _percent(share: float) -> str:
    if share is None or math.isnan(share):
        return "n/a"
    return f"{100 * share:.1f}%" if share < 0.1 else f"{100 * share:.0f}%"


def _parity(parity: dict[str, Any], result: dict[str, Any]) -> str:
    rows = []
    for name, check in parity.items():
        if not isinstance(check, dict):
            continue
        rows.append(
            [
                name,
                f"{check['prompts']} ({min(check['prompt_lengths'])}-{max(check['prompt_lengths'])} tokens)",
                f"{check['greedy_equal']} of {check['tokens']}",
                f"{check['prompts_all_greedy']} of {check['prompts']}",
                f"{check['max_gap']:.2g}",
                f"{check['max_logprob_diff']:.2g}",
                f"{check['tolerance']}",
                "passed" if check["passed"] else "**FAILED**",
            ]
        )
    return (
        "Parity with transformers in the same dtype: the engine's greedy tokens (all prompts in one batch), and "
        "transformers' log-probabilities at each of those steps (teacher-forced). A step passes when the engine's "
        "token is transformers' greedy one or within the tolerance of it, and its logprob within the tolerance of "
        "transformers' (nats; the logits' spread is about 4).\n\n"
        + markdown_table(
            [
                "engine",
                "prompts",
                "steps at transformers' greedy token",
                "prompts all greedy",
                "largest gap",
                "largest logprob difference",
                "tolerance",
                "verdict",
            ],
            rows,
            ["l", "l", "r", "r", "r", "r", "r", "l"],
        )
    )


def _hygiene(hygiene: dict[str, Any], result: dict[str, Any]) -> str:
    rows = []
    for mode in ("mp", "inproc"):
        check = hygiene.get(mode)
        if check is None:
            continue
        if "error" in check:
            rows.append([mode, *([""] * 8), "**FAILED**: " + check["error"].strip().splitlines()[-1]])
            continue
        diff = check["snapshot_diff"]
        rows.append(
            [
                mode,
                check["restarts"],
                f"{check['seconds_per_start']:.1f}",
                f"{check['device_used_while_up_mib']:,.0f}",
                f"{check['free_before_mib'] - check['free_after_mib']:+,.0f}",
                f"{check['allocated_after_mib'] - check['allocated_before_mib']:+.2f}",
                f"{check['gc_freeze_after'] - check['gc_freeze_before']:+d}",
                f"{diff['threads']:+d} / {diff['fds']:+d} / {diff['children']:+d}",
                "yes" if check["same_tokens_every_start"] else "**no**",
                "clean" if check["passed"] else "**" + "; ".join(_hygiene_problems(check)) + "**",
            ]
        )
    return (
        "Restart hygiene: after a warm-up engine, a baseline; then an engine started and restarted, generating "
        "each time; after its shutdown, the differences from the baseline (device memory used by every process, "
        "torch's allocated memory in this process, the gc freeze count, threads / fds / children).\n\n"
        + markdown_table(
            [
                "mode",
                "restarts",
                "s a start",
                "device MiB used while up",
                "device MiB not freed",
                "allocated MiB",
                "gc frozen",
                "threads / fds / children",
                "same tokens",
                "verdict",
            ],
            rows,
            ["l", "r", "r", "r", "r", "r", "r", "r", "l", "l"],
        )
    )


def _hygiene_problems(check: dict[str, Any]) -> list[str]:
    problems = list(check["leaks"])
    if check["engine_processes_still_running"]:
        problems.append(f"engine processes still running: {check['engine_processes_still_running']}")
    if not check["same_tokens_every_start"]:
        problems.append("tokens changed across restarts")
    if check["allocated_after_mib"] > check["allocated_before_mib"]:
        problems.append("allocated memory grew")
    if check["gc_freeze_after"] != check["gc_freeze_before"]:
        problems.append("gc freeze count changed")
    return problems or ["device memory not freed"]


_SIZING_LABELS = {"longest": "0.5 while 256 requests of 4,096 tokens decode (graphs on)"}


def _kv_sizing(rows: dict[str, Any], result: dict[str, Any]) -> str:
    parts = [
        f"{_SIZING_LABELS.get(share, share)}: {row['kv_cache_gib']} GiB of KV cache, {row['used_fraction']:.0%} of the "
        "device used"
        for share, row in rows.items()
        if isinstance(row, dict)
    ]
    verdict = "within the share asked for" if rows["passed"] else "**NOT within the share asked for**"
    return f"KV cache sized to the device (`gpu_memory_utilization`): {'; '.join(parts)}: {verdict}.\n"


def _tp(tp: dict[str, Any], result: dict[str, Any]) -> str:
    verdict = "passed" if tp["passed"] else "**FAILED**"
    return (
        f"Two tensor-parallel ranks over {tp['restarts']} restarts: same tokens as one rank "
        f"{'yes' if tp['same_tokens_as_one_rank'] else '**no**'}, with `cuda_graphs` "
        f"{'yes' if tp.get('same_tokens_with_graphs', True) else '**no**'}, "
        f"processes left {tp['processes_still_running'] or 'none'}: "
        f"{verdict}.\n"
        + "".join(
            f"A worker's {how} during a long generate: {'EngineDeadError naming rank 1' if failure['passed'] else '**' + failure['error'] + '**'}"
            f" after {failure['seconds_to_error']} s.\n"
            for how, failure in tp.get("worker_failures", {}).items()
        )
    )


def _verdict(target: dict[str, Any]) -> str:
    if target["measured"] is None or math.isnan(target["measured"]):
        return "not measured"
    return "met" if target["met"] else "**NOT met**"


def _targets(targets: list[dict[str, Any]]) -> str:
    if not targets:
        return ""
    rows = [
        [
            t["name"],
            goal_text(t),
            number(t["measured"], t["unit"], t["digits"]),
            _verdict(t),
        ]
        for t in targets
    ]
    met = sum(1 for t in targets if t["met"])
    return (
        "The GPU targets of issues 45 and 46 (the 1B model on one H200-class GPU, bfloat16, mp with graphs; "
        "staggered arrivals in process):\n\n"
        + markdown_table(["target", "goal", "measured", "met"], rows, ["l", "l", "r", "l"])
        + f"\n{met} of {len(targets)} targets met.\n"
    )
