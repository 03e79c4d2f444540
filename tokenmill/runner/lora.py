"""The runner's LoRA adapters: every added adapter in host memory, up to `max_loras` of them in
the projections' slots (layers/lora.py) at a time.

Each step the runner asks for the slots of the adapters its rows use (`activate`); one not in a
slot takes a free one or the least recently used one no row of this step needs (the scheduler
never puts more than `max_loras` adapters in one step). Placing an adapter copies its pairs into
every projection's slot — a few MB, against a step that reads the whole model's weights.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tokenmill.layers.linear import Linear
from tokenmill.layers.lora import LoRABank, LoRARows
from tokenmill.models import lora_adapter
from tokenmill.models.llama import CausalLM
from tokenmill.models.moe import SparseMoE
from tokenmill.resources import memory_available

log = logging.getLogger("tokenmill")


def targets(model: CausalLM) -> dict[str, Linear]:
    """The projections adapters may target, by path: each layer's qkv and o, and a dense MLP's
    gate_up and down."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        out[f"model.layers.{i}.self_attn.qkv_proj"] = layer.self_attn.qkv_proj
        out[f"model.layers.{i}.self_attn.o_proj"] = layer.self_attn.o_proj
        if not isinstance(layer.mlp, SparseMoE):
            out[f"model.layers.{i}.mlp.gate_up_proj"] = layer.mlp.gate_up_proj
            out[f"model.layers.{i}.mlp.down_proj"] = layer.mlp.down_proj
    return out


def slot_dtype(model: CausalLM, lora_dtype: str, device: torch.device) -> torch.dtype:
    """auto: float16 beside quantized weights (on the CPU kernels, which read it), else the model's dtype."""
    if lora_dtype != "auto":
        return {"float32": torch.float32, "float16": torch.float16}[lora_dtype]
    if device.type == "cpu" and model.quantized_weights():
        return torch.float16
    return model.model.embed_tokens.dtype if device.type != "cpu" else torch.float32


class LoRAManager:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, lora_dtype: str, device: torch.device) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.banks: dict[str, LoRABank] = {}
        dtype = slot_dtype(model, lora_dtype, device)
        projections = targets(model)
        if device.type == "cpu":
            need = max_loras * max_rank * dtype.itemsize * sum(len(p.part_sizes()) * p.in_features + p.out_features
                                                              for p in projections.values())
            avail, why = memory_available()
            if need + (256 << 20) > avail:
                raise ValueError(f"the LoRA slots do not fit in memory: {max_loras} adapters of rank up to {max_rank} "
                                 f"need {need / 2**30:.2f} GiB beside the model, but this process may use "
                                 f"{avail / 2**30:.2f} GiB more ({why}). Lower --max-loras or --max-lora-rank.")
        for path, proj in projections.items():
            proj.lora = self.banks[path] = LoRABank(proj.part_sizes(), proj.in_features, max_loras, max_rank, device,
                                                    dtype)
        self.host: dict[str, lora_adapter.AdapterWeights] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.free = list(range(max_loras - 1, -1, -1))
        log.info("LoRA: %d adapter slot(s) of rank up to %d beside %d projections (%s, %.1f MiB)", max_loras, max_rank,
                 len(self.banks), str(dtype)[6:], sum(b.nbytes() for b in self.banks.values()) / 2**20)

    def add(self, name: str, path: str) -> None:
        """Reads and checks the adapter into host memory (ValueError if it does not fit the model);
        an adapter already added under this name and path is kept."""
        have = self.host.get(name)
        if have is not None:
            if have.path != path:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded from {have.path}; unload it "
                                 "first or choose another name.")
            return
        self.host[name] = lora_adapter.load(name, path, self.model, self.max_rank)

    def remove(self, name: str) -> None:
        self.host.pop(name, None)
        slot = self.resident.pop(name, None)
        if slot is not None:
            for bank in self.banks.values():
                bank.clear(slot)
            self.free.append(slot)

    def names(self) -> list[str]:
        return sorted(self.host)

    def activate(self, names: set[str]) -> dict[str, int]:
        """The slot of each adapter in `names` (at most max_loras), placing those not resident."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step uses {len(names)} adapters but there are {self.max_loras} slots")
        for name in names:
            if name in self.resident:
                self.resident.move_to_end(name)
        for name in names:
            if name in self.resident:
                continue
            if name not in self.host:
                raise RuntimeError(f"LoRA adapter {name!r} was never added to the runner")
            if self.free:
                slot = self.free.pop()
            else:
                old = next(n for n in self.resident if n not in names)
                slot = self.resident.pop(old)
            adapter = self.host[name]
            for path, bank in self.banks.items():
                parts = adapter.modules.get(path)
                if parts:
                    bank.put(slot, parts)
                else:
                    bank.clear(slot)
            self.resident[name] = slot
        return {name: self.resident[name] for name in names}

    def rows(self, per_request: list[tuple[str | None, int]], device: torch.device) -> LoRARows | None:
        """The step's LoRARows from each scheduled request's (adapter or None, tokens fed) in batch
        order; None when no row runs under an adapter."""
        names = {n for n, _ in per_request if n is not None}
        if not names:
            return None
        slot_of = self.activate(names)
        slots: list[int] = []
        runs: list[tuple[int, int, int]] = []
        for name, n in per_request:
            s = -1 if name is None else slot_of[name]
            if runs and runs[-1][2] == s:
                runs[-1] = (runs[-1][0], runs[-1][1] + n, s)
            else:
                runs.append((len(slots), len(slots) + n, s))
            slots.extend([s] * n)
        return LoRARows(torch.tensor(slots, dtype=torch.long, device=device), runs)
