"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names the base model or an
adapter; /v1/models lists the adapters with the base as their `parent`; `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` change the set at run time when --enable-lora-runtime-updates allows.

`Served` is the server's view of the names (only these routes change the engine's adapters, so it
stays in step with it). An unloaded adapter takes no new requests at once; the engine frees it once
the requests running under it have finished (engine/adapters.py)."""
from __future__ import annotations

import itertools
import json
import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.lora_request import LoRARequest
from tokenmill.server.errors import APIError


def parse_modules(values: tuple[str, ...] | list[str], ids=None) -> list[LoRARequest]:
    """--lora-modules entries: name=path, or JSON {"name", "path", "base_model_name"}. ValueError
    says which entry is malformed."""
    ids = ids or itertools.count(1)
    out: dict[str, LoRARequest] = {}
    for v in values:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules entry {v!r:.80} is not valid JSON: {e}.") from None
            unknown = sorted(set(d) - {"name", "path", "base_model_name"}) if isinstance(d, dict) else None
            if not isinstance(d, dict) or unknown or not {"name", "path"} <= set(d):
                raise ValueError(f"--lora-modules JSON takes \"name\", \"path\" and optionally \"base_model_name\"; "
                                 f"got {v!r:.80}.")
            lr = LoRARequest(d["name"], next(ids), d["path"], d.get("base_model_name"))
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path entries, got {v!r:.80}.")
            lr = LoRARequest(name, next(ids), path)
        if lr.lora_name in out:
            raise ValueError(f"--lora-modules names {lr.lora_name!r} twice.")
        out[lr.lora_name] = lr
    return list(out.values())


class Served:
    """The model names this server answers to: its own, and its adapters'."""

    def __init__(self, names: tuple[str, ...], adapters: list[LoRARequest]) -> None:
        self.names = names
        self.adapters: dict[str, LoRARequest] = {lr.lora_name: lr for lr in adapters}
        self._ids = itertools.count(max((lr.lora_int_id for lr in adapters), default=0) + 1)

    def next_id(self) -> int:
        return next(self._ids)

    def resolve(self, name: str | None) -> str | None:
        """None for the base model (or no name), the adapter's name for an adapter; 404 otherwise."""
        if name is None or name in self.names:
            return None
        if name in self.adapters:
            return name
        served = list(self.names) + sorted(self.adapters)
        raise APIError(404, f"the model '{name:.200}' does not exist; this server serves {served}",
                       "not_found_error", "model")

    def model_cards(self, max_model_len: int) -> list[dict]:
        now, base = int(time.time()), self.names[0]
        cards = [{"id": n, "object": "model", "created": now, "owned_by": "tokenmill", "root": n, "parent": None,
                  "max_model_len": max_model_len} for n in self.names]
        return cards + [{"id": lr.lora_name, "object": "model", "created": now, "owned_by": "tokenmill",
                         "root": lr.lora_path, "parent": lr.base_model_name or base, "max_model_len": max_model_len}
                        for _, lr in sorted(self.adapters.items())]


class LoadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None  # vLLM's clients send it; the name is the key here


def add_routes(app: FastAPI, client, served: Served, runtime_updates: bool) -> None:
    def allowed() -> None:
        if not runtime_updates:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off; start the server with "
                                "--enable-lora-runtime-updates")

    @app.post("/v1/load_lora_adapter")
    async def load(req: LoadLoRA):
        allowed()
        name = req.lora_name
        if name in served.names:
            raise APIError(400, f"'{name}' is the base model's name; give the adapter another", param="lora_name")
        try:
            lr = LoRARequest(name, served.next_id(), req.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from None
        if name in served.adapters:
            raise APIError(400, f"the LoRA adapter '{name}' is already loaded; unload it first", param="lora_name")
        try:
            await client.call(lambda engine: engine.add_lora(lr))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        served.adapters[name] = lr
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(req: UnloadLoRA):
        allowed()
        name = req.lora_name
        if name not in served.adapters:
            raise APIError(404, f"no LoRA adapter named '{name:.200}' is loaded", "not_found_error", "lora_name")
        del served.adapters[name]  # no new requests from here on; running ones finish under it
        await client.call(lambda engine: engine.remove_lora(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
