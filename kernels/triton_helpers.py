"""Shared Triton helpers: launch checks (host side) and interpreter-safe ``@triton.jit`` primitives.

The Triton interpreter (``TRITON_INTERPRET=1``, how the kernels run on CPU in tests)
differs from the GPU in two ways that matter here, so the kernels take an
``INTERPRETER: tl.constexpr`` flag (False in every GPU / AOT build) and route through:

* :func:`dot` -- the interpreter's ``tl.dot`` multiplies bf16 *bit patterns* as integers
  (triton-lang/triton#11584; upstream: "we just don't support it yet"). Widening the
  operands to fp32 first is exact, so it still matches a bf16 tensor-core dot.
* :func:`cast` -- the interpreter's fp32 -> bf16 cast truncates instead of rounding to
  nearest even (the GPU's ``cvt.rn``); its RTNE mode also drops carries (see
  FEASIBILITY.md Q4 for the fp8 twin). We round on the fp32 bits first, so the final
  cast only drops zero bits and is exact.

:func:`tanh` (attention's soft cap) is built from ``exp2``: core ``tl`` has no tanh, and
libdevice's is unavailable in the interpreter.

FP8 (e4m3) is handled on its *bits*, stored as ``uint8``: :func:`rne_e4m3` rounds an fp32
value to the nearest e4m3 value (ties to even, saturating at +-448, like torch's
``.to(torch.float8_e4m3fn)``), :func:`e4m3_to_bits` / :func:`e4m3_from_bits` encode and
decode. The interpreter's fp32 -> fp8 cast is wrong four ways (ties away from zero,
truncated subnormals, a lost carry, no saturation; FEASIBILITY.md Q4), GPU paths have had
their own rounding bugs, and Triton refuses ``float8e4nv`` below sm_89 altogether. Integer
code runs the same everywhere, so fp8 caches are bit-exact against torch in the
interpreter, on sm_80 and on sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def is_interpreted(kernel: object) -> bool:
    """True when ``@triton.jit`` produced an interpreter object (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, device: torch.device) -> None:
    """Raise a clear error when ``kernel`` cannot run on tensors of ``device``.

    ``@triton.jit`` picks compiled vs interpreted at decoration time, i.e. when
    ``specgraph.kernels`` is first imported, so ``TRITON_INTERPRET=1`` must be set before
    that import for CPU tensors to work.
    """
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernel {getattr(kernel, '__name__', kernel)!r} got {device.type} tensors but was "
            "compiled for the GPU; set TRITON_INTERPRET=1 before importing specgraph.kernels "
            "to run it on CPU in the Triton interpreter (or use the *_ref torch path)"
        )


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even, in the interpreter too."""
    if INTERPRETER:
        if dtype == tl.bfloat16:
            if x.dtype != tl.bfloat16:
                # RNE on the fp32 bits: add 0x7FFF plus the lowest kept bit, drop 16 bits.
                bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
                x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot(a, b, INTERPRETER: tl.constexpr):
    """``a @ b`` accumulated in fp32; fp32 operands use exact ("ieee") products."""
    if INTERPRETER:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


TWO_LOG2_E = tl.constexpr(2.8853900817779268)  # 2 * log2(e)


@triton.jit
def tanh(x):
    """fp32 ``tanh(x)`` from ``exp2``: ``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``.

    Core ``tl`` has no tanh and the interpreter has no libdevice; ``e`` in (0, 1] never
    overflows, so large ``|x|`` give exactly +-1. Absolute error ~1e-7 (relative error grows
    as ``|x| -> 0``, where tanh(x) ~ x; fine for soft-capping, whose scores are ~|x| * cap).
    """
    e = tl.exp2(tl.abs(x) * -TWO_LOG2_E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


E4M3_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn value
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6; below it e4m3 values are multiples of 2**-9


@triton.jit
def rne_e4m3(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even), saturated to +-448; fp32 out.

    Normals: round to 3 mantissa bits on the fp32 bits (add ``0x7FFFF`` plus the lowest kept
    bit, clear the 20 dropped bits; a carry into the exponent is correct by construction).
    Subnormals: ``(|x| + 2**14) - 2**14`` rounds to a multiple of 2**-9 (the fp32 ulp at
    2**14) in one RNE addition. The sign is copied back, so ``-0.0`` stays ``-0.0``.
    """
    x = x.to(tl.float32)
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    a = tl.minimum(tl.abs(x), E4M3_MAX)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a < E4M3_MIN_NORMAL, subnormal, normal)
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_bits(x):
    """The float8_e4m3fn bit pattern (``uint8``) of ``rne_e4m3(x)``: torch's ``x.to(float8_e4m3fn)``."""
    r = rne_e4m3(x)
    rbits = r.to(tl.uint32, bitcast=True)
    a = tl.abs(r)
    # Normal: rebias the exponent (127 -> 7) and keep the top 3 mantissa bits.
    normal = (((rbits >> 23) & 0xFF) - 120) << 3 | ((rbits >> 20) & 7)
    # Subnormal (and zero): the value in units of 2**-9; 8 (= 2**-6) is the smallest normal's code too.
    subnormal = (a * 512.0).to(tl.uint32)
    mag = tl.where(a < E4M3_MIN_NORMAL, subnormal, normal)
    return (mag | ((rbits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def e4m3_from_bits(b):
    """fp32 value of float8_e4m3fn bits ``b`` (``uint8``); exact. ``0x7F`` / ``0xFF`` are NaN."""
    b = b.to(tl.uint32)
    exp = (b >> 3) & 15
    mant = b & 7
    normal = (((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal)  # subnormal: mant * 2**-9
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)
