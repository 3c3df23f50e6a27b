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
