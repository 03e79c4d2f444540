"""How many CPU threads the kernels run with: the cores this process may use at start, and fewer
while other work holds some of them.

Why fewer: every kernel call is a fork-join over all threads (ATen's OpenMP pool), so a step waits
for its slowest thread. When another process busies one of the cores, the thread sharing it is off
the core for whole scheduler slices and every one of a step's few hundred joins waits for it: on 2
cores with a busy loop on one, 2 threads decoded the default model several times slower than 1
thread (benchmarks/contention.py; figures in benchmarks/RESULTS.md). Waiting for a core shows in the kernel's per-thread
run-queue delay (/proc/self/task/*/schedstat); when it passes a fraction of the time, one thread
less; now and then one more is tried again, and kept if the waiting does not come back.
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


class ThreadGovernor:
    """Called after each engine step; reads the run-queue delay every INTERVAL_S of stepping."""

    def __init__(self, max_threads: int, read_delay=run_queue_delay_ns, clock=time.monotonic,
                 set_threads=torch.set_num_threads) -> None:
        self.max_threads = self.threads = max(1, max_threads)
        self.enabled = self.max_threads > 1 and os.path.exists("/proc/self/task")
        self._read_delay, self._clock, self._set_threads = read_delay, clock, set_threads
        self._t, self._wait = clock(), read_delay() if self.enabled else 0
        self._probe_wait = PROBE_S[0]
        self._last_change = self._t
        self._probing = False

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if now - self._t < INTERVAL_S:
            return
        wait = self._read_delay()
        share = (wait - self._wait) / 1e9 / (now - self._t)
        self._t, self._wait = now, wait
        if share > CONTENDED and self.threads > 1:
            if self._probing:  # the extra thread brought the waiting back: stay below, try later
                self._probe_wait = min(self._probe_wait * 2, PROBE_S[1])
            else:
                (log.warning if self.threads == self.max_threads else log.info)(
                    "CPU contention: the kernel threads waited %.0f%% of the time for a core; running with %d "
                    "threads instead of %d until the cores are free again", 100 * share, self.threads - 1,
                    self.max_threads)
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
