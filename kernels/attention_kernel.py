"""The Triton paged-attention kernel: one online-softmax tile loop for every cache layout and variant.

Contract (stream, positions, block tables, GQA, variant): ``paged_attention.py``'s glossary.
:func:`launch_paged_attention` is the one launcher; ``paged_attention_triton`` (float caches)
and ``paged_attention_{fp8,int4}_triton`` (``quant_paged_attention.py``) validate their
arguments and call it.

Tile loop
---------
``paged_attention_kernel`` runs one program per (token, kv head). It loads that kv head's
``G`` query heads (padded to ``BLOCK_G >= 16`` rows for ``tl.dot``) and walks the token's
visible keys in ``BLOCK_N``-key tiles with an online softmax: base-2 logits, fp32 running
max, denominator and accumulator. Tiles may span pages: each key's block is looked up in the
block table, and a key is addressed as the row ``(block * PAGE_SIZE + offset) * kv_heads +
kv_head`` of its (contiguous) cache.

Cache layouts
-------------
``LAYOUT`` (constexpr) selects the tile loader; each returns a K or V tile
``[BLOCK_N, BLOCK_D]`` in the matmul operand dtype (masked lanes 0):

* ``"float"`` (fp32 / bf16 / fp16 caches): the tile as stored; the dots take operands in the
  cache dtype (q and the probabilities are rounded to it), as on bf16 / fp16 tensor cores.
* ``"fp8"``: e4m3 bits (``uint8``) decoded exactly, times the row's fp32 scale.
* ``"int4"``: two nibbles per byte, ``code * scale + min`` per group of ``K_GROUP`` / ``V_GROUP``
  values (fp16 params). Quantized tiles are dequantized to fp32, then cast to q's dtype: the
  dots take operands in q's dtype.
* ``MIXED`` (hot/cold caches, ``hot_cold.py``): the cold pages in ``"fp8"`` / ``"int4"`` plus hot
  pages in q's dtype; a key whose block id is below ``num_hot`` is read from the hot pages, the
  others from cold page ``id - num_hot``, under complementary masks of one tile.

Every dot accumulates in fp32; fp32 operands use exact products (no tf32). ``cast`` / ``dot``
(``triton_helpers.py``) keep the interpreter's numerics equal to the GPU's.

Variant
-------
``window`` (runtime) starts the first tile at the token's first visible key,
``position - window + 1``, so a windowed token costs O(window / BLOCK_N) tiles, not
O(position / BLOCK_N); the launcher passes ``NO_WINDOW`` for "no window". ``HAS_SOFTCAP`` (constexpr; ``softcap``
runtime) caps the scores at ``softcap * tanh(score / softcap)``; ``HAS_ALIBI`` (constexpr)
adds ``alibi_slopes[h] * (key - position)``. Order: scale, cap, bias, mask, softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_helpers import cast, check_launchable, dot, e4m3_from_bits, is_interpreted, tanh

# Key tokens per inner-loop iteration. Independent of page_size (each key's page is looked up),
# >= 16 for tl.dot. 64 keeps the interpreter fast.
BLOCK_N = 64
# tl.dot needs M >= 16 on NVIDIA: the G query heads of one kv head are padded to this.
MIN_BLOCK_G = 16
LOG2_E = tl.constexpr(math.log2(math.e))  # the softmax runs in base 2
NO_WINDOW = 2**31 - 1  # the kernel's window when there is none: every key 0..position is in it


def token_seq_ids(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [N] int32
    """``seq_ids[i]`` = sequence of stream token ``i`` (host-free: ``output_size`` avoids a sync)."""
    num_seqs = query_start_loc.shape[0] - 1
    return torch.repeat_interleave(
        torch.arange(num_seqs, device=query_start_loc.device, dtype=torch.int32),
        query_start_loc[1:] - query_start_loc[:-1],
        output_size=num_tokens,
    )


def launch_paged_attention(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,  # contiguous [num_blocks, page_size, kv_heads, row]: float, or fp8 / int4 bytes as uint8
    v_cache: torch.Tensor,
    k_params: torch.Tensor | None,  # quantized caches: k_scale / v_scale (quant.py); float: None
    v_params: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    tree_mask: torch.Tensor | None,  # [N, W] int32 (tree_mask.py) or None
    *,
    layout: str,  # the kernel's LAYOUT: "float", "fp8" or "int4"
    page_size: int,
    kv_heads: int,
    k_group: int = 0,  # int4: values per (scale, min) pair
    v_group: int = 0,
    hot: tuple[torch.Tensor, torch.Tensor] | None = None,  # hot/cold caches (hot_cold.py): (k_hot, v_hot)
) -> torch.Tensor:  # [N, num_heads, head_dim], q.dtype
    """Run :func:`paged_attention_kernel` on validated arguments (the callers check shapes, dtypes
    and the variant); raises ``ValueError`` for the launch requirements: q contiguous in
    head_dim, block_tables contiguous in its last dim."""
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim (stride(-1) == 1)")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    check_launchable(paged_attention_kernel, q.device)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    k_hot, v_hot = hot if hot is not None else (None, None)
    paged_attention_kernel[(num_tokens, kv_heads)](
        out, q, k_cache, v_cache, k_params, v_params, k_hot, v_hot, 0 if hot is None else k_hot.shape[0],
        block_tables, seq_lens, positions, token_seq_ids(query_start_loc, num_tokens),
        alibi_slopes, tree_mask, query_start_loc,
        0 if tree_mask is None else tree_mask.shape[1],
        scale * LOG2_E.value,
        softcap * LOG2_E.value,
        window if window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        kv_heads,
        group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)),
        PAGE_SIZE=page_size,
        BLOCK_N=BLOCK_N,
        LAYOUT=layout,
        K_GROUP=k_group,
        V_GROUP=v_group,
        HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_TREE=tree_mask is not None,
        MIXED=hot is not None,
        INTERPRETER=is_interpreted(paged_attention_kernel),
    )
    return out


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr,  # [N, H, D]
    k_cache_ptr, v_cache_ptr,  # (slot, kv head) rows: float [.., D]; fp8 [.., D] uint8; int4 [.., D // 2] uint8
    k_params_ptr, v_params_ptr,  # fp8: [slots, KVH] fp32 scale; int4: [slots, KVH, D // GROUP, 2] fp16; float: None
    k_hot_ptr, v_hot_ptr,  # MIXED: the hot pages [num_hot * PAGE_SIZE, KVH, D] in q's dtype; else None
    num_hot,  # MIXED: block ids below it are hot pages, the others cold page id - num_hot
    block_tables_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    positions_ptr,  # [N]
    seq_ids_ptr,  # [N] int32
    alibi_slopes_ptr,  # [H] fp32 (HAS_ALIBI) or None
    tree_mask_ptr,  # [N, tree_words] int32 ancestor bits (HAS_TREE) or None
    query_start_loc_ptr,  # [S + 1] (HAS_TREE: where the tree's nodes are in the stream)
    tree_words,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    softcap,  # soft cap * log2(e) (HAS_SOFTCAP)
    window,  # keys j > position - window are visible (NO_WINDOW: all)
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_bt,
    kv_heads,
    group,  # G = H // KVH (runtime: all G <= BLOCK_G share one binary)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # next power of two >= max(G, 16)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key tokens per iteration
    LAYOUT: tl.constexpr,  # "float", "fp8" or "int4": the tile loader
    K_GROUP: tl.constexpr,  # int4: values per (scale, min) pair (0 otherwise)
    V_GROUP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_TREE: tl.constexpr,  # new keys seen by the tree mask's bits, at their own positions
    MIXED: tl.constexpr,  # hot/cold cache (hot_cold.py): each key from the pool its block id names
    INTERPRETER: tl.constexpr,  # work around interpreter numerics (triton_helpers.py)
):
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + tok)
    pos = tl.load(positions_ptr + tok).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    key_start = tl.maximum(pos - window + 1, 0)  # visible keys: key_start <= j < key_end
    if HAS_TREE:  # keys up to the token's own cache index; base: the sequence's first new one (tree_mask.py)
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
        base = seq_len - (tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start)
        key_end = tl.minimum(base + tok - q_start + 1, seq_len)
    else:
        key_end = tl.minimum(pos + 1, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * group + offs_g
    if LAYOUT == "float":
        dot_ty = k_cache_ptr.dtype.element_ty  # dot in the cache dtype
    else:
        dot_ty = q_ptr.dtype.element_ty  # dequantized tiles join q's dtype
    q_off = tok * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    q = cast(q, dot_ty, INTERPRETER)
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + heads, mask=mask_g, other=0.0) * LOG2_E

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles start at key_start, not at a multiple of BLOCK_N (pages are looked up per key), so without a
    # tree each tile's first key is visible: m_new stays finite and exp2(-inf) = 0 is safe. No visible key
    # (bad input): no tile. A tree's tile may see no key: its max is taken as 0 (exp2(-inf - 0) = 0).
    for start in range(key_start, key_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        visible = offs_n < key_end
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
        tile_mask = visible[:, None] & mask_d[None, :]
        if MIXED:  # hot rows and cold rows under complementary masks, then one tile
            is_hot = block < num_hot
            hot_rows = (block * PAGE_SIZE + offs_n % PAGE_SIZE) * kv_heads + kv_head
            cold_block = tl.where(is_hot, 0, block - num_hot)
            rows = (cold_block * PAGE_SIZE + offs_n % PAGE_SIZE) * kv_heads + kv_head
            hot_mask = tile_mask & is_hot[:, None]
            cold_mask = tile_mask & (block >= num_hot)[:, None]
            cold_visible = visible & (block >= num_hot)
            k = _load_tile(k_cache_ptr, k_params_ptr, rows, offs_d, cold_mask, cold_visible, HEAD_DIM, K_GROUP,
                           LAYOUT, dot_ty, INTERPRETER)
            v = _load_tile(v_cache_ptr, v_params_ptr, rows, offs_d, cold_mask, cold_visible, HEAD_DIM, V_GROUP,
                           LAYOUT, dot_ty, INTERPRETER)
            k = tl.where(hot_mask, _load_float_tile(k_hot_ptr, hot_rows, offs_d, hot_mask, HEAD_DIM), k)
            v = tl.where(hot_mask, _load_float_tile(v_hot_ptr, hot_rows, offs_d, hot_mask, HEAD_DIM), v)
        else:
            rows = (block * PAGE_SIZE + offs_n % PAGE_SIZE) * kv_heads + kv_head  # [BLOCK_N]
            k = _load_tile(k_cache_ptr, k_params_ptr, rows, offs_d, tile_mask, visible, HEAD_DIM, K_GROUP, LAYOUT,
                           dot_ty, INTERPRETER)
            v = _load_tile(v_cache_ptr, v_params_ptr, rows, offs_d, tile_mask, visible, HEAD_DIM, V_GROUP, LAYOUT,
                           dot_ty, INTERPRETER)

        key_pos = offs_n
        if HAS_TREE:
            r = offs_n - base  # >= 0: the step's new key r, seen by bit r of the mask, at its token's position
            new = visible & (r >= 0)
            key_pos = tl.where(new, tl.load(positions_ptr + q_start + r, mask=new, other=0).to(tl.int32), offs_n)
            in_mask = new & (r < tree_words * 32)
            word = tl.load(tree_mask_ptr + tok.to(tl.int64) * tree_words + r // 32, mask=in_mask, other=-1)
            bit = ((word >> (r % 32)) & 1) != 0
            visible = visible & (bit | (r < 0)) & (key_pos <= pos) & (key_pos > pos - window)
        s = dot(q, tl.trans(k), INTERPRETER) * qk_scale  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        if HAS_ALIBI:
            s += slopes[:, None] * (key_pos - pos).to(tl.float32)[None, :]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
        if HAS_TREE:  # no key seen yet: exp2 against 0 (all terms are 0), m_i stays -inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(cast(p, dot_ty, INTERPRETER), v, INTERPRETER)
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key (bad input): output 0, not NaN
    o = acc / l_i[:, None]
    o_off = tok * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    o = cast(o, out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + o_off, o, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _load_tile(cache_ptr, params_ptr, rows, offs_d, mask, visible, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
               LAYOUT: tl.constexpr, dot_ty: tl.constexpr, INTERPRETER: tl.constexpr):
    """The K or V tile ``[BLOCK_N, BLOCK_D]`` of (slot, kv head) ``rows`` in ``dot_ty``, read by
    ``LAYOUT``'s loader (``mask``: lanes to read, others 0; ``visible``: the rows to read)."""
    if LAYOUT == "fp8":
        tile = _load_fp8_tile(cache_ptr, params_ptr, rows, offs_d, mask, visible, HEAD_DIM, dot_ty, INTERPRETER)
    elif LAYOUT == "int4":
        tile = _load_int4_tile(cache_ptr, params_ptr, rows, offs_d, mask, HEAD_DIM, GROUP, dot_ty, INTERPRETER)
    else:
        tile = _load_float_tile(cache_ptr, rows, offs_d, mask, HEAD_DIM)
    return tile


@triton.jit
def _load_float_tile(cache_ptr, rows, offs_d, mask, HEAD_DIM: tl.constexpr):
    """Float cache rows, as stored (the cache dtype is the dot dtype)."""
    return tl.load(cache_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _load_fp8_tile(data_ptr, scale_ptr, rows, offs_d, mask, visible, HEAD_DIM: tl.constexpr, dot_ty: tl.constexpr,
                   INTERPRETER: tl.constexpr):
    """fp8 rows dequantized to fp32, ``e4m3(bits) * scale[row]``, then cast to ``dot_ty``."""
    bits = tl.load(data_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + rows, mask=visible, other=0.0)
    return cast(e4m3_from_bits(bits) * scale[:, None], dot_ty, INTERPRETER)


@triton.jit
def _load_int4_tile(data_ptr, params_ptr, rows, offs_d, mask, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                    dot_ty: tl.constexpr, INTERPRETER: tl.constexpr):
    """int4 rows dequantized to fp32, ``code * scale + min`` of each value's group, then cast to ``dot_ty``.

    Element ``d`` is nibble ``d % 2`` of byte ``d // 2``: each byte is loaded for both of its
    lanes (the second load hits the cache) rather than interleaving two half-width tiles.
    """
    byte = tl.load(data_ptr + rows[:, None] * (HEAD_DIM // 2) + (offs_d // 2)[None, :], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 15
    param = params_ptr + rows[:, None] * (HEAD_DIM // GROUP * 2) + (offs_d // GROUP * 2)[None, :]
    scale = tl.load(param, mask=mask, other=0.0).to(tl.float32)
    mn = tl.load(param + 1, mask=mask, other=0.0).to(tl.float32)
    return cast(code.to(tl.float32) * scale + mn, dot_ty, INTERPRETER)
