"""``specgraph::`` custom ops over the kernels, with fake impls for torch.compile.

* ``torch.ops.specgraph.cache_write(k, v, k_cache, v_cache, slot_mapping) -> None``
  (mutates ``k_cache`` and ``v_cache``; aot_autograd wraps it in ``auto_functionalized``)
* ``torch.ops.specgraph.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
  query_start_loc, positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None) -> Tensor``

Each body hands the call to ``registry.dispatch``, the one rule that picks an implementation
(Triton on CUDA or when forced, the C++ kernel for CPU decodes, else the torch reference).

These are opaque ``custom_op``s rather than ``triton_op``s: under ``TRITON_INTERPRET=1``
``wrap_triton`` cannot be traced (FEASIBILITY.md Q4), while an opaque op + ``register_fake``
works in eager, dynamo, aot and Inductor.
"""

from __future__ import annotations

import torch

from . import cache_write as _cache_write  # noqa: F401  (each kernel module registers its implementations)
from . import cpu_kernels as _cpu_kernels  # noqa: F401
from . import paged_attention as _paged_attention  # noqa: F401
from .registry import dispatch


@torch.library.custom_op("specgraph::cache_write", mutates_args=("k_cache", "v_cache"))
def cache_write(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Write ``k``/``v`` into the caches at ``slot_mapping`` (see ``cache_write.py``)."""
    dispatch("cache_write", k, v, k_cache, v_cache, slot_mapping)


@cache_write.register_fake
def _cache_write_fake(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("specgraph::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    tree_mask: torch.Tensor | None = None,  # [N, W] int32 ancestor bits (tree_mask.py)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype, contiguous
    """Causal paged attention of a flat token stream, with the optional score modifiers
    (sliding window, soft-capping, ALiBi; see ``paged_attention.py``) and token trees."""
    return dispatch("paged_attention", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale,
                    window, softcap, alibi_slopes, tree_mask)


@paged_attention.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window=0,
                          softcap=0.0, alibi_slopes=None, tree_mask=None):
    return q.new_empty(q.shape)
