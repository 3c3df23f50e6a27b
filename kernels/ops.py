"""``specgraph::`` custom ops over the kernels, with fake impls for torch.compile.

* ``torch.ops.specgraph.cache_write(k, v, k_cache, v_cache, slot_mapping) -> None``
  (mutates ``k_cache`` and ``v_cache``; aot_autograd wraps it in ``auto_functionalized``)
* ``torch.ops.specgraph.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
  query_start_loc, positions, scale) -> Tensor``

Dispatch per call: CUDA tensors -> Triton launcher; CPU tensors -> the ``*_ref`` torch
code (for paged attention over float32 caches: ``cpu_attention.paged_attention_cpu``, a C++
kernel for decode/verify steps), or the Triton launcher inside ``config.use_triton_kernels()``.

These are opaque ``custom_op``s rather than ``triton_op``s: under ``TRITON_INTERPRET=1``
``wrap_triton`` cannot be traced (FEASIBILITY.md Q4), while an opaque op + ``register_fake``
works in eager, dynamo, aot and Inductor.
"""

from __future__ import annotations

import torch

from .cache_write import cache_write_ref, cache_write_triton
from .config import use_triton_for as _use_triton
from .cpu_attention import paged_attention_cpu
from .paged_attention import paged_attention_triton


@torch.library.custom_op("specgraph::cache_write", mutates_args=("k_cache", "v_cache"))
def cache_write(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Write ``k``/``v`` into the caches at ``slot_mapping`` (see ``cache_write.py``)."""
    impl = cache_write_triton if _use_triton(k) else cache_write_ref
    impl(k, v, k_cache, v_cache, slot_mapping)


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
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype, contiguous
    """Causal paged attention of a flat token stream (see ``paged_attention.py``)."""
    impl = paged_attention_triton if _use_triton(q) else paged_attention_cpu
    return impl(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale)


@paged_attention.register_fake
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale):
    return q.new_empty(q.shape)
