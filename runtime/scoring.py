"""Scoring: log-probabilities of a given token sequence through the paged cache (``Engine.score``)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..compiler.program import AttentionMetadata


@torch.no_grad()
def score(engine, token_ids: Sequence[int], chunk_size: int | None = None, return_top1: bool = False):
    """``log p(token_ids[t] | token_ids[:t])`` for t = 1..len-1, computed through the cache.

    The sequence runs as prefill chunks of ``chunk_size`` tokens (all at once when None),
    each attending to the cached K/V of the chunks before it. Returns float32 ``[len - 1]``;
    with ``return_top1`` also the most likely next token at each position (int64 ``[len - 1]``).
    """
    ids = list(map(int, token_ids))
    if len(ids) < 2:
        raise ValueError("score needs at least 2 tokens")
    chunk = chunk_size or len(ids)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    sid = engine._new_id()
    need = -(-len(ids) // engine.page_size)
    if need > engine.table_width:
        raise ValueError(f"KV pool exhausted: scoring {len(ids)} tokens needs {need} blocks, the pool has "
                         f"{engine.table_width}")
    engine.kv.add_sequence(sid, [])  # scoring needs every position's logits: no prefix reuse
    out, top1 = [], []
    try:
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - start)
            copies = engine.kv.allocate(sid, n)
            if copies is None:
                raise RuntimeError("KV pool exhausted while scoring (other requests hold the blocks)")
            engine._copy_blocks(copies)
            meta = AttentionMetadata.build([(engine.kv.block_table(sid), start, n)], engine.page_size, [list(range(n))])
            logits = engine.program(torch.tensor(ids[start:start + n]), meta, engine.kv_cache).cpu()
            engine.kv.mark_written(sid, start + n)  # pages leaving the hot window go cold
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.append(logp.gather(1, torch.tensor(ids[start + 1:start + 1 + n]).view(-1, 1)).view(-1))
            top1.append(logp.argmax(dim=-1))
    finally:
        engine._apply_demotions()  # (before its blocks are free to be handed out again)
        engine.kv.free(sid)
    return (torch.cat(out), torch.cat(top1)) if return_top1 else torch.cat(out)
