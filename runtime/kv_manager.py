"""Per-sequence KV-cache block tables on top of a :class:`BlockPool`.

Glossary
--------
num_tokens
    Tokens of a sequence whose K/V is in the cache or will be written by the forward
    pass the caller is preparing. ``allocate`` raises it, ``truncate`` lowers it.
    The sequence's block table always has exactly ``ceil(num_tokens / page_size)``
    blocks; position ``j`` lives in slot
    ``block_table[j // page_size] * page_size + j % page_size``.
committed
    Tokens the caller has confirmed (``commit``) are written; only committed full blocks
    enter the prefix cache.
shared block
    A block with reference count > 1 (prefix-cache hit or ``fork``). Shared blocks are
    never written: full ones need no writes, and before the first write into a shared
    partial last block ``allocate`` moves the sequence onto a private copy
    (copy-on-write) and returns the ``(src, dst)`` copy the caller must perform.

Write rule (the invariant everything else serves): when ``allocate(seq, n)`` returns,
every block covering positions ``[num_tokens_before, num_tokens_before + n)`` of ``seq``
has reference count 1 and is not in the prefix cache. A cached block that is about to be
overwritten in place (count 1, partial after a ``truncate``) is uncached at that moment,
not at ``truncate`` time, since its content stays valid until then.

Engine step, per sequence::

    cached, n = kv.admit(sid, prompt, max_chunk)     # once; positions [0, cached) reused,
                                                     # [cached, cached + n) allocated; None: no room
    copies = kv.allocate(sid, n)                     # None: preempt someone, retry
    for src, dst in copies: cache[:, dst] = cache[:, src]   # every layer, K and V
    slots = kv.slot_mapping(sid, start, n)           # start = num_tokens before allocate
    ... forward writes K/V of the n tokens to `slots` ...
    kv.commit(sid, tokens_so_far)                    # register newly full blocks
    kv.truncate(sid, num_accepted_total)             # speculative decoding rejects drafts

Hot/cold pools (``num_cold > 0``; ``kernels/hot_cold.py``)
    Every block ``allocate`` hands out is hot (the compute dtype). A committed full block more
    than ``hot_window`` tokens behind a sequence's committed end may be *demoted*: its content
    moves to a cold block (quantized by the caller), every table holding it and its prefix-cache
    key follow, and the hot block is freed. ``demote="window"`` (fp8 / int4) demotes each block as
    soon as it leaves the window; ``demote="pressure"`` (adaptive) only when ``allocate`` or
    ``admit`` would otherwise fail, the longest sequences' oldest blocks first. Demotions are
    queued; the caller applies :meth:`take_demotions` (quantize ``src`` into ``dst``) before any
    copy and before the next forward writes into a freed block. Only committed blocks below the
    window are ever cold, so no write (which only reaches past the committed end) lands on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specgraph.runtime.block_pool import NULL_BLOCK, BlockPool
from specgraph.runtime.prefix_cache import BlockKey, PrefixCache

__all__ = ["NULL_BLOCK", "KVCacheManager"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)  # block table, len == cdiv(num_tokens, page_size)
    num_tokens: int = 0
    keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of blocks[:len(keys)] (committed, full)
    written: int = 0  # tokens known written (committed): blocks wholly below it minus the window may go cold


class KVCacheManager:
    """Block tables, copy-on-write and prefix reuse for a set of sequences.

    Parameters
    ----------
    num_blocks : int
        Blocks in the cache tensors, including the reserved null block 0.
    page_size : int
        Token slots per block.
    enable_prefix_caching : bool
        Reuse full blocks of earlier prompts/outputs with identical token prefixes.

    Example
    -------
    >>> kv = KVCacheManager(num_blocks=8, page_size=4)
    >>> kv.add_sequence(0, [1, 2, 3, 4, 5, 6])
    0
    >>> kv.allocate(0, 6)
    []
    >>> kv.block_table(0), kv.slot_mapping(0, 3, 2)
    ([1, 2], [7, 8])
    >>> kv.commit(0, [1, 2, 3, 4, 5, 6])            # block 1 is full: cached
    >>> kv.add_sequence(1, [1, 2, 3, 4, 9])         # reuses block 1
    4
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True, num_cold: int = 0,
                 hot_window: int = 0, demote: str = "window") -> None:
        if demote not in ("window", "pressure"):
            raise ValueError(f"demote must be 'window' or 'pressure'; got {demote!r}")
        self.block_pool = BlockPool(num_blocks, page_size, num_cold)
        self.page_size = page_size
        self.hot_cold = num_cold > 0
        self.window_blocks = -(-hot_window // page_size)  # full blocks behind the written end that stay hot
        self.demote_policy = demote
        self._demotions: list[tuple[int, int]] = []  # (hot src, cold dst) not yet applied by the caller
        self.num_demotions = 0
        # None when prefix caching is off: nothing is keyed, looked up or counted.
        self.prefix_cache = PrefixCache(self.block_pool) if enable_prefix_caching else None
        self._seqs: dict[int, _Sequence] = {}
        self.num_cow_copies = 0  # copy-on-write block copies handed out by allocate

    # ------------------------------------------------------------------ stats
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks referenced by a live sequence."""
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens added (0.0 if off)."""
        return self.prefix_cache.hit_rate if self.prefix_cache is not None else 0.0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.block_pool.num_free_blocks

    # -------------------------------------------------------------- sequences
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block ids (pad with ``NULL_BLOCK`` for kernels)."""
        return list(self._get(seq_id).blocks)

    def slot_mapping(self, seq_id: int, start: int, n: int) -> list[int]:
        """Cache slots of positions ``start .. start+n-1`` (all below ``num_tokens``)."""
        seq = self._get(seq_id)
        if start < 0 or n < 0 or start + n > seq.num_tokens:
            raise ValueError(
                f"positions [{start}, {start + n}) of sequence {seq_id} are not allocated "
                f"(num_tokens={seq.num_tokens})"
            )
        page, blocks = self.page_size, seq.blocks
        return [blocks[j // page] * page + j % page for j in range(start, start + n)]

    def add_sequence(self, seq_id: int, prompt_token_ids: Sequence[int]) -> int:
        """Register a sequence and reuse the longest cached prefix of its prompt.

        Returns the number of cached tokens: a multiple of ``page_size`` and at most
        ``len(prompt) - 1``, so the last prompt token is always computed (its logits are
        needed). The sequence starts with ``num_tokens`` equal to that number; nothing is
        allocated, so this never fails for lack of blocks.
        """
        blocks, keys = self._cached_prefix(seq_id, prompt_token_ids)
        return self._register(seq_id, prompt_token_ids, blocks, keys)

    def admit(self, seq_id: int, token_ids: Sequence[int], max_chunk: int) -> tuple[int, int] | None:
        """:meth:`add_sequence` and the allocation of its first chunk, all or nothing.

        Allocates ``n = min(len(token_ids) - cached, max_chunk)`` tokens after the cached prefix
        and returns ``(cached, n)``; or ``None`` when the pool cannot supply the blocks, and then
        nothing changed: no sequence, no references, no blocks, no hit-rate counts. A cached
        block the hit revives from the free queue is not available to the new blocks, so it is
        subtracted from what the pool can give.
        """
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1; got {max_chunk}")
        for attempt in range(2):  # a hot/cold pool short of hot blocks makes room once, then looks again
            blocks, keys = self._cached_prefix(seq_id, token_ids)
            cached = len(blocks) * self.page_size
            n = min(len(token_ids) - cached, max_chunk)
            revived = sum(self.block_pool.ref_count(b) == 0 and not self.block_pool.is_cold(b) for b in blocks)
            need = _cdiv(cached + n, self.page_size) - len(blocks)
            if need <= self.block_pool.num_free_blocks - revived:
                break
            if attempt or not self.hot_cold:
                return None
            self._make_room(need + revived)  # may move cached blocks to cold ones: the lookup is redone
        self._register(seq_id, token_ids, blocks, keys)
        copies = self.allocate(seq_id, n)
        # Hits are whole blocks, so there is no shared partial block to copy, and the room was checked.
        assert copies == [], copies
        return cached, n

    def _cached_prefix(self, seq_id: int, token_ids: Sequence[int]) -> tuple[list[int], list[BlockKey]]:
        """The cached full blocks prefixing ``token_ids`` (never the last token); nothing taken or counted."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if self.prefix_cache is None:
            return [], []
        max_blocks = max(0, len(token_ids) - 1) // self.page_size
        return self.prefix_cache.lookup(token_ids, max_blocks, record=False)

    def _register(self, seq_id: int, token_ids: Sequence[int], blocks: list[int], keys: list[BlockKey]) -> int:
        self.block_pool.incref(blocks)
        self._seqs[seq_id] = _Sequence(blocks=blocks, num_tokens=len(blocks) * self.page_size, keys=keys)
        if self.prefix_cache is not None:
            self.prefix_cache.record(len(token_ids), len(blocks) * self.page_size)
        return len(blocks) * self.page_size

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks ``allocate(seq_id, num_new_tokens)`` would take (copy included)."""
        seq = self._get(seq_id)
        if num_new_tokens <= 0:
            return 0
        new = _cdiv(seq.num_tokens + num_new_tokens, self.page_size) - len(seq.blocks)
        return new + (self._partial_last_block(seq) is not None and self._needs_copy(seq))

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` more tokens and advance ``num_tokens``.

        Returns the ``(src_block, dst_block)`` copies the caller must apply to every
        layer's K and V cache, in order, before the next forward pass: at most one, when
        the partial last block is shared and the sequence moves to a private copy.
        Returns ``None`` if the pool cannot supply the blocks; then nothing changed.
        """
        seq = self._get(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0; got {num_new_tokens}")
        if num_new_tokens == 0:
            return []
        total = seq.num_tokens + num_new_tokens
        num_new_blocks = _cdiv(total, self.page_size) - len(seq.blocks)
        last = self._partial_last_block(seq)  # will receive some of the new tokens
        if last is not None and self.block_pool.is_cold(last):
            raise RuntimeError(f"sequence {seq_id} would write into cold block {last} (it was truncated below its "
                               f"hot window); cold pages are read-only")
        copy = last is not None and self._needs_copy(seq)
        if num_new_blocks + copy > self.block_pool.num_free_blocks and self.hot_cold:
            self._make_room(num_new_blocks + copy)
        new_blocks = self.block_pool.allocate(num_new_blocks + copy)
        if new_blocks is None:
            return None
        # Past this point nothing can fail.
        copies = []
        if copy:
            dst = new_blocks.pop()
            # The source keeps a reference from its other holders, so it cannot be
            # evicted (and overwritten) before the caller performs the copy.
            self.block_pool.free([last])
            seq.blocks[-1] = dst
            copies.append((last, dst))
            self.num_cow_copies += 1
        elif last is not None:
            # Private block that may still carry a key from before a truncate; its tail
            # is about to be overwritten, so it must leave the prefix cache now.
            self.block_pool.uncache_block(last)
        seq.blocks.extend(new_blocks)
        seq.num_tokens = total
        return copies

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """The K/V of ``token_ids`` (the sequence's tokens from position 0) is written.

        Newly full blocks enter the prefix cache. ``len(token_ids)`` may not exceed
        ``num_tokens``. Tokens of already registered blocks are not re-read.
        """
        seq = self._get(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise ValueError(
                f"commit of {len(token_ids)} tokens for sequence {seq_id}, "
                f"but only {seq.num_tokens} are allocated"
            )
        self._register_keys(seq, token_ids)
        self.mark_written(seq_id, len(token_ids))

    def mark_written(self, seq_id: int, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens' K/V is written and final (``commit`` says so too, with the
        prefix cache). Under ``demote="window"`` the blocks that leave the hot window go cold."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id} has {seq.num_tokens} tokens; {num_tokens} cannot be written")
        seq.written = num_tokens
        if self.hot_cold and self.demote_policy == "window":
            for i in self._demotable(seq):
                if not self._demote(seq.blocks[i]):
                    break

    def take_demotions(self) -> list[tuple[int, int]]:
        """The ``(hot src, cold dst)`` demotions queued since the last call, in order; the caller quantizes
        each ``src`` page into ``dst`` in every layer before the next copy or forward."""
        out, self._demotions = self._demotions, []
        return out

    def _demotable(self, seq: _Sequence) -> list[int]:
        """Indices of the sequence's hot blocks that are full, written and behind the hot window."""
        end = seq.written // self.page_size - self.window_blocks
        return [i for i in range(max(end, 0)) if not self.block_pool.is_cold(seq.blocks[i])]

    def _demote(self, block: int) -> bool:
        """Move hot ``block``'s content to a new cold block in every table that holds it; False when the
        cold pool is full or a holder still writes into it (nothing changes)."""
        holders = [(seq, i) for seq in self._seqs.values() for i, b in enumerate(seq.blocks) if b == block]
        if any(i == len(seq.blocks) - 1 and seq.num_tokens % self.page_size for seq, i in holders):
            return False  # another holder still writes into it (a fork truncated into a shared page)
        got = self.block_pool.allocate(1, cold=True)
        if got is None:
            return False
        cold = got[0]
        self.block_pool.incref([cold] * (len(holders) - 1))
        for seq, i in holders:
            seq.blocks[i] = cold
        self.block_pool.move_key(block, cold)
        self.block_pool.free([block] * len(holders))
        self._demotions.append((block, cold))
        self.num_demotions += 1
        return True

    def _make_room(self, num_hot: int) -> None:
        """Demote blocks until ``num_hot`` hot blocks are free (or nothing more can go): the longest
        sequences first, each one's oldest block first."""
        while self.block_pool.num_free_blocks < num_hot and self.block_pool.num_free_cold_blocks:
            candidates = [(seq.num_tokens, self._demotable(seq), seq) for seq in self._seqs.values()]
            candidates = [(n, idx, seq) for n, idx, seq in candidates if idx]
            if not candidates:
                return
            _, idx, seq = max(candidates, key=lambda c: c[0])
            if not self._demote(seq.blocks[idx[0]]):
                return

    def _register_keys(self, seq: _Sequence, token_ids: Sequence[int]) -> None:
        if self.prefix_cache is None:
            return
        page, done = self.page_size, len(seq.keys)
        num_full = len(token_ids) // page
        if num_full <= done:
            return
        parent = seq.keys[-1] if seq.keys else None
        seq.keys += self.prefix_cache.register(
            seq.blocks[done:num_full], token_ids[done * page : num_full * page], parent
        )

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll the sequence back to its first ``num_tokens`` tokens.

        Blocks past the new end are freed. A kept partial last block that is cached
        stays cached (its content is still valid) until it is next written: then
        ``allocate`` uncaches it if private or copies it if shared.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot truncate sequence {seq_id} to {num_tokens} tokens (has {seq.num_tokens})")
        keep = _cdiv(num_tokens, self.page_size)
        seq.written = min(seq.written, num_tokens)
        self.block_pool.free(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]
        del seq.keys[num_tokens // self.page_size :]
        seq.num_tokens = num_tokens

    def fork(self, src_seq: int, dst_seq: int) -> None:
        """``dst_seq`` becomes a copy of ``src_seq`` sharing all of its blocks.

        Call it after the K/V of ``src_seq``'s ``num_tokens`` tokens is written: the
        shared blocks are read by both, and written by neither until copied.
        """
        src = self._get(src_seq)
        if dst_seq in self._seqs:
            raise ValueError(f"sequence {dst_seq} already exists")
        self.block_pool.incref(src.blocks)
        self._seqs[dst_seq] = _Sequence(list(src.blocks), src.num_tokens, list(src.keys))

    def free(self, seq_id: int) -> None:
        """Drop the sequence; its blocks are released tail first (evicted first)."""
        seq = self._get(seq_id)
        self.block_pool.free(reversed(seq.blocks))
        del self._seqs[seq_id]

    def sequence_ids(self) -> list[int]:
        """Ids of the registered sequences (every one holds references on its blocks)."""
        return list(self._seqs)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if block tables and reference counts disagree (tests/debug).

        Besides the pool's own invariants: every block's reference count equals the number of
        block-table entries naming it, and each table has ``ceil(num_tokens / page_size)`` blocks.
        """
        self.block_pool.check_invariants()
        owners = [0] * self.block_pool.num_blocks
        for seq_id, seq in self._seqs.items():
            assert len(seq.blocks) == _cdiv(seq.num_tokens, self.page_size), seq_id
            assert len(seq.keys) <= seq.num_tokens // self.page_size, seq_id
            for b in seq.blocks:
                owners[b] += 1
            if seq.num_tokens % self.page_size:  # the block a write reaches is never cold
                assert not self.block_pool.is_cold(seq.blocks[-1]), seq_id
        for b in range(1, self.block_pool.num_blocks):
            assert self.block_pool.ref_count(b) == owners[b], (b, self.block_pool.ref_count(b), owners[b])

    # -------------------------------------------------------------- helpers
    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id}") from None

    def _partial_last_block(self, seq: _Sequence) -> int | None:
        return seq.blocks[-1] if seq.num_tokens % self.page_size else None

    def _needs_copy(self, seq: _Sequence) -> bool:
        return self.block_pool.ref_count(seq.blocks[-1]) > 1
