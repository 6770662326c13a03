"""How much host memory the engine may take, without ever needing psutil.

Host memory is the smaller of what the kernel reports available (psutil, else /proc/meminfo's
MemAvailable) and what the container's cgroup still allows (limit - usage): psutil alone does not
see a container's limit, and a pool sized past it gets the process OOM-killed instead of an error.
The file locations are arguments (and `CBK_CGROUP_ROOT` / `CBK_MEMINFO` in the environment) so a
test can point the reader at a fake cgroup directory.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("cb_kernels.engine")

GIB = 1 << 30
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
DEFAULT_MEMINFO = "/proc/meminfo"
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large means unlimited.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """A snapshot of host memory, in bytes. `cgroup_limit`/`cgroup_usage` are None without a limit."""
    available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    source: str = ""

    @property
    def usable(self) -> int:
        """Bytes a new allocation may take: available memory, capped by the cgroup's headroom."""
        if self.cgroup_limit is None:
            return self.available
        headroom = max(0, self.cgroup_limit - (self.cgroup_usage or 0))
        return min(self.available, headroom)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _own_cgroup_v2_dir(root: Path, proc_cgroup: Path) -> Path | None:
    """The v2 directory of this process ("0::/path" in /proc/self/cgroup), when it exists."""
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                sub = line[3:].strip().lstrip("/")
                d = root / sub
                return d if sub and (d / "memory.max").exists() else None
    except OSError:
        return None
    return None


def read_cgroup_limit(root: str | os.PathLike | None = None,
                      proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(limit, usage) in bytes of the memory cgroup at `root`, or None when unlimited or absent.

    v2: `memory.max` ("max" = unlimited) and `memory.current`, at the root or in this process's own
    v2 directory. v1: `memory/memory.limit_in_bytes` and `memory/memory.usage_in_bytes` (a root that
    itself holds `memory.limit_in_bytes` also works).
    """
    root = Path(root or os.environ.get("CBK_CGROUP_ROOT") or DEFAULT_CGROUP_ROOT)
    v2_dirs = [root]
    own = _own_cgroup_v2_dir(root, Path(proc_cgroup))
    if own is not None:
        v2_dirs.insert(0, own)
    for d in v2_dirs:
        if (d / "memory.max").exists():
            limit = _read_int(d / "memory.max")
            if limit is None:
                return None
            return limit, _read_int(d / "memory.current") or 0
    for d in (root / "memory", root):
        if (d / "memory.limit_in_bytes").exists():
            limit = _read_int(d / "memory.limit_in_bytes")
            if limit is None:
                return None
            return limit, _read_int(d / "memory.usage_in_bytes") or 0
    return None


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_host_memory(cgroup_root: str | os.PathLike | None = None,
                     meminfo: str | os.PathLike | None = None) -> HostMemory:
    """Available host memory and the cgroup limit; psutil when importable, else /proc/meminfo."""
    available, source = None, ""
    try:
        import psutil
        available, source = int(psutil.virtual_memory().available), "psutil"
    except Exception:  # ImportError, or psutil = None in sys.modules, or a broken install
        pass
    if available is None:
        path = Path(meminfo or os.environ.get("CBK_MEMINFO") or DEFAULT_MEMINFO)
        available, source = _meminfo_available(path), str(path)
    if available is None:
        # Neither psutil nor /proc (e.g. macOS without psutil): size from os.sysconf if it can.
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "sysconf"
        except (ValueError, OSError, AttributeError):
            available, source = 0, "unknown"
    cg = read_cgroup_limit(cgroup_root)
    if cg is None:
        return HostMemory(available, source=source)
    return HostMemory(available, cg[0], cg[1], source=source + "+cgroup")


def host_pool_bytes(requested_gib: float | None, safety_fraction: float = 0.5, *,
                    memory: HostMemory | None = None) -> int:
    """Bytes for the CPU swap pool.

    `requested_gib=None` takes `safety_fraction` of the usable host memory; an explicit size is
    honoured up to that same ceiling and clamped to it with a warning (a pool larger than the
    container allows would be OOM-killed, not refused). 0 means no pool.
    """
    if requested_gib is not None:
        if isinstance(requested_gib, bool) or not isinstance(requested_gib, (int, float)):
            raise TypeError(f"cpu_offload_gib must be a number or None, got {type(requested_gib).__name__}")
        if not requested_gib >= 0 or requested_gib == float("inf"):
            raise ValueError(f"cpu_offload_gib must be a finite number >= 0, got {requested_gib}")
    if isinstance(safety_fraction, bool) or not isinstance(safety_fraction, (int, float)) \
            or not 0 < safety_fraction <= 1:
        raise ValueError(f"safety_fraction must be in (0, 1], got {safety_fraction!r}")
    memory = memory or read_host_memory()
    ceiling = int(memory.usable * safety_fraction)
    if requested_gib is None:
        logger.info("cpu_offload_gib=None: host pool %.2f GiB (%.0f%% of %.2f GiB usable, from %s)",
                    ceiling / GIB, 100 * safety_fraction, memory.usable / GIB, memory.source)
        return ceiling
    requested = int(requested_gib * GIB)
    if requested > ceiling:
        logger.warning("cpu_offload_gib=%.3g GiB exceeds %.0f%% of usable host memory (%.2f GiB, "
                       "from %s); clamped to %.2f GiB", requested_gib, 100 * safety_fraction,
                       memory.usable / GIB, memory.source, ceiling / GIB)
        return ceiling
    return requested
