"""Run the enginekit benchmarks: one run on one machine writes its raw figures and the whole page.

Usage::

    .venv/bin/python benchmarks/run.py                          # the full run (make bench): <= 35 min on 2 cores
    .venv/bin/python benchmarks/run.py --quick                  # the same sections at smaller sizes: <= 8 min
    .venv/bin/python benchmarks/run.py --quick --only limits    # some sections (their page: beside the JSON)
    .venv/bin/python benchmarks/run.py --list

Each run writes its figures as JSON to ``benchmarks/results/`` (commit, machine, figures), then renders
``docs/benchmarks.md`` and its plots from that JSON and the earlier ones (``benchmarks/report.py``), so the page
holds no number the run did not measure. Nothing here is a test: figures are medians with their spread, and
comparisons are ratios of runs interleaved round by round.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    # Run as a script: import the sections as the ``benchmarks`` package, and keep this folder's module
    # names (common, report, ...) from shadowing anything else.
    sys.path[0] = str(REPO_ROOT)

from benchmarks.sections import BY_NAME, SECTIONS  # noqa: E402

SCHEMA = 1
PAGE = REPO_ROOT / "docs" / "benchmarks.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same sections at smaller sizes (<= 8 min)")
    parser.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(BY_NAME)}")
    parser.add_argument(
        "--output",
        type=Path,
        help="the page to write (default: docs/benchmarks.md for a full run; beside the run's JSON for a quick "
        "or partial one, which leaves the page alone)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results",
        help="where the run's JSON goes (and the earlier runs' are read for the trend plot)",
    )
    parser.add_argument("--threads", type=int, help="torch threads for this process (default: torch's)")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    args = parser.parse_args(argv)

    if args.list:
        for section in SECTIONS:
            print(
                f"{section.name:12s} {section.question}{'  (optional)' if section.optional or section.needs else ''}"
            )
        return 0
    selected = [s.strip() for s in args.only.split(",") if s.strip()] or list(BY_NAME)
    unknown = [s for s in selected if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading draws a progress bar on stderr
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch
    from benchmarks.baselines import clear_model_cache
    from benchmarks.common import load_average, log, session
    from benchmarks.report import write_report
    from benchmarks.stats import machine_info

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    busy = other_work_share()
    session()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "command": _command(args),
        "only": args.only,
        **revision(),
        "machine": {**machine_info(), "llama_cpp": _llama_cpp_version(), "busy_before_run": busy},
        "duration_s": 0.0,
        "sections": {},
    }
    path = args.results_dir / result_name(result)
    failed = False
    for name in selected:
        section = BY_NAME[name]
        entry: dict[str, Any] = {"question": section.question, "load_before": load_average()}
        result["sections"][name] = entry
        log(f"== {name}: {section.question}")
        t0 = time.perf_counter()
        try:
            try:
                run, _ = section.load()
            except ModuleNotFoundError as error:
                if section.needs and error.name == section.needs:
                    entry["skipped"] = (
                        f"`{section.needs}` is not installed (`pip install 'enginekit[{section.needs}]'`)"
                    )
                elif section.optional and error.name == section.module:
                    entry["skipped"] = f"`{section.module.replace('.', '/')}.py` is not in this checkout"
                else:
                    raise
                log(f"== {name}: skipped ({entry['skipped']})")
                continue
            entry["figures"] = run(args.quick)
        except Exception:
            failed = True
            entry["error"] = traceback.format_exc(limit=8)
            log(entry["error"])
        finally:
            # transformers' continuous-batching managers run a thread the interpreter would wait for at exit
            clear_model_cache()
        entry["runtime_s"] = round(time.perf_counter() - t0, 1)
        entry["load_after"] = load_average()
        log(f"== {name} done in {entry['runtime_s']:.0f} s")
        result["duration_s"] = round(time.perf_counter() - started, 1)
        _write_json(path, result)  # keep what is done, should a later section hang
    result["duration_s"] = round(time.perf_counter() - started, 1)
    _write_json(path, result)
    log(f"wrote {path}")
    page = args.output
    if page is None:
        page = PAGE if not (args.quick or args.only) else path.with_suffix(".md")
    write_report(path, page)
    log(f"wrote {page}")
    return 1 if failed else 0


def other_work_share(seconds: float = 1.0) -> float | None:
    """The share of the machine's CPU time that was busy over ``seconds`` before the run: others' work."""

    def read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="utf-8") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle

    first = read()
    time.sleep(seconds)
    second = read()
    if first is None or second is None or second[0] == first[0]:
        return None
    total, idle = second[0] - first[0], second[1] - first[1]
    return round(1.0 - idle / total, 3)


def revision(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit the run measures, and whether the tree had changes beside it: ``dirty`` (tracked files differ
    from the commit), ``diff_sha256`` (the SHA-256 of ``git diff HEAD``'s output, so a page can be matched with
    the diff it was run on: ``git diff HEAD | sha256sum``), ``changed`` (the files that differ) and ``untracked``
    (source files in ``sdk/`` and ``benchmarks/`` that git does not track, which the run may import)."""

    def git(*command: str) -> bytes:
        try:
            return subprocess.run(["git", *command], cwd=root, capture_output=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return b""

    diff = git("diff", "HEAD")
    untracked = [
        name
        for name in git("ls-files", "--others", "--exclude-standard", "--", "sdk", "benchmarks")
        .decode(errors="replace")
        .splitlines()
        if name.endswith((".py", ".c", ".h")) and not name.startswith("benchmarks/results/")
    ]
    return {
        "commit": git("rev-parse", "--short", "HEAD").decode().strip() or "unknown",
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None,
        "changed": git("diff", "HEAD", "--name-only").decode(errors="replace").splitlines(),
        "untracked": untracked,
    }


def result_name(result: dict[str, Any]) -> str:
    stamp = result["date"][:19].replace("-", "").replace(":", "").replace("T", "-")
    kind = "-quick" if result["quick"] else ""
    part = "-" + result["only"].replace(",", "+") if result["only"] else ""
    return f"{stamp}-{result['commit']}{kind}{part}.json"


def _command(args: argparse.Namespace) -> str:
    command = ".venv/bin/python benchmarks/run.py" + (" --quick" if args.quick else "")
    if args.only:
        command += f" --only {args.only}"
    if args.threads is not None:
        command += f" --threads {args.threads}"
    return command


def _llama_cpp_version() -> str | None:
    """llama-cpp-python's version, read without loading its native library (it runs in a child process)."""
    from benchmarks import llama_cpp_runner

    return None if llama_cpp_runner.available() else llama_cpp_runner.version()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
