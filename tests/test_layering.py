"""Dependency direction (DESIGN.md), for every package: each sits on a floor and imports only from
floors below it (never sideways, never up), plus the rules a floor alone does not say: core/ and
structured/ never import torch, not even through what they import; server/ never imports torch,
runner/, layers/ or models/ itself; compress/ stays off the serving stack; the router is an HTTP
client that imports nothing of the engine; the kernels are a leaf. And a line budget per module.
Checked on the source with `ast` (and, for the torch-free packages, by importing them), so a
violation cannot hide."""
import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "tokenmill"

# bottom to top; the top-level modules are one-file packages of floor 0
FLOORS = [
    {"kernels", "config", "cpus", "lora_request", "outputs", "pooling_params", "resources", "sampling_params",
     "utils"},
    {"core", "structured", "quant", "sampling", "flags"},
    {"layers"},
    {"models"},
    {"runner"},
    {"spec"},          # proposers serve the runner (a draft model runs in a ModelRunner of its own)
    {"distributed"},   # the ranks' plumbing builds runners and models, never the engine
    {"engine"},
    {"compress", "bench", "server"},
    {"router"},
    {"__init__"},      # the package's face (LLM, SamplingParams): for users, not for its own packages
    {"cli"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
# what a floor alone allows but the design does not
EXTRA = {
    "server": ("torch", "tokenmill.runner", "tokenmill.layers", "tokenmill.models"),
    # offline compression works on models directly, never through the serving stack
    "compress": ("tokenmill.server", "tokenmill.engine", "tokenmill.runner"),
    # the router is an HTTP client of replicas: nothing of the engine, nor the server's engine-facing app
    "router": ("torch", "tokenmill.engine", "tokenmill.runner", "tokenmill.layers", "tokenmill.models",
               "tokenmill.core", "tokenmill.server.api", "tokenmill.sampling", "tokenmill.distributed"),
    # the native kernels are a leaf: arithmetic and layouts, nothing of tokenmill above them
    "kernels": ("tokenmill.",),
    "core": ("torch",),
    "structured": ("torch",),
}
TORCH_FREE = ("core", "structured")
# lines a module may have: a reader's afternoon is many small files, not a few long ones
BUDGET = {".py": 400, ".cpp": 600, ".h": 600}
# over budget today, each to be split; the list may only shrink (empty: every module within budget)
OVER_BUDGET: set[str] = set()


def imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports (`from tokenmill import a` counts as tokenmill.a)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "tokenmill":  # a module of the package, or a name its __init__ exports
                names |= {f"tokenmill.{a.name}" if (PKG / a.name).is_dir() or (PKG / f"{a.name}.py").exists()
                          else "tokenmill.__init__" for a in node.names}
    return names


def _unit(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _files(unit: str) -> list[pathlib.Path]:
    return list((PKG / unit).glob("**/*.py")) if (PKG / unit).is_dir() else [PKG / f"{unit}.py"]


def test_every_package_has_a_floor():
    units = {_unit(p) for p in PKG.glob("**/*.py")} - {"__main__"}
    assert units <= set(FLOOR), f"packages without a floor in this test: {sorted(units - set(FLOOR))}"


@pytest.mark.parametrize("unit", sorted(FLOOR))
def test_imports_run_down(unit):
    files = _files(unit)
    assert files and all(f.exists() for f in files), f"{unit} is gone: update FLOORS"
    for f in files:
        for name in imports(f):
            if name.startswith(EXTRA.get(unit, ("\0",))):
                pytest.fail(f"{f.relative_to(PKG)} imports {name}")
            parts = name.split(".")
            if parts[0] != "tokenmill" or len(parts) < 2 or parts[1] == unit:
                continue
            target = parts[1]
            assert target in FLOOR, f"{f.relative_to(PKG)} imports {name}, which has no floor here"
            assert FLOOR[target] < FLOOR[unit], \
                f"{f.relative_to(PKG)} (floor {FLOOR[unit]}) imports {name} (floor {FLOOR[target]}): up or sideways"


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_never_load_torch(package):
    """Followed through every import, not only the package's own: import all of it and look."""
    modules = sorted("tokenmill." + ".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
                     for p in (PKG / package).glob("**/*.py"))
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_modules_keep_to_their_line_budget():
    over = {}
    for p in PKG.glob("**/*"):
        if p.suffix in BUDGET and "__pycache__" not in p.parts:
            lines = len(p.read_text().splitlines())
            if lines > BUDGET[p.suffix]:
                over[str(p.relative_to(PKG))] = lines
    assert set(over) <= OVER_BUDGET, f"over the line budget {BUDGET}: {sorted(set(over) - OVER_BUDGET)}"
    assert OVER_BUDGET <= set(over), f"now within budget, take off OVER_BUDGET: {sorted(OVER_BUDGET - set(over))}"


def test_the_router_process_never_imports_torch():
    code = ("import sys, tokenmill.router.app, tokenmill.router.cli, tokenmill.router.launcher, tokenmill.cli; "
            "tokenmill.cli.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
