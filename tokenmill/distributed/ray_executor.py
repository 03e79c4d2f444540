"""Worker ranks as Ray actors, so one model can span the hosts of a Ray cluster.

The engine process stays rank 0 (scheduler, sampling, its own shard); ranks 1..N-1 are actors
placed by a placement group (one bundle of `threads` CPUs per rank; PACK: on as few hosts as fit,
since every all-reduce crosses between them). Each actor runs the same `worker_main` as a local
worker process; the group rendezvous is a TCPStore on rank 0's host, reached at its cluster
address. Ranks on one host still meet in shared memory; ranks on several, over gloo (NCCL on GPUs).
Ray itself is an optional extra: `pip install tokenmill[ray]`.
"""
from __future__ import annotations

import logging
import os
import time

from tokenmill.distributed.executor import Executor, WorkerSpec, worker_main
from tokenmill.utils import resolve_device

log = logging.getLogger("tokenmill")
READY_TIMEOUT_S = 300.0  # the placement group's resources must appear within this


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'tokenmill[ray]' "
                         "(or pip install ray), or use the default backend 'mp' on one host.") from None
    return ray


class _Rank:
    """A Ray actor holding one worker rank; `run` returns when rank 0 sends STOP."""

    def run(self, spec: WorkerSpec) -> None:
        worker_main(spec, die_with_parent=False)  # Ray ends its actors when the driver goes

    def node(self) -> str:
        import ray
        return ray.util.get_node_ip_address()


class RayExecutor(Executor):
    def __init__(self, config, size: int) -> None:
        super().__init__(config, size)
        self.actors: list = []
        self.refs: list = []
        self.pg = None
        self._started_ray = False

    def _check_devices(self) -> None:
        if resolve_device(self.config.model.device).type == "cuda":
            # a Ray actor sees the GPUs its bundle reserves, and rank 0 (this process) holds none:
            # CUDA ranks would need GPU bundles and a device map that no test here has exercised
            raise ValueError("distributed_executor_backend 'ray' places CPU ranks; for CUDA ranks on one host use "
                             "the default backend 'mp' (one rank per device, NCCL), or --device cpu.")

    def _connect(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            # RAY_ADDRESS (or `ray start`'s local cluster) if there is one, else a local cluster of our own
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True,
                     logging_level=logging.WARNING, configure_logging=False)
            self._started_ray = True

    def _master_host(self) -> str:
        return _ray().util.get_node_ip_address()

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [{"CPU": s.threads} for s in specs]
        self.pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            have = ray.cluster_resources().get("CPU", 0)
            raise ValueError(f"the Ray cluster did not provide {len(specs)} bundle(s) of CPUs {bundles} within "
                             f"{READY_TIMEOUT_S:g} s (it has {have:g} CPUs in all; rank 0 runs in this process "
                             "and needs none of them); add nodes or lower tensor_parallel_size / --threads.")
        actor = ray.remote(_Rank)
        for i, spec in enumerate(specs):
            handle = actor.options(num_cpus=spec.threads, name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote()
            # a rank on another host cannot take this host's core numbers; Ray's bundle gives it its CPUs
            spec.cores = None
            self.actors.append(handle)
            self.refs.append(handle.run.remote(spec))

    def _dead_worker(self, timeout: float) -> str | None:
        ray = _ray()
        refs = list(self.refs)  # close() may clear the list meanwhile
        if not refs:
            time.sleep(timeout)
            return None
        ready, _ = ray.wait(refs, timeout=timeout)
        for ref in ready:
            rank = refs.index(ref) + 1
            try:
                ray.get(ref)
                how = "returned"
            except Exception as e:  # noqa: BLE001 - RayActorError and kin: the actor's process is gone
                how = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return f"tensor-parallel rank {rank} (Ray actor) died ({how})"
        return None

    def _stop_workers(self) -> None:
        if not self.actors and self.pg is None:
            return
        ray = _ray()
        if self.refs:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=10)
        for a in self.actors:
            ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
        self.actors, self.refs, self.pg = [], [], None
        if self._started_ray:
            ray.shutdown()
