"""Which instruction-set variant of the CPU kernels this machine runs, and building it once.

One install serves any x86-64 CPU: the kernels are compiled on first use for one named ISA variant
(never `-march=native`), picked by the CPU's features or forced with `TOKENMILL_CPU_ISA`. The
compiled library is cached under a name that hashes the sources, the variant's flags and the torch
version, so a cache directory shared by machines with different CPUs never hands one a binary it
cannot execute, and an edited source never loads a stale binary.

Builds run in a private temporary folder and the finished library is renamed into the cache
atomically: there is no shared lock for an interrupted start to leave behind, and two processes
building at once both succeed (the second rename replaces the first with identical bytes).
"""
from __future__ import annotations

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
SOURCES = [HERE / f for f in ("linear.cpp", "attention.cpp", "pointwise.cpp", "stack.cpp")]
HEADERS = [HERE / f for f in ("ops.h", "vec.h")]

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
    for name in ("avx512vnni", "avx512", "avxvnni", "avx2"):
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


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill")
    return pathlib.Path(root) / "kernels"


def _cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", "-fno-math-errno", *VARIANTS[isa][0], f"-DTOKENMILL_ISA_NAME={isa}"]


def library_name(isa: str) -> str:
    """tokenmill_cpu_<isa>_<hash of sources, headers, flags, torch and Python version>."""
    import torch
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(_cflags(isa)).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
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


def load(isa: str) -> pathlib.Path:
    """Loads the cached library of variant `isa` into torch.ops, building it first if needed.
    Returns its path. Raises whatever the compiler or loader raises."""
    import torch
    folder = cache_dir()
    name = library_name(isa)
    target = folder / f"{name}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        _prune(folder)
        logger.info("building tokenmill's CPU kernels (%s) into %s; the first start only, about a minute",
                    isa, folder)
        bindir = os.path.dirname(sys.executable)  # the `ninja` wheel puts its binary beside the interpreter
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        from torch.utils import cpp_extension
        work = pathlib.Path(tempfile.mkdtemp(prefix="build-", dir=folder))
        try:
            cpp_extension.load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(work),
                               extra_cflags=_cflags(isa), extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
            os.replace(work / f"{name}.so", target)  # the loaded mapping outlives the rename
            return target
        finally:
            shutil.rmtree(work, ignore_errors=True)
    torch.ops.load_library(str(target))
    return target
