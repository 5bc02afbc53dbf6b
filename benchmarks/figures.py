"""The figures a section returns: plain JSON values, and the helpers renderers use to turn them into text.

A section's function returns a dict of figures that ``json.dumps`` accepts (a ``Summary`` goes in as
``Summary.to_dict()``). The runner writes it to ``benchmarks/results/`` and the page is rendered from it
alone, so every number on the page comes from a run's own data. Two keys have a meaning for the page:

* ``"targets"``: a list of ``target(...)`` dicts, collected into the page's "Targets at a glance";
* ``"curves"``: a list of ``curve(...)`` dicts, each drawn as a PNG plot of tokens/s against concurrency.
"""

from __future__ import annotations

import math
from typing import Any

from .stats import Summary, summarize


def summary(values: Any) -> dict[str, float]:
    """A Summary (or the samples to summarize) as JSON."""
    if isinstance(values, Summary):
        return values.to_dict()
    return summarize(values).to_dict()


def of(data: dict[str, float]) -> Summary:
    """A summary back from its JSON."""
    return Summary.from_dict(data)


def target(
    name: str,
    goal: float,
    measured: Summary | dict[str, float] | float,
    *,
    at_least: bool = True,
    unit: str = "x",
    digits: int = 2,
    headline: bool = False,
) -> dict[str, Any]:
    """A target and what the run measured against it; met when the median is on the right side of ``goal``.

    ``headline`` targets are drawn in the trend plot across commits.
    """
    if isinstance(measured, dict):
        measured = of(measured)
    if isinstance(measured, Summary):
        median, low, high = measured.median, measured.min, measured.max
    else:
        median = low = high = float(measured)
    met = median >= goal if at_least else median <= goal
    return {
        "name": name,
        "goal": goal,
        "at_least": at_least,
        "unit": unit,
        "digits": digits,
        "measured": median,
        "low": low,
        "high": high,
        "met": bool(met) and not math.isnan(median),
        "headline": headline,
    }


def curve(title: str, systems: dict[str, list[tuple[int, dict[str, float]]]]) -> dict[str, Any]:
    """Tokens/s against concurrency per system: ``{system: [(concurrency, summary), ...]}``."""
    return {
        "title": title,
        "systems": {
            name: [[int(c), s] for c, s in sorted(points, key=lambda point: point[0])]
            for name, points in systems.items()
            if points
        },
    }


def number(value: float, unit: str = "", digits: int = 2) -> str:
    """``value`` in ``unit``: ``1.23x``, ``45%``, ``12.3 GB/s``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "x":
        return f"{value:.{digits}f}x"
    if unit == "%":
        return f"{100 * value:.{digits}f}%"
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}" if unit else text


def goal_text(item: dict[str, Any]) -> str:
    sign = ">=" if item["at_least"] else "<="
    return f"{sign} {number(item['goal'], item['unit'], item['digits'])}"


def spread_text(data: dict[str, float] | None, unit: str = "x", digits: int = 2) -> str:
    """``min-max`` of a summary (or ``n/a``)."""
    if data is None:
        return "n/a"
    return f"{number(data['min'], unit, digits)}-{number(data['max'], unit, digits)}"


def ratio(data: dict[str, float] | None, digits: int = 2) -> str:
    """A per-round ratio as ``1.23x (1.10-1.30)``."""
    if data is None:
        return "n/a"
    return f"{data['median']:.{digits}f}x ({data['min']:.{digits}f}-{data['max']:.{digits}f})"


def rate(data: dict[str, float] | None, digits: int = 1) -> str:
    """A median with its spread: p10-p90 from ten samples on, else min-max."""
    if data is None:
        return "n/a"
    s = of(data)
    if s.n >= 10:
        return f"{s.median:,.{digits}f} ({s.p10:,.{digits}f}-{s.p90:,.{digits}f})"
    if s.n == 1:
        return f"{s.median:,.{digits}f}"
    return f"{s.median:,.{digits}f} ({s.min:,.{digits}f}-{s.max:,.{digits}f})"


def median(data: dict[str, float] | None) -> float:
    return float("nan") if data is None else float(data["median"])
