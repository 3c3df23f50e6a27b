from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from specgraph.runtime.block_pool import NULL_BLOCK
from specgraph.runtime.kv_manager import KVCacheManager
from specgraph.runtime.prefix_cache import BlockKey


def _prefill(kv, sid, prompt):
    cached = kv.add_sequence(sid, prompt)
    assert kv.allocate(sid, len(prompt) - cached) == []
    kv.commit(sid, prompt)
    return cached


def test_slot_mapping_and_block_table():
    kv = KVCacheManager(num_blocks=8, page_size=4)
    assert kv.add_sequence(0, list(range(6))) == 0
    assert kv.allocate(0, 6) == []
    table = kv.block_table(0)
    assert len(table) == 2 and NULL_BLOCK not in table
    assert kv.slot_mapping(0, 0, 6) == [table[j // 4] * 4 + j % 4 for j in range(6)]
    assert kv.slot_mapping(0, 6, 0) == []
    with pytest.raises(ValueError, match="not allocated"):
        kv.slot_mapping(0, 5, 2)
    with pytest.raises(ValueError, match="unknown sequence"):
        kv.block_table(1)
    with pytest.raises(ValueError, match="already exists"):
        kv.add_sequence(0, [1])


def test_prefix_hit_always_leaves_last_token_uncached():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    prompt = list(range(12))
    assert _prefill(kv, 0, prompt) == 0
    # Same 12 tokens: 3 full blocks cached, but the last token must be recomputed,
    # so only 2 blocks (8 tokens) are reused.
    assert kv.add_sequence(1, prompt) == 8
    assert kv.block_table(1) == kv.block_table(0)[:2]
    assert kv.add_sequence(2, prompt + [99]) == 12
    assert kv.add_sequence(3, prompt[:5] + [7, 7, 7, 7]) == 4
    assert kv.add_sequence(4, [5]) == 0
    assert kv.add_sequence(5, []) == 0
    assert kv.prefix_cache_hit_rate == (8 + 12 + 4) / (12 + 12 + 13 + 9 + 1 + 0)
    assert kv.block_pool.ref_count(kv.block_table(0)[0]) == 4


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=16, page_size=4, enable_prefix_caching=False)
    _prefill(kv, 0, list(range(12)))
    assert kv.add_sequence(1, list(range(12))) == 0
    assert kv.prefix_cache_hit_rate == 0.0
    assert kv.block_pool.num_cached_blocks == 0


def test_allocate_none_changes_nothing_and_succeeds_after_preemption():
    kv = KVCacheManager(num_blocks=5, page_size=4)  # 4 usable blocks
    kv.add_sequence(0, [1] * 10)
    kv.add_sequence(1, [2] * 10)
    assert kv.allocate(0, 10) == []
    assert kv.num_free_blocks == 1 and kv.usage == 0.75
    assert kv.num_blocks_needed(1, 10) == 3 and not kv.can_allocate(3)
    assert kv.allocate(1, 10) is None
    assert kv.num_tokens(1) == 0 and kv.block_table(1) == [] and kv.num_free_blocks == 1
    kv.free(0)  # preempt
    assert kv.allocate(1, 10) == [] and kv.num_tokens(1) == 10
    with pytest.raises(ValueError, match=">= 0"):
        kv.allocate(1, -1)


def test_fork_copy_on_write_of_partial_last_block():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    _prefill(kv, 0, [1, 2, 3, 4, 5, 6])
    kv.fork(0, 1)
    a_full, a_part = kv.block_table(0)
    assert kv.block_table(1) == [a_full, a_part]
    assert kv.block_pool.ref_count(a_part) == 2
    # Seq 1 writes position 6, inside the shared partial block: it gets a copy.
    assert kv.num_blocks_needed(1, 1) == 1
    copies = kv.allocate(1, 1)
    (src, dst), = copies
    assert src == a_part and kv.block_table(1) == [a_full, dst]
    assert kv.block_pool.ref_count(a_part) == 1 and kv.block_pool.ref_count(dst) == 1
    # Seq 0 is now the only holder: it writes in place.
    assert kv.allocate(0, 1) == []
    assert kv.block_table(0) == [a_full, a_part]
    # The full block stays shared; crossing into a new block needs no copy.
    assert kv.allocate(0, 2) == [] and kv.block_pool.ref_count(a_full) == 2
    with pytest.raises(ValueError, match="already exists"):
        kv.fork(0, 1)


def test_truncate_into_private_cached_block_uncaches_on_write():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _prefill(kv, 0, tokens)
    b1 = kv.block_table(0)[1]
    assert kv.block_pool.block_key(b1) is not None
    kv.truncate(0, 6)  # rejected drafts 6..8; block 1 keeps positions 4, 5
    assert len(kv.block_table(0)) == 2 and kv.num_tokens(0) == 6
    assert kv.block_pool.block_key(b1) is not None  # content still valid until written
    assert kv.allocate(0, 1) == []  # private: written in place, so it leaves the cache
    assert kv.block_pool.block_key(b1) is None
    assert kv.add_sequence(1, tokens) == 4
    kv.commit(0, [1, 2, 3, 4, 5, 6, 0])
    kv.allocate(0, 1)
    kv.commit(0, [1, 2, 3, 4, 5, 6, 0, 0])
    assert kv.add_sequence(2, [1, 2, 3, 4, 5, 6, 0, 0, 1]) == 8
    assert kv.block_table(2) == kv.block_table(0)[:2]


def test_truncate_into_shared_cached_block_copies_and_keeps_cache_entry():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _prefill(kv, 0, tokens)
    assert kv.add_sequence(1, tokens) == 8  # shares both full blocks
    b1 = kv.block_table(0)[1]
    kv.truncate(0, 5)
    assert kv.num_free_blocks == 15 - 2
    copies = kv.allocate(0, 1)
    assert copies == [(b1, kv.block_table(0)[1])]
    assert kv.block_pool.block_key(b1) is not None
    assert kv.add_sequence(2, tokens) == 8


def test_truncate_frees_tail_blocks_and_validates():
    kv = KVCacheManager(num_blocks=16, page_size=4)
    _prefill(kv, 0, list(range(10)))
    kv.truncate(0, 8)
    assert len(kv.block_table(0)) == 2 and kv.num_free_blocks == 13
    kv.truncate(0, 0)
    assert kv.block_table(0) == [] and kv.num_free_blocks == 15
    with pytest.raises(ValueError, match="cannot truncate"):
        kv.truncate(0, 1)
    with pytest.raises(ValueError, match="commit of 3 tokens"):
        kv.commit(0, [0, 1, 2])


def test_free_keeps_cached_blocks_for_later_hits():
    kv = KVCacheManager(num_blocks=8, page_size=2)
    _prefill(kv, 0, [1, 2, 3, 4, 5])
    kv.free(0)
    assert kv.num_free_blocks == 7 and kv.usage == 0.0
    assert kv.add_sequence(1, [1, 2, 3, 4, 5]) == 4
    assert kv.num_free_blocks == 5
    with pytest.raises(ValueError, match="unknown sequence"):
        kv.free(0)


def test_eviction_takes_uncached_then_chain_tails_first():
    kv = KVCacheManager(num_blocks=4, page_size=2)  # 3 usable blocks
    _prefill(kv, 0, [1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] cached, [5] not
    head, second, tail = kv.block_table(0)
    kv.free(0)
    kv.add_sequence(1, [9, 9, 9, 9])
    assert kv.allocate(1, 4) == []
    # The uncached tail block is reused first, then the chain's last cached block.
    assert sorted(kv.block_table(1)) == sorted([tail, second])
    assert kv.block_pool.num_evictions == 1
    assert kv.add_sequence(2, [1, 2, 3, 4, 5]) == 2  # the head block survived
    assert kv.block_table(2) == [head]


# --------------------------------------------------------------------------- stateful
class KVCacheMachine(RuleBasedStateMachine):
    """Random add/allocate/commit/truncate/fork/free against a model of the cache.

    ``self.content`` simulates the KV tensors: slot -> the token prefix whose last token's
    K/V is stored there (K/V at position j depends on tokens 0..j, so the model stores
    ``tuple(tokens[:j + 1])``). The harness writes it only through ``slot_mapping`` and
    the copy list returned by ``allocate``; reading each live sequence back through its
    block table then checks that no write ever hit a block another sequence (or the
    prefix cache) relies on, and that cached blocks hold what their keys claim.
    """

    PAGE_SIZE = 2
    NUM_BLOCKS = 9
    VOCAB = st.integers(0, 1)  # tiny vocabulary: prefix hits and duplicates are common

    @initialize()
    def setup(self):
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.PAGE_SIZE)
        self.content: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}  # written tokens; len == num_tokens
        self.pending: dict[int, list[int]] = {}  # prompt tokens not yet written
        self.history: list[list[int]] = []  # committed token lists, to build prompts that hit
        self.next_id = 0
        self._add([])

    def _pick(self, data):
        # Favour the newest sequence so forks and fresh prompts get exercised right away.
        ids = sorted(self.tokens)
        return data.draw(st.just(ids[-1]) | st.sampled_from(ids), label="seq")

    def _read(self, sid):
        return [self.content.get(s) for s in self.kv.slot_mapping(sid, 0, self.kv.num_tokens(sid))]

    @staticmethod
    def _prefixes(tokens):
        return [tuple(tokens[: j + 1]) for j in range(len(tokens))]

    def _add(self, prompt):
        sid, self.next_id = self.next_id, self.next_id + 1
        cached = self.kv.add_sequence(sid, prompt)
        event(f"add: hit {cached > 0}")
        page = self.PAGE_SIZE
        assert cached % page == 0 and cached <= max(0, len(prompt) - 1)
        self.tokens[sid], self.pending[sid] = prompt[:cached], prompt[cached:]
        assert self._read(sid) == self._prefixes(prompt[:cached])  # reused K/V is exactly the prompt's
        # Longest: the next full block (if it may be reused) is not in the cache.
        max_blocks = max(0, len(prompt) - 1) // page
        if cached // page < max_blocks:
            parent = None
            for i in range(cached // page + 1):
                parent = BlockKey.of(parent, prompt[i * page : (i + 1) * page])
            assert self.kv.block_pool.lookup(parent) is None

    @rule(data=st.data(), tail=st.lists(VOCAB, max_size=9))
    def add(self, data, tail):
        base = []
        if self.history and data.draw(st.integers(0, 3), label="extend a committed prefix (if > 0)"):
            base = data.draw(st.sampled_from(self.history))
            base = base[: data.draw(st.just(len(base)) | st.integers(0, len(base)))]
        self._add(base + tail[: max(0, 9 - len(base))])

    @rule(data=st.data(), n=st.integers(0, 5), commit=st.booleans())
    def allocate(self, data, n, commit, sid=None):
        sid = self._pick(data) if sid is None else sid
        start = self.kv.num_tokens(sid)
        before = {s: self.kv.block_table(s) for s in self.tokens}
        free_before = self.kv.num_free_blocks
        needed = self.kv.num_blocks_needed(sid, n)
        evictions = self.kv.block_pool.num_evictions
        copies = self.kv.allocate(sid, n)
        event(f"allocate: {'none' if copies is None else len(copies)} copies")
        if self.kv.block_pool.num_evictions > evictions:
            event("allocate: evicted")
        if copies is None:
            assert needed > free_before and not self.kv.can_allocate(needed)
            assert {s: self.kv.block_table(s) for s in self.tokens} == before
            assert self.kv.num_free_blocks == free_before and self.kv.num_tokens(sid) == start
            victims = sorted(set(self.tokens) - {sid})
            if not victims or not data.draw(st.booleans(), label="preempt and retry"):
                return
            # What a scheduler does: preempt another sequence and try again.
            self._free(data.draw(st.sampled_from(victims), label="victim"))
            self.allocate(data, n, commit, sid=sid)
            return
        assert free_before - self.kv.num_free_blocks == needed
        assert len(copies) <= 1
        page = self.PAGE_SIZE
        for src, dst in copies:
            assert src == before[sid][-1] and dst == self.kv.block_table(sid)[len(before[sid]) - 1]
            for o in range(page):
                if src * page + o in self.content:
                    self.content[dst * page + o] = self.content[src * page + o]
                else:
                    self.content.pop(dst * page + o, None)
        others = Counter(b for s, table in before.items() if s != sid for b in table)
        new_tokens = self.pending[sid][:n]
        new_tokens += data.draw(st.lists(self.VOCAB, min_size=n - len(new_tokens), max_size=n - len(new_tokens)))
        del self.pending[sid][:n]
        self.tokens[sid] += new_tokens
        prefixes = self._prefixes(self.tokens[sid])[start:]
        for slot, prefix in zip(self.kv.slot_mapping(sid, start, n), prefixes, strict=True):
            block = slot // page
            # The write rule: private, not cached, held by nobody else.
            assert self.kv.block_pool.ref_count(block) == 1
            assert self.kv.block_pool.block_key(block) is None
            assert block not in others
            self.content[slot] = prefix
        if commit:  # what an engine does right after the forward pass
            self._commit(sid, len(self.tokens[sid]))

    def _commit(self, sid, m):
        self.kv.commit(sid, self.tokens[sid][:m])
        self.history.append(self.tokens[sid][:m])

    @rule(data=st.data())
    def commit(self, data):
        sid = self._pick(data)
        self._commit(sid, data.draw(st.integers(0, len(self.tokens[sid]))))

    @rule(data=st.data())
    def truncate(self, data):
        sid = self._pick(data)
        n = data.draw(st.integers(0, len(self.tokens[sid])))
        self.kv.truncate(sid, n)
        del self.tokens[sid][n:]
        self.pending[sid] = []

    @rule(data=st.data())
    def fork(self, data):
        src = self._pick(data)
        dst, self.next_id = self.next_id, self.next_id + 1
        self.kv.fork(src, dst)
        self.tokens[dst], self.pending[dst] = list(self.tokens[src]), list(self.pending[src])

    @rule(data=st.data())
    def free(self, data):
        self._free(self._pick(data))
        if not self.tokens:  # keep one sequence so every rule has something to act on
            self._add([])

    def _free(self, sid):
        self.kv.free(sid)
        del self.tokens[sid], self.pending[sid]

    @invariant()
    def refcounts_match_holders(self):
        pool = self.kv.block_pool
        held = Counter()
        for sid in self.tokens:
            table = self.kv.block_table(sid)
            assert len(set(table)) == len(table) and NULL_BLOCK not in table
            assert len(table) == -(-self.kv.num_tokens(sid) // self.PAGE_SIZE)
            held.update(table)
        for block in range(1, self.NUM_BLOCKS):
            assert pool.ref_count(block) == held[block], block
        assert self.kv.num_free_blocks + len(held) == self.NUM_BLOCKS - 1
        assert self.kv.usage == pytest.approx(len(held) / (self.NUM_BLOCKS - 1))
        pool.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for sid, tokens in self.tokens.items():
            assert self.kv.num_tokens(sid) == len(tokens)
            assert self._read(sid) == self._prefixes(tokens), sid

    @invariant()
    def cached_blocks_hold_their_keyed_prefix(self):
        pool, page = self.kv.block_pool, self.PAGE_SIZE
        for block in range(1, self.NUM_BLOCKS):
            key = pool.block_key(block)
            if key is None:
                continue
            # The block's last slot holds K/V computed with the whole prefix up to the
            # block's end; re-deriving the key chain from it must give the block's key.
            prefix = self.content.get(block * page + page - 1)
            assert prefix is not None and len(prefix) % page == 0
            assert [self.content.get(block * page + o) for o in range(page)] == self._prefixes(prefix)[-page:]
            expected = None
            for i in range(len(prefix) // page):
                expected = BlockKey.of(expected, prefix[i * page : (i + 1) * page])
            assert expected == key


class KVCacheMachinePage3(KVCacheMachine):
    PAGE_SIZE = 3
    NUM_BLOCKS = 7


class KVCacheMachinePage1(KVCacheMachine):
    PAGE_SIZE = 1
    NUM_BLOCKS = 14


_settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = _settings
TestKVCacheMachinePage3 = KVCacheMachinePage3.TestCase
TestKVCacheMachinePage3.settings = _settings
TestKVCacheMachinePage1 = KVCacheMachinePage1.TestCase
TestKVCacheMachinePage1.settings = _settings
