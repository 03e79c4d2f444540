"""Packed weights kept on disk between starts: a later start maps them instead of packing again.

Why: a GGUF's blocks are transcoded into the kernels' panel layouts as they load (quant/kquant.py),
into fresh anonymous memory. The packing is quick; faulting in gigabytes of fresh memory is not
everywhere (on virtual machines the hypervisor backs each page on its first touch), and it was most
of a 3B model's start. llama.cpp maps its file and starts from the page cache. So once a model is
loaded and packed, it is written to one file (in the background, while the server already serves):
the model's Python skeleton (modules, panel objects) pickled with every tensor replaced by a
reference, then the tensors' bytes. A later start with the same source files, load settings,
kernel variant and tokenmill sources maps that file copy-on-write (the kernels only read weights)
and neither reads nor packs the source: its pages come from the page cache as llama.cpp's do. A
table the model reads through a mapping of the GGUF itself (the embedding) is referenced, not copied.
Where the filesystem keeps large folios (ext4 and xfs on Linux 6.x) the mapped weights come in huge
pages as packed ones do; replicas on one host share one copy. Tensor-parallel ranks load from the source.

One entry per source and load settings: writing one removes the other entries of that source
(another tokenmill version, a changed file) and those whose source is gone. An entry that does not
read back whole is deleted and the model loaded from its source. The skeleton is a pickle, trusted
as the compiled kernels in the same cache directory are; classes outside tokenmill, torch and
numpy are refused all the same. `--weight-cache off` turns it off; by default it applies to models
of WEIGHT_CACHE_MIN_BYTES or more (smaller ones load in well under a second).
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import mmap
import os
import pathlib
import pickle
import shutil
import struct
import threading

import numpy as np
import torch
from torch import nn

from tokenmill.kernels.build import cache_root

log = logging.getLogger(__name__)

MAGIC, VERSION = b"TMWCACHE", 1
WEIGHT_CACHE_MIN_BYTES = 256 << 20
_HEAD = struct.Struct("<8sIQQQ")  # magic, version, skeleton bytes, storages, file bytes
_PAGE, _SMALL = 4096, 64         # storages start on a page (those under a page on 64 bytes)
_MADV_POPULATE_READ = 22         # Linux 5.14+: map every page of a range in one call
_ALLOWED_ROOTS = {"tokenmill", "torch", "numpy", "collections", "builtins", "copyreg", "_codecs", "functools"}
_UNSAFE_BUILTINS = {"eval", "exec", "compile", "open", "__import__", "getattr", "setattr", "delattr", "input",
                    "breakpoint", "globals", "locals", "vars", "exit", "quit", "help"}
_writers: list[threading.Thread] = []


class NotCacheable(Exception):
    """The model holds something the cache does not write (a tensor off the CPU, a foreign mapping)."""


def default_dir() -> pathlib.Path:
    return cache_root() / "weights"  # beside the compiled kernels


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of tokenmill's own sources: the skeleton's classes and the panel layouts are theirs."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _stat(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


class Entry:
    """The cache file for one model source (`files`: every file it is read from) and its load
    settings (`settings`: plain values that change what is packed)."""

    def __init__(self, directory: str | os.PathLike, files: list[str], settings: dict) -> None:
        self.dir = pathlib.Path(directory)
        self.sources = [_stat(f) for f in files]
        self.settings = {**settings, "torch": torch.__version__, "code": code_fingerprint()}
        digest = json.dumps({"sources": self.sources, "settings": self.settings}, sort_keys=True).encode()
        self.key = hashlib.sha256(digest).hexdigest()[:32]
        self.path = self.dir / f"{self.key}.bin"

    def read(self) -> nn.Module | None:
        """The cached model mapped from disk, or None (no entry, or one that does not read back)."""
        if not self.path.exists():
            return None
        try:
            return _read(self.path)
        except Exception as e:  # a truncated or foreign file: load from the source, write it again
            log.warning("weight cache entry %s does not read back (%s); loading from the source", self.path, e)
            self.path.unlink(missing_ok=True)
            return None

    def write_later(self, model: nn.Module, min_bytes: int = 0) -> None:
        """Writes the model's entry in a background thread (the process waits for it at exit). The
        skeleton is taken now: the weights do not change after loading, and the thread's references
        keep the storages it writes alive if the model moves a tensor meanwhile."""
        try:
            skeleton, storages = _skeleton(model)
        except NotCacheable as e:
            log.info("weights not cached: %s", e)
            return
        size = sum(st.nbytes() for st in storages)
        if size < min_bytes:
            return
        t = threading.Thread(target=self._write, args=(skeleton, storages, size), name="tokenmill-weight-cache")
        _writers.append(t)
        t.start()

    def _write(self, skeleton: bytes, storages: list, size: int) -> None:
        tmp = self.dir / f"{self.key}.{os.getpid()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.dir).free
            if free < size + (1 << 30):
                log.warning("weights not cached: %.2f GB to write, %.2f GB free in %s", size / 1e9, free / 1e9, self.dir)
                return
            _write(tmp, skeleton, storages)
            (self.dir / f"{self.key}.json").write_text(json.dumps({"sources": self.sources, "settings": self.settings}))
            os.replace(tmp, self.path)  # readers see a whole entry or none
            self._remove_stale()
            log.info("packed weights cached in %s (%.2f GB): the next start maps them", self.path, size / 1e9)
        except OSError as e:
            log.warning("weights not cached in %s: %s", self.dir, e)
        finally:
            tmp.unlink(missing_ok=True)
            _writers.remove(threading.current_thread())

    def _remove_stale(self) -> None:
        """Entries of this source and settings made by another tokenmill or torch, entries whose
        source changed or is gone, and files of entries that a process died while writing."""
        def same(settings: dict) -> bool:
            return {k: v for k, v in settings.items() if k not in ("code", "torch")} == \
                {k: v for k, v in self.settings.items() if k not in ("code", "torch")}

        mine = [s[0] for s in self.sources]
        for meta in self.dir.glob("*.json"):
            if meta.stem == self.key:
                continue
            try:
                info = json.loads(meta.read_text())
                sources = info["sources"]
                stale = ([s[0] for s in sources] == mine and same(info["settings"])) or \
                    any(not os.path.exists(s[0]) or _stat(s[0]) != s for s in sources)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                stale = True
            if stale:
                (self.dir / f"{meta.stem}.bin").unlink(missing_ok=True)
                meta.unlink(missing_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            pid = tmp.suffixes[-2][1:] if len(tmp.suffixes) >= 2 else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                tmp.unlink(missing_ok=True)
        for entry in self.dir.glob("*.bin"):
            if not entry.with_suffix(".json").exists():
                entry.unlink(missing_ok=True)


def wait_for_writes(timeout: float | None = None) -> None:
    for t in list(_writers):
        t.join(timeout)


class _Pickler(pickle.Pickler):
    def __init__(self, file) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: dict[tuple[int, int], tuple[int, torch.UntypedStorage]] = {}
        self.tensors: dict[int, int] = {}
        self.keep: list = []  # the objects whose ids are keys above stay alive while pickling

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                raise NotCacheable(f"a {obj.device.type} {obj.layout} tensor")
            tid = self.tensors.setdefault(id(obj), len(self.tensors))
            self.keep.append(obj)
            st = obj.untyped_storage()
            sid = self.storages.setdefault((st.data_ptr(), st.nbytes()), (len(self.storages), st))[0]
            return ("t", tid, sid, str(obj.dtype).removeprefix("torch."), obj.storage_offset(), tuple(obj.shape),
                    tuple(obj.stride()), isinstance(obj, nn.Parameter), obj.requires_grad)
        if isinstance(obj, np.memmap):
            if not isinstance(obj.base, mmap.mmap) or obj.mode not in ("r", "c"):
                raise NotCacheable("a view of a memory-mapped array")
            return ("m", obj.filename, obj.offset, obj.dtype.str, obj.shape, obj.mode)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, base: torch.Tensor, offsets: list[int]) -> None:
        super().__init__(file)
        self.base, self.offsets, self.tensors = base.untyped_storage(), offsets, {}

    def find_class(self, module: str, name: str):
        root = module.split(".")[0]
        if root not in _ALLOWED_ROOTS or (root == "builtins" and name in _UNSAFE_BUILTINS):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weight cache entry")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        if pid[0] == "m":
            _, filename, offset, dtype, shape, mode = pid
            return np.memmap(filename, np.dtype(dtype), mode, offset, shape)
        _, tid, sid, dtype, offset, shape, stride, param, grad = pid
        if tid not in self.tensors:
            dt = getattr(torch, dtype)
            start, item = self.offsets[sid], dt.itemsize
            t = torch.empty(0, dtype=dt).set_(self.base, start // item + offset, shape, stride)
            self.tensors[tid] = nn.Parameter(t, requires_grad=grad) if param else t
        return self.tensors[tid]


def _skeleton(model: nn.Module) -> tuple[bytes, list[torch.UntypedStorage]]:
    buf = io.BytesIO()
    p = _Pickler(buf)
    try:
        p.dump(model)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise NotCacheable(str(e)) from None
    storages = [st for _, st in sorted(p.storages.values(), key=lambda v: v[0])]
    return buf.getvalue(), storages


def _layout(sizes: list[int], start: int) -> tuple[list[int], int]:
    offsets, at = [], start
    for n in sizes:
        align = _PAGE if n >= _PAGE else _SMALL
        at = (at + align - 1) // align * align
        offsets.append(at)
        at += n
    return offsets, at


def _data_start(skeleton_bytes: int, count: int) -> int:
    return (_HEAD.size + skeleton_bytes + 8 * count + _PAGE - 1) // _PAGE * _PAGE


def _write(path: pathlib.Path, skeleton: bytes, storages: list) -> None:
    sizes = [st.nbytes() for st in storages]
    offsets, end = _layout(sizes, _data_start(len(skeleton), len(sizes)))
    with open(path, "wb") as f:
        f.write(_HEAD.pack(MAGIC, VERSION, len(skeleton), len(sizes), end) + skeleton)
        f.write(struct.pack(f"<{len(sizes)}Q", *sizes))
        for st, off in zip(storages, offsets):
            f.seek(off)
            if st.nbytes():
                f.write(torch.empty(0, dtype=torch.uint8).set_(st).numpy().data)
        f.truncate(end)


def _read(path: pathlib.Path) -> nn.Module:
    with open(path, "rb") as f:
        magic, version, n_skeleton, count, end = _HEAD.unpack(f.read(_HEAD.size))
        if magic != MAGIC or version != VERSION:
            raise ValueError("not a tokenmill weight cache file of this version")
        skeleton, table = f.read(n_skeleton), f.read(8 * count)
        if len(table) != 8 * count or os.fstat(f.fileno()).st_size != end:
            raise ValueError("truncated")
        offsets, last = _layout(list(struct.unpack(f"<{count}Q", table)), _data_start(n_skeleton, count))
        if last != end:
            raise ValueError("the data does not match its table")
        mm = mmap.mmap(f.fileno(), end, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _map_now(mm)
    base = torch.frombuffer(mm, dtype=torch.uint8)  # holds `mm`
    return _Unpickler(io.BytesIO(skeleton), base, offsets).load()


def _map_now(mm: mmap.mmap) -> None:
    """Every page mapped in one call (they come from the page cache; from disk on a cold cache)."""
    import ctypes

    from tokenmill.utils import _libc

    buf = (ctypes.c_char * len(mm)).from_buffer(mm)
    _libc().madvise(ctypes.addressof(buf), len(mm), _MADV_POPULATE_READ)
    del buf
