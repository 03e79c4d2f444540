"""What this process may use of the machine: cores (CPU affinity, then the cgroup's CPU quota) and
memory (the cgroup's limit, then MemAvailable). A container limited to 2 CPUs and 8 GB on a 64-core,
512 GB host must see 2 and 8, not 64 and 512: more threads than the quota gives make spinning
threads wait for each other, and memory past the limit is an OOM kill with no message.

`root`/`proc` (default CGROUP_ROOT, PROC) let tests point these readers at files they write.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC = "/proc"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(root: str | None, proc: str | None) -> list[str]:
    """This process's cgroup directories, innermost first, up to the root (v2; v1 cpu and memory
    controllers' own hierarchies too). A limit anywhere on the path applies."""
    text = _read(os.path.join(proc or PROC, "self", "cgroup")) or ""
    root = root or CGROUP_ROOT
    dirs = []
    for line in text.splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers not in ("", "memory", "cpu", "cpu,cpuacct", "cpuacct,cpu"):
            continue
        base, path = (root if not controllers else os.path.join(root, controllers)), rel.strip("/")
        while True:
            dirs.append(os.path.join(base, path) if path else base)
            if not path:
                break
            path = os.path.dirname(path)
    return [d for d in dirs if os.path.isdir(d)]


def cgroup_cpu_limit(root: str | None = None, proc: str | None = None) -> float | None:
    """CPUs the cgroup quota allows (cpu.max "quota period", v1 cfs_quota_us / cfs_period_us), the
    smallest along the path; None when unlimited."""
    best = None
    for d in _cgroup_dirs(root, proc):
        quota = period = None
        text = _read(os.path.join(d, "cpu.max"))
        if text:
            q, _, p = text.partition(" ")
            if q != "max":
                quota, period = int(q), int(p or 100000)
        else:
            q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
            if q and p and int(q) > 0:
                quota, period = int(q), int(p)
        if quota and period:
            cpus = quota / period
            best = cpus if best is None else min(best, cpus)
    return best


def usable_cores(root: str | None = None, proc: str | None = None, affinity: set[int] | None = None) -> tuple[int, str]:
    """(threads to run, why): the cores in this process's affinity mask, capped by the cgroup CPU
    quota rounded up (a 2.5-CPU quota: 3 threads)."""
    cores = len(os.sched_getaffinity(0) if affinity is None else affinity)
    quota = cgroup_cpu_limit(root, proc)
    if quota is not None and math.ceil(quota) < cores:
        return max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g} of {cores} cores in the affinity mask"
    return max(1, cores), f"{cores} cores in the affinity mask" + ("" if quota is None else f" (cgroup quota {quota:g})")


def memory_available(root: str | None = None, proc: str | None = None) -> tuple[int, str]:
    """(bytes this process may still allocate, where that figure comes from): the least of the
    room left under each cgroup memory limit on its path and the system's MemAvailable."""
    avail, why = None, ""
    meminfo = _read(os.path.join(proc or PROC, "meminfo")) or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            avail, why = int(line.split()[1]) * 1024, "MemAvailable"
    for d in _cgroup_dirs(root, proc):
        limit = _read(os.path.join(d, "memory.max")) or _read(os.path.join(d, "memory.limit_in_bytes"))
        if not limit or limit == "max" or int(limit) >= 1 << 60:
            continue
        used = _read(os.path.join(d, "memory.current")) or _read(os.path.join(d, "memory.usage_in_bytes")) or "0"
        room = max(0, int(limit) - int(used))
        if avail is None or room < avail:
            avail, why = room, f"cgroup memory limit {int(limit) / 2**30:.2f} GiB, {int(used) / 2**30:.2f} GiB in use"
    return (avail if avail is not None else 1 << 62), why or "unknown"


def check_fits(weights: int, kv_cache: int, what: str, root: str | None = None, proc: str | None = None,
               working: int = 512 << 20) -> None:
    """Refuse, before anything is allocated, a model whose weights, KV cache and working memory
    exceed what this process may use: a clear error instead of the kernel's OOM killer."""
    avail, why = memory_available(root, proc)
    need = weights + kv_cache + working
    if need > avail:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise ValueError(
            f"{what} does not fit in memory: it needs {gib(need)} (weights {gib(weights)} + KV cache {gib(kv_cache)} "
            f"+ {gib(working)} working memory) but this process may use {gib(avail)} ({why}). Lower --kv-cache-memory "
            f"(or --max-model-len with it), use a smaller quantization of the model (e.g. Q4_K_M instead of Q8_0), "
            f"or free memory.")


@contextlib.contextmanager
def returning_freed_memory():
    """After loading, glibc's heap gives back what the load's conversion buffers freed
    (malloc_trim): otherwise the heap keeps it, hundreds of MB resident after a 1B load. glibc's
    thresholds are left to adapt as they do (fixing them made a serving process's heap grow over
    the soak test's requests, and a fixed trim threshold slowed prompts)."""
    try:
        yield
    finally:
        return_freed_memory()


def return_freed_memory() -> None:
    """Hand what the heap holds freed back to the system now (glibc's malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
