"""Which instruction-set variant of the CPU kernels this machine runs, and building it once.

One install serves any x86-64 CPU: the kernels are compiled on first use for one named ISA variant
(never `-march=native`), picked by the CPU's features or forced with `TOKENMILL_CPU_ISA`. The
compiled library is cached under a name that hashes the sources, the variant's flags and the torch
version, so a cache directory shared by machines with different CPUs never hands one a binary it
cannot execute, and an edited source never loads a stale binary.

Builds run in a child process (a time limit and Ctrl-C kill the whole compiler process group), in
a private temporary folder whose finished library is renamed into the cache atomically: there is
no shared lock for an interrupted start to leave behind, and two processes building at once both
succeed (the second rename replaces the first with identical bytes). `make install` runs the build
(`python -m tokenmill.kernels`) so that serving loads a built library; a build on first use
remains for pip installs and forced variants, announced before and after.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

logger = logging.getLogger("tokenmill.kernels")

HERE = pathlib.Path(__file__).parent
# The sources compiled as two translation units that #include them (a "unity" build). Parsing
# PyTorch's headers is most of a small source's compile: eleven units parsed them eleven times
# (or loaded a precompiled header of them, itself a serial step as long as two sources); two
# parse them twice, and ninja builds both at once on a 2-core machine. The partition is fixed,
# not sized to the machine, so that every machine builds the same binary for the same cache name.
UNITS = (("dot_linear.cpp", "kquant.cpp", "linear.cpp", "shm.cpp", "amx.cpp"),
         ("stack.cpp", "lut.cpp", "attention.cpp", "context_attention.cpp", "pointwise.cpp", "amx_attention.cpp",
          "encoder_attention.cpp", "lora.cpp"))
SOURCES = [HERE / f for unit in UNITS for f in unit]
HEADERS = [HERE / f for f in ("ops.h", "vec.h", "shm.h", "dot.h", "attention.h", "decode_avx2.h", "decode_avx512.h", "rows_avx2.h", "amx.h")]

_AVX2 = ("-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# variant -> (compiler flags, /proc/cpuinfo flags the CPU must have), in ascending preference
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx2": (_AVX2, frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "avxvnni": (_AVX2 + ("-mavxvnni",), frozenset({"avx2", "fma", "f16c", "bmi2", "avx_vnni"})),
    "avx512": (_AVX512, frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    "avx512vnni": (_AVX512 + ("-mavx512vnni",),
                   frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                              "avx512_vnni"})),
    # avx512vnni plus bfloat16 products for prompt chunks on VDPBF16PS (amx.cpp; AMD Zen 4/5)
    "avx512bf16": (_AVX512 + ("-mavx512vnni", "-mavx512bf16"),
                   frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                              "avx512_vnni", "avx512_bf16"})),
    # avx512vnni plus AMX tiles for prompt chunks (amx.cpp); decode keeps the VNNI kernels
    "amx": (_AVX512 + ("-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                       "avx512_bf16", "amx_tile", "amx_bf16"})),
}
ISA_ENV = "TOKENMILL_CPU_ISA"


class UnsupportedISA(ValueError):
    """TOKENMILL_CPU_ISA names a variant that does not exist or that this CPU cannot execute."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "x86-64", "i686", "i386")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (the kernel clears those it cannot save and
    restore, e.g. AVX-512 state). Elsewhere, PyTorch's own CPU capability stands in."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch
    cap = torch.backends.cpu.get_cpu_capability()  # "DEFAULT" | "AVX2" | "AVX512" | ...
    return VARIANTS["avx512"][1] if cap.startswith("AVX512") else VARIANTS["avx2"][1] if cap == "AVX2" else frozenset()


def executable(flags: frozenset[str] | None = None) -> list[str]:
    """The variants this CPU can execute, ascending."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, (_, need) in VARIANTS.items() if need <= flags] if is_x86() else []


def best(flags: frozenset[str] | None = None) -> str | None:
    """The variant `auto` picks: the widest this CPU executes (VNNI before its absence)."""
    runs = executable(flags)
    for name in ("amx", "avx512bf16", "avx512vnni", "avx512", "avxvnni", "avx2"):
        if name in runs:
            return name
    return None


def requested() -> str | None:
    """The variant to build: TOKENMILL_CPU_ISA (auto by default), validated against this CPU.
    None: no variant runs here (not x86-64, or no AVX2), PyTorch's kernels serve."""
    want = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if want == "auto":
        return best()
    if want not in VARIANTS:
        raise UnsupportedISA(f"{ISA_ENV}={want!r} is not a kernel variant; use auto or one of "
                             f"{', '.join(VARIANTS)}.")
    runs = executable()
    if want not in runs:
        missing = sorted(VARIANTS[want][1] - cpu_flags()) if is_x86() else [platform.machine()]
        raise UnsupportedISA(f"{ISA_ENV}={want} asks for instructions this CPU lacks ({', '.join(missing)}); "
                             f"it can run: {', '.join(runs) or 'none (PyTorch kernels only)'}.")
    return want


def cache_root() -> pathlib.Path:
    """tokenmill's cache folder: TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill (~/.cache)."""
    return pathlib.Path(os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill"))


def cache_dir() -> pathlib.Path:
    return cache_root() / "kernels"


def _cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", "-fno-math-errno", *VARIANTS[isa][0], f"-DTOKENMILL_ISA_NAME={isa}"]


def compiler_version() -> str:
    """The first line of `$CXX --version` (what torch's extension builder runs), or "none"."""
    return _compiler_version(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    import subprocess
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    return (out.splitlines() or ["none"])[0]


def library_name(isa: str) -> str:
    """tokenmill_cpu_<isa>_<hash of sources, headers, flags, compiler, torch and Python version>."""
    import torch
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(_cflags(isa)).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()} {compiler_version()}".encode())
    return f"tokenmill_cpu_{isa}_{h.hexdigest()[:16]}"


def _prune(folder: pathlib.Path, max_age_s: float = 86400.0) -> None:
    """Remove build folders left by killed processes (a day old: no build takes that long)."""
    now = time.time()
    for p in folder.glob("build-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


BUILD_TIMEOUT_ENV = "TOKENMILL_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 900.0


class BuildTimeout(RuntimeError):
    """The compiler ran past TOKENMILL_KERNEL_BUILD_TIMEOUT; its processes were killed."""


def build_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={raw!r} must be positive")
    return value


def load(isa: str) -> pathlib.Path:
    """Loads the cached library of variant `isa` into torch.ops, compiling it first if needed.
    Returns its path. Raises BuildTimeout, or RuntimeError with the compiler's error lines."""
    import torch
    target = cache_dir() / f"{library_name(isa)}.so"
    if not target.exists():
        compile_variant(isa)
    torch.ops.load_library(str(target))
    return target


def compile_variant(isa: str, timeout: float | None = None) -> pathlib.Path:
    """Compiles variant `isa` into the cache in a child process, with one line before and one after.

    A child process because a compiler cannot be stopped from inside the process that waits on it:
    on timeout, Ctrl-C or any error the child's whole process group (ninja, g++) is killed, its
    private build folder goes with it, and the caller falls back to PyTorch's kernels."""
    import subprocess
    timeout = build_timeout() if timeout is None else timeout
    folder = cache_dir()
    target = folder / f"{library_name(isa)}.so"
    folder.mkdir(parents=True, exist_ok=True)
    _prune(folder)
    logger.warning("building tokenmill's CPU kernels for %s, once, into %s (about a minute; at most %.0f s, "
                   "%s sets the limit)", isa, folder, timeout, BUILD_TIMEOUT_ENV)
    t0 = time.monotonic()
    work = pathlib.Path(tempfile.mkdtemp(prefix="build-", dir=folder))
    pythonpath = [str(HERE.parent.parent)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    try:
        child = subprocess.Popen([sys.executable, "-m", "tokenmill.kernels", "--isa", isa, "--work", str(work)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)})
        try:
            out, _ = child.communicate(timeout=timeout)
        except BaseException as e:  # timeout, Ctrl-C, SystemExit: no compiler outlives us
            _stop(child)
            if isinstance(e, subprocess.TimeoutExpired):
                raise BuildTimeout(f"the kernel build ran past {timeout:.0f} s ({BUILD_TIMEOUT_ENV}) and was "
                                   f"stopped") from None
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if child.returncode != 0 or not target.exists():
        text = out.decode(errors="replace").strip()
        logger.debug("kernel build output:\n%s", text)
        errors = [ln.strip() for ln in text.splitlines() if "error:" in ln.lower()] or text.splitlines()[-1:]
        raise RuntimeError(f"the kernel build failed (exit {child.returncode}): "
                           + " | ".join(list(dict.fromkeys(errors))[:3]))
    logger.warning("built tokenmill's CPU kernels for %s in %.0f s: %s", isa, time.monotonic() - t0, target.name)
    return target


def _stop(child) -> None:
    """SIGTERM to the child's process group first: ninja runs each compiler in a process group of
    its own and, on SIGTERM, stops them before it exits; SIGKILL whatever is left after 10 s."""
    import signal
    import subprocess
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            child.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _compile_in_process(isa: str, work: pathlib.Path) -> pathlib.Path:
    """The child's side: compile in the folder the parent made (and removes), rename into the cache."""
    name = library_name(isa)
    bindir = os.path.dirname(sys.executable)  # the `ninja` wheel puts its binary beside the interpreter
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension
    cpp_extension.load(name=name, sources=[str(u) for u in unity_sources(work)], build_directory=str(work),
                       extra_cflags=_cflags(isa), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    target = cache_dir() / f"{name}.so"
    os.replace(work / f"{name}.so", target)
    return target


def unity_sources(work: pathlib.Path) -> list[pathlib.Path]:
    """Writes the translation units of UNITS into `work`; each includes its sources by absolute
    path, so the compiler's messages still name the source file and line."""
    units = []
    for i, names in enumerate(UNITS):
        unit = work / f"unit{i}.cpp"
        unit.write_text("".join(f'#include "{HERE / n}"\n' for n in names))
        units.append(unit)
    return units


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenmill.kernels`: compile this CPU's variant now (install time, `make
    install`) so that the first `tokenmill serve` loads it instead of compiling."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tokenmill.kernels", description=main.__doc__)
    ap.add_argument("--isa", default=None, help=f"a variant ({', '.join(VARIANTS)}); default: {ISA_ENV} or auto")
    ap.add_argument("--work", type=pathlib.Path, default=None, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s", stream=sys.stderr)
    try:
        if args.isa is not None:
            os.environ[ISA_ENV] = args.isa
        isa = requested()
    except UnsupportedISA as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isa is None:
        print("no kernel variant runs on this CPU (x86-64 with AVX2 needed); PyTorch's kernels will serve.",
              file=sys.stderr)
        return 0
    if args.work is not None:
        _compile_in_process(isa, args.work)
        return 0
    target = cache_dir() / f"{library_name(isa)}.so"
    if target.exists():
        print(f"tokenmill's CPU kernels for {isa} are built: {target}", file=sys.stderr)
        return 0
    try:
        compile_variant(isa)
    except (BuildTimeout, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
