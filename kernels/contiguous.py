"""Contiguous (unpaged) KV-cache ops: the form the ``kv_cache`` pass emits before ``paging``.

The cache is ``[rows, max_len, kv_heads, head_dim]``: sequence ``s`` owns row ``cache_rows[s]``.
That is exactly a paged cache with ``page_size = max_len`` and the one-entry block table
``[[row]]``, so both ops are thin adapters over the paged references.
"""
from __future__ import annotations

import torch

from .cache_write import cache_write_ref
from .paged_attention import paged_attention_ref


def _token_rows(cache_rows: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    return torch.repeat_interleave(cache_rows.long(), counts, output_size=num_tokens)


@torch.library.custom_op("specgraph::contiguous_cache_write", mutates_args=("k_cache", "v_cache"))
def contiguous_cache_write(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [rows, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
) -> None:
    max_len = k_cache.shape[1]
    slots = _token_rows(cache_rows, query_start_loc, k.shape[0]) * max_len + positions
    cache_write_ref(k, v, k_cache, v_cache, slots)


@contiguous_cache_write.register_fake
def _(k, v, k_cache, v_cache, cache_rows, query_start_loc, positions) -> None:
    return None


@torch.library.custom_op("specgraph::contiguous_attention", mutates_args=())
def contiguous_attention(
    q: torch.Tensor,  # [N, heads, head_dim]
    k_cache: torch.Tensor,  # [rows, max_len, kv_heads, head_dim]
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,  # [S] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    tables = cache_rows.view(-1, 1).to(torch.int32)
    return paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, query_start_loc, positions, scale,
                               window, softcap, alibi_slopes)


@contiguous_attention.register_fake
def _(q, k_cache, v_cache, cache_rows, seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0,
      alibi_slopes=None):
    return q.new_empty(q.shape)
