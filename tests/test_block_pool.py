import pytest

from specgraph.runtime.block_pool import NULL_BLOCK, BlockPool


def test_allocate_never_hands_out_null_block_and_fails_atomically():
    pool = BlockPool(num_blocks=5, page_size=4)
    blocks = pool.allocate(3)
    assert sorted(blocks) == [1, 2, 3] and NULL_BLOCK not in blocks
    assert pool.num_free_blocks == 1
    assert pool.allocate(2) is None  # only one left: nothing changes
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [4]
    assert pool.allocate(1) is None
    pool.check_invariants()


def test_usage_counts_non_null_blocks():
    pool = BlockPool(num_blocks=5, page_size=4)
    assert pool.usage == 0.0
    blocks = pool.allocate(2)
    assert pool.usage == 0.5
    pool.free(blocks)
    assert pool.usage == 0.0


def test_refcounts_and_free():
    pool = BlockPool(num_blocks=4, page_size=2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 2
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 3
    pool.check_invariants()


def test_double_free_and_null_block_raise_without_changes():
    pool = BlockPool(num_blocks=4, page_size=2)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free of block"):
        pool.free([b, a])
    assert pool.ref_count(b) == 1  # validated before anything changed
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1
    with pytest.raises(ValueError, match="null block"):
        pool.free([NULL_BLOCK])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="null block"):
        pool.incref([NULL_BLOCK])
    pool.check_invariants()


def test_bad_construction():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(num_blocks=1, page_size=2)
    with pytest.raises(ValueError, match="page_size"):
        BlockPool(num_blocks=4, page_size=0)
    with pytest.raises(ValueError, match="negative"):
        BlockPool(num_blocks=4, page_size=2).allocate(-1)


def test_cached_blocks_survive_free_until_evicted():
    pool = BlockPool(num_blocks=3, page_size=2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, "A")
    pool.free([a, b])
    # b (uncached) is reused before a (cached) is evicted.
    assert pool.allocate(1) == [b]
    assert pool.lookup("A") == a and pool.num_cached_blocks == 1
    assert pool.allocate(1) == [a]  # eviction drops the key
    assert pool.lookup("A") is None and pool.block_key(a) is None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(num_blocks=5, page_size=2)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, i)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3], blocks[1]])
    # A prefix hit revives blocks[0]; freeing it again makes it the most recent.
    pool.incref([blocks[0]])
    pool.free([blocks[0]])
    assert pool.allocate(4) == [blocks[2], blocks[3], blocks[1], blocks[0]]
    pool.check_invariants()


def test_incref_revives_free_cached_block_only():
    pool = BlockPool(num_blocks=4, page_size=2)
    a, b = pool.allocate(2)
    pool.cache_block(a, "A")
    pool.free([a, b])
    pool.incref([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="uncached"):
        pool.incref([b])
    pool.check_invariants()


def test_cache_block_rules():
    pool = BlockPool(num_blocks=4, page_size=2)
    a, b, c = pool.allocate(3)
    assert pool.cache_block(a, "K")
    assert pool.cache_block(a, "K")  # same key again: no-op
    assert not pool.cache_block(b, "K")  # duplicate content: first copy stays cached
    assert pool.block_key(b) is None and pool.lookup("K") == a
    with pytest.raises(RuntimeError, match="different content"):
        pool.cache_block(a, "other")
    pool.free([c])
    with pytest.raises(RuntimeError, match="free block"):
        pool.cache_block(c, "C")
    pool.check_invariants()


def test_uncache_block():
    pool = BlockPool(num_blocks=4, page_size=2)
    a, b = pool.allocate(2)
    pool.cache_block(a, "A")
    pool.cache_block(b, "B")
    pool.uncache_block(a)
    assert pool.lookup("A") is None and pool.block_key(a) is None
    pool.uncache_block(a)  # idempotent
    # Uncaching a free cached block moves it to the front of the queue.
    pool.free([b])
    pool.uncache_block(b)
    assert pool.allocate(1) == [b]
    pool.check_invariants()
