"""Paged KV cache bookkeeping: which physical blocks each request owns, and which cached blocks
hold which token prefixes. No torch here.

The cache is `num_blocks` blocks of `block_size` token slots. A request's `block_table[i]` is the
physical block holding its tokens `[i*block_size, (i+1)*block_size)`; token t lives in slot
`block_table[t // block_size] * block_size + t % block_size`. Blocks carry reference counts, so
several requests can share one; a block whose count drops to zero goes back to the free list.

Prefix caching: once a block is full of computed (final) tokens it gets a key,
`(parent block's key id, its token ids)` — a chain that identifies the whole prefix. Keys are
compared by value (dict lookup), so two different prefixes can never alias, whatever their hash.
A request's `cache_salt` becomes part of its first block's parent: requests with different salts
(tenants) never share a block, so none can learn from cache hits what another one sent. So does its
LoRA adapter: the same tokens under another adapter (or the base) have other keys and values.
A freed block keeps its key and content while it waits in the free list; a later request with the
same prefix takes it back instead of recomputing it. Eviction is least-recently-freed first, and
blocks with no key (nothing worth keeping) are handed out before any cached one:

    free list:  [uncached ... | cached, least recently used ... most recently used]
                 ^ allocate from here
"""
from __future__ import annotations

from collections import OrderedDict

from tokenmill.core.request import Request

BlockKey = tuple[int | tuple, tuple[int, ...]]  # (parent key id or salted root, token ids of the block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_id = -1 - cache_salt   # the parent id of a first block; salt = model / adapter identity
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.key_id: list[int] = [0] * num_blocks   # unique id of the key a block holds
        self.cached: dict[BlockKey, int] = {}         # key -> block
        self._next_key_id = 0
        self.num_queries = 0   # prompt tokens looked up
        self.num_hits = 0      # of those, found in the cache

    def _root(self, req: Request) -> int | tuple:
        """The parent of a request's first block: the manager's root, salted per request and adapter."""
        if req.cache_salt is None and req.lora_name is None:
            return self.root_id
        return (self.root_id, req.cache_salt, req.lora_name)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---------------------------------------------------------------- prefix lookup
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks matching the start of `req.token_ids`. The last token is never taken
        from the cache: the request must compute at least one token to get logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits, parent = [], self._root(req)
        for i in range((req.num_tokens - 1) // bs):
            block = self.cached.get((parent, tuple(req.token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
            parent = self.key_id[block]
        return hits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record one admitted request's prompt lookup (the prefix-cache query/hit counters)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    # ---------------------------------------------------------------- allocation
    def num_blocks_needed(self, req: Request, num_tokens: int, num_cached: int = 0) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(req.block_table) - num_cached)

    def allocate(self, req: Request, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Grow `req.block_table` to cover `num_tokens` tokens, first with `cached` prefix blocks
        (only for a request that holds none yet), then fresh ones. All or nothing."""
        cached = cached or []
        need = self.num_blocks_needed(req, num_tokens, len(cached))
        # cached blocks sitting in the free list are taken out of it, so they cannot serve as fresh ones
        reclaimed = sum(1 for b in cached if self.ref_counts[b] == 0)
        if need + reclaimed > len(self.free_blocks):
            return False
        assert not cached or not req.block_table
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            req.block_table.append(block)
        for _ in range(need):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            req.block_table.append(block)
        return True

    def _evict(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None:
            del self.cached[key]
            self.block_key[block] = None

    def share(self, src: Request, dst: Request, num_blocks: int) -> None:
        """Let `dst` point at the first `num_blocks` blocks of `src` (copy-free prefix sharing)."""
        assert not dst.block_table and not src.released_blocks
        for block in src.block_table[:num_blocks]:
            self.ref_counts[block] += 1
            dst.block_table.append(block)

    def cache_full_blocks(self, req: Request) -> None:
        """Give a key to each of `req`'s blocks that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_table))
        parent = req.block_hashes[-1] if req.block_hashes else self._root(req)
        for i in range(len(req.block_hashes), num_full):
            block = req.block_table[i]
            key = (parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))
            holder = self.cached.get(key)
            if holder is None:
                assert self.block_key[block] is None
                self.block_key[block] = key
                self.key_id[block] = self._next_key_id
                self._next_key_id += 1
                self.cached[key] = holder = block
            # else: this block was a cache hit (holder is block), or the same prefix was computed
            # twice at once and the other copy serves future hits
            parent = self.key_id[holder]
            req.block_hashes.append(parent)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (lookahead slots of rejected
        drafts). They were never keyed: only blocks full of verified tokens are."""
        keep = cdiv(num_tokens, self.block_size)
        while len(req.block_table) > keep:
            block = req.block_table.pop()
            assert self.block_key[block] is None and self.ref_counts[block] == 1
            self.ref_counts[block] = 0
            self.free_blocks[block] = None
            self.free_blocks.move_to_end(block, last=False)

    def release_before_window(self, req: Request, window: int) -> None:
        """Give back the blocks no future query of `req` can see when every layer attends to a
        sliding `window` of positions: the next token (position num_computed_tokens) sees positions
        from num_computed_tokens - window + 1 on, and later ones see less. So one conversation
        holds about window / block_size blocks however long it runs. A released block that is full
        keeps its prefix-cache key like any freed block: a later request with the same prefix can
        take it back (its K/V are the same), and a request that recomputes after preemption
        computes it again."""
        keep_from = min(max(0, req.num_computed_tokens - window + 1) // self.block_size, len(req.block_table))
        for j in range(req.released_blocks, keep_from):
            self._unref(req.block_table[j])
        req.released_blocks = max(req.released_blocks, keep_from)

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.block_key[block] is None:
                self.free_blocks.move_to_end(block, last=False)

    def free(self, req: Request) -> None:
        """Drop `req`'s references. Unkeyed blocks go to the front of the free list (reused
        first), keyed ones to the back (kept longest); the tail of a sequence is freed first so
        that it is also evicted first."""
        for block in reversed(req.block_table[req.released_blocks:]):
            self._unref(block)
        req.block_table = []
        req.block_hashes = []
        req.released_blocks = 0

    # ---------------------------------------------------------------- invariants
    def check_integrity(self, live: list[Request]) -> None:
        """Every block is free (count 0) or referenced exactly as often as live requests hold it,
        and the key table and the blocks agree. Raises AssertionError; tests call it after every
        operation."""
        held = [0] * self.num_blocks
        for req in live:
            for block in req.block_table[req.released_blocks:]:
                held[block] += 1
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == held[block], \
                f"block {block}: refcount {self.ref_counts[block]} != holders {held[block]}"
            assert (block in self.free_blocks) == (held[block] == 0), f"block {block}: free-list membership wrong"
            key = self.block_key[block]
            assert key is None or self.cached.get(key) == block, f"block {block}: key table disagrees"
        assert len(self.cached) == sum(k is not None for k in self.block_key), "stale keys in the table"
