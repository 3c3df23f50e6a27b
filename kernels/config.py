"""Explicit switch between the pure-torch reference kernels and the Triton kernels.

The ``specgraph::`` ops (see ``ops.py``) pick an implementation per call:

* CUDA tensors always run the Triton launcher;
* CPU tensors run the CPU path (the ``*_ref`` torch code; for float32 paged attention
  the C++ kernels of ``cpu_kernels.py`` where they apply), unless the caller
  forces the Triton launcher with :func:`use_triton_kernels`. On CPU that only works
  under ``TRITON_INTERPRET=1``; tests use it to run the real kernels in the interpreter.

The switch is a ``ContextVar`` scoped by a context manager, not an env var, so that it is
visible at the call site and cannot leak between threads or tests.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_FORCE_TRITON: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "specgraph_force_triton_kernels", default=False
)


@contextlib.contextmanager
def use_triton_kernels(enabled: bool = True) -> Iterator[None]:
    """Force (or, with ``enabled=False``, stop forcing) the Triton path for CPU tensors.

    Example
    -------
    >>> with use_triton_kernels():           # doctest: +SKIP
    ...     out = torch.ops.specgraph.paged_attention(...)   # runs the Triton kernel
    """
    token = _FORCE_TRITON.set(bool(enabled))
    try:
        yield
    finally:
        _FORCE_TRITON.reset(token)


def use_triton_for(t) -> bool:
    """The dispatch rule of every specgraph op: Triton for CUDA tensors or when forced, else the reference."""
    return t.is_cuda or triton_kernels_forced()


def triton_kernels_forced() -> bool:
    """True inside ``use_triton_kernels(True)``."""
    return _FORCE_TRITON.get()

