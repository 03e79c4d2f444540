"""`serve --data-parallel-size N`: N `tokenmill serve` processes on loopback ports, each pinned to
its own share of the cores, kept alive (one that exits is started again), stopped together.

The replicas run in their own sessions: a terminal's Ctrl-C or a container's SIGTERM reaches the
parent only, which stops taking requests, lets the router drain, and then stops the replicas (each
drains what it still holds). Should the parent be killed outright, the kernel sends each replica
SIGTERM (PR_SET_PDEATHSIG), so no orphan keeps serving on a loopback port.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tokenmill.cpus import core_sets
from tokenmill.utils import free_port

log = logging.getLogger("tokenmill.router")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed parent leaves the replicas to be stopped by hand


@dataclass
class ReplicaProcess:
    index: int
    port: int
    cores: list[int]
    threads: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Launcher:
    def __init__(self, serve_argv: list[str], cores: list[int], num: int, threads: int | None, api_key: str,
                 log_level: str = "WARNING", stop_timeout: float = 30.0) -> None:
        self.serve_argv, self.api_key, self.log_level, self.stop_timeout = serve_argv, api_key, log_level, stop_timeout
        self.replicas = [ReplicaProcess(i, free_port(), share, threads or len(share))
                         for i, share in enumerate(core_sets(cores, num))]
        self.stopping = False

    def start(self) -> None:
        for rp in self.replicas:
            self._spawn(rp)

    def _spawn(self, rp: ReplicaProcess) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(rp.threads), TOKENMILL_API_KEY=self.api_key)
        cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", self.log_level, "serve", *self.serve_argv,
               "--host", "127.0.0.1", "--port", str(rp.port), "--threads", str(rp.threads),
               "--cpu-cores", ",".join(map(str, rp.cores))]
        rp.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        rp.started_at = time.monotonic()
        log.info("replica %d: pid %d on %s, cores %s, %d threads", rp.index, rp.proc.pid, rp.url, rp.cores,
                 rp.threads)

    async def supervise(self) -> None:
        """Until cancelled: start again a replica that exited (after a pause that doubles while it
        keeps failing at once, up to a minute); the router's health checks re-admit it when it is
        up. Cancelled at the router's shutdown, after it has drained: then the replicas stop (here,
        because uvicorn ends the process by re-raising SIGTERM once its own shutdown is done)."""
        try:
            await self._watch()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.stop, self.stop_timeout)

    async def _watch(self) -> None:
        pending: dict[int, float] = {}
        while True:
            now = time.monotonic()
            for rp in self.replicas:
                if self.stopping or rp.proc is None or rp.proc.poll() is None:
                    continue
                if rp.index not in pending:
                    quick = now - rp.started_at < 30
                    delay = min(60.0, 2.0 ** rp.restarts) if quick else 1.0
                    rp.restarts = rp.restarts + 1 if quick else 0
                    pending[rp.index] = now + delay
                    log.warning("replica %d exited with status %s; starting it again in %.0f s", rp.index,
                                rp.proc.returncode, delay)
                elif now >= pending[rp.index]:
                    del pending[rp.index]
                    self._spawn(rp)
            await asyncio.sleep(0.5)

    def stop(self, timeout: float) -> None:
        """SIGTERM every replica (each drains), SIGKILL what is left after `timeout` seconds."""
        self.stopping = True
        live = [rp.proc for rp in self.replicas if rp.proc is not None and rp.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
