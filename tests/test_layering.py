"""Dependency direction (DESIGN.md): core/ never imports torch; server/ never imports torch,
runner/, layers/ or models/; compress/ stays off the serving stack; quant/ off models and tools; kernels/ a leaf; router/ an HTTP client that imports nothing of the engine. Checked on the source with `ast`, so a violation cannot hide."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "tokenmill"
RULES = {
    "core": ("torch", "tokenmill.runner", "tokenmill.layers", "tokenmill.models", "tokenmill.engine"),
    "server": ("torch", "tokenmill.runner", "tokenmill.layers", "tokenmill.models"),
    # offline compression works on models directly, never through the serving stack
    "compress": ("tokenmill.server", "tokenmill.engine", "tokenmill.runner"),
    # kernels and checkpoint formats know nothing of models or of the tools that write them
    "quant": ("tokenmill.models", "tokenmill.compress", "tokenmill.engine", "tokenmill.server"),
    # proposers serve the runner: they know nothing of the engine or the server
    # constraints compile from plain params to matchers: no torch, no model, no engine
    "structured": ("torch", "tokenmill.runner", "tokenmill.models", "tokenmill.engine", "tokenmill.server"),
    "spec": ("tokenmill.server", "tokenmill.engine"),
    # the router is an HTTP client of replicas: nothing of the engine, nor the server's engine-facing app
    "router": ("torch", "tokenmill.engine", "tokenmill.runner", "tokenmill.layers", "tokenmill.models",
               "tokenmill.core", "tokenmill.server.api", "tokenmill.sampling"),
    # the ranks' plumbing sits below the engine: it builds runners and models, never the engine or a server
    "distributed": ("tokenmill.engine", "tokenmill.server", "tokenmill.router"),
    # the native kernels are a leaf: arithmetic and layouts, nothing of tokenmill above them
    "kernels": ("tokenmill.",),
}


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(RULES))
def test_forbidden_imports(package):
    files = list((PKG / package).glob("**/*.py"))
    if package == "core":
        assert files, "core/ must exist"
    for f in files:
        for name in imports(f):
            assert not name.startswith(RULES[package]), f"{f.relative_to(PKG)} imports {name}"


def test_the_router_process_never_imports_torch():
    import subprocess
    import sys
    code = ("import sys, tokenmill.router.app, tokenmill.router.cli, tokenmill.router.launcher, tokenmill.cli; "
            "tokenmill.cli.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
