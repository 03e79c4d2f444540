"""Block manager: exact block ids, all-or-nothing allocation, shared blocks, integrity."""
import pytest
from hypothesis import given, settings, strategies as st

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def req(i: int, n: int = 1, tokens: list[int] | None = None) -> Request:
    return Request(f"r{i}", tokens if tokens is not None else list(range(n)), SamplingParams(), set())


def compute(bm: BlockManager, r: Request, num_tokens: int | None = None) -> None:
    """What a step does: blocks for the tokens, then they count as computed and get cached."""
    n = r.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(r, n)
    r.num_computed_tokens = n
    bm.cache_full_blocks(r)


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req(0), req(1)
    assert bm.allocate(a, 5)          # 5 tokens -> 2 blocks
    assert a.block_table == [0, 1]
    assert bm.allocate(b, 4)
    assert b.block_table == [2]
    assert bm.allocate(a, 8)          # still 2 blocks: nothing new
    assert a.block_table == [0, 1]
    assert bm.allocate(a, 9)
    assert a.block_table == [0, 1, 3]
    bm.check_integrity([a, b])
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7
    # freed blocks holding nothing cacheable are handed out first, in table order
    c = req(2)
    assert bm.allocate(c, 4 * 7)
    assert c.block_table == [0, 1, 3, 4, 5, 6, 7]
    bm.check_integrity([b, c])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req(0)
    assert not bm.allocate(a, 13)     # needs 4 blocks, 3 exist
    assert a.block_table == [] and bm.num_free_blocks == 3
    bm.check_integrity([a])


def test_shared_blocks_are_freed_by_the_last_holder():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a, b = req(0), req(1)
    assert bm.allocate(a, 4)
    bm.share(a, b, 2)
    assert b.block_table == a.block_table == [0, 1]
    assert bm.ref_counts[:2] == [2, 2]
    bm.free(a)
    assert bm.num_free_blocks == 2    # b still holds them
    bm.check_integrity([b])
    bm.free(b)
    assert bm.num_free_blocks == 4
    bm.check_integrity([])


def test_prefix_hits_misses_and_partial_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req(0, tokens=list(range(10)))           # 2 full blocks + 2 tokens
    assert bm.find_cached_prefix(a) == []
    compute(bm, a)
    assert a.block_table == [0, 1, 2] and len(a.block_hashes) == 2   # the partial block is not cached
    # same first 8 tokens, different tail: both full blocks hit
    b = req(1, tokens=list(range(8)) + [99, 98, 97])
    assert bm.find_cached_prefix(b) == [0, 1]
    # diverging inside the second block: only the first hits
    c = req(2, tokens=[0, 1, 2, 3, 4, 5, 77, 7, 8])
    assert bm.find_cached_prefix(c) == [0]
    # an exact repeat of 8 tokens: the last token must be computed, so only block 0 is reused
    d = req(3, tokens=list(range(8)))
    assert bm.find_cached_prefix(d) == [0]
    # a different first block changes every later key, even with equal later tokens
    e = req(4, tokens=[50, 51, 52, 53] + list(range(4, 12)))
    assert bm.find_cached_prefix(e) == []


def test_shared_cached_blocks_refcounts_and_reuse_after_finish():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(0, tokens=list(range(9)))
    compute(bm, a)
    b = req(1, tokens=list(range(8)) + [42, 43])
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate(b, b.num_tokens, hits)
    assert b.block_table[:2] == [0, 1] and bm.ref_counts[:2] == [2, 2]
    b.num_computed_tokens = b.num_tokens
    bm.cache_full_blocks(b)
    bm.check_integrity([a, b])
    bm.free(a)                                     # abort one holder: the shared blocks stay
    assert bm.ref_counts[:2] == [1, 1]
    bm.check_integrity([b])
    bm.free(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == 8
    c = req(2, tokens=list(range(8)) + [5])        # finished requests' blocks still hit
    assert bm.find_cached_prefix(c) == [0, 1]
    assert bm.allocate(c, 9, [0, 1])
    assert bm.num_free_blocks == 5
    bm.check_integrity([c])


def test_eviction_is_least_recently_freed_and_uncached_blocks_go_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = req(0, tokens=[1, 2, 3, 4])                # blocks 0, 1 cached
    b = req(1, tokens=[5, 6, 7, 8])                # blocks 2, 3 cached
    compute(bm, a)
    compute(bm, b)
    u = req(2, tokens=[9])                         # block 4, partial: never cached
    compute(bm, u)
    bm.free(a)
    bm.free(b)
    bm.free(u)
    # order to hand out: uncached 4, never-used 5, then a's tail 1, a's head 0, b's tail 3, b's head 2
    assert list(bm.free_blocks) == [4, 5, 1, 0, 3, 2]
    x = req(3, tokens=[0] * 8)
    assert bm.allocate(x, 6)                       # takes 4, 5, 1: evicts a's second block only
    assert x.block_table == [4, 5, 1]
    assert bm.find_cached_prefix(req(4, tokens=[1, 2, 3, 4, 0])) == [0]
    assert bm.find_cached_prefix(req(5, tokens=[5, 6, 7, 8, 0])) == [2, 3]
    bm.check_integrity([x])


def test_taking_a_cached_free_block_counts_against_free_space():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = req(0, tokens=[1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)                                     # 3 free, 2 of them cached
    b = req(1, tokens=[1, 2, 3, 4, 6, 7, 8])
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert not bm.allocate(b, 8, hits)             # 2 reclaimed + 2 fresh > 3 free: refused, untouched
    assert b.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate(b, 6, hits)
    bm.check_integrity([b])


def test_integrity_check_catches_a_leak():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = req(0)
    bm.allocate(a, 2)
    a.block_table = []                # forgotten without freeing
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(1, 24),
                          st.integers(0, 2)), max_size=60))
def test_random_operations_keep_integrity_and_cache_content(ops):
    """Requests over a 3-letter alphabet share prefixes often. After every operation the
    integrity check holds, and every cached hit really holds the tokens asked for."""
    bm = BlockManager(num_blocks=10, block_size=4)
    content: dict[int, tuple] = {}                 # block -> the tokens it was computed with
    reqs: list[Request | None] = [None] * 6
    for op, i, n, seed in ops:
        r = reqs[i]
        if op == "admit" and r is None:
            r = req(i, tokens=[(seed * k + k // 3) % 3 for k in range(n)])
            hits = bm.find_cached_prefix(r)
            for j, block in enumerate(hits):
                assert content[block] == tuple(r.token_ids[j * 4:(j + 1) * 4])
            if bm.allocate(r, r.num_tokens, hits):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                for j in range(r.num_tokens // 4):
                    content[r.block_table[j]] = tuple(r.token_ids[j * 4:(j + 1) * 4])
                reqs[i] = r
        elif op == "grow" and r is not None:
            r.token_ids += [seed] * n
            if bm.allocate(r, r.num_tokens):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                for j in range(r.num_tokens // 4):
                    content[r.block_table[j]] = tuple(r.token_ids[j * 4:(j + 1) * 4])
            else:
                r.token_ids = r.token_ids[:r.num_computed_tokens]
        elif op == "free" and r is not None:
            bm.free(r)
            reqs[i] = None
        bm.check_integrity([x for x in reqs if x is not None])


def test_a_cache_salt_is_a_namespace_of_its_own():
    bm = BlockManager(num_blocks=16, block_size=2)
    tokens = [1, 2, 3, 4, 5]

    def salted(i: int, salt: str | None) -> Request:
        return Request(f"s{i}", tokens, SamplingParams(), set(), cache_salt=salt)

    a = salted(0, "tenant-a")
    compute(bm, a)
    assert bm.find_cached_prefix(salted(1, "tenant-a")) == a.block_table[:2]
    assert bm.find_cached_prefix(salted(2, "tenant-b")) == []
    assert bm.find_cached_prefix(salted(3, None)) == []
    plain = salted(4, None)
    compute(bm, plain)
    assert bm.find_cached_prefix(salted(5, None)) == plain.block_table[:2]
    assert bm.find_cached_prefix(salted(6, "tenant-b")) == []
    bm.check_integrity([a, plain])


def test_blocks_before_a_sliding_window_are_given_back():
    from tokenmill.core.block_manager import BlockManager

    bm = BlockManager(num_blocks=8, block_size=4)
    r = Request("r", list(range(22)), SamplingParams(), set())
    assert bm.allocate(r, 22)
    r.num_computed_tokens = 21
    bm.cache_full_blocks(r)
    bm.release_before_window(r, window=6)   # next query at 21 sees 16..21: blocks 0-3 are behind it
    assert r.released_blocks == 4 and r.block_table[4:] and bm.num_free_blocks == 8 - 2
    bm.check_integrity([r])
    keyed = r.block_table[0]
    assert bm.block_key[keyed] is not None and keyed in bm.free_blocks  # still a prefix-cache hit
    again = Request("s", list(range(22)), SamplingParams(), set())
    assert bm.find_cached_prefix(again)[:1] == [keyed]
    bm.release_before_window(r, window=6)   # idempotent
    assert r.released_blocks == 4
    bm.free(r)
    assert r.released_blocks == 0 and bm.num_free_blocks == 8
    bm.check_integrity([])
