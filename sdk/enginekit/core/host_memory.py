"""What memory this process may still take on the host: ``/proc/meminfo``'s available memory, bounded by the memory
cgroups (v1 or v2) the process runs in. The CPU KV cache's default is a share of it (``core/resources.py``)."""

from __future__ import annotations

import os

NO_LIMIT = 1 << 62  # a cgroup limit at or past this is no limit (v1 writes 2**63 - 4096 for none)


def host_memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may still take: ``MemAvailable`` of ``/proc/meminfo``, bounded by the memory cgroup's
    limit less its usage (v2 ``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes``), the smallest over the process's cgroup and every parent up to the mount."""
    available = _meminfo_available(os.path.join(proc, "meminfo"))
    for limit, usage in _cgroup_limits(os.path.join(proc, "self", "cgroup"), cgroup_root):
        available = min(available, max(0, limit - usage))
    return available


def _meminfo_available(path: str) -> int:
    with open(path) as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {path}")


def _cgroup_limits(self_cgroup: str, root: str) -> list[tuple[int, int]]:
    """``(limit, usage)`` of each memory cgroup that bounds this process (limited ones only)."""
    try:
        with open(self_cgroup) as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, mounted at the root
            mount, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            mount, limit_file, usage_file = (
                os.path.join(root, "memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        for directory in _cgroup_dirs(mount, path):
            limit = _read_int(os.path.join(directory, limit_file))
            usage = _read_int(os.path.join(directory, usage_file))
            if limit is not None and usage is not None and limit < NO_LIMIT:
                found.append((limit, usage))
    return found


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """The cgroup's directory and its parents up to the mount. In a container the mount is the container's own
    cgroup while ``/proc/self/cgroup`` names the host's path: the longest tail of the path found under the mount
    is the process's directory."""
    parts = [part for part in path.split("/") if part]
    for skip in range(len(parts) + 1):
        directory = os.path.join(mount, *parts[skip:])
        if os.path.isdir(directory):
            break
    else:
        return []
    dirs = []
    while True:
        dirs.append(directory)
        if os.path.normpath(directory) == os.path.normpath(mount):
            return dirs
        directory = os.path.dirname(directory)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    if text == "max":
        return NO_LIMIT
    return int(text) if text.isdigit() else None
