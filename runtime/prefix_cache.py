"""Prefix caching: content keys for full KV blocks and longest-prefix lookup.

A *full block* holds ``page_size`` tokens. Its K/V depend on its own tokens and on every
token before it, so its key chains the key of the previous block::

    key_i = BlockKey(sha256(key_{i-1}.digest || int64-LE(tokens of block i)), tokens of block i)

with an empty parent digest for block 0. Two sequences sharing the first ``k`` full
blocks of tokens therefore share ``key_0 .. key_{k-1}``, and the K/V stored in a block
cached under ``key_i`` can be reused by any sequence whose first ``(i+1)*page_size``
tokens match.

Why SHA-256 and not Python's ``hash``: ``hash`` of an int tuple is 64 bits and not
collision resistant, so crafted prompts could alias another user's prefix; SHA-256 is
collision resistant and stable across processes (a cache key could later leave this
process). Belt and braces: :class:`BlockKey` also stores the block's tokens and compares
them on equality, so a digest match alone never aliases blocks with different tokens.
Hashing costs about a microsecond per block, once per block per prompt.

The content index (key -> block) lives in :class:`~specgraph.runtime.block_pool.BlockPool`
because eviction happens there: when a free cached block is handed out again its key is
dropped in the same step, so the index can never point at overwritten content. This
module only makes keys, walks the chain and counts hits.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from specgraph.runtime.block_pool import BlockPool


@dataclass(frozen=True)
class BlockKey:
    """Content key of one full block: chained digest plus the block's own token ids."""

    digest: bytes  # sha256 over (parent digest, this block's token ids)
    token_ids: tuple[int, ...]

    def __hash__(self) -> int:  # the digest is already uniform; bytes cache their hash
        return hash(self.digest)

    @classmethod
    def of(cls, parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
        token_ids = tuple(token_ids)
        h = hashlib.sha256(parent.digest if parent is not None else b"")
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        return cls(h.digest(), token_ids)


class PrefixCache:
    """Finds and registers cached full blocks in a :class:`BlockPool`'s content index.

    Parameters
    ----------
    block_pool : BlockPool
        Owns the index and evicts from it.

    Attributes
    ----------
    queried_tokens, hit_tokens : int
        Prompt tokens looked up, and those served from the cache (for ``hit_rate``).

    Example
    -------
    >>> pool = BlockPool(num_blocks=8, page_size=2)
    >>> cache = PrefixCache(pool)
    >>> blocks = pool.allocate(2)
    >>> keys = cache.register(blocks, [5, 6, 7, 8, 9], parent=None)  # two full blocks
    >>> cache.lookup([5, 6, 7, 8, 1], max_blocks=2)[0] == blocks
    True
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.page_size = block_pool.page_size
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before the first query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def lookup(self, token_ids: Sequence[int], max_blocks: int, record: bool = True
               ) -> tuple[list[int], list[BlockKey]]:
        """Longest chain of cached full blocks that prefixes ``token_ids``.

        Returns ``(block_ids, keys)`` for at most ``max_blocks`` blocks. Does not take
        references: the caller must ``incref`` the blocks before anything can allocate.
        With ``record`` counts ``len(token_ids)`` queried tokens and the matched tokens as
        hits; a caller that may abandon the lookup passes ``False`` and calls :meth:`record`
        once it keeps it.
        """
        page = self.page_size
        max_blocks = max(0, min(max_blocks, len(token_ids) // page))
        blocks: list[int] = []
        keys: list[BlockKey] = []
        parent = None
        for i in range(max_blocks):
            key = BlockKey.of(parent, token_ids[i * page : (i + 1) * page])
            block_id = self.block_pool.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
            keys.append(key)
            parent = key
        if record:
            self.record(len(token_ids), len(blocks) * page)
        return blocks, keys

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one lookup that was kept (see :meth:`lookup`)."""
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def register(self, block_ids: Sequence[int], token_ids: Sequence[int], parent: BlockKey | None) -> list[BlockKey]:
        """Key and cache the full blocks of ``token_ids`` that ``block_ids`` hold.

        ``block_ids[i]`` holds tokens ``token_ids[i*page_size : (i+1)*page_size]`` and
        ``parent`` is the key of the block just before ``block_ids[0]`` (``None`` if
        ``block_ids[0]`` is the sequence's first block). Only full blocks are keyed.
        Returns the new keys in order, whether or not each block became the cached copy
        (a duplicate of content cached elsewhere stays uncached; its key is still the
        parent of the next block).
        """
        page = self.page_size
        num_full = min(len(block_ids), len(token_ids) // page)
        keys = []
        for i in range(num_full):
            parent = BlockKey.of(parent, token_ids[i * page : (i + 1) * page])
            self.block_pool.cache_block(block_ids[i], parent)
            keys.append(parent)
        return keys
