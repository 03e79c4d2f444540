"""Errors of the distributed layer that the engine and server name to users (no torch here)."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank stopped; the engine cannot run without it."""
