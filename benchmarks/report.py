"""The report of one benchmark section, rendered as a markdown chapter of ``docs/benchmarks.md``."""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import markdown_table


@dataclass
class Table:
    caption: str
    headers: list[str]
    rows: list[list[object]]
    align: list[str] | None = None

    def render(self) -> str:
        return f"**{self.caption}**\n\n" + markdown_table(self.headers, self.rows, self.align)


@dataclass
class SectionReport:
    """What one section measured, how (the command), against which targets, and what limits it."""

    title: str
    command: str
    method: str = ""
    tables: list[Table] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    limits: str = ""
    runtime_s: float = 0.0
    load_before: str = ""
    load_after: str = ""
    error: str = ""

    def table(
        self, caption: str, headers: list[str], rows: list[list[object]], align: list[str] | None = None
    ):
        self.tables.append(Table(caption, headers, rows, align))

    def render(self, number: int) -> str:
        parts = [f"## {number}. {self.title}\n"]
        parts.append(f"Command: `{self.command}`  \n")
        parts.append(
            f"Section runtime {self.runtime_s:.0f} s; load average before {self.load_before}, "
            f"after {self.load_after}.\n"
        )
        if self.method:
            parts.append(self.method.strip() + "\n")
        if self.error:
            parts.append(f"**This section failed:**\n\n```\n{self.error.strip()}\n```\n")
        for table in self.tables:
            parts.append(table.render())
        if self.targets:
            parts.append("**Targets**\n\n" + "".join(f"- {line}\n" for line in self.targets))
        if self.findings:
            parts.append("**Findings**\n\n" + "".join(f"- {line}\n" for line in self.findings))
        if self.limits:
            parts.append(
                "**What limits this figure and what would move it**\n\n" + self.limits.strip() + "\n"
            )
        return "\n".join(parts)
