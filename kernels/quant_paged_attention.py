"""Causal paged attention over a quantized KV cache (fp8 or int4; layouts in ``quant.py``).

Same stream / position / block-table contract as ``paged_attention.py``; the cache is a
quantized layer cache ``(k_cache, v_cache, k_scale, v_scale)``. Dequantization happens
inside attention, on the pages that are read:

* ``paged_attention_{fp8,int4}_ref`` (the production CPU path) run the float
  reference's loop (:func:`paged_attention.attend_pages_ref`) with a gather that
  index-selects the slots a step reads, of data and params, and dequantizes just those to
  float32. The pool is never dequantized as a whole.
* ``paged_attention_{fp8,int4}_triton`` launch the one Triton attention kernel
  (``attention_kernel.py``: one program per (token, kv head), online softmax over
  ``BLOCK_N``-key tiles, GQA heads batched, the variant included) with the layout's tile
  loader, which decodes each K/V tile in registers right after its load: e4m3 bits -> fp32
  (exact integer decode) times the token's scale, or int4 nibbles -> ``code * scale + min``
  per group. The two matmuls take operands in q's dtype (fp32 products for fp32 q, tensor
  cores for bf16/fp16 q) and accumulate in fp32.
"""

from __future__ import annotations

import torch

from .attention_kernel import launch_paged_attention
from .paged_attention import attend_pages_ref, check_same_device, check_stream_args, check_variant
from .quant import QuantLayout, dequantize_fp8, dequantize_int4, fp8_layout, int4_layout
from .registry import register


def _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                layout_fn) -> QuantLayout:
    layout = layout_fn(k_cache, v_cache, k_scale, v_scale)
    check_stream_args(q, layout.kv_heads, layout.head_dim, block_tables, seq_lens, query_start_loc, positions)
    check_same_device(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions)
    return layout


def _slots(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of ``[num_blocks, page_size, ...]`` viewed as ``[num_blocks * page_size, ...]``."""
    return t.flatten(0, 1).index_select(0, slots)


def paged_attention_fp8_ref(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    tree_mask: torch.Tensor | None = None,  # [N, W] int32 (tree_mask.py)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Pure-torch paged attention over an fp8 cache: ``paged_attention_ref`` on dequantized pages.

    Example
    -------
    >>> from specgraph.kernels.quant import allocate_fp8
    >>> from specgraph.kernels.quant_cache_write import cache_write_fp8_ref
    >>> c = allocate_fp8(4, 8, 1, 32)
    >>> cache_write_fp8_ref(torch.randn(10, 1, 32), torch.randn(10, 1, 32), *c.tensors(),
    ...     torch.tensor([16, 17, 18, 19, 20, 21, 22, 23, 0, 1]))   # pages 2, 0
    >>> out = paged_attention_fp8_ref(torch.randn(3, 2, 32), *c.tensors(), torch.tensor([[2, 0]], dtype=torch.int32),
    ...     torch.tensor([10], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
    ...     torch.tensor([7, 8, 9]), 32 ** -0.5)
    >>> out.shape
    torch.Size([3, 2, 32])
    """
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         fp8_layout)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_fp8(_slots(k_cache, slots), _slots(k_scale, slots))
        v = dequantize_fp8(_slots(v_cache, slots), _slots(v_scale, slots))
        return k, v

    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=layout.page_size, kv_heads=layout.kv_heads, gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes, tree_mask=tree_mask)


def paged_attention_int4_ref(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // k_group, 2] float16 (scale, min)
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // v_group, 2] float16 (scale, min)
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [N] int64
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    tree_mask: torch.Tensor | None = None,  # [N, W] int32 (tree_mask.py)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Pure-torch paged attention over an int4 cache: ``paged_attention_ref`` on dequantized pages."""
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         int4_layout)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_int4(_slots(k_cache, slots), _slots(k_scale, slots))
        v = dequantize_int4(_slots(v_cache, slots), _slots(v_scale, slots))
        return k, v

    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=layout.page_size, kv_heads=layout.kv_heads, gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes, tree_mask=tree_mask)


def paged_attention_fp8_triton(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                               positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None) -> torch.Tensor:
    """Triton paged attention over an fp8 cache; same contract as :func:`paged_attention_fp8_ref`.

    Requirements beyond the ref as for ``paged_attention_triton``: q contiguous in
    head_dim, block_tables contiguous in its last dim.
    """
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         fp8_layout)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    return launch_paged_attention(q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale,
                                  block_tables, seq_lens, query_start_loc, positions, scale, window, softcap,
                                  alibi_slopes, tree_mask, layout="fp8", page_size=layout.page_size, kv_heads=layout.kv_heads)


def paged_attention_int4_triton(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                               positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None) -> torch.Tensor:
    """Triton paged attention over an int4 cache; same contract as :func:`paged_attention_int4_ref`."""
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         int4_layout)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    return launch_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                                  positions, scale, window, softcap, alibi_slopes, tree_mask, layout="int4",
                                  page_size=layout.page_size, kv_heads=layout.kv_heads,
                                  k_group=layout.k_group, v_group=layout.v_group)


for _scheme in ("fp8", "int4"):
    register(f"paged_attention_{_scheme}", "reference", globals()[f"paged_attention_{_scheme}_ref"], ("cpu", "cuda"))
    register(f"paged_attention_{_scheme}", "triton", globals()[f"paged_attention_{_scheme}_triton"], ("cuda",),
             priority=10)
