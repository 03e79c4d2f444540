"""The engine's one way into its runner: `execute(scheduler_output) -> RunnerOutput`.

vLLM v1's shape: the engine holds an executor, the executor holds the runner(s). This one is a
single process, one rank; the tensor-parallel executors (distributed/executor.py) have the same
methods and also hand each step to their worker ranks. Nothing outside an executor calls a
runner: a draft model's runner belongs to its proposer, a worker rank's to its loop.
"""
from __future__ import annotations

from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.runner.model_runner import ModelRunner


class UniprocExecutor:
    group = None  # no tensor-parallel group: the model is whole in this process

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None

    def attach(self, runner: ModelRunner) -> None:
        """The runner, once the KV cache is sized (after the model loaded)."""
        self.runner = runner

    def handshake(self, num_blocks: int) -> None:
        """No other rank to tell the cache size."""

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(sched)

    def add_lora(self, name: str, path: str) -> None:
        """Reads the adapter into the runner's host memory (ValueError when it does not fit)."""
        self.runner.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.runner.lora.remove(name)

    def check_health(self) -> None:
        """One process: healthy while it runs."""

    def abandon(self, error: str) -> None:
        """Nothing started that must be stopped when the engine fails to build."""

    def close(self) -> None:
        """Nothing to stop."""
