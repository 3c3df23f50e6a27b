"""Causal attention of a flat token stream over the paged KV cache.

Glossary
--------
stream
    the ``N`` query tokens of one step, from ``S`` sequences; the tokens of sequence
    ``s`` are ``q[query_start_loc[s]:query_start_loc[s + 1]]`` (possibly none).
position
    ``positions[i]`` is token ``i``'s index within its sequence. Token ``i`` attends to
    keys ``0..positions[i]`` (inclusive) of its own sequence, capped at
    ``seq_lens[s] - 1``. This covers prefill, chunked prefill (positions start > 0),
    decode (one token at ``seq_len - 1``) and speculative verification (a few tokens).
variant
    three optional score modifiers every attention kernel takes (``check_variant``):
    ``window > 0``, a sliding window: token ``i`` sees only keys ``j > positions[i] - window``
    (Mistral, Gemma 2's local layers); ``softcap > 0``: scores become
    ``softcap * tanh(score / softcap)`` (Gemma 2); ``alibi_slopes [num_heads]``: head ``h``'s
    score gains ``alibi_slopes[h] * (j - positions[i])`` (ALiBi, Bloom). Order: scale, cap,
    bias, mask, softmax.
block table
    ``block_tables[s, j]`` is the cache block holding positions
    ``j * page_size .. (j + 1) * page_size - 1`` of sequence ``s``; blocks may be shared
    between rows (prefix caching).
GQA
    query head ``h`` uses kv head ``h // G`` with ``G = num_heads // kv_heads``.

``paged_attention_ref`` is the pure-torch reference, and the CPU path wherever the C++ kernel of
``cpu_kernels.py`` does not pay: a few gathers and SDPA calls per step (``attention_plan.py``).
``paged_attention_triton`` checks the arguments and launches the one Triton attention kernel
(``attention_kernel.py``) with its float-cache tile loader: one program per (token, kv head),
handling that kv head's ``G`` query heads with an online softmax over ``BLOCK_N``-token key
tiles (tiles may span pages; each key's block is looked up through the block table), the
variant included. The quantized caches (``quant_paged_attention.py``) plug their own loaders
into the same kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention_kernel import launch_paged_attention
from .attention_plan import attend, plan_for
from .registry import register
from .tree_mask import check_tree_mask

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_stream_args(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    kv_heads: int,
    head_dim: int,
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    positions: torch.Tensor,  # [N]
) -> None:
    """Validate the query stream and its batch metadata against a cache of ``kv_heads`` x ``head_dim``.

    Shared by every paged-attention flavour (plain and quantized caches); raises
    ``ValueError`` naming the bad argument. Cache layouts are checked by the callers.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, num_heads, head_dim]; got {tuple(q.shape)}")
    num_tokens, num_heads, q_head_dim = q.shape
    if head_dim != q_head_dim:
        raise ValueError(f"cache head_dim {head_dim} != q head_dim {q_head_dim}")
    if num_heads % kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of kv_heads {kv_heads}")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point; got {q.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks]; got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [S={num_seqs}]; got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [S+1={num_seqs + 1}]; got {tuple(query_start_loc.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [N={num_tokens}]; got {tuple(positions.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("positions", positions)):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")


def check_same_device(*tensors: torch.Tensor) -> None:
    """``ValueError`` unless every tensor is on one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def check_variant(q: torch.Tensor, window: int, softcap: float, alibi_slopes: torch.Tensor | None,
                  tree_mask: torch.Tensor | None = None) -> None:
    """Validate the score modifiers (module glossary, "variant") and the tree mask; raises ``ValueError``."""
    check_tree_mask(q, tree_mask)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no sliding window); got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-capping); got {softcap}")
    if alibi_slopes is not None:
        if alibi_slopes.shape != (q.shape[1],) or not alibi_slopes.is_floating_point():
            raise ValueError(f"alibi_slopes must be float [num_heads={q.shape[1]}]; got "
                             f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        check_same_device(q, alibi_slopes)


def has_variant(window: int, softcap: float, alibi_slopes: torch.Tensor | None) -> bool:
    """Whether any score modifier is on (kernels without them decline such calls)."""
    return window > 0 or softcap > 0 or alibi_slopes is not None


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions) -> None:
    """Validate shapes/dtypes/devices; raises ``ValueError`` naming the bad argument."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, page_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_stream_args(q, k_cache.shape[2], k_cache.shape[3], block_tables, seq_lens, query_start_loc, positions)
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"cache dtype must be one of {CACHE_DTYPES} (same for k and v); got {k_cache.dtype}, {v_cache.dtype}"
        )
    check_same_device(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions)


def paged_attention_ref(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, cached tokens per sequence (new ones included)
    query_start_loc: torch.Tensor,  # [S + 1] int32, cumulative query counts
    positions: torch.Tensor,  # [N] int64, position of each query token in its sequence
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    tree_mask: torch.Tensor | None = None,  # [N, W] int32 (tree_mask.py)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Pure-torch paged attention, computed in float32 (the reference; see ``cpu_kernels.py`` for
    the CPU dispatch).

    Decodes and short verifies of all sequences: one gather of their cache slots and one
    padded ``F.scaled_dot_product_attention`` call; each long prefill chunk: its own call.
    The query heads of each kv head are folded into the query-length dim (no K/V expansion
    for GQA). Plain decodes of equal-length sequences need no mask. The loop is
    :func:`attend_pages_ref`, shared with the quantized caches (``quant_paged_attention.py``).

    Example
    -------
    >>> kc = torch.randn(4, 8, 1, 32); vc = torch.randn_like(kc)
    >>> q = torch.randn(3, 2, 32)   # 3 tokens of one sequence, 2 heads, 1 kv head
    >>> out = paged_attention_ref(q, kc, vc, torch.tensor([[2, 0]], dtype=torch.int32),
    ...     torch.tensor([10], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
    ...     torch.tensor([7, 8, 9]), 32 ** -0.5)
    >>> out.shape
    torch.Size([3, 2, 32])
    """
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select: ~5x faster than advanced indexing
        return k_cache.flatten(0, 1).index_select(0, slots), v_cache.flatten(0, 1).index_select(0, slots)

    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=k_cache.shape[1], kv_heads=k_cache.shape[2], gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes, tree_mask=tree_mask)


def attend_pages_ref(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    positions: torch.Tensor,  # [N]
    scale: float,
    *,
    page_size: int,
    kv_heads: int,
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """The math of :func:`paged_attention_ref` over K/V that ``gather`` fetches by slot.

    ``gather(slots) -> (k, v)``, each ``[len(slots), kv_heads, head_dim]`` (any float dtype;
    upcast to float32 here), where ``slots`` ([n] int64) are flat cache slots
    ``block * page_size + offset``. A cache layout plugs in only its gather (e.g. a
    dequantizing one), so it touches the slots of the batch, never the whole pool. The
    metadata-only work (slots, masks) is planned once per step (``attention_plan.py``).
    Arguments are assumed validated by the caller.
    """
    plan = plan_for(block_tables, seq_lens, query_start_loc, positions, page_size, q.shape[1] // kv_heads, window,
                    tree_mask)
    return attend(q, plan, gather, kv_heads, scale, softcap, alibi_slopes)


def paged_attention_triton(
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
    alibi_slopes: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Triton paged attention; same contract as :func:`paged_attention_ref`.

    Requirements beyond the ref: q contiguous in head_dim, caches contiguous,
    block_tables contiguous in its last dim. ``positions[i] < seq_lens[s]`` is assumed
    (the kernel caps the key range at ``seq_lens[s]`` regardless).

    Numerics: softmax and accumulation in fp32; the two matmuls take operands in the
    cache dtype (q and the probabilities are rounded to it), as on bf16/fp16 tensor
    cores; fp32 caches use exact fp32 products (no tf32).
    """
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions)
    check_variant(q, window, softcap, alibi_slopes, tree_mask)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _, page_size, kv_heads, _ = k_cache.shape
    return launch_paged_attention(q, k_cache, v_cache, None, None, block_tables, seq_lens, query_start_loc,
                                  positions, scale, window, softcap, alibi_slopes, tree_mask,
                                  layout="float", page_size=page_size, kv_heads=kv_heads)


register("paged_attention", "reference", paged_attention_ref, ("cpu", "cuda"))
register("paged_attention", "triton", paged_attention_triton, ("cuda",), priority=10)
