"""CPU placement shared by the data-parallel launcher and the tensor-parallel ranks: which cores a
process may use, how to split them into contiguous shares, and the machine's NUMA nodes.

Decode is bound by memory bandwidth, and on a multi-socket server each socket brings its own: a
rank pinned to one node's cores allocates its weights and KV cache on that node too, because
Linux places a page on the node of the core that first touches it (the default "local"
policy). So pinning before loading is all the NUMA binding a rank needs; no libnuma.
"""
from __future__ import annotations

import glob
import os


def parse_cores(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the format of taskset and /sys cpulists)."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--cpu-cores takes a list like 0-3,8 , got {text!r}.") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"--cpu-cores takes a list like 0-3,8 , got {text!r}.")
    return sorted(set(cores))


def core_sets(cores: list[int], n: int) -> list[list[int]]:
    """Contiguous shares of the cores (neighbours share caches); with fewer cores than shares,
    shares take cores round-robin."""
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    base, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(cores[start:start + size])
        start += size
    return out


def numa_nodes() -> list[list[int]]:
    """Each NUMA node's cores, from /sys (one node holding every core where /sys has none)."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"),
                       key=lambda p: int(p.split("/node")[-1].split("/")[0])):
        with open(path) as f:
            text = f.read().strip()
        if text:
            nodes.append(parse_cores(text))
    return nodes or [sorted(os.sched_getaffinity(0))]


def rank_core_sets(cores: list[int], n: int, nodes: list[list[int]] | None = None) -> list[list[int]]:
    """Cores for n ranks out of `cores`: when the cores span several NUMA nodes and the ranks
    divide among them evenly, each rank's share lies within one node (ranks 0..n/k-1 on the first
    node, and so on); otherwise contiguous shares."""
    nodes = numa_nodes() if nodes is None else nodes
    spans = [[c for c in node if c in set(cores)] for node in nodes]
    spans = [s for s in spans if s]
    if len(spans) > 1 and n % len(spans) == 0:
        return [share for span in spans for share in core_sets(span, n // len(spans))]
    return core_sets(cores, n)
