"""Rank 0's side of tensor parallelism and the worker ranks' loop.

The engine process is rank 0: it schedules, runs its own shard and samples. Ranks 1..N-1 are
workers that hold their shards and KV caches and wait for steps. Each step rank 0 broadcasts the
SchedulerOutput (plain data; through shared memory when all ranks share a host, else over the
group), then every rank runs the same forward pass, meeting in the model's all-reduces; the
logits gather on rank 0. The scheduler and block manager never
know how many ranks there are: every rank holds the same block ids, each for its own heads.

Workers start as local processes (`mp`, this module) or Ray actors (ray_executor.py); either way
they run `worker_main`. A worker that dies is noticed by a watcher on the worker processes (or
actors): it records the death, aborts the shared-memory waits (a gloo collective in flight fails
by itself as the worker's sockets close), and an idle engine learns of it at its next health
check (the server's /health then turns 503). While the engine is idle, rank 0 pings the workers
so that a wait for the next step over gloo never reaches the group's timeout.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.cpus import rank_core_sets
from tokenmill.distributed.errors import WorkerDiedError
from tokenmill.distributed.tensor_parallel import TPGroup, shared_memory_all_reduce
from tokenmill.utils import default_model_path, free_port, resolve_device

log = logging.getLogger("tokenmill")

STOP, PING = "stop", "ping"
PING_EVERY_S = 60.0  # idle rank 0 pings this often: far inside the group's timeout
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a collective waits this long (loading included)
JOINED = "tokenmill/joined"  # store counter: workers that have reached rank 0's rendezvous


@dataclass
class WorkerSpec:
    """What a rank needs to join the group and build its shard."""
    config: EngineConfig
    rank: int
    size: int
    master: tuple[str, int]    # the group's rendezvous (a TCPStore on rank 0's host)
    cores: list[int] | None    # pin to these before loading (first touch puts memory on their node)
    threads: int
    log_level: int = logging.WARNING


def place(cores: list[int] | None, threads: int) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def init_group(spec: WorkerSpec, dead_worker=None) -> TPGroup:
    """Join the group. Rank 0 passes `dead_worker` (Executor._dead_worker): while it waits for the
    workers to arrive it watches them, so a worker that dies first fails the start at once."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; a tensor-parallel engine "
                           "starts its own group (one tensor-parallel engine per process).")
    host, port = spec.master
    store = dist.TCPStore(host, port, spec.size, is_master=spec.rank == 0, timeout=GROUP_TIMEOUT,
                          wait_for_workers=False)
    if spec.rank == 0:
        await_workers(store, spec.size, dead_worker)
    else:
        store.add(JOINED, 1)
    # gloo carries CPU tensors (where shared memory cannot); NCCL the CUDA ones, each rank on its card
    cuda = resolve_device(spec.config.model.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(spec.rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=spec.rank,
                            world_size=spec.size, timeout=GROUP_TIMEOUT)
    world = dist.group.WORLD
    shm = None if cuda else shared_memory_all_reduce(world, spec.rank, spec.size)
    return TPGroup(spec.rank, spec.size, world, shm)


def await_workers(store, size: int, dead_worker, poll_s: float = 0.05) -> None:
    """Until every worker has reached the store, asking `dead_worker(wait_s)` in between: a worker
    that dies before (an import error, a missing `if __name__ == "__main__":`) raises
    WorkerDiedError here, not a timeout 30 min on."""
    deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
    while store.add(JOINED, 0) < size - 1:
        dead = dead_worker(poll_s)
        if dead:
            raise WorkerDiedError(f"{dead} before it joined the tensor-parallel group")
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"the tensor-parallel workers did not arrive within {GROUP_TIMEOUT}")


def load_shard(config: EngineConfig, group: TPGroup):
    """A worker's shard of the model; returns the function that builds its runner once rank 0
    has said how many KV blocks every rank holds."""
    from tokenmill.models import loader
    from tokenmill.runner import kv_cache
    from tokenmill.runner.model_runner import ModelRunner

    mc, cc = config.model, config.cache
    device = resolve_device(mc.device)
    if device.type == "cuda":
        device = torch.device("cuda", group.rank)
    torch.manual_seed(mc.seed)
    loaded = loader.load(mc.model or default_model_path(), mc.dtype, device, load_tokenizer=False,
                         quantization=mc.quantization, group_size=mc.quantization_group_size,
                         keep_float=mc.keep_float_weights, activation_bits=mc.activation_bits, tp_group=group)
    kv_dtype = kv_cache.resolve_dtype(cc.kv_cache_dtype, next(loaded.model.parameters()).dtype, device)
    return lambda num_blocks: ModelRunner(loaded.model, num_blocks, cc.block_size, device, kv_dtype)


def handshake(group: TPGroup, status: dict) -> list[dict]:
    """Every rank's load status ({"error": ...} or rank 0's {"num_blocks": ...}), on every rank."""
    import torch.distributed as dist

    out: list = [None] * group.size
    dist.all_gather_object(out, status, group=group.group)
    return out


def worker_main(spec: WorkerSpec, die_with_parent: bool = True) -> None:
    """A worker rank from start to STOP: join, load the shard, report, then run steps."""
    import torch.distributed as dist

    if die_with_parent:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan ranks
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s tp{spec.rank} %(name)s: %(message)s")
    place(spec.cores, spec.threads)
    group = init_group(spec)
    try:
        try:
            build = load_shard(spec.config, group)
            status = {}
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it for the user
            log.exception("rank %d could not load its shard", spec.rank)
            build, status = None, {"error": f"{type(e).__name__}: {e}"}
        statuses = handshake(group, status)
        if build is None or any("error" in s for s in statuses):
            return
        runner = build(statuses[0]["num_blocks"])
        with torch.inference_mode():
            while (msg := group.broadcast()) != STOP:
                if msg != PING:
                    runner.forward(msg)
    except Exception:  # noqa: BLE001 - rank 0 has gone or failed: nothing to serve
        log.warning("tensor-parallel rank %d stops: rank 0 is gone or failed", spec.rank, exc_info=True)
    finally:
        dist.destroy_process_group()


class Executor:
    """Rank 0's handle on its workers: start, feed each step, watch, stop; the engine's way into
    its runner as runner/executor.UniprocExecutor is for one process (the same methods). Subclasses
    start the workers (`_start_workers`) and say whether one has stopped (`_dead_worker`)."""
    join_hint = ""  # what a worker's death before it joined most often means, for the error

    def __init__(self, config: EngineConfig, size: int) -> None:
        self.config, self.size = config, size
        self.failure: str | None = None
        self._lock = threading.Lock()  # one collective sequence at a time: steps and pings
        self._last = time.monotonic()
        self._closed = False
        self._handshaken = False  # past the handshake the workers wait in the step broadcast
        self.group: TPGroup | None = None
        self.runner = None  # rank 0's (`attach`)

    def start(self) -> TPGroup:
        """Start the workers, join the group as rank 0; its group is for rank 0's shard."""
        self._check_devices()
        threads_each = self.config.model.threads
        cores = sorted(os.sched_getaffinity(0))
        shares = rank_core_sets(cores, self.size)
        specs = []
        self._connect()
        master = (self._master_host(), free_port())
        for rank in range(self.size):
            share = shares[rank] if len(cores) >= self.size else None
            threads = threads_each or (len(share) if share else max(1, len(cores) // self.size))
            specs.append(WorkerSpec(self.config, rank, self.size, master, share, threads,
                                    logging.getLogger("tokenmill").getEffectiveLevel()))
        self._start_workers(specs[1:])
        place(specs[0].cores, specs[0].threads)
        try:
            self.group = init_group(specs[0], self._dead_worker)
        except WorkerDiedError as e:
            self.failure = f"{e}{self.join_hint}"
            raise WorkerDiedError(self.failure) from None
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="tokenmill-tp-watch", daemon=True).start()
        return self.group

    def _check_devices(self) -> None:
        """CUDA ranks take one device each on this host (rank r: cuda:r), over NCCL."""
        if resolve_device(self.config.model.device).type != "cuda":
            return
        have = torch.cuda.device_count()
        if self.size > have:
            raise ValueError(f"tensor_parallel_size {self.size} runs one rank per CUDA device and this machine has "
                             f"{have}; lower it, or run the ranks on CPUs (--device cpu).")

    def handshake(self, num_blocks: int | None, error: str | None = None) -> None:
        """After rank 0 loaded (or failed to): learn every rank's outcome, hand out the cache size."""
        statuses = handshake(self.group, {"error": error} if error else {"num_blocks": num_blocks})
        self._handshaken = True
        for rank, s in enumerate(statuses[1:], start=1):
            if "error" in s:  # every worker has returned: nothing waits for a STOP
                self.failure = f"tensor-parallel rank {rank} could not load its shard: {s['error']}"
                raise ValueError(self.failure)

    def abandon(self, error: str) -> None:
        """Rank 0 failed to build: tell the workers (they wait in the handshake), then stop them."""
        if self.group is not None and not self._handshaken and self.failure is None:
            try:  # the workers learn of it where they wait, and return
                handshake(self.group, {"error": error})
            except Exception:  # noqa: BLE001 - a worker is gone
                pass
        self.close()

    def attach(self, runner) -> None:
        """Rank 0's runner, once the KV cache is sized."""
        self.runner = runner

    def execute(self, sched):
        """Hand the step to every rank, run rank 0's part (forward, sampling) and return its output."""
        with self._lock:
            self._check()
            try:
                self.group.broadcast(sched)
                out = self.runner.execute(sched)
            except Exception as e:
                time.sleep(0.2)  # a worker's death and the error it caused arrive together: name the cause
                self._check()
                # the ranks are out of step now, whatever failed: the engine cannot go on
                raise WorkerDiedError(f"a tensor-parallel step failed: {e}") from e
            self._last = time.monotonic()
            return out

    def check_health(self) -> None:
        """Raises WorkerDiedError once a worker has stopped."""
        self._check()

    def _ping_if_idle(self) -> None:
        """Workers wait for the next step inside a collective, which times out after GROUP_TIMEOUT:
        an idle engine (a quiet server, an offline script between calls) pings them well before."""
        if time.monotonic() - self._last > PING_EVERY_S and self._lock.acquire(blocking=False):
            try:
                if not self._closed and self.failure is None:
                    self.group.broadcast(PING)
                    self._last = time.monotonic()
            except Exception as e:  # noqa: BLE001 - reported through check_health
                self.failure = f"a tensor-parallel rank stopped answering: {e}"
            finally:
                self._lock.release()

    def close(self) -> None:
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        if self._handshaken and self.failure is None and self._lock.acquire(timeout=30):
            try:
                self.group.broadcast(STOP)
            except Exception:  # noqa: BLE001 - a worker already gone
                pass
            finally:
                self._lock.release()
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _watch(self) -> None:
        while not self._closed and self.failure is None:
            if self._handshaken:
                self._ping_if_idle()
            dead = self._dead_worker(timeout=1.0)
            if dead and not self._closed:
                self.failure = dead
                if self.group is not None:
                    self.group.abort()  # a step waiting on the dead rank in shared memory fails now
                log.error("%s; the engine stops", dead)
                return

    # ---- what a backend provides
    def _connect(self) -> None:
        """Join whatever places the workers (nothing for local processes)."""

    def _master_host(self) -> str:
        return "127.0.0.1"

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        raise NotImplementedError

    def _dead_worker(self, timeout: float) -> str | None:
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError


class MultiprocExecutor(Executor):
    """Workers as local processes (spawned: a fork would copy rank 0's threads' state)."""
    join_hint = ("; its error is above. Spawned workers first import the program's main module: a "
                 "script that creates the LLM at import time creates it again in every worker, which "
                 "fails. Put that code under `if __name__ == \"__main__\":`.")

    def __init__(self, config: EngineConfig, size: int) -> None:
        super().__init__(config, size)
        self.procs: list[multiprocessing.Process] = []

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(s,), name=f"tokenmill-tp{s.rank}", daemon=True)
                      for s in specs]
        for p in self.procs:
            p.start()

    def _dead_worker(self, timeout: float) -> str | None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout)
        for p in self.procs:
            if p.sentinel in ready:
                p.join(0)
                code = p.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                return f"tensor-parallel rank {self.procs.index(p) + 1} (pid {p.pid}) died ({how})"
        return None

    def _stop_workers(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
