"""``specgraph::`` custom ops over the quantized-cache kernels, with fake impls for torch.compile.

One write op and one attention op per scheme in ``quant.QUANT_SCHEMES``; the signatures
are the float ops' (``ops.py``) with ``k_scale, v_scale`` after ``v_cache``:

* ``torch.ops.specgraph.cache_write_fp8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None``
* ``torch.ops.specgraph.paged_attention_fp8(q, k_cache, v_cache, k_scale, v_scale, block_tables,
  seq_lens, query_start_loc, positions, scale, window=0, softcap=0.0, alibi_slopes=None) -> Tensor``
* ``torch.ops.specgraph.cache_write_int4(...)`` / ``torch.ops.specgraph.paged_attention_int4(...)``:
  same arguments, int4 layout.
* ``torch.ops.specgraph.paged_attention_mixed(q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale,
  block_tables, ...)``: attention over a hot/cold cache (``hot_cold.py``): float hot pages and
  fp8 / int4 cold pages in one block-id space; writes go to the hot pages with ``cache_write``.
* ``torch.ops.specgraph.quant_linear(x, weight, scales, bias, scheme) -> Tensor``: a linear over
  quantized weights (int8, int4, fp8, bfloat16; formats in ``quant_linear.py``).

The writes mutate the caches *and* the scale tensors. Each body hands the call to
``registry.dispatch`` (Triton on CUDA or when forced, else the torch reference).
"""

from __future__ import annotations

import torch

from . import quant_cache_write as _w  # noqa: F401  (each kernel module registers its implementations)
from . import hot_cold as _h  # noqa: F401
from . import quant_linear as _l  # noqa: F401
from . import quant_linear_triton as _lt  # noqa: F401
from . import quant_paged_attention as _a  # noqa: F401
from .registry import dispatch

_WRITE_MUTATES = ("k_cache", "v_cache", "k_scale", "v_scale")


@torch.library.custom_op("specgraph::cache_write_fp8", mutates_args=_WRITE_MUTATES)
def cache_write_fp8(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Quantize ``k``/``v`` to fp8 into the cache at ``slot_mapping`` (see ``quant_cache_write.py``)."""
    dispatch("cache_write_fp8", k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


@torch.library.custom_op("specgraph::cache_write_int4", mutates_args=_WRITE_MUTATES)
def cache_write_int4(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // k_group, 2] float16
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // v_group, 2] float16
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Quantize ``k``/``v`` to int4 into the cache at ``slot_mapping`` (see ``quant_cache_write.py``)."""
    dispatch("cache_write_int4", k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


@cache_write_fp8.register_fake
def _cache_write_fp8_fake(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    return None


@cache_write_int4.register_fake
def _cache_write_int4_fake(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    return None


@torch.library.custom_op("specgraph::paged_attention_fp8", mutates_args=())
def paged_attention_fp8(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32
    v_scale: torch.Tensor,
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
    """Causal paged attention over an fp8 cache, with the score modifiers (see ``quant_paged_attention.py``)."""
    return dispatch("paged_attention_fp8", q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                    query_start_loc, positions, scale, window, softcap, alibi_slopes, tree_mask)


@torch.library.custom_op("specgraph::paged_attention_int4", mutates_args=())
def paged_attention_int4(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // k_group, 2] float16
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // v_group, 2] float16
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
    """Causal paged attention over an int4 cache, with the score modifiers (see ``quant_paged_attention.py``)."""
    return dispatch("paged_attention_int4", q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                    query_start_loc, positions, scale, window, softcap, alibi_slopes, tree_mask)


@paged_attention_fp8.register_fake
def _paged_attention_fp8_fake(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                              positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None):
    return q.new_empty(q.shape)


@paged_attention_int4.register_fake
def _paged_attention_int4_fake(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                               positions, scale, window=0, softcap=0.0, alibi_slopes=None, tree_mask=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("specgraph::paged_attention_mixed", mutates_args=())
def paged_attention_mixed(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_hot: torch.Tensor,  # [num_hot, page_size, kv_heads, head_dim] float: block ids < num_hot
    v_hot: torch.Tensor,
    k_cold: torch.Tensor,  # [num_cold, page_size, kv_heads, ...] fp8 / int4 (quant.py): ids >= num_hot
    v_cold: torch.Tensor,
    k_scale: torch.Tensor,  # the cold pages' params
    v_scale: torch.Tensor,
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
    """Causal paged attention over a hot/cold cache: hot pages as stored, cold ones dequantized (``hot_cold.py``)."""
    return dispatch("paged_attention_mixed", q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables,
                    seq_lens, query_start_loc, positions, scale, window, softcap, alibi_slopes, tree_mask)


@paged_attention_mixed.register_fake
def _paged_attention_mixed_fake(q, k_hot, v_hot, k_cold, v_cold, k_scale, v_scale, block_tables, seq_lens,
                                query_start_loc, positions, scale, window=0, softcap=0.0, alibi_slopes=None,
                                tree_mask=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("specgraph::quant_linear", mutates_args=())
def quant_linear(
    x: torch.Tensor,  # [..., K] float
    weight: torch.Tensor,  # [N, K] (int4: [N, K // 2]) in the scheme's storage dtype
    scales: torch.Tensor | None,  # int8/fp8: float32 [N]; int4: float16 [N, K // group, 2]; bfloat16: None
    bias: torch.Tensor | None,  # [N]
    scheme: str,  # "int8", "int4", "fp8" or "bfloat16"
) -> torch.Tensor:  # [..., N], x.dtype
    """``x @ W.T + bias`` with ``W`` stored quantized (see ``quant_linear.py``)."""
    return dispatch("quant_linear", x, weight, scales, bias, scheme)


@quant_linear.register_fake
def _quant_linear_fake(x, weight, scales, bias, scheme):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
