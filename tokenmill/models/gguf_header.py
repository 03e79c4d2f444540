"""A GGUF file's header: its metadata and tensor table, parsed with `struct` in one pass.

Why not gguf-py's GGUFReader: it builds numpy views for every array element, seconds for a Llama 3
vocabulary (128k tokens, 280k merges) where one pass takes a small fraction of that (RESULTS.md §1,
ready time), and it keeps the whole file memory-mapped. Everything a hostile file could declare (string and array lengths, tensor
dimensions) is checked against the file's size before it is read.

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64 | kv pairs | tensor infos | padding | data
    kv: key (u64 length + utf-8) | type u32 | value (an array: elem type u32, count u64, elements)
    tensor info: name | n_dims u32 | dims u64 x n_dims (innermost first) | type u32 | offset u64
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # as stored: innermost (columns) first, like gguf-py's ReaderTensor.shape
    type_id: int
    data_offset: int         # absolute, in the file
    path: str = ""

    @property
    def tensor_type(self):
        import gguf
        return gguf.GGMLQuantizationType(self.type_id)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        import gguf
        size, nbytes = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // size * nbytes

    @property
    def data(self) -> np.ndarray:
        """The tensor's raw bytes, read now (small tensors: rope factors)."""
        with open(self.path, "rb") as f:
            f.seek(self.data_offset)
            raw = np.frombuffer(f.read(self.n_bytes), np.uint8)
        if raw.size != self.n_bytes:
            raise ValueError(f"tensor {self.name} ends past the end of {self.path}; the file is truncated.")
        return raw


class _Cursor:
    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"a field of {n} bytes at offset {self.pos} runs past the end of the file")
        at = self.pos
        self.pos += n
        return at

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.buf[self.take(n):self.pos]).decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == STRING:
            return self.string()
        if type_id != ARRAY:
            raise ValueError(f"unknown metadata type {type_id}")
        elem, count = self.scalar("<I"), self.scalar("<Q")
        if elem in _NUMPY:
            width = np.dtype(_NUMPY[elem]).itemsize
            at = self.take(count * width)
            return np.frombuffer(self.buf, _NUMPY[elem], count, at).tolist()
        if count > self.size - self.pos:  # every element takes at least a byte
            raise ValueError(f"an array of {count} elements runs past the end of the file")
        if elem == STRING:
            return self._strings(count)
        return [self.value(elem) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """A string array (a vocabulary, BPE merges: 128k+ entries) in one loop of plain calls."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack, append = struct.Struct("<Q").unpack_from, out.append
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"a string length at offset {pos} runs past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                raise ValueError(f"a field of {n} bytes at offset {pos} runs past the end of the file")
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def read_header(path: str) -> tuple[int, dict, list[TensorInfo]]:
    """(version, metadata, tensors) of a GGUF file; ValueError when it is not one or is broken."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError("shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, size)
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            c.take(4)
            version = c.scalar("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (tokenmill reads 2 and 3)")
            n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
            if n_tensors > size or n_kv > size:
                raise ValueError(f"{n_tensors} tensors and {n_kv} metadata fields cannot fit in {size} bytes")
            meta = {}
            for _ in range(n_kv):
                key = c.string()
                meta[key] = c.value(c.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                n_dims = c.scalar("<I")
                if n_dims > 8:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions")
                dims = tuple(c.scalar("<Q") for _ in range(n_dims))
                infos.append(TensorInfo(name, dims, c.scalar("<I"), c.scalar("<Q"), path))
            align = int(meta.get("general.alignment", 32)) or 32
            start = (c.pos + align - 1) // align * align
    for t in infos:
        t.data_offset += start
        try:
            t.tensor_type  # noqa: B018 - an unknown type id is a broken (or too new) file
        except ValueError:
            raise ValueError(f"tensor {t.name} has an unknown type id {t.type_id}") from None
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"tensor {t.name} ends past the end of the file (truncated?)")
    return version, meta, infos


def architecture(path: str) -> str | None:
    """`general.architecture` of a GGUF file, read without parsing the rest of the header (it is
    written first); None if the file is not a GGUF or names none before its vocabulary."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                c = _Cursor(buf, size)
                if size < 24 or bytes(buf[:4]) != b"GGUF":
                    return None
                c.take(8)
                _, n_kv = c.scalar("<Q"), c.scalar("<Q")
                for _ in range(min(n_kv, 8)):
                    key = c.string()
                    kind = c.scalar("<I")
                    if key == "general.architecture" and kind == STRING:
                        return c.string()
                    c.value(kind)
    except (OSError, ValueError, struct.error):
        return None
    return None
