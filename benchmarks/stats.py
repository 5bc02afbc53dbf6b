"""Small statistics and reporting helpers for the benchmark suite.

Every figure in the report is a median with its spread over repeats: the machine the suite
runs on may be shared and noisy, so single numbers are never reported on their own, and
comparisons are made as ratios between figures measured in the same run.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Summary",
    "fmt",
    "machine_info",
    "markdown_table",
    "percentile",
    "render_machine_info",
    "summarize",
]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linearly interpolated.

    This is the same rule as ``numpy.percentile``'s default ("linear").
    """
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(sorted_values[lo])
    frac = pos - lo
    return float(sorted_values[lo]) * (1.0 - frac) + float(sorted_values[hi]) * frac


@dataclass(frozen=True)
class Summary:
    """Median and spread of one measured quantity over ``n`` samples."""

    median: float
    p10: float
    p90: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        vals = sorted(float(v) for v in values)
        if not vals:
            raise ValueError("cannot summarize an empty list of values")
        if any(math.isnan(v) for v in vals):
            raise ValueError("cannot summarize values containing NaN")
        return cls(
            median=percentile(vals, 50.0),
            p10=percentile(vals, 10.0),
            p90=percentile(vals, 90.0),
            min=vals[0],
            max=vals[-1],
            n=len(vals),
        )

    def to_dict(self) -> dict[str, float]:
        """The summary as plain JSON values (``Summary.from_dict`` reads it back)."""
        return {
            "median": self.median,
            "p10": self.p10,
            "p90": self.p90,
            "min": self.min,
            "max": self.max,
            "n": self.n,
        }

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> Summary:
        return cls(
            median=float(data["median"]),
            p10=float(data["p10"]),
            p90=float(data["p90"]),
            min=float(data["min"]),
            max=float(data["max"]),
            n=int(data["n"]),
        )

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (e.g. ``scaled(1e3)`` for seconds -> ms).

        A negative factor swaps the ends so that ``min <= max`` still holds.
        """
        lo_hi = sorted((self.min * factor, self.max * factor))
        p_lo_hi = sorted((self.p10 * factor, self.p90 * factor))
        return Summary(
            median=self.median * factor,
            p10=p_lo_hi[0],
            p90=p_lo_hi[1],
            min=lo_hi[0],
            max=lo_hi[1],
            n=self.n,
        )

    def ratio_to(self, other: Summary) -> float:
        """``self.median / other.median`` (``inf`` if the other median is zero)."""
        if other.median == 0:
            return math.inf
        return self.median / other.median

    @property
    def rel_spread(self) -> float:
        """(p90 - p10) / median: a unit-free measure of how noisy the figure is."""
        if self.median == 0:
            return math.inf
        return (self.p90 - self.p10) / abs(self.median)


def summarize(values: Iterable[float]) -> Summary:
    """Summarize a list of samples (median, p10, p90, min, max, n)."""
    return Summary.of(values)


_EN_DASH = "\u2013"


def _num(value: float, digits: int, thousands: bool) -> str:
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:,.{digits}f}" if thousands else f"{value:.{digits}f}"


def fmt(
    summary: Summary,
    unit: str = "",
    digits: int = 1,
    *,
    spread: str = "auto",
    thousands: bool = False,
) -> str:
    """Render a summary as e.g. ``"12.3 ms (p10 11.9\u2013p90 13.0, n=20)"`` (an en dash).

    ``spread`` is ``"p"`` (p10 to p90), ``"minmax"`` (min to max) or ``"auto"``: p10/p90 from
    ten samples on, min/max below that (with few samples the percentiles are mostly
    interpolation).
    ``thousands`` adds thousands separators (``1,234,567``).
    """
    if spread not in ("auto", "p", "minmax"):
        raise ValueError(f"spread must be 'auto', 'p' or 'minmax', got {spread!r}")
    if spread == "auto":
        spread = "p" if summary.n >= 10 else "minmax"
    u = f" {unit}" if unit else ""
    med = _num(summary.median, digits, thousands)
    if summary.n == 1:
        return f"{med}{u} (n=1)"
    if spread == "p":
        lo, hi = ("p10", summary.p10), ("p90", summary.p90)
    else:
        lo, hi = ("min", summary.min), ("max", summary.max)
    lo_s = _num(lo[1], digits, thousands)
    hi_s = _num(hi[1], digits, thousands)
    return f"{med}{u} ({lo[0]} {lo_s}{_EN_DASH}{hi[0]} {hi_s}, n={summary.n})"


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    # Keep every row on one line and keep cell contents from closing the cell.
    return text.replace("\r", " ").replace("\n", " ").replace("|", "\\|")


_ALIGN = {"l": ":---", "r": "---:", "c": ":---:", "": "---"}


def markdown_table(
    headers: Sequence[object],
    rows: Iterable[Sequence[object]],
    align: Sequence[str] | None = None,
) -> str:
    """A GitHub-flavoured markdown table; cells are ``str()``-ed and ``|`` is escaped.

    ``align`` optionally gives one of ``"l"``, ``"r"``, ``"c"`` or ``""`` per column.
    Rows must have exactly as many cells as there are headers.
    """
    ncols = len(headers)
    if ncols == 0:
        raise ValueError("a table needs at least one column")
    if align is None:
        align = [""] * ncols
    if len(align) != ncols:
        raise ValueError(f"align has {len(align)} entries for {ncols} columns")
    bad = [a for a in align if a not in _ALIGN]
    if bad:
        raise ValueError(f"unknown alignment(s) {bad}; use 'l', 'r', 'c' or ''")
    lines = [
        "| " + " | ".join(_cell(h) for h in headers) + " |",
        "| " + " | ".join(_ALIGN[a] for a in align) + " |",
    ]
    for i, row in enumerate(rows):
        cells = list(row)
        if len(cells) != ncols:
            raise ValueError(f"row {i} has {len(cells)} cells, expected {ncols}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model", "Hardware"):
                    value = value.strip()
                    if value:
                        return value
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_features() -> str:
    """The vector and matrix extensions that decide which matmul paths are fast (bfloat16 above all)."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    flags = set(value.split())
                    return " ".join(flag for flag in wanted if flag in flags) or "none of " + ", ".join(
                        wanted
                    )
    except OSError:
        pass
    return "unknown"


def _memory_total_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        pass
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def machine_info() -> dict:
    """What the numbers were measured on: CPU, cores, memory, Python, torch, OS."""
    info: dict = {
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "logical_cores": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "memory_gib": None,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "torch": None,
        "torch_threads": None,
        "os": platform.platform(),
    }
    mem = _memory_total_bytes()
    if mem is not None:
        info["memory_gib"] = round(mem / 2**30, 1)
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    for name in ("transformers", "zmq"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                continue
        info[name if name != "zmq" else "pyzmq"] = getattr(mod, "__version__", "?")
    return info


_INFO_LABELS = {
    "cpu": "CPU",
    "cpu_features": "CPU features (vector and matrix)",
    "logical_cores": "Logical cores",
    "usable_cores": "Cores usable by this process",
    "memory_gib": "Memory (GiB)",
    "python": "Python",
    "torch": "torch",
    "torch_threads": "torch threads (get_num_threads)",
    "transformers": "transformers",
    "pyzmq": "pyzmq",
    "os": "OS",
}


def render_machine_info(info: dict | None = None) -> str:
    """``machine_info()`` as a two-column markdown table."""
    if info is None:
        info = machine_info()
    rows = [(_INFO_LABELS.get(key, key), "n/a" if value is None else value) for key, value in info.items()]
    return markdown_table(["Machine", "Value"], rows, align=["l", "l"])
