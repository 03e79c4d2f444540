"""How many CPU threads the kernels run with: the cores this process may use at start, and fewer
while other work holds some of them.

Why fewer: every kernel call is a fork-join over all threads (ATen's OpenMP pool), so a step waits
for its slowest thread. When another process busies one of the cores, the thread sharing it is off
the core for whole scheduler slices and every one of a step's few hundred joins waits for it: on 2
cores with a busy loop on one, 2 threads decoded the default model several times slower than 1
thread (benchmarks/contention.py; figures in benchmarks/RESULTS.md). Waiting for a core shows in the kernel's per-thread
run-queue delay (/proc/self/task/*/schedstat); when it passes a fraction of the time while other
processes keep the cores busy, one thread less; now and then one more is tried again, and kept if
the waiting does not come back.

Why "other processes": the waiting also comes from this process's own threads (the server's
event loop, its tokenizer calls) and from light neighbours (a benchmark's client). Those run in
bursts shorter than a scheduler slice, and against them the whole team still wins: an embeddings
server with 16 clients served 20-45 % more with its 2 threads kept than with the drop to 1 the
waiting alone triggered (benchmarks/RESULTS.md). A busy neighbour takes most of a core; a burst
does not.
"""
from __future__ import annotations

import glob
import logging
import os
import time

import torch

from tokenmill import resources

log = logging.getLogger("tokenmill")

CONTENDED = 0.2      # run-queue delay summed over the threads, per second of wall time, that means contention
OTHERS_BUSY = 0.5    # ... when other processes use at least this many of the cores this process may use
INTERVAL_S = 0.5     # wall time between two looks
PROBE_S = (2.0, 64.0)  # first and longest wait before trying one thread more again


def default_threads() -> tuple[int, str]:
    """OMP_NUM_THREADS if set, else the usable cores (affinity mask and cgroup quota)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    return resources.usable_cores()


def run_queue_delay_ns(proc: str = "/proc") -> int:
    """Nanoseconds this process's threads have spent runnable but waiting for a core, in all."""
    total = 0
    for path in glob.glob(os.path.join(proc, "self", "task", "*", "schedstat")):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended between listing and reading
            continue
    return total


def other_cpu_seconds(proc: str = "/proc") -> float:
    """CPU seconds other processes have used on the cores this process may run on, since boot: those
    cores' busy time (/proc/stat) less this process's own (/proc/self/stat)."""
    cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    busy = 0
    try:
        with open(os.path.join(proc, "stat")) as f:
            for line in f:
                name, *ticks = line.split()
                if name in cpus:  # user nice system idle iowait irq softirq steal ...: busy = all but idle, iowait, steal
                    v = [int(t) for t in ticks[:8]]
                    busy += sum(v[:3]) + v[5] + v[6]
        with open(os.path.join(proc, "self", "stat")) as f:
            own = f.read().rsplit(")", 1)[1].split()
        busy -= int(own[11]) + int(own[12])  # utime, stime of every thread
    except (OSError, IndexError, ValueError):
        return 0.0
    return busy / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Called after each engine step; reads the run-queue delay every INTERVAL_S of stepping."""

    def __init__(self, max_threads: int, read_delay=run_queue_delay_ns, clock=time.monotonic,
                 set_threads=torch.set_num_threads, read_others=other_cpu_seconds) -> None:
        self.max_threads = self.threads = max(1, max_threads)
        self.enabled = self.max_threads > 1 and os.path.exists("/proc/self/task")
        self._read_delay, self._clock, self._set_threads = read_delay, clock, set_threads
        self._read_others = read_others
        self._t, self._wait = clock(), read_delay() if self.enabled else 0
        self._others = read_others() if self.enabled else 0.0
        self._probe_wait = PROBE_S[0]
        self._last_change = self._t
        self._probing = False

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if now - self._t < INTERVAL_S:
            return
        wait, others = self._read_delay(), self._read_others()
        share = (wait - self._wait) / 1e9 / (now - self._t)
        others_share = (others - self._others) / (now - self._t)
        self._t, self._wait, self._others = now, wait, others
        if share > CONTENDED and others_share >= OTHERS_BUSY and self.threads > 1:
            if self._probing:  # the extra thread brought the waiting back: stay below, try later
                self._probe_wait = min(self._probe_wait * 2, PROBE_S[1])
            else:
                (log.warning if self.threads == self.max_threads else log.info)(
                    "CPU contention: the kernel threads waited %.0f%% of the time for a core while other processes "
                    "used %.1f of them; running with %d threads instead of %d until the cores are free again",
                    100 * share, others_share, self.threads - 1, self.max_threads)
            self._probing = False
            self._set(self.threads - 1, now)
        elif self._probing:  # one more thread and no waiting: keep it
            self._probing, self._probe_wait = False, PROBE_S[0]
            if self.threads == self.max_threads:
                log.info("CPU contention over: running with %d threads again", self.threads)
        elif self.threads < self.max_threads and now - self._last_change >= self._probe_wait:
            self._probing = True
            self._set(self.threads + 1, now)

    def _set(self, threads: int, now: float) -> None:
        self.threads, self._last_change = threads, now
        self._set_threads(threads)
