"""Write new keys/values into a quantized paged KV cache (fp8 or int4; layouts in ``quant.py``).

Same slot contract as ``cache_write.py`` (``slot = block * page_size + offset``, negative
slots are padding and are skipped), plus the ``k_scale`` / ``v_scale`` parameter tensors,
written at the same slots. Every (token, kv head) row is quantized from its own values
only, so a write never reads the cache.

``cache_write_{fp8,int4}_ref`` are the pure-torch implementations (the production CPU
path); ``cache_write_{fp8,int4}_triton`` launch one program per (token, kv head) that
quantizes the K row and the V row. Both are bit-exact with the references, on every
backend: the kernels do the same fp32 operations with correctly rounded divisions
(``tl.div_rn``, where ``/`` would be approximate on NVIDIA), round to integers and to fp8
on the fp32 bits, and store e4m3 as ``uint8`` bits (``triton_helpers.e4m3_to_bits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write import check_token_args, drop_padding
from .registry import register
from .quant import (
    FP8_MAX,
    FP16_MAX,
    INT4_MAX_CODE,
    QuantLayout,
    fp8_layout,
    int4_layout,
    quantize_fp8,
    quantize_int4,
)
from .triton_helpers import check_launchable, e4m3_to_bits

# @triton.jit code may only read globals that are tl.constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP16_MAX = tl.constexpr(FP16_MAX)
_INT4_MAX_CODE = tl.constexpr(float(INT4_MAX_CODE))


def _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, layout_fn) -> QuantLayout:
    layout = layout_fn(k_cache, v_cache, k_scale, v_scale)
    check_token_args(k, v, layout.kv_heads, layout.head_dim, slot_mapping)
    devices = {t.device for t in (k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    return layout


def _slot_rows(t: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_size, ...]`` -> ``[num_slots, ...]`` (a view: slots index dim 0)."""
    return t.view(-1, *t.shape[2:])


def cache_write_fp8_ref(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn, written in place
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim] float8_e4m3fn, written in place
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32, written in place
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads] float32, written in place
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Pure-torch fp8 cache write: ``quantize_fp8`` each (token, kv head) row into its slot.

    Example
    -------
    >>> from specgraph.kernels.quant import allocate_fp8
    >>> c = allocate_fp8(2, 4, 1, 2)
    >>> cache_write_fp8_ref(torch.tensor([[[1.0, -4.0]]]), torch.zeros(1, 1, 2), *c.tensors(), torch.tensor([5]))
    >>> c.k_cache[1, 1].float().tolist(), c.k_scale[1, 1].tolist()
    ([[112.0, -448.0]], [0.008928571827709675])
    """
    _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, fp8_layout)
    slots, k, v = drop_padding(slot_mapping, k, v)
    for x, data, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize_fp8(x)
        # index_copy_ has no fp8 kernel on CPU: copy the bytes.
        _slot_rows(data.view(torch.uint8)).index_copy_(0, slots, q.view(torch.uint8))
        _slot_rows(scale).index_copy_(0, slots, s)


def cache_write_int4_ref(
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8, written in place
    v_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // 2] uint8, written in place
    k_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // k_group, 2] float16 (scale, min)
    v_scale: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim // v_group, 2] float16 (scale, min)
    slot_mapping: torch.Tensor,  # [N] int64, < 0 = skip
) -> None:
    """Pure-torch int4 cache write: ``quantize_int4`` each row (groups read from the params' shapes)."""
    layout = _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, int4_layout)
    slots, k, v = drop_padding(slot_mapping, k, v)
    for x, data, params, group in ((k, k_cache, k_scale, layout.k_group), (v, v_cache, v_scale, layout.v_group)):
        packed, p = quantize_int4(x, group)
        _slot_rows(data).index_copy_(0, slots, packed)
        _slot_rows(params).index_copy_(0, slots, p)


def cache_write_fp8_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Triton fp8 cache write; same contract as :func:`cache_write_fp8_ref`, bit-exact with it.

    ``k``/``v`` may be strided but their last dim must be contiguous.
    """
    layout = _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, fp8_layout)
    _check_rows(k, v)
    if k.shape[0] == 0:
        return
    check_launchable(_cache_write_fp8_kernel, k.device)
    _cache_write_fp8_kernel[(k.shape[0], layout.kv_heads)](
        k, v, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layout.kv_heads,
        HEAD_DIM=layout.head_dim,
        BLOCK_D=triton.next_power_of_2(layout.head_dim),
    )


def cache_write_int4_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Triton int4 cache write; same contract as :func:`cache_write_int4_ref`, bit-exact with it."""
    layout = _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, int4_layout)
    _check_rows(k, v)
    if k.shape[0] == 0:
        return
    check_launchable(_cache_write_int4_kernel, k.device)
    d = layout.head_dim
    _cache_write_int4_kernel[(k.shape[0], layout.kv_heads)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layout.kv_heads,
        HEAD_DIM=d,
        K_GROUP=layout.k_group,
        V_GROUP=layout.v_group,
        BLOCK_KG=triton.next_power_of_2(d // layout.k_group),
        BLOCK_VG=triton.next_power_of_2(d // layout.v_group),
    )


def _check_rows(k: torch.Tensor, v: torch.Tensor) -> None:
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in head_dim (stride(-1) == 1)")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _cache_write_fp8_kernel(
    k_ptr, v_ptr,  # [N, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [num_slots, KVH, D] uint8 (e4m3 bits), contiguous
    k_scale_ptr, v_scale_ptr,  # [num_slots, KVH] fp32, contiguous
    slot_mapping_ptr,  # [N]
    stride_kn, stride_kh, stride_vn, stride_vh,
    kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    valid = slot >= 0  # a negative slot is padding: every store below is masked off
    row = slot * kv_heads + head  # (slot, head) row of the contiguous data and scale tensors
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < tl.where(valid, HEAD_DIM, 0)  # one comparison: the interpreter rejects block & scalar masks
    _quantize_fp8_row(k_ptr + tok * stride_kn + head * stride_kh, k_cache_ptr + row * HEAD_DIM, k_scale_ptr + row,
                      offs_d, mask, valid)
    _quantize_fp8_row(v_ptr + tok * stride_vn + head * stride_vh, v_cache_ptr + row * HEAD_DIM, v_scale_ptr + row,
                      offs_d, mask, valid)


@triton.jit
def _quantize_fp8_row(src_ptr, dst_ptr, scale_ptr, offs_d, mask, valid):
    """``quantize_fp8`` of one row: scale = amax / 448 (1 if 0), bits = e4m3(x / scale)."""
    x = tl.load(src_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.div_rn(amax, tl.full([], _FP8_MAX, tl.float32))
    scale = tl.where(scale > 0.0, scale, 1.0)
    tl.store(dst_ptr + offs_d, e4m3_to_bits(tl.div_rn(x, scale)), mask=mask)
    tl.store(scale_ptr, scale, mask=valid)


@triton.jit
def _cache_write_int4_kernel(
    k_ptr, v_ptr,  # [N, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [num_slots, KVH, D // 2] uint8, contiguous
    k_params_ptr, v_params_ptr,  # [num_slots, KVH, D // GROUP, 2] fp16 (scale, min), contiguous
    slot_mapping_ptr,  # [N]
    stride_kn, stride_kh, stride_vn, stride_vh,
    kv_heads,
    HEAD_DIM: tl.constexpr,
    K_GROUP: tl.constexpr,  # values per (scale, min) pair, a power of two
    V_GROUP: tl.constexpr,
    BLOCK_KG: tl.constexpr,  # next power of two >= HEAD_DIM // K_GROUP
    BLOCK_VG: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    valid = slot >= 0
    row = slot * kv_heads + head
    _quantize_int4_row(k_ptr + tok * stride_kn + head * stride_kh, k_cache_ptr + row * (HEAD_DIM // 2),
                       k_params_ptr + row * (HEAD_DIM // K_GROUP * 2), valid, HEAD_DIM, K_GROUP, BLOCK_KG)
    _quantize_int4_row(v_ptr + tok * stride_vn + head * stride_vh, v_cache_ptr + row * (HEAD_DIM // 2),
                       v_params_ptr + row * (HEAD_DIM // V_GROUP * 2), valid, HEAD_DIM, V_GROUP, BLOCK_VG)


@triton.jit
def _quantize_int4_row(src_ptr, dst_ptr, params_ptr, valid,
                       HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """``quantize_int4`` of one row, as a ``[groups, GROUP // 2]`` tile of (even, odd) element pairs."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, GROUP // 2)
    mask_g = offs_g < tl.where(valid, HEAD_DIM // GROUP, 0)
    mask = mask_g[:, None] & (offs_j[None, :] < GROUP // 2)
    even = offs_g[:, None] * GROUP + 2 * offs_j[None, :]
    x0 = tl.load(src_ptr + even, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(src_ptr + even + 1, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.minimum(tl.maximum(x0, -_FP16_MAX), _FP16_MAX)
    x1 = tl.minimum(tl.maximum(x1, -_FP16_MAX), _FP16_MAX)
    lo = tl.minimum(tl.min(x0, axis=1), tl.min(x1, axis=1))
    hi = tl.maximum(tl.max(x0, axis=1), tl.max(x1, axis=1))
    min16 = _fp16_round_down(lo)
    scale16 = _fp16_round_up(tl.div_rn(hi - min16.to(tl.float32), tl.full([BLOCK_G], _INT4_MAX_CODE, tl.float32)))
    mn = min16.to(tl.float32)[:, None]
    scale = scale16.to(tl.float32)[:, None]
    packed = _int4_code(x0, mn, scale) | (_int4_code(x1, mn, scale) << 4)
    tl.store(dst_ptr + offs_g[:, None] * (GROUP // 2) + offs_j[None, :], packed, mask=mask)
    tl.store(params_ptr + 2 * offs_g, scale16, mask=mask_g)
    tl.store(params_ptr + 2 * offs_g + 1, min16, mask=mask_g)


@triton.jit
def _int4_code(x, mn, scale):
    """``clamp(round_half_even((x - mn) / scale), 0, 15)`` as uint8.

    ``scale == 0`` only for a group that is constant up to fp32 underflow: dividing by 1
    then gives code 0, as in the reference.
    """
    y = tl.div_rn(x - mn, tl.where(scale > 0.0, scale, 1.0))
    y = (y + 8388608.0) - 8388608.0  # 2**23: the fp32 addition rounds 0 <= y < 2**22 to an integer, ties to even
    return tl.minimum(tl.maximum(y, 0.0), _INT4_MAX_CODE).to(tl.uint8)


@triton.jit
def _fp16_round_down(x):
    """fp32 -> the largest fp16 <= x (|x| <= 65504): round to nearest, then step down if that went up."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    up = h.to(tl.float32) > x
    bits = tl.where(up & (h > 0), bits - 1, tl.where(up & (h < 0), bits + 1, tl.where(up, -32767, bits)))
    return bits.to(tl.int16).to(tl.float16, bitcast=True)  # -32767 = 0x8001 = -2**-24


@triton.jit
def _fp16_round_up(x):
    """fp32 ``x >= 0`` -> the smallest fp16 >= x (x <= 65504)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(h.to(tl.float32) < x, bits + 1, bits)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


for _scheme in ("fp8", "int4"):
    register(f"cache_write_{_scheme}", "reference", globals()[f"cache_write_{_scheme}_ref"], ("cpu", "cuda"))
    register(f"cache_write_{_scheme}", "triton", globals()[f"cache_write_{_scheme}_triton"], ("cuda",), priority=10)
