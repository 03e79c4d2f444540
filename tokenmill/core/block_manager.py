"""Paged KV cache bookkeeping: which physical blocks each request owns. No torch here.

The cache is `num_blocks` blocks of `block_size` token slots. A request's `block_table[i]` is
the physical block holding its tokens `[i*block_size, (i+1)*block_size)`; token t lives in slot
`block_table[t // block_size] * block_size + t % block_size`. Blocks carry reference counts so
that several requests may share one (prefix sharing); a block returns to the free list when its
count drops to zero.
"""
from __future__ import annotations

from collections import deque

from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (the `kv_cache_usage_perc` gauge)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Extra blocks `req` needs so that its first `num_tokens` tokens have slots."""
        return max(0, cdiv(num_tokens, self.block_size) - len(req.block_table))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow `req.block_table` to cover `num_tokens` tokens. All or nothing: returns False and
        changes nothing when the free list is too short."""
        need = self.num_blocks_needed(req, num_tokens)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            req.block_table.append(block)
        return True

    def share(self, src: Request, dst: Request, num_blocks: int) -> None:
        """Let `dst` point at the first `num_blocks` blocks of `src` (copy-free prefix sharing)."""
        assert not dst.block_table
        for block in src.block_table[:num_blocks]:
            self.ref_counts[block] += 1
            dst.block_table.append(block)

    def free(self, req: Request) -> None:
        """Drop `req`'s references; blocks nobody else holds go back to the free list."""
        for block in reversed(req.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        req.block_table = []

    def check_integrity(self, live: list[Request]) -> None:
        """Every block is either free (count 0) or referenced exactly as often as the live
        requests hold it. Raises AssertionError otherwise; tests call it after every step."""
        held = [0] * self.num_blocks
        for req in live:
            for block in req.block_table:
                held[block] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == held[block], f"block {block}: refcount {self.ref_counts[block]} != holders {held[block]}"
            assert (block in free) == (held[block] == 0), f"block {block}: free-list membership wrong"
