"""The engine's LoRA adapters by name: which exist, which are being unloaded, and the runner told of
both (through the executor). Requests name an adapter; one being unloaded takes no new requests and
leaves the runner once the requests running under it have finished."""
from __future__ import annotations

import logging
from typing import Iterable

from tokenmill.core.request import Request
from tokenmill.lora_request import LoRARequest

log = logging.getLogger("tokenmill")


class Adapters:
    def __init__(self, executor, enabled: bool) -> None:
        self.executor, self.enabled = executor, enabled
        self.loaded: dict[str, LoRARequest] = {}
        self.unloading: set[str] = set()

    def add(self, lora: LoRARequest) -> None:
        """Reads and checks the adapter in the runner (ValueError when it does not fit the model, or
        its name is taken by another path); adding one already added is a no-op."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest, got {type(lora).__name__}.")
        if not self.enabled:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora (--enable-lora).")
        if lora.lora_name in self.unloading:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is being unloaded; add it again once its running "
                             "requests have finished.")
        have = self.loaded.get(lora.lora_name)
        if have is not None and have.lora_path != lora.lora_path:
            raise ValueError(f"a LoRA adapter named {lora.lora_name!r} is already loaded from {have.lora_path}; "
                             "unload it first or choose another name.")
        if have is None:
            self.executor.add_lora(lora.lora_name, lora.lora_path)
            self.loaded[lora.lora_name] = lora
            log.info("LoRA adapter %r loaded from %s", lora.lora_name, lora.lora_path)

    def remove(self, name: str) -> None:
        """Marks the adapter for unloading (`reap` drops it); KeyError if no adapter has this name."""
        if name not in self.loaded or name in self.unloading:
            raise KeyError(name)
        self.unloading.add(name)

    def list(self) -> list[LoRARequest]:
        return [lr for n, lr in sorted(self.loaded.items()) if n not in self.unloading]

    def resolve(self, lora: LoRARequest | str | None) -> str | None:
        """A request's adapter name: a LoRARequest is added on first use, a name must be loaded."""
        if lora is None:
            return None
        if isinstance(lora, str):
            if lora not in self.loaded or lora in self.unloading:
                raise ValueError(f"no LoRA adapter named {lora!r} is loaded.")
            return lora
        self.add(lora)
        return lora.lora_name

    @staticmethod
    def of(requests: Iterable[Request]) -> list[str]:
        """The adapters `requests` run under, sorted (for the metrics)."""
        return sorted({r.lora_name for r in requests if r.lora_name is not None})

    def reap(self, requests: Iterable[Request]) -> None:
        """Drops the adapters being unloaded that none of `requests` (the unfinished ones) uses."""
        if not self.unloading:
            return
        in_use = {r.lora_name for r in requests}
        for name in sorted(self.unloading - in_use):
            self.executor.remove_lora(name)
            del self.loaded[name]
            self.unloading.discard(name)
            log.info("LoRA adapter %r unloaded", name)
