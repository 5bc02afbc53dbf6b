"""The ``enginekit`` command: ``enginekit cache list|prune|clear`` looks after the weight cache.

Installed as a console script (``[project.scripts]``); ``python -m enginekit.cli`` runs it too.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from enginekit.cache import cache_dir
from enginekit.model.formats.weight_cache import (
    CacheEntry,
    cache_limits,
    clear_cache,
    list_entries,
    prune_cache,
)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="enginekit", description="enginekit's command line tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("cache", help="the weight cache (prepared weights, mapped by later loads)")
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every entry, most recently used first, and the cache's bounds")
    prune = actions.add_parser("prune", help="remove entries past the bounds (least recently used first)")
    prune.add_argument("--max-bytes", type=int, default=None, help="most bytes to keep (default: the bound)")
    prune.add_argument(
        "--max-age-days", type=float, default=None, help="most days unused (default: the bound)"
    )
    actions.add_parser("clear", help="remove every entry")
    args = parser.parse_args(argv)
    if args.action == "list":
        _print_list()
    elif args.action == "prune":
        removed = prune_cache(max_bytes=args.max_bytes, max_age_days=args.max_age_days)
        for entry in removed:
            print(f"removed {_row(entry)}")
        print(f"removed {len(removed)} entries, {_size(sum(e.num_bytes for e in removed))}")
    else:
        print(f"removed {clear_cache()} entries from {cache_dir()}")
    return 0


def _print_list() -> None:
    entries = list_entries()
    max_bytes, max_age_days = cache_limits()
    bytes_bound = _size(max_bytes) if max_bytes else "no bound"
    age_bound = f"{max_age_days:g} days unused" if max_age_days else "no bound"
    print(f"weight cache {cache_dir()}: {len(entries)} entries, {_size(sum(e.num_bytes for e in entries))}")
    print(f"bounds: {bytes_bound} (ENGINEKIT_CACHE_MAX_BYTES), {age_bound} (ENGINEKIT_CACHE_MAX_AGE_DAYS)")
    for entry in entries:
        print(_row(entry))


def _row(entry: CacheEntry) -> str:
    days = (time.time() - entry.last_used) / 86400
    key = ", ".join(f"{k}={v}" for k, v in sorted(entry.key_parts.items()))
    return f"{entry.path.name}  {_size(entry.num_bytes)}  last used {days:.1f} days ago  {key}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


if __name__ == "__main__":
    sys.exit(main())
