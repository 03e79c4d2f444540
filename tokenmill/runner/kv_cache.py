"""KV cache allocation: how many blocks fit the memory budget, and one tensor holding them all."""
from __future__ import annotations

import torch

from tokenmill.config import CPU_KV_CACHE_BYTES
from tokenmill.layers.attention import CACHE_DTYPES, row_width
from tokenmill.models.arch import ArchConfig
from tokenmill.utils import huge_page_zeros


def resolve_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': float16 on CPU, where decode attention is bound by reading the cache (the kernel
    widens to float32 as it loads); the model's dtype elsewhere."""
    if kv_cache_dtype == "auto":
        return torch.float16 if device.type == "cpu" else model_dtype
    return CACHE_DTYPES[kv_cache_dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype name of a cache dtype (float16, int8, fp8_e5m2, ...)."""
    return next(name for name, d in CACHE_DTYPES.items() if d == dtype)


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * row_width(arch.head_dim, dtype) * dtype.itemsize


def cpu_budget(kv_cache_memory: int | None, device: torch.device) -> int:
    """The bytes a CPU KV cache may grow to (what the memory check keeps free for it); 0 elsewhere."""
    if device.type != "cpu":
        return 0
    return CPU_KV_CACHE_BYTES if kv_cache_memory is None else int(kv_cache_memory)


def num_blocks_for(arch: ArchConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_memory: int | None, gpu_memory_utilization: float,
                   extra_bytes_per_block: int = 0) -> tuple[int, int]:
    """(num_blocks, budget_bytes). CPU: the explicit byte budget. CUDA: what is left of
    `gpu_memory_utilization` of the card once the weights are loaded. `extra_bytes_per_block`:
    a second cache with as many blocks shares the budget (a draft model's)."""
    if kv_cache_memory is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free - total * (1.0 - gpu_memory_utilization))
        else:
            kv_cache_memory = CPU_KV_CACHE_BYTES
    per_block = bytes_per_block(arch, block_size, dtype) + extra_bytes_per_block
    num = kv_cache_memory // per_block
    if num < 1:
        raise ValueError(f"KV cache budget of {kv_cache_memory} bytes holds no {block_size}-token block "
                         f"(one needs {per_block} bytes); raise kv_cache_memory or gpu_memory_utilization.")
    return int(num), int(kv_cache_memory)


def allocate(arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """(2, num_layers, num_blocks, block_size, num_kv_heads, row_width): [0] keys, [1] values."""
    shape = (2, arch.num_layers, num_blocks, block_size, arch.num_kv_heads, row_width(arch.head_dim, dtype))
    if device.type == "cpu":
        return huge_page_zeros(shape, dtype, touched_now=False)  # scattered block reads: one TLB entry per 2 MiB
    return torch.zeros(shape, dtype=dtype, device=device)
