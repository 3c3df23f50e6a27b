"""Linears over quantized weights: the weight formats, their quantizers and the torch reference.

``specgraph::quant_linear(x, weight, scales, bias, scheme) -> y`` computes ``y = x @ W.T + bias``
where ``W`` is stored in one of these formats (``scheme``), float32 accumulation, ``y`` in
``x``'s dtype:

========== ============================ ================================ ====================
scheme     ``weight``                   ``scales``                       activations
========== ============================ ================================ ====================
int8       int8 ``[N, K]``              float32 ``[N]`` (per channel)    float
int4       uint8 ``[N, K // 2]``        float16 ``[N, K // g, 2]``       int8, per 32 (below)
fp8        float8_e4m3fn ``[N, K]``     float32 ``[N]`` (per channel)    float
bfloat16   bfloat16 ``[N, K]``          None                             float
========== ============================ ================================ ====================

* int8: symmetric, ``scale = amax(|W[n]|) / 127``, ``code = rne(W / scale)`` in ``-127..127``.
* int4: the KV cache's int4 scheme (``quant.quantize_int4``) over each weight row: groups of
  ``g`` (32 or 64) consecutive input columns, ``(scale, min)`` per group in float16 (min rounded
  down, scale up), ``code = rne((W - min) / scale)`` in ``0..15``, value ``code * scale + min``;
  byte ``i`` holds columns ``2i`` (low nibble) and ``2i + 1`` (high nibble).
* fp8: the KV cache's fp8 helper (``quant.quantize_fp8``) over each weight row: e4m3 values,
  RNE, saturating, ``scale = amax / 448`` per output channel.
* bfloat16: the weight rounded to bfloat16 (RNE), read back to float32 for the products.

**Activations of int4** are rounded on the fly, per row and per block of :data:`ACT_BLOCK` (32)
columns, to an int8 grid: ``step = amax(|x_block|) / 127``, ``code = rne(x * (127 / amax))`` (a
correctly rounded division; a zero block stays zero), as llama.cpp's Q4 x Q8 products do. This is
part of the op's contract, so every implementation computes the same numbers (up to float
summation order): it lets a CPU multiply the unpacked 4-bit codes by 8-bit activation codes with
integer dot-product instructions (AVX2 ``vpmaddubsw`` + ``vpmaddwd``: 32 products in two
instructions) instead of widening every weight to float, which makes int4 the fastest format on
a compute-bound CPU. The rounding costs SmolLM2 about +0.2% perplexity, small beside int4's own.
int8, fp8 and bfloat16 are weight-only: the weights are widened to float in registers (two or
three instructions per 8 weights) and multiplied by float activations. (int8 with int8
activations, llama.cpp's Q8_0 x Q8_0, was no faster on an AMD EPYC with AVX2 and cost +0.4%
perplexity; int16 activations with ``vpmaddwd`` were 25% slower than widening.)

``quant_linear_ref`` is the pure-torch reference (dequantize, fake-quantize the activations,
``F.linear``); the C++ CPU kernel is in ``cpu_kernels.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged_attention import check_same_device
from .quant import dequantize_fp8, dequantize_int4, quantize_fp8, quantize_int4
from .registry import register

WEIGHT_SCHEMES = ("int8", "int4", "fp8", "bfloat16")
ACT_QUANT_SCHEMES = ("int4",)  # activations rounded per ACT_BLOCK (see the module docstring)
ACT_BLOCK = 32
ACT_MAX = 127  # activation codes are int8 (see the module docstring)
INT4_GROUPS = (32, 64)
INT8_MAX = 127


def quantize_weight(w: torch.Tensor, scheme: str, group: int = 32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w [N, K]`` (any float dtype) -> ``(weight, scales)`` in ``scheme``'s format (module docstring).

    Example
    -------
    >>> weight, scales = quantize_weight(torch.tensor([[0.5, -1.0], [0.0, 0.0]]), "int8")
    >>> weight.tolist(), scales.tolist()
    ([[64, -127], [0, 0]], [0.007874015718698502, 1.0])
    """
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r}; valid: {', '.join(WEIGHT_SCHEMES)}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"a weight to quantize must be a float [N, K] matrix; got {w.dtype} {tuple(w.shape)}")
    w = w.detach().float()
    if scheme == "int8":
        scale = w.abs().amax(dim=1) / INT8_MAX
        scale = torch.where(scale > 0, scale, 1.0)
        return torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    if scheme == "int4":
        if group not in INT4_GROUPS or w.shape[1] % group:
            raise ValueError(f"int4 weights need groups of {INT4_GROUPS} dividing the input size; "
                             f"got group {group}, K = {w.shape[1]}")
        return quantize_int4(w, group)
    if scheme == "fp8":
        return quantize_fp8(w)
    return w.to(torch.bfloat16), None


def dequantize_weight(weight: torch.Tensor, scales: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix a quantized weight stands for."""
    if scheme == "int8":
        return weight.float() * scales.float()[:, None]
    if scheme == "int4":
        return dequantize_int4(weight, scales)
    if scheme == "fp8":
        return dequantize_fp8(weight, scales)
    return weight.float()


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` -> float32, each block of :data:`ACT_BLOCK` columns rounded to its int8 grid."""
    *lead, k = x.shape
    xb = x.float().reshape(*lead, k // ACT_BLOCK, ACT_BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, ACT_MAX).div(amax), 0.0)  # one rounding, like 127.f / amax
    codes = torch.round(xb * inv).clamp_(-ACT_MAX, ACT_MAX)
    return (codes * (amax / ACT_MAX)).reshape(*lead, k)


def weight_shape(weight: torch.Tensor, scheme: str) -> tuple[int, int]:
    """``(N, K)`` of the matrix a stored weight stands for."""
    n, stored = weight.shape
    return (n, 2 * stored) if scheme == "int4" else (n, stored)


_STORAGE = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}


def check_quant_linear_args(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                            bias: torch.Tensor | None, scheme: str) -> None:
    """Raise ``ValueError`` naming the problem when the arguments do not fit ``scheme``'s format."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"quant_linear: unknown scheme {scheme!r}; valid: {', '.join(WEIGHT_SCHEMES)}")
    if weight.dim() != 2 or weight.dtype != _STORAGE[scheme]:
        raise ValueError(f"quant_linear: a {scheme} weight is {_STORAGE[scheme]} [N, K]; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight_shape(weight, scheme)
    if not x.is_floating_point() or x.shape[-1] != k:
        raise ValueError(f"quant_linear: x must be float [..., {k}]; got {x.dtype} {tuple(x.shape)}")
    if scheme in ACT_QUANT_SCHEMES and k % ACT_BLOCK:
        raise ValueError(f"quant_linear: {scheme} needs an input size divisible by {ACT_BLOCK}; got {k}")
    if scheme in ("int8", "fp8"):
        if scales is None or scales.shape != (n,) or scales.dtype != torch.float32:
            raise ValueError(f"quant_linear: {scheme} scales are float32 [{n}]; got "
                             f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")
    elif scheme == "int4":
        if (scales is None or scales.dim() != 3 or scales.shape[0] != n or scales.shape[2] != 2
                or scales.dtype != torch.float16 or k % scales.shape[1] or k // scales.shape[1] not in INT4_GROUPS):
            raise ValueError(f"quant_linear: int4 scales are float16 [{n}, {k} // group, 2] with group in "
                             f"{INT4_GROUPS}; got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
    elif scales is not None:
        raise ValueError("quant_linear: bfloat16 weights take no scales")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"quant_linear: bias must be [{n}]; got {tuple(bias.shape)}")
    check_same_device(x, weight, *(t for t in (scales, bias) if t is not None))


def quant_linear_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None,
                     bias: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """The pure-torch reference of ``specgraph::quant_linear`` (module docstring)."""
    check_quant_linear_args(x, weight, scales, bias, scheme)
    xf = fake_quantize_activations(x) if scheme in ACT_QUANT_SCHEMES else x.float()
    y = F.linear(xf, dequantize_weight(weight, scales, scheme), None if bias is None else bias.float())
    return y.to(x.dtype)


register("quant_linear", "reference", quant_linear_ref, ("cpu", "cuda"))
