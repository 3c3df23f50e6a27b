"""Causal paged attention over a quantized KV cache (fp8 or int4; layouts in ``quant.py``).

Same stream / position / block-table contract as ``paged_attention.py``; the cache is a
quantized layer cache ``(k_cache, v_cache, k_scale, v_scale)``. Dequantization happens
inside attention, on the pages that are read:

* ``paged_attention_{fp8,int4}_ref`` (the production CPU path) run the float
  reference's loop (:func:`paged_attention.attend_pages_ref`) with a gather that
  index-selects the slots a step reads, of data and params, and dequantizes just those to
  float32. The pool is never dequantized as a whole.
* ``paged_attention_{fp8,int4}_triton`` launch ``_quant_paged_attention_kernel``: the float
  kernel's structure (one program per (token, kv head), online softmax over ``BLOCK_N``-key
  tiles, GQA heads batched) with each K/V tile decoded in registers right after its load:
  e4m3 bits -> fp32 (exact integer decode) times the token's scale, or int4 nibbles ->
  ``code * scale + min`` per group. The two matmuls take operands in q's dtype (fp32
  products for fp32 q, tensor cores for bf16/fp16 q) and accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import (
    BLOCK_N,
    LOG2_E,
    MIN_BLOCK_G,
    attend_pages_ref,
    check_same_device,
    check_stream_args,
    check_variant,
    has_variant,
    token_seq_ids,
)
from .quant import QuantLayout, dequantize_fp8, dequantize_int4, fp8_layout, int4_layout
from .registry import register
from .triton_helpers import cast, check_launchable, dot, e4m3_from_bits, is_interpreted


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

    check_variant(q, window, softcap, alibi_slopes)
    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=layout.page_size, kv_heads=layout.kv_heads, gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes)


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
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Pure-torch paged attention over an int4 cache: ``paged_attention_ref`` on dequantized pages."""
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         int4_layout)

    def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = dequantize_int4(_slots(k_cache, slots), _slots(k_scale, slots))
        v = dequantize_int4(_slots(v_cache, slots), _slots(v_scale, slots))
        return k, v

    check_variant(q, window, softcap, alibi_slopes)
    return attend_pages_ref(q, block_tables, seq_lens, query_start_loc, positions, scale,
                            page_size=layout.page_size, kv_heads=layout.kv_heads, gather=gather,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes)


def paged_attention_fp8_triton(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                               positions, scale, window=0, softcap=0.0, alibi_slopes=None) -> torch.Tensor:
    """Triton paged attention over an fp8 cache; same contract as :func:`paged_attention_fp8_ref`.

    Requirements beyond the ref as for ``paged_attention_triton``: q contiguous in
    head_dim, block_tables contiguous in its last dim.
    """
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         fp8_layout)
    check_variant(q, window, softcap, alibi_slopes)
    if has_variant(window, softcap, alibi_slopes):
        raise NotImplementedError("the Triton kernels do not take window/softcap/alibi_slopes yet")
    return _launch(q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, block_tables,
                   seq_lens, query_start_loc, positions, scale, layout, int4=False)


def paged_attention_int4_triton(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
                               positions, scale, window=0, softcap=0.0, alibi_slopes=None) -> torch.Tensor:
    """Triton paged attention over an int4 cache; same contract as :func:`paged_attention_int4_ref`."""
    layout = _check_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions,
                         int4_layout)
    check_variant(q, window, softcap, alibi_slopes)
    if has_variant(window, softcap, alibi_slopes):
        raise NotImplementedError("the Triton kernels do not take window/softcap/alibi_slopes yet")
    return _launch(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, scale,
                   layout, int4=True)


def _launch(q, k_data, v_data, k_params, v_params, block_tables, seq_lens, query_start_loc, positions, scale,
            layout: QuantLayout, int4: bool) -> torch.Tensor:
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim (stride(-1) == 1)")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // layout.kv_heads
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    check_launchable(_quant_paged_attention_kernel, q.device)
    _quant_paged_attention_kernel[(num_tokens, layout.kv_heads)](
        out, q, k_data, v_data, k_params, v_params, block_tables, seq_lens, positions,
        token_seq_ids(query_start_loc, num_tokens),
        scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        layout.kv_heads,
        group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)),
        PAGE_SIZE=layout.page_size,
        BLOCK_N=BLOCK_N,
        INT4=int4,
        K_GROUP=layout.k_group,
        V_GROUP=layout.v_group,
        INTERPRETER=is_interpreted(_quant_paged_attention_kernel),
    )
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _quant_paged_attention_kernel(
    out_ptr, q_ptr,  # [N, H, D]
    k_cache_ptr, v_cache_ptr,  # [num_slots, KVH, ROW] uint8: ROW = D (e4m3 bits) or D // 2 (int4 nibbles)
    k_params_ptr, v_params_ptr,  # fp8: [num_slots, KVH] fp32 scale; int4: [num_slots, KVH, D // GROUP, 2] fp16
    block_tables_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    positions_ptr,  # [N]
    seq_ids_ptr,  # [N] int32
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_bt,
    kv_heads,
    group,  # G = H // KVH (runtime: all G <= BLOCK_G share one binary)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # next power of two >= max(G, 16)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key tokens per iteration
    INT4: tl.constexpr,  # False: fp8 e4m3 cache, True: int4 cache
    K_GROUP: tl.constexpr,  # int4: values per (scale, min) pair (ignored for fp8)
    V_GROUP: tl.constexpr,
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
    dot_ty = q_ptr.dtype.element_ty  # matmul operand dtype; accumulation is fp32

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_keys
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        rows = (block * PAGE_SIZE + offs_n % PAGE_SIZE) * kv_heads + kv_head  # (slot, kv head) rows, [BLOCK_N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if INT4:
            k = _load_int4_tile(k_cache_ptr, k_params_ptr, rows, offs_d, kv_mask, HEAD_DIM, K_GROUP)
            v = _load_int4_tile(v_cache_ptr, v_params_ptr, rows, offs_d, kv_mask, HEAD_DIM, V_GROUP)
        else:
            k = _load_fp8_tile(k_cache_ptr, k_params_ptr, rows, offs_d, kv_mask, mask_n, HEAD_DIM)
            v = _load_fp8_tile(v_cache_ptr, v_params_ptr, rows, offs_d, kv_mask, mask_n, HEAD_DIM)
        k = cast(k, dot_ty, INTERPRETER)
        v = cast(v, dot_ty, INTERPRETER)

        s = dot(q, tl.trans(k), INTERPRETER) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key, so m_new is finite and exp2(-inf) = 0 is safe.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(cast(p, dot_ty, INTERPRETER), v, INTERPRETER)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key (bad input): output 0, not NaN
    o = acc / l_i[:, None]
    o_off = tok * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    o = cast(o, out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + o_off, o, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _load_fp8_tile(data_ptr, scale_ptr, rows, offs_d, mask, mask_n, HEAD_DIM: tl.constexpr):
    """Dequantized fp8 rows ``[BLOCK_N, BLOCK_D]`` fp32: ``e4m3(bits) * scale[row]`` (masked lanes 0)."""
    bits = tl.load(data_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + rows, mask=mask_n, other=0.0)
    return e4m3_from_bits(bits) * scale[:, None]


@triton.jit
def _load_int4_tile(data_ptr, params_ptr, rows, offs_d, mask, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Dequantized int4 rows ``[BLOCK_N, BLOCK_D]`` fp32: ``code * scale + min`` of each value's group.

    Element ``d`` is nibble ``d % 2`` of byte ``d // 2``: each byte is loaded for both of its
    lanes (the second load hits the cache) rather than interleaving two half-width tiles.
    """
    byte = tl.load(data_ptr + rows[:, None] * (HEAD_DIM // 2) + (offs_d // 2)[None, :], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 15
    param = params_ptr + rows[:, None] * (HEAD_DIM // GROUP * 2) + (offs_d // GROUP * 2)[None, :]
    scale = tl.load(param, mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(param + 1, mask=mask, other=0.0).to(tl.float32)
    return code.to(tl.float32) * scale + mn


for _scheme in ("fp8", "int4"):
    register(f"paged_attention_{_scheme}", "reference", globals()[f"paged_attention_{_scheme}_ref"], ("cpu", "cuda"))
    register(f"paged_attention_{_scheme}", "triton", globals()[f"paged_attention_{_scheme}_triton"], ("cuda",),
             priority=10)
