"""The memory this process may still take: the kernel's MemAvailable, bounded by its cgroup's limit.

A container's limit is invisible to /proc/meminfo (which reports the whole host), so the smaller of the two is
what the engine may plan on. The cgroup's page cache counts as usage there, but the kernel reclaims it before
it kills anything, so, as `docker stats` and the kubelet do, its inactive file pages are not counted as used.
Nothing here is cached: memory changes while other processes run, and each engine build reads it afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A cgroup v1 "no limit" reads as a page-rounded 2**63 - 1; anything this large is no limit.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """Available bytes and where the number came from (for the reasons the engine prints)."""

    available_bytes: int | None  # None: neither /proc/meminfo nor a cgroup could be read
    source: str  # e.g. "MemAvailable" or "the cgroup's limit (4.0 GiB, 1.2 GiB in use)"


def host_memory(root: Path = Path("/")) -> HostMemory:
    """The memory this process may take now: min(MemAvailable, the cgroup's limit - its working set).

    :param root: the file-system root the files are read under (tests pass a fake one).
    """
    meminfo = _meminfo_available(root / "proc/meminfo")
    cgroup = _cgroup_headroom(root)
    if cgroup is not None and (meminfo is None or cgroup[0] < meminfo):
        headroom, limit, used = cgroup
        return HostMemory(headroom, f"the cgroup's limit ({limit / 2**30:.1f} GiB, {used / 2**30:.1f} GiB in use)")
    return HostMemory(meminfo, "MemAvailable" if meminfo is not None else "unknown")


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path) -> tuple[int, int, int] | None:
    """(limit - working set, limit, working set) of this process's memory cgroup, v2 or v1; None without a
    limit. The working set is usage less inactive file pages."""
    for relative in _cgroup_paths(root):
        v2 = root / "sys/fs/cgroup" / relative
        v1 = root / "sys/fs/cgroup/memory" / relative
        for limit_file, usage_file, stat_file, inactive_key in (
            (v2 / "memory.max", v2 / "memory.current", v2 / "memory.stat", "inactive_file"),
            (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat", "total_inactive_file"),
        ):
            limit = _read_int(limit_file)
            usage = _read_int(usage_file)
            if limit is None or usage is None:
                continue
            if limit >= _NO_LIMIT:
                return None
            working_set = max(0, usage - _stat_value(stat_file, inactive_key))
            return max(0, limit - working_set), limit, working_set
    return None


def _cgroup_paths(root: Path) -> list[str]:
    """This process's cgroup paths (relative, memory controller or the v2 unified one), then the mount's root:
    inside a container the listed path is often the host's, and the container sees its own cgroup at the root."""
    paths: list[str] = []
    try:
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _id, controllers, path = line.split(":", 2)
            if controllers in ("", "memory") or "memory" in controllers.split(","):
                paths.append(path.lstrip("/"))
    except (OSError, ValueError):
        pass
    return [*paths, ""]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0
