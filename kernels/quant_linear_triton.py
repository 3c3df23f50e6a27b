"""The Triton implementation of ``specgraph::quant_linear`` (formats and contract: ``quant_linear.py``).

``y[M, N] = x[M, K] @ W.T + bias``, ``W`` stored as int8, int4, fp8 or bfloat16, float32
accumulation, ``y`` in ``x``'s dtype. :func:`quant_linear_triton` flattens ``x`` to ``[M, K]``
and launches :func:`quant_linear_kernel`, one kernel whose ``SCHEME`` constexpr selects the
weight decoder.

Tiling
------
One program per ``[BLOCK_M, BLOCK_N]`` output tile, walking K in ``BLOCK_K``-column steps
(``BLOCK_N = BLOCK_K = 64``). ``BLOCK_M`` is 16 (``tl.dot``'s minimum on NVIDIA) for decode-sized
inputs (``M <= 16``; the rows are padded and masked) and 64 above, where a taller tile reads
each weight tile for more rows. The weight tile is loaded as ``[BLOCK_K, BLOCK_N]`` (rows of
``W`` are contiguous in K) and decoded in registers right after its load, so the weight is read
once per M-tile in its stored width and never materialized in float.

Scale factoring
---------------
Every scale that is constant along K for a whole dot is applied to the dot's result instead of
to its operands, so the weight operands are exactly representable:

* int8, fp8, bfloat16 (weight-only; x stays float): the weight codes are exact in bfloat16
  (int8 codes ``-127..127``, loaded as ``int8`` and widened through fp32; e4m3 bits loaded as
  ``uint8`` and decoded exactly by ``triton_helpers.e4m3_from_bits``, the interpreter's fp8
  conversions being wrong; bfloat16 as is), so the dot takes x and the weight in x's dtype:
  bf16 tensor cores for bf16 x (exact products), fp32 ("ieee", not tf32) products for fp32 x.
  int8 / fp8: the per-channel scale multiplies ``acc`` once at the end.
* int4 (activations fake-quantized, ``quant_linear.fake_quantize_activations``): each
  ``BLOCK_K`` step is split into ``BLOCK_K // 32`` activation blocks (``BLOCK_K`` is a multiple
  of 32 so blocks never straddle a step). Per block and row: ``amax``, ``inv = 127 / amax``
  (0 for a zero block), ``code = rne(x * inv)`` clamped to +-127 and ``step = amax / 127``, the
  reference's fp32 operations: both divisions correctly rounded (``tl.div_rn``; ``/`` is
  approximate on NVIDIA), ``inv`` in ONE rounding like the reference's ``full(127).div(amax)``
  (``reciprocal(amax) * 127`` differs in the last bit for some amax values and flips codes at
  near-ties), so the codes are the reference's codes bit for bit.

  The int8 activation codes and the weight nibbles (``0..15``) are integers that bfloat16 holds
  exactly, so ONE bf16 tensor-core dot per block gives the exact code dot product ``D``
  (``|D| <= 32 * 127 * 15 < 2**24``: every partial sum is exact whatever the accumulation
  order), whatever x's dtype. ``w = code * scale + min`` per group of ``g`` (32 or 64, so one
  32-column block lies in one group), hence ``sum_k xq_k w_k = step * (scale * D + min *
  sum_k code_x_k)`` (the code sum, ``<= 32 * 127``, is exact).

So the kernel computes the reference's real numbers up to fp32 rounding of the sums and of
the factored scales. ``triton_helpers.dot`` / ``cast`` keep the interpreter's numerics equal to
the GPU's. Offsets into the weight, its params and x are 64-bit (an lm_head's ``N * K`` can
pass ``2**31``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .quant_linear import ACT_BLOCK, ACT_MAX, check_quant_linear_args, weight_shape
from .registry import register
from .triton_helpers import cast, check_launchable, dot, e4m3_from_bits, is_interpreted

BLOCK_N = 64  # output channels per program
BLOCK_K = 64  # input columns per K step: a multiple of ACT_BLOCK
BLOCK_MS = (16, 64)  # rows per program: decode-sized inputs (M <= 16) and larger ones
assert BLOCK_K % ACT_BLOCK == 0

# @triton.jit code may only read globals that are tl.constexpr.
_ACT_BLOCK = tl.constexpr(ACT_BLOCK)
_ACT_MAX = tl.constexpr(float(ACT_MAX))


def block_m(m: int) -> int:
    """The ``BLOCK_M`` the launcher uses for ``m`` rows (one of :data:`BLOCK_MS`)."""
    return BLOCK_MS[0] if m <= BLOCK_MS[0] else BLOCK_MS[1]


def quant_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                        bias: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """Triton ``specgraph::quant_linear``; same contract as ``quant_linear.quant_linear_ref``.

    ``x [..., K]`` -> ``y [..., N]`` in ``x``'s dtype. ``weight`` / ``scales`` are made contiguous
    and ``x`` contiguous in K if they are not (copies); ``bias`` is read as float32.
    """
    check_quant_linear_args(x, weight, scales, bias, scheme)
    n, k = weight_shape(weight, scheme)
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    check_launchable(quant_linear_kernel, x.device)
    weight = weight.contiguous()
    if scheme == "fp8":
        weight = weight.view(torch.uint8)  # e4m3 bits, decoded in the kernel
    group = 0
    if scales is not None:
        scales = scales.contiguous()
        if scheme == "int4":
            group = k // scales.shape[1]
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    bm = block_m(m)
    quant_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))](
        y, x2, weight, scales, bias,
        m, n, k,
        x2.stride(0),
        group,
        SCHEME=scheme,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        INTERPRETER=is_interpreted(quant_linear_kernel),
    )
    return y.reshape(*lead, n)


@triton.jit
def quant_linear_kernel(
    y_ptr,  # [M, N] x's dtype, contiguous
    x_ptr,  # [M, K] float, rows stride_xm apart, contiguous in K
    w_ptr,  # [N, K] int8 / uint8 (e4m3 bits) / bf16, or int4: [N, K // 2] uint8; contiguous
    scales_ptr,  # int8 / fp8: [N] fp32; int4: [N, K // group, 2] fp16 (scale, min); bfloat16: None
    bias_ptr,  # [N] fp32 (HAS_BIAS) or None
    M, N, K,
    stride_xm,
    group,  # int4: input columns per (scale, min) pair (32 or 64); unused otherwise
    SCHEME: tl.constexpr,  # "int8", "int4", "fp8" or "bfloat16"
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of ACT_BLOCK (32)
    INTERPRETER: tl.constexpr,  # work around interpreter numerics (triton_helpers.py)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    n64 = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if SCHEME == "int4":
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // _ACT_BLOCK):
                kb = k0 + j * _ACT_BLOCK  # first column of this activation block
                offs_k = kb + tl.arange(0, _ACT_BLOCK)
                mask_k = offs_k < K  # K is a multiple of 32: a block is all in or all out
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                codes_x, step = _quantize_act_block(x.to(tl.float32))
                # Column k is nibble k % 2 of byte k // 2: each byte is loaded for both of its
                # columns (the second load hits the cache) rather than interleaving two tiles.
                w_mask = mask_k[:, None] & mask_n[None, :]
                byte = tl.load(w_ptr + n64[None, :] * (K // 2) + (offs_k // 2)[:, None], mask=w_mask, other=0)
                codes_w = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15
                # Integers in -127..127 and 0..15: exact in bf16, and so is the dot (module docstring).
                d = dot(codes_x.to(tl.bfloat16), _int_to_bf16(codes_w), INTERPRETER)
                # The block's group; a block past K (all codes 0) reads the last group's params.
                g = tl.minimum(kb, K - 1) // group
                params = scales_ptr + n64 * ((K // group) * 2) + g * 2
                scale = tl.load(params, mask=mask_n, other=0.0).to(tl.float32)
                mn = tl.load(params + 1, mask=mask_n, other=0.0).to(tl.float32)
                code_sum = tl.sum(codes_x, axis=1)
                acc += step[:, None] * (d * scale[None, :] + code_sum[:, None] * mn[None, :])
    else:
        if x_ptr.dtype.element_ty == tl.bfloat16:
            dot_ty = tl.bfloat16  # bf16 x and int8 / e4m3 / bf16 weights: exact bf16 operands
        else:
            dot_ty = tl.float32  # fp32 ("ieee") products
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_off = n64[None, :] * K + offs_k[:, None]
            w_mask = mask_k[:, None] & mask_n[None, :]
            if SCHEME == "fp8":
                w = e4m3_from_bits(tl.load(w_ptr + w_off, mask=w_mask, other=0))
            elif SCHEME == "int8":
                w = tl.load(w_ptr + w_off, mask=w_mask, other=0).to(tl.float32)  # codes; the scale comes after
            else:
                w = tl.load(w_ptr + w_off, mask=w_mask, other=0.0)
            acc += dot(x.to(dot_ty), w.to(dot_ty), INTERPRETER)

    if SCHEME == "int8" or SCHEME == "fp8":
        acc *= tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptr + y_off, cast(acc, y_ptr.dtype.element_ty, INTERPRETER), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _quantize_act_block(x):
    """One activation block ``x [BLOCK_M, 32]`` (fp32) -> ``(codes, step)``: integer codes in
    ``-127..127`` (fp32) and ``step [BLOCK_M] = amax / 127``, as ``fake_quantize_activations``.

    ``rne(x * inv)`` is taken on the magnitude: ``(|v| + 2**23) - 2**23`` rounds ``0 <= |v| < 2**22``
    to an integer, ties to even, and ``torch.round`` is symmetric. (The ``abs`` also keeps the
    product out of an FMA with the addition, which would skip the product's rounding.)
    """
    amax = tl.max(tl.abs(x), axis=1)
    nonzero = amax > 0.0
    # One correctly rounded quotient, as the reference's ``full_like(amax, 127).div(amax)``; inv
    # decides the codes at near-ties, so ``reciprocal * 127`` (two roundings) would not do.
    inv = tl.div_rn(tl.full(amax.shape, _ACT_MAX, tl.float32), tl.where(nonzero, amax, 1.0))
    inv = tl.where(nonzero, inv, 0.0)
    v = tl.abs(x * inv[:, None])
    r = tl.minimum((v + 8388608.0) - 8388608.0, _ACT_MAX)
    codes = tl.where(x < 0.0, -r, r)
    step = tl.div_rn(amax, tl.full(amax.shape, _ACT_MAX, tl.float32))
    return codes, step


@triton.jit
def _int_to_bf16(codes):
    """Integer codes -> bf16 through fp32: the interpreter's int -> bf16 cast reinterprets bits."""
    return codes.to(tl.float32).to(tl.bfloat16)


register("quant_linear", "triton", quant_linear_triton, ("cuda",), priority=10)
