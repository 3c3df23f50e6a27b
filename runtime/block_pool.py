"""A fixed pool of KV-cache blocks: allocation, reference counts, LRU eviction.

The KV cache of every layer is ``[num_blocks, page_size, kv_heads, head_dim]``; this
module only hands out block ids, it never touches tensors.

Glossary
--------
null block
    Block ``0``. Never allocated, never freed; padding entries of block tables point
    to it so kernels always read a valid page.
reference count
    Number of sequences whose block table holds the block. A block with count 0 is
    *free*: it sits in the free queue and may be handed out by :meth:`allocate`.
cached block
    A block whose full content is described by a key in the content index (keys are
    made by :mod:`specgraph.runtime.prefix_cache`; the pool treats them as opaque
    hashables). A cached block keeps its key after its count drops to 0, so a later
    prefix hit can revive it; the key is dropped when the block is *evicted* (handed
    out again by :meth:`allocate`) or explicitly by :meth:`uncache_block`.

hot and cold blocks
    With ``num_cold > 0`` the ids ``num_hot .. num_blocks - 1`` are *cold*: pages of a hot/cold
    cache's quantized pool (``kernels/hot_cold.py``), handed out by ``allocate(n, cold=True)``
    from their own free queue; ids ``1 .. num_hot - 1`` are the hot (compute-dtype) pages that
    every write goes to. Counts, keys and eviction work the same in both.

Invariants (checked by :meth:`check_invariants`)
-----------------------------------------------
* ``ref_count(b) == 0`` exactly when ``b`` is in the free queue (``b != 0``).
* The content index is a bijection between its keys and the blocks that carry a key.

"Doesn't fit" is a return value (``allocate`` returns ``None``); misuse that would
break an invariant (double free, freeing the null block) raises.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable

NULL_BLOCK = 0


class BlockPool:
    """Hands out block ids ``1 .. num_blocks-1`` with reference counting.

    Parameters
    ----------
    num_blocks : int
        Blocks in the cache tensors, including the null block ``0`` (the hot pages of a hot/cold cache).
    page_size : int
        Token slots per block (kept here so every user agrees on it).
    num_cold : int
        Cold pages after them (ids ``num_blocks ..``); 0 for a cache of one kind.

    Example
    -------
    >>> pool = BlockPool(num_blocks=4, page_size=16)
    >>> pool.allocate(2)
    [1, 2]
    >>> pool.allocate(2) is None  # only block 3 is left; nothing changes
    True
    >>> pool.free([2, 1]); pool.num_free_blocks
    3
    """

    def __init__(self, num_blocks: int, page_size: int, num_cold: int = 0) -> None:
        if num_cold < 0:
            raise ValueError(f"num_cold must be >= 0; got {num_cold}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block); got {num_blocks}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.num_hot = num_blocks  # ids below it are hot pages
        self.num_blocks = num_blocks + num_cold  # every id, null block included
        num_blocks = self.num_blocks
        self.page_size = page_size
        # _ref_cnt[b]: sequences holding block b. The null block stays at 0 and is never
        # in the free queue; every public method rejects it explicitly.
        self._ref_cnt = [0] * num_blocks
        # Free blocks in eviction order; allocate() pops from the front. Uncached free
        # blocks are put at the front (reusing them loses nothing); a freed cached block
        # goes to the back, so cached blocks are evicted least-recently-freed first.
        # An OrderedDict (values unused) gives O(1) removal from the middle when a
        # prefix hit revives a free cached block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_hot))
        self._free_cold: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_hot, num_blocks))
        # Content index for the prefix cache: key -> block, and its inverse per block.
        self._cached: dict[Hashable, int] = {}
        self._block_key: list[Hashable | None] = [None] * num_blocks
        self.num_evictions = 0  # cached blocks handed out again (their key was dropped)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now (free cached blocks included); hot ones of a hot/cold pool."""
        return len(self._free)

    @property
    def num_free_cold_blocks(self) -> int:
        """Cold blocks ``allocate(n, cold=True)`` can hand out now."""
        return len(self._free_cold)

    def is_cold(self, block_id: int) -> bool:
        return block_id >= self.num_hot

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is in the index (held or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks that are referenced by some sequence."""
        return 1.0 - (len(self._free) + len(self._free_cold)) / (self.num_blocks - 1)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_cnt[block_id]

    def block_key(self, block_id: int) -> Hashable | None:
        """The content key of ``block_id``, or ``None`` if it is not cached."""
        self._check_id(block_id)
        return self._block_key[block_id]

    def lookup(self, key: Hashable) -> int | None:
        """The block cached under ``key`` (held or free), or ``None``. Does not incref."""
        return self._cached.get(key)

    # ---------------------------------------------------------------- mutation
    def allocate(self, n: int, cold: bool = False) -> list[int] | None:
        """Take ``n`` blocks from the front of the free queue (the cold one with ``cold``), each with count 1.

        Returns ``None`` (and changes nothing) if fewer than ``n`` blocks are free.
        A cached block taken here is evicted: its key leaves the index.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        queue = self._free_cold if cold else self._free
        if n > len(queue):
            return None
        blocks = []
        for _ in range(n):
            block_id, _ = queue.popitem(last=False)
            key = self._block_key[block_id]
            if key is not None:
                del self._cached[key]
                self._block_key[block_id] = None
                self.num_evictions += 1
            self._ref_cnt[block_id] = 1
            blocks.append(block_id)
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a block may repeat to add several).

        Reviving a free block is only legal if it is cached (its content is known);
        reviving an uncached free block would hand out garbage and raises.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_cnt[block_id] == 0 and self._block_key[block_id] is None:
                raise RuntimeError(f"incref of free, uncached block {block_id}: its content is undefined")
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._queue(block_id)[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        Pass a sequence's blocks tail first: blocks freed earlier are evicted earlier,
        and a cached prefix is useless without its first blocks.
        Raises ``RuntimeError`` on a double free and ``ValueError`` for the null block;
        in both cases nothing is changed.
        """
        block_ids = list(block_ids)
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref_cnt[block_id] < times:
                raise RuntimeError(
                    f"double free of block {block_id}: reference count {self._ref_cnt[block_id]}, "
                    f"freed {times} time(s)"
                )
        for block_id in block_ids:
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                queue = self._queue(block_id)
                queue[block_id] = None  # back of the queue: evicted last
                if self._block_key[block_id] is None:
                    queue.move_to_end(block_id, last=False)  # nothing to lose: reuse first

    def cache_block(self, block_id: int, key: Hashable) -> bool:
        """Record that held block ``block_id`` has the full content described by ``key``.

        Returns ``False`` (and changes nothing) if another block already holds ``key``
        (the same content was computed twice; the first copy stays the cached one).
        Re-registering a block under its own key is a no-op returning ``True``.
        """
        self._check_id(block_id)
        if self._ref_cnt[block_id] == 0:
            raise RuntimeError(f"cannot cache free block {block_id}: its content is not owned by anyone")
        current = self._block_key[block_id]
        if current is not None:
            if current != key:
                raise RuntimeError(f"block {block_id} is already cached with different content")
            return True
        if key in self._cached:
            return False
        self._cached[key] = block_id
        self._block_key[block_id] = key
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop ``block_id``'s key (call before overwriting a cached block's content)."""
        self._check_id(block_id)
        key = self._block_key[block_id]
        if key is None:
            return
        del self._cached[key]
        self._block_key[block_id] = None
        if self._ref_cnt[block_id] == 0:
            self._queue(block_id).move_to_end(block_id, last=False)

    def move_key(self, src: int, dst: int) -> None:
        """Give held block ``dst`` the content key of ``src`` (``src``'s content now lives in ``dst``)."""
        key = self.block_key(src)
        if key is None:
            return
        self.uncache_block(src)
        self.cache_block(dst, key)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the internal structures disagree (tests/debug)."""
        assert NULL_BLOCK not in self._free and self._ref_cnt[NULL_BLOCK] == 0
        assert self._block_key[NULL_BLOCK] is None
        free = set(self._free) | set(self._free_cold)
        assert len(free) == len(self._free) + len(self._free_cold)
        assert all(b < self.num_hot for b in self._free) and all(b >= self.num_hot for b in self._free_cold)
        for block_id in range(1, self.num_blocks):
            assert self._ref_cnt[block_id] >= 0, block_id
            assert (self._ref_cnt[block_id] == 0) == (block_id in free), block_id
            key = self._block_key[block_id]
            assert key is None or self._cached.get(key) == block_id, block_id
        assert all(self._block_key[b] == k for k, b in self._cached.items())

    def _queue(self, block_id: int) -> OrderedDict[int, None]:
        return self._free_cold if block_id >= self.num_hot else self._free

    def _check_id(self, block_id: int) -> None:
        if block_id == NULL_BLOCK:
            raise ValueError("block 0 is the reserved null block; it is never allocated, freed or cached")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [1, {self.num_blocks})")
