"""Run the enginekit benchmark suite and write its report (``make bench`` -> ``docs/benchmarks.md``).

Usage::

    .venv/bin/python benchmarks/run.py --output docs/benchmarks.md     # the full suite (~15 min)
    .venv/bin/python benchmarks/run.py --quick                         # small sizes, a few minutes
    .venv/bin/python benchmarks/run.py --only throughput,ipc --quick   # some sections
    .venv/bin/python benchmarks/run.py --list

Nothing here is a test: figures are medians with their spread, and comparisons are ratios of figures
measured interleaved in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as a script: import the sections as the ``benchmarks`` package, and keep this folder's module
    # names (common, report, ...) from shadowing anything else.
    sys.path[0] = str(REPO_ROOT)

SECTIONS = {
    "throughput": "benchmarks.bench_throughput",
    "real": "benchmarks.bench_real",
    "modes": "benchmarks.bench_modes",
    "threads": "benchmarks.bench_threads",
    "ipc": "benchmarks.bench_ipc",
    "startup": "benchmarks.bench_startup",
    "scaling": "benchmarks.bench_scaling",
    "steps": "benchmarks.bench_steps",
    "hygiene": "benchmarks.bench_hygiene",
    "dp": "benchmarks.bench_dp",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and repeats (a few minutes)")
    parser.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--output", type=Path, help="write the markdown report here (default: stdout)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads for every engine and baseline that does not vary them (default: torch's default)",
    )
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)

    if args.list:
        for key, module in SECTIONS.items():
            print(f"{key:12s} {importlib.import_module(module).TITLE}")
        return 0
    selected = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in selected if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch
    from benchmarks.common import Context, load_average
    from benchmarks.report import SectionReport
    from benchmarks.stats import machine_info

    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    info = machine_info()
    reports: list[tuple[str, SectionReport]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="enginekit-bench-") as workdir:
        ctx = Context(
            quick=args.quick,
            workdir=Path(workdir),
            threads=torch.get_num_threads(),
            log=_log,
            extra_args="" if args.threads is None else f" --threads {args.threads}",
        )
        for key in selected:
            module = importlib.import_module(SECTIONS[key])
            report = SectionReport(title=module.TITLE, command=ctx.command(key))
            report.load_before = load_average()
            _log(f"== {key}: {module.TITLE}")
            t0 = time.perf_counter()
            try:
                module.run(ctx, report)
            except Exception:
                failed = True
                report.error = traceback.format_exc(limit=8)
                _log(report.error)
            report.runtime_s = time.perf_counter() - t0
            report.load_after = load_average()
            _log(f"== {key} done in {report.runtime_s:.0f} s")
            reports.append((key, report))
            if args.output is not None:  # keep what is done so far, should a later section hang
                _write(args.output, _render(args, info, reports, time.perf_counter() - started))
    text = _render(args, info, reports, time.perf_counter() - started)
    if args.output is None:
        print(text)
    else:
        _write(args.output, text)
        _log(f"wrote {args.output}")
    return 1 if failed else 0


def _render(args: argparse.Namespace, info: dict, reports: list, total_s: float) -> str:
    from benchmarks.stats import render_machine_info

    command = f".venv/bin/python benchmarks/run.py{' --quick' if args.quick else ''}"
    if args.threads is not None:
        command += f" --threads {args.threads}"
    if args.only:
        command += f" --only {args.only}"
    if args.output is not None:
        command += f" --output {args.output}"
    lines = ["# enginekit benchmarks\n"]
    if args.quick:
        lines.append(
            "> **QUICK RUN** (`--quick`): small sizes and few repeats, to check the suite and the report's "
            "format. These figures are not the reference numbers; `make bench` (the full suite, on a quiet "
            "machine) overwrites this file.\n"
        )
    lines.append(
        f"Generated by `{command}` on {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} "
        f"from {_revision()}, in {total_s / 60:.1f} min. `make bench` runs the full suite; "
        "`benchmarks/run.py --only SECTION[,SECTION] [--quick]` runs some sections; `--list` names them.\n"
    )
    lines.append(
        "Every figure is a median with its spread (p10-p90 from ten samples on, else min-max, and n). "
        "Comparisons are measured interleaved, run by run, in the same process and run, and given as the "
        "median of the per-round ratios (min-max in brackets): the machine may be shared, and a ratio "
        "survives background load much better than an absolute figure. The load average before and after "
        "each section says how quiet the machine was.\n"
    )
    lines.append("## Machine\n\n" + render_machine_info(info))
    targets = [line for _, report in reports for line in report.targets]
    if targets:
        lines.append("## Targets at a glance\n\n" + "".join(f"- {line}\n" for line in targets))
    index = [
        f"| {i} | {report.title} | `{key}` | {report.runtime_s:.0f} s |"
        for i, (key, report) in enumerate(reports, 1)
    ]
    lines.append(
        "## Sections\n\n| # | section | `--only` | runtime |\n|---:|:---|:---|---:|\n"
        + "\n".join(index)
        + "\n"
    )
    for number, (_, report) in enumerate(reports, 1):
        lines.append(report.render(number))
    return "\n".join(lines)


def _revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "an unknown revision"
    if not head:
        return "an unknown revision"
    return f"commit {head}" + (" with uncommitted changes" if dirty else "")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
