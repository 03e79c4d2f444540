"""Command-line pieces every command shares: engine flags generated from the config dataclasses
(one definition and one help text per option), durations, API keys, JSON reports."""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import MISSING, fields

from tokenmill.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulingConfig

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulingConfig, ParallelConfig, LoRAConfig)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, *ENGINE_CONFIGS)


def add_config_args(p: argparse.ArgumentParser, *configs) -> None:
    """One flag per field of each frozen config dataclass: `--kebab-case` of the field's name (or the
    metadata's `flag`; None: no flag, another part of the command line sets it), its help from the
    metadata, booleans as --x / --no-x; the metadata may give `type`, `choices` or `action="append"`
    (repeatable) / `"extend"` (several values, repeatable), else the annotation decides. Each flag's
    value lands under the field's name."""
    for cls in configs:
        for f in fields(cls):
            name = f.metadata.get("flag", f.name.replace("_", "-"))
            if name is None:
                continue
            flag, help_text = "--" + name, f.metadata.get("help", "")
            default = None if f.default is MISSING else f.default
            if f.type in ("bool", bool):
                p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=f"{help_text} (default: {'on' if f.default else 'off'})")
                continue
            if f.metadata.get("action") == "append":
                p.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
                continue
            if f.metadata.get("action") == "extend":  # one or more values per flag, the flag repeatable
                p.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None, help=help_text)
                continue
            kind = f.metadata.get("type") or scalar_type(f.type)
            suffix = "" if "default" in help_text else f" (default: {default})"
            p.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                           help=help_text + suffix)


def scalar_type(annotation) -> type:
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text and "str" not in text:
        return int
    return str


def config_kwargs(args: argparse.Namespace, *configs) -> dict:
    names = {f.name for cls in configs for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return config_kwargs(args, *ENGINE_CONFIGS)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key flags and TOKENMILL_API_KEY (comma-separated)."""
    env = os.environ.get("TOKENMILL_API_KEY", "")
    keys = list(args.api_keys or []) + (env.split(",") if env else [])
    if any(not k.strip() for k in keys):  # an empty key would look like auth while letting "Bearer " in
        raise ValueError("--api-key must not be empty, nor any comma-separated entry of TOKENMILL_API_KEY.")
    return [k.strip() for k in keys]


def emit_json(result: dict, path: str | None) -> None:
    """A command's JSON report: printed, and written to `path` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
