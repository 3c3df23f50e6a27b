import hashlib
import struct

from specgraph.runtime.block_pool import BlockPool
from specgraph.runtime.prefix_cache import BlockKey, PrefixCache


def test_block_key_is_chained_sha256_of_int64_tokens():
    k0 = BlockKey.of(None, [1, 2])
    k1 = BlockKey.of(k0, [3, -4])
    assert k0.digest == hashlib.sha256(struct.pack("<2q", 1, 2)).digest()
    assert k1.digest == hashlib.sha256(k0.digest + struct.pack("<2q", 3, -4)).digest()
    assert k1.token_ids == (3, -4)
    # Same tokens, different parent: different key.
    assert BlockKey.of(BlockKey.of(None, [9, 9]), [3, -4]) != k1
    assert BlockKey.of(BlockKey.of(None, [1, 2]), (3, -4)) == k1
    assert hash(BlockKey.of(k0, [3, -4])) == hash(k1)


def test_block_key_equality_compares_tokens_not_only_digest():
    key = BlockKey.of(None, [1, 2])
    forged = BlockKey(key.digest, (7, 7))  # pretend a digest collision
    assert hash(forged) == hash(key) and forged != key
    assert {key: 1}.get(forged) is None


def _cached(pool, cache, tokens):
    """Allocate and register blocks for the full blocks of `tokens`."""
    blocks = pool.allocate(len(tokens) // pool.page_size)
    keys = cache.register(blocks, tokens, parent=None)
    return blocks, keys


def test_lookup_longest_chain_and_hit_rate():
    pool = BlockPool(num_blocks=10, page_size=2)
    cache = PrefixCache(pool)
    assert cache.hit_rate == 0.0
    blocks, keys = _cached(pool, cache, [1, 2, 3, 4, 5, 6, 7])
    assert len(blocks) == len(keys) == 3
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], max_blocks=3) == (blocks, keys)
    assert cache.lookup([1, 2, 3, 4, 9, 9], max_blocks=3) == (blocks[:2], keys[:2])
    assert cache.lookup([1, 2, 3, 4, 5, 6], max_blocks=2)[0] == blocks[:2]  # capped
    assert cache.lookup([2, 1, 3, 4], max_blocks=2) == ([], [])  # same block 1 tokens, other parent
    assert cache.lookup([1], max_blocks=5) == ([], [])  # no full block
    assert cache.queried_tokens == 7 + 6 + 6 + 4 + 1
    assert cache.hit_tokens == 6 + 4 + 4
    assert cache.hit_rate == 14 / 24


def test_register_continues_a_chain_and_skips_duplicates():
    pool = BlockPool(num_blocks=10, page_size=2)
    cache = PrefixCache(pool)
    b0, b1 = pool.allocate(2)
    (k0,) = cache.register([b0], [1, 2], parent=None)
    (k1,) = cache.register([b1], [3, 4, 5], parent=k0)  # partial tail ignored
    assert cache.lookup([1, 2, 3, 4, 0], max_blocks=2)[0] == [b0, b1]
    # The same content computed again elsewhere: the key is returned (it is the next
    # block's parent) but the first copy stays the cached one.
    c0, c1 = pool.allocate(2)
    assert cache.register([c0, c1], [1, 2, 3, 4], parent=None) == [k0, k1]
    assert pool.block_key(c0) is None and pool.lookup(k0) == b0


def test_evicted_block_leaves_the_cache_and_cuts_the_chain():
    pool = BlockPool(num_blocks=3, page_size=2)
    cache = PrefixCache(pool)
    blocks, keys = _cached(pool, cache, [1, 2, 3, 4])
    pool.free(reversed(blocks))  # tail first: the second block is evicted first
    assert pool.allocate(1) == [blocks[1]]
    assert cache.lookup([1, 2, 3, 4, 5], max_blocks=2)[0] == blocks[:1]
    pool.free([blocks[1]])
    assert pool.allocate(2) is not None  # evicts the first block too
    assert cache.lookup([1, 2, 3, 4, 5], max_blocks=2) == ([], [])
    pool.check_invariants()
