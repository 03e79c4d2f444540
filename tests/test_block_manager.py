"""Block manager: exact block ids, all-or-nothing allocation, shared blocks, integrity."""
import pytest
from hypothesis import given, settings, strategies as st

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def req(i: int, n: int = 1) -> Request:
    return Request(f"r{i}", list(range(n)), SamplingParams(), set())


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
    # freed blocks are reused after the never-used ones, most recently freed last
    c = req(2)
    assert bm.allocate(c, 4 * 7)
    assert c.block_table == [4, 5, 6, 7, 3, 1, 0]
    bm.check_integrity([b, c])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req(0)
    assert not bm.allocate(a, 13)     # needs 4 blocks, 3 exist
    assert a.block_table == [] and bm.num_free_blocks == 3
    bm.check_integrity([a])


def test_shared_blocks_are_freed_by_the_last_holder():
    bm = BlockManager(num_blocks=4, block_size=2)
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


def test_integrity_check_catches_a_leak():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = req(0)
    bm.allocate(a, 2)
    a.block_table = []                # forgotten without freeing
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5), st.integers(1, 40)),
                max_size=60))
def test_random_operations_keep_integrity(ops):
    bm = BlockManager(num_blocks=10, block_size=4)
    reqs = [req(i) for i in range(6)]
    for op, i, n in ops:
        r = reqs[i]
        if op == "alloc":
            before = list(r.block_table)
            ok = bm.allocate(r, n)
            if not ok:
                assert r.block_table == before
            else:
                assert len(r.block_table) >= -(-n // 4)
        elif op == "free":
            bm.free(r)
        else:
            src = reqs[(i + 1) % 6]
            if not r.block_table and src.block_table:
                bm.share(src, r, min(len(src.block_table), n))
        bm.check_integrity(reqs)
