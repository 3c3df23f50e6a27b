"""Quantized paged KV caches: the two schemes, their pure-torch (de)quantizers and a registry.

A quantized layer cache is four tensors, in this order in every op signature:
``k_cache, v_cache`` (the quantized data, ``[num_blocks, page_size, kv_heads, ...]``)
and ``k_scale, v_scale`` (the per-token quantization parameters). Slots, block tables and
padding work exactly as for the float cache (``cache_write.py``, ``paged_attention.py``).

Schemes
-------
fp8 (e4m3)
    data ``float8_e4m3fn [num_blocks, page_size, kv_heads, head_dim]``; scale ``float32
    [num_blocks, page_size, kv_heads]`` = ``amax(|x|) / 448`` over ``head_dim`` (1.0 for an
    all-zero row, whose values stay exact zeros); value = ``rne(x / scale)``, saturated to
    +-448 (torch's ``.to(torch.float8_e4m3fn)``).

    Why one scale per (token, kv head): the scale depends only on the row being written,
    so a write never reads the cache and never rescales tokens written earlier (the cache
    stays append-only and prefix-shared pages stay immutable); a per-tensor or per-page
    scale would have to grow, and requantize old tokens, whenever a new token had a larger
    amax. A per-head scale also keeps one head's outliers from crushing the resolution of
    the others. Cost: 4 bytes per 64 values (6%, head_dim 64).

int4
    data ``uint8 [num_blocks, page_size, kv_heads, head_dim // 2]``: elements ``2i`` and
    ``2i + 1`` are the low and high nibble of byte ``i``. Params ``float16 [num_blocks,
    page_size, kv_heads, head_dim // group, 2]``: ``(scale, min)`` per group of ``group``
    consecutive values of one (token, kv head). Asymmetric min/max: ``code =
    round((x - min) / scale)`` in ``0..15`` (round half to even), value = ``code * scale +
    min``. ``min`` is rounded *down* and ``scale`` *up* to float16, so every value of the
    group lies in ``[min, min + 15 * scale]`` and the error is at most ``scale / 2`` (plus
    fp32 rounding) for any input within the float16 range (inputs are clamped to
    +-65504). An all-zero group gets ``scale = min = 0`` and dequantizes to exact zeros.
    Same append-only argument as fp8: the params come from the row being written.

    Group sizes: **32 for keys, 64 for values** (``INT4_GROUPS``; capped at ``head_dim``).
    Budget: total KV bytes per token <= 0.15x float32, i.e. <= 4.8 bits per value with the
    params. Per value, a group of ``g`` costs ``4 + 32 / g`` bits (two fp16 params):
    g=32 -> 5.0, g=64 -> 4.5, so K32/V64 averages 4.75 bits. SmolLM2-135M (30 layers,
    3 kv heads, head_dim 64), bytes per token per layer:

    ======== ===================================== =========== =============
    scheme   K + V per kv head                     x 3 x 30    vs float32
    ======== ===================================== =========== =============
    float32  256 + 256                             46080       1.000
    fp8      (64 + 4) + (64 + 4)                   12240       0.266
    int4     (32 + 2*4) + (32 + 1*4) = 40 + 36      6840       0.148
    (g64/64) (32 + 4) + (32 + 4)                    6480       0.141
    (g32/32) (32 + 8) + (32 + 8)                    7200       0.156 (over)
    ======== ===================================== =========== =============

    Measured on SmolLM2 (3 texts of 512 tokens): K/V rel RMS of the round trip over every
    layer's post-RoPE K/V, and the model with every attention call reading round-tripped
    K/V (float32 elsewhere) vs the float model: perplexity, mean KL(float || quantized) of
    the next-token distribution, agreement of the argmax token:

    ============ ======== ========= ========= ======== ========= ===========
    scheme       bits/val K rel RMS V rel RMS ppl      KL/token  top-1 agree
    ============ ======== ========= ========= ======== ========= ===========
    float32      32       0         0         67.22    0         1.000
    fp8          8.5      0.021     0.025     67.04    0.0052    0.951
    int4 g64/64  4.5      0.131     0.096     73.41    0.115     0.761
    int4 K32/V64 4.75     0.100     0.096     71.19    0.054     0.827
    int4 K64/V32 4.75     0.131     0.082     72.63    0.113     0.780
    int4 g32/32  5.0      0.100     0.082     69.89    0.051     0.837
    ============ ======== ========= ========= ======== ========= ===========

    Keys dominate the error (int4 on V alone costs KL 0.011, on K alone 0.107; SmolLM2's
    keys have outlier channels: the largest channel RMS of a (layer, head) is a median 8x
    its median channel's, vs 2.3x for values, and a min/max group spans its outliers), so
    the quarter bit the budget leaves goes to the keys:
    K32/V64 halves the KL of g64/64 and nearly matches g32/32 within the budget. float32
    params instead of float16 changed no digit of the rel RMS above (and would cost 5 bits
    at g64).

Both write paths (``quant_cache_write.py``) are bit-exact between the torch references
here and the Triton kernels; attention (``quant_paged_attention.py``) dequantizes only the
pages it reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import huge_pages

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP16_MAX = 65504.0
INT4_MAX_CODE = 15
INT4_GROUPS = (32, 64)  # (keys, values) target group sizes; see the module docstring


# ---------------------------------------------------------------------------------- fp8


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization over the last dim.

    Shape: ``x [..., D]`` (any float dtype) -> ``(data float8_e4m3fn [..., D], scale float32 [...])``.

    Example
    -------
    >>> data, scale = quantize_fp8(torch.tensor([[0.0, 1.0, -2.0], [0.0, 0.0, 0.0]]))
    >>> scale.tolist(), dequantize_fp8(data, scale).tolist()
    ([0.004464285913854837, 1.0], [[0.0, 1.0, -2.0], [0.0, 0.0, 0.0]])
    """
    x = x.float()
    scale = x.abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, 1.0)  # all-zero (or underflowing) row: any positive scale
    data = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return data, scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data [..., D] (e4m3)``, ``scale [...]`` -> float32 ``[..., D]``: ``data.float() * scale``, bit for bit.

    torch's e4m3 -> float32 conversion is scalar code on CPU (~3 ns a value, the bulk of the
    fp8 attention reference); moving the bits into float16 fields is vectorized and ~3x
    faster. The float16 number is ``value * 2**-8`` exactly (float16 has one more exponent
    bit, bias 15 vs 7, subnormals included), and ``2**8`` folds into the scale, so every
    product is the same real number as ``value * scale`` and rounds identically.
    """
    u = data.view(torch.uint8).to(torch.int16)
    low = u & 0x7F
    # sign -> bit 15, exponent + mantissa -> bits 7..13; the NaN pattern (low == 0x7F, where
    # low + 1 carries into bit 7) also sets bit 14: exponent all ones, mantissa != 0, a float16
    # NaN. (Integer ops only: a compare + where costs as much as the rest together.)
    h = ((u & 0x80) << 8) | (low << 7) | (((low + 1) & 0x80) << 7)
    return h.view(torch.float16).float() * (scale * 256.0).unsqueeze(-1)


# --------------------------------------------------------------------------------- int4


def int4_group_size(head_dim: int, target: int) -> int:
    """The largest power of two <= ``target`` that divides ``head_dim`` (so 32 -> 32 for D=64, 8 for D=40)."""
    group = target
    while group > 2 and head_dim % group:
        group //= 2
    if head_dim % group or head_dim % 2:
        raise ValueError(f"int4 needs an even head_dim divisible by a power-of-two group; got head_dim {head_dim}")
    return group


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group int4 quantization over the last dim.

    Shape: ``x [..., D]`` -> ``(packed uint8 [..., D // 2], params float16 [..., D // group, 2])``
    with ``params[..., 0] = scale`` and ``params[..., 1] = min``.

    Example
    -------
    >>> packed, params = quantize_int4(torch.tensor([0.0, 1.5, 3.0, 0.75]), group=4)
    >>> params.tolist(), packed.tolist(), dequantize_int4(packed, params).tolist()
    ([[0.2000732421875, 0.0]], [112, 79], [0.0, 1.4005126953125, 3.0010986328125, 0.80029296875])
    """
    *lead, head_dim = x.shape
    assert head_dim % group == 0 and group % 2 == 0, (head_dim, group)
    xg = x.float().clamp(-FP16_MAX, FP16_MAX).view(*lead, head_dim // group, group)
    lo, hi = torch.aminmax(xg, dim=-1)
    min16 = _fp16_round_down(lo)
    mn = min16.float()
    scale16 = _fp16_round_up((hi - mn) / INT4_MAX_CODE)
    # scale 0 <=> the group is constant up to fp32 underflow: dividing by 1 gives codes 0.
    divisor = torch.where(scale16 > 0, scale16.float(), 1.0)
    codes = torch.round((xg - mn.unsqueeze(-1)) / divisor.unsqueeze(-1)).clamp_(0, INT4_MAX_CODE)
    codes = codes.to(torch.uint8).view(*lead, head_dim)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.stack([scale16, min16], dim=-1)


def dequantize_int4(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """``packed uint8 [..., D // 2]``, ``params float16 [..., D // group, 2]`` -> float32 ``[..., D]``."""
    *lead, half = packed.shape
    num_groups = params.shape[-2]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(*lead, num_groups, 2 * half // num_groups)
    scale, mn = params.float().unbind(-1)
    return (codes.float() * scale.unsqueeze(-1) + mn.unsqueeze(-1)).view(*lead, 2 * half)


def _fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest float16 <= x (x within +-65504)."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest float16 >= x (x within +-65504)."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


# ------------------------------------------------------------------- layout validation


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """Geometry of one layer's quantized cache, read off (and checked against) its tensors."""

    num_blocks: int
    page_size: int
    kv_heads: int
    head_dim: int
    k_group: int  # int4 only (values per (scale, min) pair); 0 for fp8
    v_group: int


def fp8_layout(k_cache, v_cache, k_scale, v_scale) -> QuantLayout:
    """Validate an fp8 layer cache; raises ``ValueError`` naming the bad tensor."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "fp8 k_cache and v_cache must both be [num_blocks, page_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 cache dtype must be {FP8_DTYPE}; got {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.shape != k_cache.shape[:3] or t.dtype != torch.float32:
            raise ValueError(f"fp8 {name} must be float32 {list(k_cache.shape[:3])}; got {t.dtype} {list(t.shape)}")
    _check_contiguous(k_cache, v_cache, k_scale, v_scale)
    return QuantLayout(*k_cache.shape, k_group=0, v_group=0)


def int4_layout(k_cache, v_cache, k_scale, v_scale) -> QuantLayout:
    """Validate an int4 layer cache (group sizes are read from the params' shapes)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "int4 k_cache and v_cache must both be [num_blocks, page_size, kv_heads, head_dim // 2]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
        raise ValueError(
            f"int4 cache dtype must be torch.uint8 (2 values per byte); got {k_cache.dtype}, {v_cache.dtype}"
        )
    num_blocks, page_size, kv_heads, half = k_cache.shape
    head_dim = 2 * half
    groups = []
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        ok = (t.dim() == 5 and t.shape[:3] == k_cache.shape[:3] and t.shape[4] == 2 and t.dtype == torch.float16
              and t.shape[3] > 0 and head_dim % t.shape[3] == 0)
        group = head_dim // t.shape[3] if ok else 0
        if not ok or group % 2 or group & (group - 1):
            raise ValueError(
                f"int4 {name} must be float16 [{num_blocks}, {page_size}, {kv_heads}, head_dim // group, 2] with a "
                f"power-of-two group dividing head_dim {head_dim}; got {t.dtype} {list(t.shape)}"
            )
        groups.append(group)
    _check_contiguous(k_cache, v_cache, k_scale, v_scale)
    return QuantLayout(num_blocks, page_size, kv_heads, head_dim, *groups)


def _check_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("quantized caches and their scales must be contiguous (slots are addressed as a flat index)")


# ---------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class QuantKVCache:
    """One layer's quantized cache; the field order is the op argument order."""

    k_cache: torch.Tensor  # [num_blocks, page_size, kv_heads, ...] quantized keys
    v_cache: torch.Tensor
    k_scale: torch.Tensor  # [num_blocks, page_size, kv_heads, ...] key quantization params
    v_scale: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.k_cache, self.v_cache, self.k_scale, self.v_scale)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


def allocate_fp8(num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                 device: torch.device | str | None = None) -> QuantKVCache:
    """Zeroed fp8 data and unit scales (unwritten slots dequantize to 0); on the CPU in huge pages."""
    shape = (num_blocks, page_size, kv_heads, head_dim)
    return QuantKVCache(
        huge_pages.zeros(shape, FP8_DTYPE, device),
        huge_pages.zeros(shape, FP8_DTYPE, device),
        huge_pages.zeros(shape[:3], torch.float32, device).fill_(1.0),
        huge_pages.zeros(shape[:3], torch.float32, device).fill_(1.0),
    )


def allocate_int4(num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                  device: torch.device | str | None = None) -> QuantKVCache:
    """Zeroed int4 data and params, groups from :data:`INT4_GROUPS` via :func:`int4_group_size`; on the CPU in
    huge pages."""
    k_group, v_group = (int4_group_size(head_dim, g) for g in INT4_GROUPS)
    data = (num_blocks, page_size, kv_heads, head_dim // 2)
    return QuantKVCache(
        huge_pages.zeros(data, torch.uint8, device),
        huge_pages.zeros(data, torch.uint8, device),
        huge_pages.zeros((*data[:3], head_dim // k_group, 2), torch.float16, device),
        huge_pages.zeros((*data[:3], head_dim // v_group, 2), torch.float16, device),
    )


def fp8_bytes_per_token(kv_heads: int, head_dim: int) -> int:
    """Bytes one token takes in one layer: K and V, e4m3 data + one float32 scale per kv head."""
    return 2 * kv_heads * (head_dim + 4)


def int4_bytes_per_token(kv_heads: int, head_dim: int) -> int:
    """Bytes one token takes in one layer: K and V, packed nibbles + (scale, min) float16 pairs per group."""
    k_group, v_group = (int4_group_size(head_dim, g) for g in INT4_GROUPS)
    return kv_heads * (head_dim + 4 * (head_dim // k_group + head_dim // v_group))


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """What the compiler needs to swap a layer's float cache for a quantized one.

    ``allocate(num_blocks, page_size, kv_heads, head_dim, device=None) -> QuantKVCache``;
    ``bytes_per_token(kv_heads, head_dim)`` is per layer (K + V, data + params);
    ``write_op`` / ``attention_op`` take the float op's arguments with ``k_scale, v_scale``
    inserted after ``v_cache``::

        write_op(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None
        attention_op(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                     query_start_loc, positions, scale) -> Tensor
    """

    name: str
    allocate: Callable[..., QuantKVCache]
    bytes_per_token: Callable[[int, int], int]

    @property
    def write_op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.specgraph, f"cache_write_{self.name}")  # registered by quant_ops.py

    @property
    def attention_op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.specgraph, f"paged_attention_{self.name}")


QUANT_SCHEMES: dict[str, QuantScheme] = {
    "fp8": QuantScheme("fp8", allocate_fp8, fp8_bytes_per_token),
    "int4": QuantScheme("int4", allocate_int4, int4_bytes_per_token),
}


def get_scheme(name: str) -> QuantScheme:
    """``QUANT_SCHEMES[name]``; ``ValueError`` listing the valid names otherwise."""
    if name not in QUANT_SCHEMES:
        raise ValueError(f"unknown KV-cache quantization {name!r}; valid: {sorted(QUANT_SCHEMES)}")
    return QUANT_SCHEMES[name]
