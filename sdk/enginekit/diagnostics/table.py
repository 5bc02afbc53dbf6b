"""Markdown tables of snapshot diffs (``format_table``) and the cell formatting they share."""

from __future__ import annotations

_MIB = 2**20


def format_table(rows: list[dict[str, object]]) -> str:
    """Render rows (such as :meth:`SnapshotDiff.as_row` dicts) as a Markdown table.

    Columns appear in the order their keys first appear, so extra keys placed first in a row
    (``{"mode": "restart", **diff.as_row()}``) come first. Missing values are left blank,
    floats are shown with two decimals and numeric columns are right-aligned.

    Parameters
    ----------
    rows : list of dict of str to object
        The rows; at least one.

    Returns
    -------
    str
        The table, one line per row after the header and separator, without a trailing newline.

    Raises
    ------
    ValueError
        If ``rows`` is empty.
    """
    if not rows:
        raise ValueError("format_table needs at least one row")
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    numeric = {
        column: all(_is_number(row[column]) for row in rows if row.get(column) is not None)
        for column in columns
    }
    cells = [[_format_cell(row.get(column)) for column in columns] for row in rows]
    header = [_escape(column) for column in columns]
    widths = [max(3, len(header[i]), *(len(line[i]) for line in cells)) for i in range(len(columns))]

    def render(values: list[str]) -> str:
        padded = [
            value.rjust(width) if numeric[column] else value.ljust(width)
            for value, width, column in zip(values, widths, columns)
        ]
        return "| " + " | ".join(padded) + " |"

    separator = (
        "|"
        + "|".join(
            ("-" * (width + 1) + ":") if numeric[column] else ("-" * (width + 2))
            for width, column in zip(widths, columns)
        )
        + "|"
    )
    return "\n".join([render(header), separator, *(render(line) for line in cells)])


def format_mib(num_bytes: int) -> str:
    return f"{num_bytes / _MIB:+.1f} MiB"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return _escape(str(value))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
