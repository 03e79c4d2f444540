"""`LoRARequest`: which adapter a request runs with, as vLLM names it. Plain data (no torch): it
crosses from the caller through the engine and scheduler to the runner, which loads the weights."""
from __future__ import annotations

import re
from dataclasses import dataclass

# an adapter's name is what a client puts in `model`: printable, no spaces, no path separators
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: the name requests select the adapter by (the server's `model` field);
    `lora_int_id`: a positive number of the caller's (vLLM's field; the name is the key here);
    `lora_path`: a PEFT directory (adapter_config.json + adapter_model.safetensors) or a llama.cpp
    LoRA GGUF file; `base_model_name`: the model it was trained on, shown as `parent` in /v1/models."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not _NAME.fullmatch(self.lora_name):
            raise ValueError(f"a LoRA adapter's name must be 1-128 letters, digits or ._:@+- (starting with a letter "
                             f"or digit), got {self.lora_name!r:.80}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r:.40}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs lora_path: a PEFT directory or a LoRA GGUF file.")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
