"""Which executor a tensor-parallel engine gets: local worker processes (executor.py) or Ray
actors (ray_executor.py, imported only when asked for: Ray is an optional extra). Apart from both
so that neither backend imports the other."""
from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.distributed.executor import Executor, MultiprocExecutor


def start(config: EngineConfig) -> Executor:
    """The executor for config.parallel: workers started, rank 0 in the group."""
    par = config.parallel
    if par.distributed_executor_backend == "ray":
        from tokenmill.distributed.ray_executor import RayExecutor
        executor: Executor = RayExecutor(config, par.tensor_parallel_size)
    else:
        executor = MultiprocExecutor(config, par.tensor_parallel_size)
    try:
        executor.start()
    except BaseException:
        executor.close()
        raise
    return executor
