"""The kernels' ISA variants and their build: which variant a CPU gets, a forced variant the CPU
cannot run refused with a clear error, cache names keyed by the variant, every other variant this
machine can execute passing the kernel tests, and a wheel install (outside the checkout, with a
fresh build cache) that builds and loads the kernels from the packaged sources alone."""
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

from tokenmill import kernels
from tokenmill.kernels import build

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="TOKENMILL_KERNELS=0")

ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt".split())
ALDER_LAKE = ZEN3 | {"avx_vnni"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ICE_LAKE = SKYLAKE_X | {"avx512_vnni", "avx512vbmi"}
ZEN4 = ICE_LAKE | {"avx512_bf16", "avx_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags,want", [(ZEN3, "avx2"), (ALDER_LAKE, "avxvnni"), (SKYLAKE_X, "avx512"),
                                        (ICE_LAKE, "avx512vnni"), (ZEN4, "avx512bf16"), (SAPPHIRE_RAPIDS, "amx"),
                                        (frozenset({"sse4_2", "avx"}), None)])
def test_auto_picks_the_widest_variant_the_cpu_runs(flags, want, monkeypatch):
    monkeypatch.setattr(build, "is_x86", lambda: True)
    assert build.best(flags) == want
    assert (want in build.executable(flags)) if want else not build.executable(flags)


def test_a_forced_variant_must_exist_and_run_here(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "avx9000")
    with pytest.raises(build.UnsupportedISA, match="not a kernel variant"):
        build.requested()
    monkeypatch.setattr(build, "cpu_flags", lambda: ZEN3)
    monkeypatch.setattr(build, "is_x86", lambda: True)
    monkeypatch.setenv(build.ISA_ENV, "avx512vnni")
    with pytest.raises(build.UnsupportedISA, match=r"lacks \(.*avx512_vnni.*\); it can run: avx2"):
        build.requested()
    monkeypatch.setenv(build.ISA_ENV, "AVX2")
    assert build.requested() == "avx2"
    monkeypatch.setattr(build, "is_x86", lambda: False)  # an ARM machine: PyTorch's kernels
    monkeypatch.setenv(build.ISA_ENV, "auto")
    assert build.requested() is None


def test_cache_names_differ_by_variant_and_name_the_variant():
    names = {isa: build.library_name(isa) for isa in build.VARIANTS}
    assert len(set(names.values())) == len(names)
    assert all(n.startswith(f"tokenmill_cpu_{isa}_") for isa, n in names.items())


def test_the_loaded_library_is_the_requested_variant():
    import torch

    assert kernels.available()
    assert kernels.isa() == build.requested() == torch.ops.tokenmill.isa()
    assert kernels.dot_layout()
    path = pathlib.Path(kernels._state["path"])
    assert path.parent == build.cache_dir() and path.name.startswith(f"tokenmill_cpu_{kernels.isa()}_") and path.exists()


@pytest.mark.slow
def test_a_wheel_install_builds_and_loads_the_kernels_after_an_interrupted_first_start(tmp_path):
    """pip wheel, then a fresh venv outside the checkout that sees this environment's torch (a .pth
    file) but tokenmill only from the wheel, and an empty kernel cache: the build must find every
    source and header in the installed package. Its first start is interrupted with Ctrl-C mid-build
    (the report: every later start then hung on a stale lock): the compiler stops with it, nothing
    is left in the cache, and the next start builds and loads the kernels (one build for both).
    It builds a variant the test below needs (the library is the same bytes from the same sources,
    whichever folder compiles them) and leaves it in this suite's cache, saving that test a build."""
    import shutil
    import signal
    import time

    src = tmp_path / "src"  # a copy: setuptools writes build/ beside the sources
    shutil.copytree(ROOT / "tokenmill", src / "tokenmill", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(src)], check=True, timeout=600)
    wheel = next(wheels.glob("tokenmill-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (pathlib.Path(site) / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)],
                   check=True, timeout=600)
    probe = ("import tokenmill, tokenmill.kernels as k, torch; "
             "assert k.available(), 'kernels did not load'; "
             "print(tokenmill.__file__, k.isa(), torch.ops.tokenmill.isa())")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["TOKENMILL_CACHE_DIR"] = str(tmp_path / "cache")
    others = [isa for isa in build.executable() if isa != kernels.isa()]
    want = others[0] if others else build.requested()
    env[build.ISA_ENV] = want
    # Ctrl-C's handler, even where this suite runs as a background job (which starts with SIGINT ignored)
    p = subprocess.Popen([py, "-c", "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                          "import tokenmill.kernels as k; print(k.available())"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    ours = str(tmp_path / "cache")  # its build folder: not another build's compiler
    while not _live_processes_mentioning("cc1plus", ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert _live_processes_mentioning(str(tmp_path / "cache")) == []
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []
    r = subprocess.run([py, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    path, isa, built = r.stdout.split()
    assert path.startswith(site) and isa == built == want
    [lib] = (tmp_path / "cache" / "kernels").glob(f"tokenmill_cpu_{isa}_*.so")
    assert lib.name == f"{build.library_name(isa)}.so"
    again = subprocess.run([py, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr[-2000:]
    if not (build.cache_dir() / lib.name).exists():
        shutil.copy(lib, build.cache_dir() / f".{lib.name}.part")
        os.replace(build.cache_dir() / f".{lib.name}.part", build.cache_dir() / lib.name)


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(build.VARIANTS))
def test_every_variant_this_cpu_runs_passes_the_kernel_tests(isa):
    if isa not in build.executable():
        pytest.skip(f"this CPU cannot execute {isa}")
    if isa == kernels.isa():
        pytest.skip(f"{isa} is this process's variant: tests/test_kernels.py ran on it")
    env = {**os.environ, build.ISA_ENV: isa}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_kernels.py"),
                        str(ROOT / "tests" / "test_decode_stack.py"), str(ROOT / "tests" / "test_kquant.py")], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def _start(tmp_path, env_extra, code="import tokenmill.kernels as k; print(k.available())"):
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache"), **env_extra}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _live_processes_mentioning(*texts: str) -> list[str]:
    """Processes (zombies have no command line) whose command line contains every one of `texts`."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(t in cmd for t in texts):
            found.append(cmd[:200])
    return found


def test_a_build_past_its_time_limit_is_stopped_and_pytorch_serves(tmp_path):
    """The first start announces the build; past TOKENMILL_KERNEL_BUILD_TIMEOUT the compiler is
    killed (no g++ left running, no build folder left behind) and the process carries on without
    the kernels, saying so once."""
    p = _start(tmp_path, {build.BUILD_TIMEOUT_ENV: "2", build.ISA_ENV: "avx2"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "False", err
    assert "building tokenmill's CPU kernels for avx2, once" in err
    assert err.count("kernels unavailable") == 1 and "ran past 2 s" in err
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []
    assert _live_processes_mentioning(str(tmp_path / "cache")) == []


def test_a_failing_compiler_falls_back_with_its_error_line(tmp_path):
    bad = tmp_path / "c++"
    bad.write_text("#!/bin/sh\necho 'fatal error: this compiler is broken' >&2\nexit 1\n")
    bad.chmod(0o755)
    p = _start(tmp_path, {"CXX": str(bad), build.ISA_ENV: "avx2"})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and out.strip() == "False", err
    assert err.count("kernels unavailable") == 1 and "the kernel build failed" in err
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def test_the_build_time_limit_must_be_a_positive_number(monkeypatch):
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(build.BUILD_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=build.BUILD_TIMEOUT_ENV):
            build.build_timeout()
    monkeypatch.setenv(build.BUILD_TIMEOUT_ENV, "30")
    assert build.build_timeout() == 30.0


def test_the_sources_compile_as_two_units_that_include_each_source_once(tmp_path):
    """Two translation units parse PyTorch's headers twice where one per source parsed them eleven
    times; together they include every packaged source exactly once, by absolute path."""
    units = build.unity_sources(tmp_path)
    assert len(units) == 2 and all(u.parent == tmp_path for u in units)
    included = [line.split('"')[1] for u in units for line in u.read_text().splitlines()]
    assert sorted(included) == sorted(str(s) for s in build.SOURCES)
    assert sorted(s.name for s in build.SOURCES) == sorted(p.name for p in build.HERE.glob("*.cpp"))
