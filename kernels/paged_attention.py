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
``paged_attention_triton`` launches ``_paged_attention_kernel``: one program per (token, kv head), handling that kv head's ``G`` query heads with an online softmax
over ``BLOCK_N``-token key tiles (tiles may span pages; each key's block is looked up
through the block table).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .attention_plan import attend, plan_for
from .registry import register
from .triton_helpers import cast, check_launchable, dot, is_interpreted

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Key tokens per inner-loop iteration of the Triton kernel. Independent of page_size
# (each key's page is looked up), >= 16 for tl.dot. 64 keeps the interpreter fast.
BLOCK_N = 64
# tl.dot needs M >= 16 on NVIDIA: the G query heads of one kv head are padded to this.
MIN_BLOCK_G = 16
LOG2_E = 1.4426950408889634


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


def check_variant(q: torch.Tensor, window: int, softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    """Validate the score modifiers (module glossary, "variant"); raises ``ValueError``."""
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
    check_variant(q, window, softcap, alibi_slopes)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select: ~5x faster than advanced indexing
        return k_cache.flatten(0, 1).index_select(0, slots), v_cache.flatten(0, 1).index_select(0, slots)

    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=k_cache.shape[1], kv_heads=k_cache.shape[2], gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes)


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
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """The math of :func:`paged_attention_ref` over K/V that ``gather`` fetches by slot.

    ``gather(slots) -> (k, v)``, each ``[len(slots), kv_heads, head_dim]`` (any float dtype;
    upcast to float32 here), where ``slots`` ([n] int64) are flat cache slots
    ``block * page_size + offset``. A cache layout plugs in only its gather (e.g. a
    dequantizing one), so it touches the slots of the batch, never the whole pool. The
    metadata-only work (slots, masks) is planned once per step (``attention_plan.py``).
    Arguments are assumed validated by the caller.
    """
    plan = plan_for(block_tables, seq_lens, query_start_loc, positions, page_size, q.shape[1] // kv_heads, window)
    return attend(q, plan, gather, kv_heads, scale, softcap, alibi_slopes)


def token_seq_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [N] int32
    """``seq_ids[i]`` = sequence of stream token ``i`` (host-free: ``output_size`` avoids a sync)."""
    num_seqs = query_start_loc.shape[0] - 1
    return torch.repeat_interleave(
        torch.arange(num_seqs, device=query_start_loc.device, dtype=torch.int32),
        query_start_loc[1:] - query_start_loc[:-1],
        output_size=num_tokens,
    )


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
    check_variant(q, window, softcap, alibi_slopes)
    if has_variant(window, softcap, alibi_slopes):
        raise NotImplementedError("the Triton kernels do not take window/softcap/alibi_slopes yet")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim (stride(-1) == 1)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    check_launchable(_paged_attention_kernel, q.device)
    seq_ids = token_seq_ids(query_start_loc, num_tokens)
    _paged_attention_kernel[(num_tokens, kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, positions, seq_ids,
        scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)),
        PAGE_SIZE=page_size,
        BLOCK_N=BLOCK_N,
        INTERPRETER=is_interpreted(_paged_attention_kernel),
    )
    return out


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr,  # [N, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, PAGE_SIZE, KVH, D], contiguous
    block_tables_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    positions_ptr,  # [N]
    seq_ids_ptr,  # [N] int32
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_cache_block, stride_cache_page, stride_cache_head,  # same for k and v caches
    stride_bt,
    group,  # G = H // KVH (runtime: all G <= BLOCK_G share one binary)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # next power of two >= max(G, 16)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key tokens per iteration
    INTERPRETER: tl.constexpr,  # work around interpreter numerics (triton_helpers.py)
):
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + tok)
    pos = tl.load(positions_ptr + tok).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    num_keys = tl.minimum(pos + 1, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * group + offs_g
    q_off = tok * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    q = cast(q, k_cache_ptr.dtype.element_ty, INTERPRETER)  # dot in the cache dtype, accumulate in fp32

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_keys
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        kv_off = (block * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_page
                  + kv_head * stride_cache_head)
        kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)

        s = dot(q, tl.trans(k), INTERPRETER) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key, so m_new is finite and exp2(-inf) = 0 is safe.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERPRETER), v, INTERPRETER)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key (bad input): output 0, not NaN
    o = acc / l_i[:, None]
    o_off = tok * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    o = cast(o, out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + o_off, o, mask=mask_g[:, None] & mask_d[None, :])


register("paged_attention", "reference", paged_attention_ref, ("cpu", "cuda"))
register("paged_attention", "triton", paged_attention_triton, ("cuda",), priority=10)
