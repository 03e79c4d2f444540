"""One GGUF tensor, read from the file on demand, a run of rows at a time: what the loader hands each
layer so that it goes from the file straight into its packed kernel form. No float copy of the
model ever exists, and the file is never memory-mapped: pages read through a mapping count as the
process's resident memory for as long as it stays mapped (the whole file, on top of the packed
weights), where a read into a small buffer costs that buffer.

GGUF stores a weight (rows = outputs, cols = inputs) row after row, each row a run of blocks, so a
slice of rows is a slice of the file and a block-aligned slice of columns a slice of each row.
Llama's Q/K rows are permuted by llama.cpp's converter; `row_order` undoes that as rows are read.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch

from tokenmill.quant import gguf_blocks

FLOAT_TYPES = ("F32", "F16", "BF16")
CHUNK_BYTES = 16 << 20  # float32 bytes per conversion step: bounds what a tensor's conversion holds


class BlockTensor:
    """A 2-D GGUF tensor (rows, cols) of one block type: `rows(a, b)` reads rows as stored,
    `dequantize()` gives float32, `int4_parts()` the exact 4-bit form of Q4_0/Q4_1 and
    `int8_parts()` per-row int8 (what `int8.quantize_rtn` makes of the dequantized float, row for row)."""

    def __init__(self, path: str, offset: int, kind: str, shape: tuple[int, int], row_stride: int,
                 block: tuple[int, int], name: str = "", cols: tuple[int, int] | None = None,
                 row_order: np.ndarray | None = None) -> None:
        self.path, self.offset, self.kind, self.name = path, offset, kind, name
        self.block_size, self.block_bytes = block   # weights per block, bytes per block
        self.row_stride = row_stride                # bytes of one stored row
        self.num_rows = shape[0] if row_order is None else len(row_order)
        self.col_range = cols or (0, shape[1])      # the columns this tensor is of the stored rows
        self.row_order = row_order                  # stored row of each row, or None: in order

    # ------------------------------------------------------------------ shape and slicing
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_rows, self.col_range[1] - self.col_range[0]))

    def dim(self) -> int:
        return 2

    @property
    def quantized(self) -> bool:
        return self.kind not in FLOAT_TYPES

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.shape[1] // self.block_size * self.block_bytes

    def _replace(self, **kw) -> "BlockTensor":
        t = BlockTensor.__new__(BlockTensor)
        t.__dict__.update(self.__dict__, **kw)
        return t

    def __getitem__(self, index) -> "BlockTensor | torch.Tensor":
        """t[a:b] (rows) or t[:, a:b] (columns): a view of the same file. Columns that cut a block
        come back as the float slice they are."""
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        t = self
        if rows != slice(None):
            start, stop, step = rows.indices(self.num_rows)
            if step != 1:
                raise IndexError("BlockTensor rows slice with step 1 only")
            order = np.arange(start, stop) if self.row_order is None else self.row_order[start:stop]
            t = t._replace(row_order=order, num_rows=stop - start)
        if cols != slice(None):
            start, stop, step = cols.indices(t.shape[1])
            if step != 1:
                raise IndexError("BlockTensor columns slice with step 1 only")
            if start % self.block_size or stop % self.block_size:
                return t.dequantize()[:, start:stop]
            lo = self.col_range[0]
            t = t._replace(col_range=(lo + start, lo + stop))
        return t

    def permute_rows(self, order: np.ndarray) -> "BlockTensor":
        """Rows in `order` (indices of this tensor's rows)."""
        base = np.arange(self.num_rows) if self.row_order is None else self.row_order
        return self._replace(row_order=base[order], num_rows=len(order))

    # ------------------------------------------------------------------ reading
    def raw(self, start: int, stop: int) -> np.ndarray:
        """uint8 (stop - start, bytes per row) of rows [start, stop), this tensor's columns only."""
        if self.row_order is None:
            lo, hi, pick = start, stop, None
        else:
            stored = self.row_order[start:stop]
            lo, hi = int(stored.min()), int(stored.max()) + 1
            pick = stored - lo
        buf = np.empty((hi - lo) * self.row_stride, np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset + lo * self.row_stride)
            got = f.readinto(memoryview(buf))
        if got != buf.nbytes:
            raise ValueError(f"tensor {self.name} in {self.path} ends past the end of the file; the file is truncated.")
        rows = buf.reshape(hi - lo, self.row_stride)
        if pick is not None and not np.array_equal(pick, np.arange(hi - lo)):
            rows = rows[pick]
        c0, c1 = (c // self.block_size * self.block_bytes for c in self.col_range)
        return rows[:, c0:c1] if (c0, c1) != (0, self.row_stride) else rows

    def mapped(self) -> np.ndarray:
        """uint8 (rows, bytes per row) of the whole tensor, memory-mapped read-only: the page cache's
        own pages, nothing copied or allocated (the embedding table, read as rows are looked up).
        Only for a tensor of all its stored rows and columns in order; others read a copy."""
        if self.row_order is not None or self.col_range != (0, self.row_stride // self.block_bytes * self.block_size):
            return np.ascontiguousarray(self.raw(0, self.num_rows))
        size = os.path.getsize(self.path)
        if self.offset + self.num_rows * self.row_stride > size:
            raise ValueError(f"tensor {self.name} in {self.path} ends past the end of the file; the file is truncated.")
        return np.memmap(self.path, np.uint8, "r", self.offset, (self.num_rows, self.row_stride))

    def _each_chunk(self, fn: Callable[[int, int, np.ndarray], None]) -> None:
        """fn(start, stop, raw rows) over runs of rows whose float32 form is about CHUNK_BYTES."""
        per = max(1, CHUNK_BYTES // max(1, 4 * self.shape[1]))
        if self.row_order is not None:  # whole permuted heads per read: reads stay one contiguous span
            per = max(per // 256 * 256, 256)
        for start in range(0, self.num_rows, per):
            stop = min(start + per, self.num_rows)
            fn(start, stop, self.raw(start, stop))

    def dequantize(self) -> torch.Tensor:
        """float32 (rows, cols), exactly what `gguf.quants.dequantize` gives."""
        out = torch.empty(tuple(self.shape), dtype=torch.float32)
        self._each_chunk(lambda a, b, raw: out[a:b].copy_(torch.from_numpy(self._dequantize_raw(raw))))
        return out

    def _dequantize_raw(self, raw: np.ndarray) -> np.ndarray:
        import gguf

        try:
            data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.kind])
        except Exception as e:  # noqa: BLE001 - any failure here is a broken tensor
            raise ValueError(f"tensor {self.name} in {self.path} could not be read ({type(e).__name__}: {e}); "
                             "the file is corrupt or truncated.") from None
        return np.ascontiguousarray(data.astype(np.float32, copy=False).reshape(raw.shape[0], self.shape[1]))

    def int4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q uint8 (rows, cols), scale, min float32 (rows, cols/32)) for Q4_0/Q4_1, else None."""
        if self.kind not in ("Q4_0", "Q4_1"):
            return None
        rows, cols = self.shape
        q = torch.empty(rows, cols, dtype=torch.uint8)
        scale, minimum = (torch.empty(rows, cols // gguf_blocks.GROUP) for _ in range(2))

        def fill(a: int, b: int, raw: np.ndarray) -> None:
            for dst, src in zip((q, scale, minimum), gguf_blocks.decode(np.ascontiguousarray(raw), self.kind, cols)):
                dst[a:b] = src
        self._each_chunk(fill)
        return q, scale, minimum

    def int8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 (rows, cols), scale float32 (rows,)): each row rounded to nearest over its
        largest magnitude / 127, as `int8.quantize_rtn` rounds the dequantized float."""
        from tokenmill.quant import int8

        q = torch.empty(tuple(self.shape), dtype=torch.int8)
        scale = torch.empty(self.num_rows)

        def fill(a: int, b: int, raw: np.ndarray) -> None:
            q[a:b], scale[a:b] = int8.rtn_parts(torch.from_numpy(self._dequantize_raw(raw)))
        self._each_chunk(fill)
        return q, scale


def block_info(kind: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


def read_float(path: str, offset: int, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float tensor (F32/F16/BF16) read whole into float32."""
    n = int(np.prod(shape))
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        raw = np.fromfile(f, dtype=dtype, count=n)
    if raw.size != n:
        raise ValueError(f"{path}: a {kind} tensor of {n} values ends past the end of the file; the file is truncated.")
    if kind == "BF16":
        return torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float().reshape(shape)
    return torch.from_numpy(raw.astype(np.float32, copy=False)).reshape(shape)


def open_tensor(path: str, offset: int, kind: str, shape: tuple[int, ...], name: str = "") -> BlockTensor:
    """The 2-D view (rows = everything but the last dimension) of a block-format tensor."""
    size, nbytes = block_info(kind)
    cols = shape[-1]
    if cols % size:
        raise ValueError(f"tensor {name} in {path}: {cols} columns do not fill whole {kind} blocks of {size}.")
    rows = int(np.prod(shape[:-1]))
    return BlockTensor(path, offset, kind, (rows, cols), cols // size * nbytes, (size, nbytes), name)
